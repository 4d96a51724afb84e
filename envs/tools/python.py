"""PythonTool: one persistent sandbox session per episode.

The session is opened by `open()` (the environment calls it on reset), reused by every call of
the episode so variables persist between turns, and closed by `close()` (next reset or
`env.close()`), also after errors. Any exception from the backend is an infrastructure failure
(the agent's own exceptions come back inside the result), so it is re-raised as ToolInfraError.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from envs.protocols import SandboxBackend, SessionLike
from envs.tools.base import Tool, ToolInfraError, ToolOutput

NO_OUTPUT = "[no output]"


_shared: dict[str, SandboxBackend] = {}
_shared_lock = threading.Lock()


def _close_shared() -> None:
    for backend in _shared.values():
        with contextlib.suppress(Exception):
            backend.close()  # type: ignore[attr-defined]


atexit.register(_close_shared)


def shared_backend(spec: str = "local") -> SandboxBackend:
    """One backend per process for `spec`: "local" (a LocalSandbox) or an "http(s)://" service URL.

    Many environments (one per rollout slot) then share one warm worker pool instead of each
    starting its own. Imported lazily so `envs` imports without the sandbox package.
    """
    with _shared_lock:
        if spec not in _shared:
            if spec == "local":
                from sandbox import LocalSandbox

                _shared[spec] = LocalSandbox()
            elif spec.startswith(("http://", "https://")):
                from sandbox import Client

                _shared[spec] = Client(spec)
            else:
                raise ValueError(
                    f'sandbox must be "local", an http(s):// URL, or a backend object; got {spec!r}'
                )
        return _shared[spec]


class Shared:
    """Wraps a backend object so Gymnasium may deep-copy env kwargs (it does in `spec.make()`)
    without copying the backend: `gymnasium.make(id, sandbox=Shared(LocalSandbox()))`."""

    def __init__(self, backend: SandboxBackend) -> None:
        self.backend = backend

    def session(self, **limits: Any) -> Any:
        return self.backend.session(**limits)

    def __deepcopy__(self, memo: dict[int, Any]) -> Shared:
        return self


def resolve_backend(spec: Any) -> SandboxBackend:
    """None/"local"/URL -> the shared backend; a backend object as is; a factory is called."""
    if spec is None:
        return shared_backend("local")
    if isinstance(spec, str):
        return shared_backend(spec)
    if isinstance(spec, SandboxBackend) and not isinstance(spec, type):
        return spec
    if callable(spec):
        return spec()
    raise TypeError(f"sandbox must be None, a string, a backend with .session(), or a factory; got {spec!r}")


class PythonTool(Tool):
    """Run Python code in a persistent, sandboxed interpreter."""

    name = "python"
    description = "Run Python code in a persistent session and return what it prints."
    parameters: dict[str, Any] = {  # noqa: RUF012 - class-level schema, never mutated
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python source to run."}},
        "required": ["code"],
        "additionalProperties": False,
    }

    def __init__(
        self,
        backend: SandboxBackend | Callable[[], SandboxBackend] | str | None = None,
        *,
        timeout_s: float | None = 5.0,
        session_limits: dict[str, Any] | None = None,
    ) -> None:
        """`backend`: see `resolve_backend` (None: the process-wide LocalSandbox, made on first
        use). `timeout_s` bounds each call's run time."""
        self._backend_arg = backend
        self._backend: SandboxBackend | None = None
        self.timeout_s = timeout_s
        self.session_limits = dict(session_limits or {})
        self._stack: contextlib.ExitStack | None = None
        self._session: SessionLike | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> PythonTool:
        # gymnasium.make deep-copies env kwargs (tools=[...]); a copy shares the backend and
        # settings but never an open session.
        return PythonTool(
            self._backend_arg, timeout_s=self.timeout_s, session_limits=dict(self.session_limits)
        )

    @property
    def backend(self) -> SandboxBackend:
        if self._backend is None:
            self._backend = resolve_backend(self._backend_arg)
        return self._backend

    @property
    def is_open(self) -> bool:
        return self._session is not None

    def open(self) -> None:
        """Close any previous session, then open a fresh one. Raises ToolInfraError on failure."""
        self.close()
        stack = contextlib.ExitStack()
        try:
            manager = self.backend.session(**self.session_limits)
            entered = stack.enter_context(manager) if hasattr(manager, "__enter__") else manager
            if not hasattr(entered, "close"):
                stack.callback(getattr(manager, "close", lambda: None))
        except Exception as exc:
            stack.close()
            raise ToolInfraError(f"could not open a sandbox session: {type(exc).__name__}: {exc}") from exc
        self._stack, self._session = stack, entered

    def close(self) -> None:
        """Close the session; never raises, since it runs on cleanup paths."""
        stack, self._stack, self._session = self._stack, None, None
        if stack is not None:
            with contextlib.suppress(Exception):
                stack.close()

    def call(self, arguments: dict[str, Any]) -> ToolOutput:
        problem = self.validate(arguments)
        if problem:
            return ToolOutput(text=f"Error: {problem}", ok=False, metadata={"error_type": "BadArguments"})
        if self._session is None:
            self.open()
        assert self._session is not None
        try:
            result = self._session.run(arguments["code"], timeout_s=self.timeout_s)
        except Exception as exc:
            # The session may be broken; drop it so the next episode starts clean.
            self.close()
            raise ToolInfraError(f"sandbox failed while running code: {type(exc).__name__}: {exc}") from exc
        return format_result(result, self.timeout_s)


def format_result(result: Any, timeout_s: float | None) -> ToolOutput:
    """Render an ExecResult as the text the agent reads (stdout, then errors), plus metadata."""
    stdout = getattr(result, "stdout", "") or ""
    stderr = getattr(result, "stderr", "") or ""
    error = getattr(result, "error", None)
    parts = [p.rstrip("\n") for p in (stdout, stderr) if p]
    if error is not None:
        tb = getattr(error, "traceback", "") or ""
        summary = f"{getattr(error, 'type', 'Error')}: {getattr(error, 'message', '')}"
        shown = tb.rstrip("\n") if tb else summary
        if shown not in stderr and summary not in stderr:
            parts.append(shown)
    if getattr(result, "timed_out", False):
        parts.append(f"TimeoutError: the code ran longer than {timeout_s}s and was stopped")
    if getattr(result, "memory_exceeded", False):
        parts.append("MemoryError: the code exceeded the memory limit and was stopped")
    if getattr(result, "session_restarted", False):
        parts.append("[the Python session was restarted: earlier variables are lost]")
    value = getattr(result, "value", None)
    if value is not None and not stdout:
        parts.append(str(value))
    ok = bool(getattr(result, "ok", error is None))
    metadata = {
        "ok": ok,
        "error_type": getattr(error, "type", None) if error is not None else None,
        "timed_out": bool(getattr(result, "timed_out", False)),
        "memory_exceeded": bool(getattr(result, "memory_exceeded", False)),
        "sandbox_truncated": bool(getattr(result, "truncated", False)),
        "session_restarted": bool(getattr(result, "session_restarted", False)),
        "limit": getattr(result, "limit", None),
        "duration_s": float(getattr(result, "duration_s", 0.0) or 0.0),
    }
    return ToolOutput(text="\n".join(parts) if parts else NO_OUTPUT, ok=ok, metadata=metadata)
