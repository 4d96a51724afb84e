"""The session core: runs cells on one worker and replaces the worker after any limit or crash.

It knows nothing about how the worker was started. Anything with a ``WorkerChannel`` and the
methods of ``WorkerHandle`` can be driven, and anything with ``Launcher.spawn`` can feed the pool
(sandbox/session/pool.py): a bubblewrap process (``sandbox.bwrap.launcher``) or a Docker container
attached over its stdio (``sandbox.docker.backend``). The core turns every way a worker can fail (no reply in
time, EOF, garbage on the wire, SIGXCPU, the OOM killer) into an ``ExecResult`` that says which
limit fired, and marks ``session_restarted`` when the next cell will run in a fresh worker.

A worker that the sandbox's own side stopped (a session closed mid-cell, a worker killed from
outside its sandbox) is not the program's result: that raises ``SandboxUnavailable`` (or
``SessionClosed``), which callers treat as an infrastructure failure, and the session continues in
a fresh worker.
"""

from __future__ import annotations

import functools
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from sandbox.limits import Limits
from sandbox.result import ExecError, ExecResult, SandboxUnavailable, SessionClosed
from sandbox.session.protocol import (
    ChannelError,
    ChannelTimeout,
    WorkerChannel,
    exec_request,
    result_from_reply,
)


class WorkerHandle(Protocol):
    """One started worker, as the session core and the pool see it, whatever started it."""

    channel: WorkerChannel

    @property
    def id(self) -> str:
        """A name for logs and tests (a container id under Docker)."""

    def alive(self) -> bool:
        """Whether it can still take a cell (a warm worker may have died while it waited)."""

    def kill(self) -> None:
        """Kill and reap the worker's whole process tree; idempotent."""

    def wait_exit(self, timeout_s: float) -> int | None:
        """Exit status (128+signal for signals), or None while still running."""

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer fired inside this worker's memory cgroup."""

    def terminate(self, reason: str) -> None:
        """Stop the worker now from any thread, leaving clean-up to ``kill``; idempotent."""

    def lost_reason(self) -> str | None:
        """After the worker died: why, when it was not its own code that ended it; else None."""


class Launcher(Protocol):
    """Starts workers for the pool: ``spawn`` blocks until the worker said it is ready."""

    def spawn(self, limits: Limits, background: bool = False) -> WorkerHandle:
        """A ready worker with ``limits``' per-session limits; SandboxUnavailable when it cannot.
        ``background``: started ahead of demand, it may boot at a low CPU priority until handed out."""


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def classify_death(rc: int | None, oom: bool, limits: Limits) -> ExecResult:
    """Explain a worker that stopped answering mid-cell."""
    r = ExecResult(session_restarted=True, exit_code=rc)
    if oom:
        r.memory_exceeded, r.limit = True, "memory"
        r.error = ExecError("MemoryError", f"memory limit of {limits.memory_mb} MB exceeded (OOM kill)")
    elif rc == 128 + signal.SIGXCPU:
        r.limit = "cpu_time"
        r.error = ExecError("CpuTimeExceeded", f"CPU time limit of {limits.cpu_s:g} s exceeded")
    elif rc is None:
        r.error = ExecError("WorkerLost", "the worker stopped responding")
    elif rc > 128:
        r.error = ExecError("WorkerCrashed", f"the worker died from {_signal_name(rc - 128)}", exit_code=rc)
    elif rc != 0:
        r.error = ExecError("WorkerExited", f"the worker exited with status {rc}", exit_code=rc)
    return r


async def _to_thread(fn: Callable[[], Any]) -> Any:
    import anyio  # only the async path needs it (it ships with httpx and FastAPI)

    return await anyio.to_thread.run_sync(fn)


