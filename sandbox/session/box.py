"""The front every backend shares: a sandbox of pooled workers and the sessions that drive them.

``PooledSandbox(launcher, ...)`` is LocalSandbox (bubblewrap workers) and DockerSandbox (one
container per worker) alike; only the launcher differs. ``.session()`` hands out a warm worker from
the pool; ``.run(code)`` is a one-shot in a fresh worker that is thrown away afterwards;
``.run_batch([...])`` runs one-shots concurrently. ``Session.run`` has one signature for every
backend (and ``RemoteSession.run`` mirrors it over HTTP): ``timeout_s``, ``want_value``, ``stdin``,
``files`` and the per-execution limits.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sandbox.limits import DEFAULT_LIMITS, MAX_LIMITS, PER_EXECUTION, LimitError, Limits
from sandbox.result import ExecResult, SandboxUnavailable
from sandbox.session.core import Launcher, SessionCore
from sandbox.session.pool import WorkerPool

_LIVE: weakref.WeakSet[PooledSandbox] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Kill every worker at interpreter exit, before daemon threads are frozen mid-spawn."""
    for sb in list(_LIVE):
        with contextlib.suppress(Exception):
            sb.close()


def exec_limits(base: Limits, maxima: Limits, timeout_s: float | None, overrides: dict[str, Any]) -> Limits:
    """Per-execution limits: only wall_s, cpu_s and output_bytes may change between cells."""
    bad = set(overrides) - PER_EXECUTION
    if bad:
        raise LimitError(
            f"limits {sorted(bad)} are fixed per session; per execution you may set {sorted(PER_EXECUTION)}"
        )
    if timeout_s is not None:
        overrides = {**overrides, "wall_s": timeout_s}
    return base.updated(overrides, maxima)


