"""What one execution returns, shared by LocalSandbox, the HTTP API and the clients."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any


class SandboxUnavailable(Exception):
    """The sandbox itself failed (server unreachable, worker cannot start, protocol broken).

    Distinct from the user's code failing, which is reported inside an ExecResult.
    """


class SessionClosed(SandboxUnavailable):
    """The session was closed (deleted, expired, shut down) while the cell ran: it was cancelled.

    A subclass so that callers who treat any sandbox failure as infrastructure keep doing so,
    while the HTTP server can answer the client that caused it with 409 rather than 503.
    """


@dataclass
class ExecError:
    """The exception an execution raised, or why its worker died."""

    type: str
    message: str
    traceback: str = ""
    exit_code: int | None = None

    def __getitem__(self, key: str) -> Any:  # lets callers treat it like the JSON dict too
        return getattr(self, key)


@dataclass
class ExecResult:
    stdout: str = ""
    stderr: str = ""
    value: str | None = None
    """``repr`` of the trailing expression (notebook style), or None."""
    error: ExecError | None = None
    timed_out: bool = False
    memory_exceeded: bool = False
    truncated: bool = False
    session_restarted: bool = False
    """The session's process was replaced after this execution: its globals are gone."""
    limit: str | None = None
    """Which limit fired: wall_time, cpu_time, memory, output (only with truncated), or None."""
    duration_s: float = 0.0
    cpu_s: float = 0.0
    exit_code: int | None = None
    """Set when the code exited the interpreter (sys.exit, os._exit, a fatal signal as 128+n)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No exception and no limit hit."""
        return self.error is None and self.limit is None and not self.timed_out

    def to_dict(self) -> dict[str, Any]:
        # By hand rather than dataclasses.asdict, whose recursive deep copy was a visible share of
        # the server's time per warm execution; the result is the same plain JSON-ready dict.
        d = {name: getattr(self, name) for name in _RESULT_FIELDS}
        if self.error is not None:
            d["error"] = dict(vars(self.error))
        d["extra"] = copy.deepcopy(self.extra) if self.extra else {}
        d["ok"] = self.ok
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExecResult:
        err = d.get("error")
        return cls(
            stdout=d.get("stdout", ""),
            stderr=d.get("stderr", ""),
            value=d.get("value"),
            error=ExecError(**{k: err.get(k) for k in ("type", "message", "traceback", "exit_code")})
            if err
            else None,
            timed_out=bool(d.get("timed_out")),
            memory_exceeded=bool(d.get("memory_exceeded")),
            truncated=bool(d.get("truncated")),
            session_restarted=bool(d.get("session_restarted")),
            limit=d.get("limit"),
            duration_s=float(d.get("duration_s", 0.0)),
            cpu_s=float(d.get("cpu_s", 0.0)),
            exit_code=d.get("exit_code"),
            extra=dict(d.get("extra") or {}),
        )


_RESULT_FIELDS = tuple(f.name for f in fields(ExecResult))
