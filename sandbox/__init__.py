"""Python execution service: persistent sessions, hard limits, real isolation.

``LocalSandbox`` runs in-process; ``Client``/``AsyncClient`` talk to ``python -m sandbox serve``;
``DockerSandbox`` runs one container per session. All share one shape: ``with sb.session() as s: s.run("x = 41"); s.run("print(x + 1)")``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sandbox.limits import DEFAULT_LIMITS, MAX_LIMITS, LimitError, Limits
from sandbox.local import LocalSandbox, LocalSession
from sandbox.result import ExecError, ExecResult, SandboxUnavailable

if TYPE_CHECKING:
    from sandbox.client import AsyncClient, Client
    from sandbox.docker_backend import DockerSandbox

__all__ = [
    "DEFAULT_LIMITS",
    "MAX_LIMITS",
    "AsyncClient",
    "Client",
    "DockerSandbox",
    "ExecError",
    "ExecResult",
    "LimitError",
    "Limits",
    "LocalSandbox",
    "LocalSession",
    "SandboxUnavailable",
]


def __getattr__(name: str) -> Any:
    # The clients need httpx (the sandbox extra); import them only when asked for.
    if name in ("Client", "AsyncClient"):
        from sandbox import client

        return getattr(client, name)
    if name == "DockerSandbox":  # needs the docker SDK (the docker extra)
        from sandbox.docker_backend import DockerSandbox

        return DockerSandbox
    raise AttributeError(f"module 'sandbox' has no attribute {name!r}")
