"""The slice of the sandbox API that environments rely on, as structural types.

Why Protocols rather than importing `sandbox`: an environment must work with any backend that
can open a session (the in-process LocalSandbox, the HTTP Client, a DockerSandbox, or a test
double), and `envs` must import even where the sandbox service is not installed.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


class ExecErrorLike(Protocol):
    """An exception raised by the agent's code (not by the sandbox)."""

    type: str
    message: str
    traceback: str


class ExecResultLike(Protocol):
    """What one code execution returns; only these fields are read."""

    stdout: str
    stderr: str
    ok: bool
    error: ExecErrorLike | None
    timed_out: bool
    memory_exceeded: bool
    truncated: bool
    session_restarted: bool
    duration_s: float


class SessionLike(Protocol):
    """A persistent interpreter: variables survive between `run` calls of one episode."""

    def run(self, code: str, *, timeout_s: float | None = None) -> ExecResultLike: ...

    def close(self) -> None: ...


@runtime_checkable
class SandboxBackend(Protocol):
    """Anything that opens sessions: `backend.session(**limits)` returns a context manager."""

    def session(self, **limits: Any) -> Any: ...