class Session:
    """One persistent interpreter; use as a context manager or call ``close``."""

    def __init__(self, sandbox: PooledSandbox, core: SessionCore, session_id: str) -> None:
        self.sandbox = sandbox
        self.core = core
        self.id = session_id

    @property
    def limits(self) -> Limits:
        return self.core.limits

    @property
    def closed(self) -> bool:
        return self.core.closed

    @property
    def worker_id(self) -> str | None:
        """The worker running this session now (a container id under Docker); None between workers."""
        worker = self.core.worker
        return None if worker is None else worker.id

    def run(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        want_value: bool = True,
        stdin: str | None = None,
        files: dict[str, str] | None = None,
        **limits: Any,
    ) -> ExecResult:
        """Run one cell. ``files`` maps workspace paths to base64 content written before it runs."""
        lim = self._cell_limits(code, timeout_s, limits)
        return self.core.run(code, lim, want_value=want_value, stdin=stdin, files=files)

    async def run_async(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        want_value: bool = True,
        stdin: str | None = None,
        files: dict[str, str] | None = None,
        **limits: Any,
    ) -> ExecResult:
        """``run`` for asyncio callers: waits on the event loop, not a thread, when it can."""
        lim = self._cell_limits(code, timeout_s, limits)
        return await self.core.run_async(code, lim, want_value=want_value, stdin=stdin, files=files)

    def _cell_limits(self, code: object, timeout_s: float | None, limits: dict[str, Any]) -> Limits:
        """The limits of one cell (session limits, overrides capped by the sandbox's maxima)."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        return exec_limits(self.core.limits, self.sandbox.max_limits, timeout_s, limits)

    def close(self) -> None:
        self.core.close()
        self.sandbox._forget(self.id)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PooledSandbox:
    """A warm pool of workers from ``launcher`` and the sessions that use them; the backends' base."""

    def __init__(
        self,
        launcher: Launcher,
        *,
        limits: Limits | None = None,
        max_limits: Limits | None = None,
        pool_size: int = 2,
        batch_concurrency: int = 8,
        **pool_options: Any,
    ) -> None:
        self.limits = limits or DEFAULT_LIMITS
        self.max_limits = max_limits or MAX_LIMITS
        if self.limits.updated(self.limits.to_dict(), self.max_limits) != self.limits:
            raise LimitError("the default limits must not exceed the maximum limits")
        self.launcher = launcher
        self.pool = WorkerPool(launcher, self.limits, pool_size, **pool_options)
        self.batch_concurrency = batch_concurrency
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._batch_pool: ThreadPoolExecutor | None = None
        self._one_shots: set[SessionCore] = set()  # running, so that close() can cancel them
        self.closed = False
        _LIVE.add(self)

    # -- sessions ---------------------------------------------------------------------------
    def session(self, **limit_overrides: Any) -> Session:
        limits = self.limits.updated(limit_overrides, self.max_limits)
        if self.closed:
            raise SandboxUnavailable("the sandbox is closed")
        core = SessionCore(lambda: self.pool.acquire(limits), self.pool.release, limits)
        core.ensure_worker()  # fail now (SandboxUnavailable) rather than at the first run
        s = Session(self, core, uuid.uuid4().hex)
        with self._lock:
            if not self.closed:  # else closed while the worker started: close() did not see it
                self._sessions[s.id] = s
                return s
        core.close()
        raise SandboxUnavailable("the sandbox is closed")

    def get_session(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    @property
    def sessions(self) -> dict[str, Session]:
        return dict(self._sessions)

    def _forget(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    # -- one-shot ---------------------------------------------------------------------------
    def _one_shot_limits(
        self, code: object, timeout_s: float | None, overrides: dict[str, Any]
    ) -> tuple[Limits, Limits]:
        """Validate a one-shot request; return (session limits, this execution's limits)."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        per_exec = {k: v for k, v in overrides.items() if k in PER_EXECUTION}
        per_session = {k: v for k, v in overrides.items() if k not in PER_EXECUTION}
        limits = self.limits.updated(per_session, self.max_limits)
        return limits, exec_limits(limits, self.max_limits, timeout_s, per_exec)

    def run(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        stdin: str | None = None,
        files: dict[str, str] | None = None,
        want_value: bool = True,
        **limit_overrides: Any,
    ) -> ExecResult:
        """Run ``code`` in a fresh worker that is discarded afterwards."""
        limits, lim = self._one_shot_limits(code, timeout_s, limit_overrides)
        core = self._one_shot_core(limits)
        try:
            result = core.run(code, lim, want_value=want_value, stdin=stdin, files=files)
        finally:
            self._end_one_shot(core)
        result.session_restarted = False  # nothing persists in a one-shot, so nothing was lost
        return result

    def _one_shot_core(self, limits: Limits) -> SessionCore:
        core = SessionCore(lambda: self.pool.acquire(limits), self.pool.release, limits)
        with self._lock:
            if self.closed:
                raise SandboxUnavailable("the sandbox is closed")
            self._one_shots.add(core)
        return core

    def _end_one_shot(self, core: SessionCore) -> None:
        with self._lock:
            self._one_shots.discard(core)
        core.close()

    async def run_async(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        stdin: str | None = None,
        files: dict[str, str] | None = None,
        want_value: bool = True,
        **limit_overrides: Any,
    ) -> ExecResult:
        """One-shot for asyncio callers; a warm worker is used without any thread hop."""
        limits, lim = self._one_shot_limits(code, timeout_s, limit_overrides)
        worker = None if files else self.pool.try_acquire(limits)
        if worker is None:
            import anyio

            return await anyio.to_thread.run_sync(
                lambda: self.run(
                    code,
                    timeout_s=timeout_s,
                    stdin=stdin,
                    files=files,
                    want_value=want_value,
                    **limit_overrides,
                )
            )
        try:
            core = self._one_shot_core(limits)
        except SandboxUnavailable:
            self.pool.release(worker)
            raise
        core.worker = worker
        try:
            result = await core.run_async(code, lim, want_value=want_value, stdin=stdin)
        finally:
            self._end_one_shot(core)
        result.session_restarted = False
        return result

    def run_batch(
        self, codes: list[str], *, timeout_s: float | None = None, **limit_overrides: Any
    ) -> list[ExecResult]:
        """Run independent programs concurrently, each in a fresh worker; results keep input order."""
        if self._batch_pool is None:
            with self._lock:
                if self._batch_pool is None:
                    self._batch_pool = ThreadPoolExecutor(
                        self.batch_concurrency, thread_name_prefix="sandbox-batch"
                    )
        futures = [
            self._batch_pool.submit(self.run, c, timeout_s=timeout_s, **limit_overrides) for c in codes
        ]
        return [f.result() for f in futures]

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Kill and reap every worker, warm or in use; running cells are cancelled, not awaited."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            one_shots = list(self._one_shots)
        for s in list(self._sessions.values()):
            s.close()
        for core in one_shots:
            core.close()
        if self._batch_pool is not None:
            self._batch_pool.shutdown(wait=True)
        self.pool.close()

    def __enter__(self) -> PooledSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # try/except, not contextlib: at interpreter exit module globals may already be None
        # (CI printed "'NoneType' object has no attribute 'suppress'" from here).
        try:
            if not self.closed:
                self.close()
        except Exception:
            pass
