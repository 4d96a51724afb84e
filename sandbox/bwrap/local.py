"""LocalSandbox: the sandbox in-process, with no server; the default for environments and tests.

It is ``PooledSandbox`` (sandbox/session/box.py: sessions, one-shots, batches) over bubblewrap
workers (``launcher``), plus the choice of isolation. The HTTP server is a thin layer over this
class, and ``Client``/``AsyncClient`` mirror its shape.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import replace

from sandbox.bwrap.launcher import LaunchConfig, Launcher, bwrap_path
from sandbox.limits import Limits
from sandbox.result import SandboxUnavailable
from sandbox.session.box import PooledSandbox

log = logging.getLogger("sandbox")

ISOLATION_MODES = ("auto", "bwrap", "rlimits")


def resolve_isolation(mode: str, require_isolation: bool) -> str:
    """Pick bwrap when we can; fall back to rlimits loudly, or refuse when isolation is required."""
    if mode not in ISOLATION_MODES:
        raise ValueError(f"isolation must be one of {ISOLATION_MODES}, got {mode!r}")
    if mode == "rlimits" and require_isolation:
        raise SandboxUnavailable("isolation='rlimits' contradicts require_isolation=True")
    if mode in ("auto", "bwrap") and bwrap_path():
        return "bwrap"
    if mode == "bwrap" or require_isolation:
        raise SandboxUnavailable(
            "bubblewrap is required but not installed: `apt-get install -y bubblewrap`, "
            "or allow the weaker fallback with isolation='rlimits'"
        )
    if mode == "auto":
        msg = (
            "SANDBOX NOT ISOLATED: bubblewrap (bwrap) is not installed, so executed code runs with "
            "rlimits only and can read host files and use the network. Install bubblewrap, or set "
            "require_isolation=True to refuse to start."
        )
        log.warning("sandbox/isolation: %s", msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return "rlimits"


class LocalSandbox(PooledSandbox):
    """In-process sandbox: a warm pool of bubblewrap-confined workers and the sessions that use them."""

    def __init__(
        self,
        *,
        limits: Limits | None = None,
        max_limits: Limits | None = None,
        pool_size: int = 2,
        isolation: str = "auto",
        require_isolation: bool = False,
        launch: LaunchConfig | None = None,
        batch_concurrency: int = 8,
    ) -> None:
        launch = replace(launch or LaunchConfig(), isolation=resolve_isolation(isolation, require_isolation))
        self.isolation = launch.isolation
        super().__init__(
            Launcher(launch),
            limits=limits,
            max_limits=max_limits,
            pool_size=pool_size,
            batch_concurrency=batch_concurrency,
        )
