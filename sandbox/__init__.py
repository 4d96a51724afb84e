"""Python execution service: persistent sessions, hard limits, real isolation.

Three backends share one session core and one session interface
(``with sb.session() as s: s.run("x = 41"); s.run("print(x + 1)")``):

- ``LocalSandbox`` (``sandbox/bwrap/``): workers confined by bubblewrap, in this process;
- ``DockerSandbox`` (``sandbox/docker/``): one hardened container per session;
- ``Client``/``AsyncClient`` (``sandbox/http/``): the FastAPI service (``python -m sandbox serve``),
  which serves a ``LocalSandbox``.

What they share lives in ``sandbox/session/``: the wire protocol to the worker (``protocol``), the
session driver and its error taxonomy (``core``), the warm pool over a ``Launcher`` (``pool``) and
the sandbox/session front (``box``). ``limits``, ``result`` and the stdlib-only ``worker`` script
sit at the top because every backend uses them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import TYPE_CHECKING, Any

from sandbox.bwrap.local import LocalSandbox
from sandbox.limits import DEFAULT_LIMITS, MAX_LIMITS, LimitError, Limits
from sandbox.result import ExecError, ExecResult, SandboxUnavailable, SessionClosed
from sandbox.session.box import Session

if TYPE_CHECKING:
    from sandbox.docker.backend import DockerSandbox
    from sandbox.http.client import AsyncClient, Client

LocalSession = Session
"""The name sessions had when only the local backend had them; every backend's session is a ``Session``."""

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
    "Session",
    "SessionClosed",
]


def __getattr__(name: str) -> Any:
    # The clients need httpx (the sandbox extra); import them only when asked for.
    if name in ("Client", "AsyncClient"):
        from sandbox.http import client

        return getattr(client, name)
    if name == "DockerSandbox":  # needs the docker SDK (the docker extra)
        from sandbox.docker.backend import DockerSandbox

        return DockerSandbox
    raise AttributeError(f"module 'sandbox' has no attribute {name!r}")


MOVED = {
    "sandbox.client": "sandbox.http.client",
    "sandbox.settings": "sandbox.http.settings",
    "sandbox.server": "sandbox.http.server",
    "sandbox.local": "sandbox.bwrap.local",
    "sandbox.docker_backend": "sandbox.docker.backend",
}
"""Module paths from before the backends had folders, still used by compose.yaml, docs/docker.md and
two benchmarks: importing one gives the module at its new home. New code uses the new paths."""


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old path in ``MOVED`` (or a submodule of one) to the very module at its new path,
    so classes keep one identity (``isinstance`` and pickling see no difference)."""

    def _new_name(self, name: str) -> str | None:
        for old, new in MOVED.items():
            if name == old or name.startswith(old + "."):
                return new + name[len(old) :]
        return None

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        new = self._new_name(name)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(name, self, loader_state=new)

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(spec.loader_state)
        spec.loader_state = module.__spec__  # the import system sets __spec__ next: put it back after
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())  # before the path finder, which would load copies