class SessionCore:
    """Serialises a session's cells onto its current worker (thread-safe)."""

    def __init__(
        self,
        acquire: Callable[[], WorkerHandle],
        release: Callable[[WorkerHandle], None],
        limits: Limits,
    ) -> None:
        self._acquire = acquire
        self._release = release
        self.limits = limits
        self.worker: WorkerHandle | None = None
        self.closed = False
        self.restarts = 0
        self.executions = 0
        self.last_used = time.monotonic()
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def ensure_worker(self) -> WorkerHandle:
        if self.worker is None:
            self.worker = self._acquire()
        return self.worker

    def run(
        self,
        code: str,
        limits: Limits | None = None,
        *,
        want_value: bool = True,
        stdin: str | None = None,
        files: dict[str, str] | None = None,
    ) -> ExecResult:
        limits = limits or self.limits
        with self._lock:
            worker = self._begin()
            t0 = time.perf_counter()
            try:
                if files:
                    reply = worker.channel.request({"op": "put_files", "files": files}, limits.wall_s)
                    if reply.get("error"):
                        return self._finish(result_from_reply(reply, 0.0), t0)
                reply = worker.channel.request(
                    exec_request(code, limits, want_value=want_value, stdin=stdin), limits.wall_s
                )
            except ChannelError as e:
                return self._finish(self._failed(worker, e, limits), t0)
            return self._finish(self._replied(reply), t0)

    async def run_async(
        self,
        code: str,
        limits: Limits | None = None,
        *,
        want_value: bool = True,
        stdin: str | None = None,
        files: dict[str, str] | None = None,
    ) -> ExecResult:
        """Like ``run`` but waits on the event loop instead of a thread when the worker is warm."""
        limits = limits or self.limits
        if files or self.worker is None or not self._lock.acquire(blocking=False):
            # Starting a worker or waiting for a busy session blocks: do that on a thread.
            return await _to_thread(
                functools.partial(self.run, code, limits, want_value=want_value, stdin=stdin, files=files)
            )
        try:
            worker = self._begin()
            t0 = time.perf_counter()
            try:
                reply = await worker.channel.request_async(
                    exec_request(code, limits, want_value=want_value, stdin=stdin), limits.wall_s
                )
            except ChannelError as e:
                result = await _to_thread(functools.partial(self._failed, worker, e, limits))
                return self._finish(result, t0)
            if reply.get("restart"):
                return self._finish(await _to_thread(functools.partial(self._replied, reply)), t0)
            return self._finish(self._replied(reply), t0)
        finally:
            self._lock.release()

    def _begin(self) -> WorkerHandle:
        if self.closed:
            raise SessionClosed("session is closed")
        self.last_used = time.monotonic()
        worker = self.ensure_worker()
        if self.closed:  # closed while the worker was starting: ``close`` could not stop it
            self._drop_worker()
            raise SessionClosed("session is closed")
        return worker

    def _failed(self, worker: WorkerHandle, e: ChannelError, limits: Limits) -> ExecResult:
        if isinstance(e, ChannelTimeout):
            result = ExecResult(
                timed_out=True,
                limit="wall_time",
                session_restarted=True,
                error=ExecError(
                    "TimeoutError", f"execution exceeded the {limits.wall_s:g} s wall-time limit"
                ),
            )
        else:
            rc = worker.wait_exit(1.0)
            lost = worker.lost_reason()
            if lost is not None:
                self._drop_worker()
                raise (SessionClosed if self.closed else SandboxUnavailable)(lost)
            result = classify_death(rc, worker.oom_killed(), limits)
        self._drop_worker()
        return result

    def _replied(self, reply: dict[str, Any]) -> ExecResult:
        result = result_from_reply(reply, 0.0)
        if reply.get("restart"):
            result.session_restarted = True
            self._drop_worker()
        return result

    def _finish(self, result: ExecResult, t0: float) -> ExecResult:
        result.duration_s = time.perf_counter() - t0
        self.executions += 1
        self.last_used = time.monotonic()
        return result

    def _drop_worker(self) -> None:
        worker, self.worker = self.worker, None
        self.restarts += 1
        if worker is not None:
            worker.kill()

    def close(self) -> None:
        """Close now: a running cell is cancelled (its worker killed), not waited for."""
        self.closed = True
        while not self._lock.acquire(timeout=0.05):
            worker = self.worker  # None while a worker is being started: _begin sees `closed`
            if worker is not None:
                worker.terminate("the session was closed while this cell ran; the cell was cancelled")
        try:
            worker, self.worker = self.worker, None
        finally:
            self._lock.release()
        if worker is not None:
            self._release(worker)

    def stats(self) -> dict[str, Any]:
        return {"executions": self.executions, "restarts": self.restarts}
