"""What the running server holds: the LocalSandbox, the execution gate, metrics, session expiry."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any, TypeVar

import anyio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sandbox.bwrap.local import LocalSandbox
from sandbox.http.settings import SandboxSettings
from sandbox.result import ExecResult
from sandbox.zygote import Zygote

log = logging.getLogger("sandbox")
T = TypeVar("T")


class Overloaded(Exception):
    """Too many sessions or queued executions: the client should retry after a pause."""


class QueueTimeout(Overloaded):
    """A SandboxFusion request waited ``fusion_queue_wait_s`` without a slot: answered 504."""


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.executions = Counter(
            "sandbox_executions_total",
            "Executions by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.latency = Histogram(
            "sandbox_execution_seconds",
            "Wall time of executions as seen by the server",
            ["endpoint"],
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.rejected = Counter("sandbox_rejected_total", "Requests answered 429", ["reason"], registry=r)
        self.sessions = Gauge("sandbox_sessions", "Live sessions", registry=r)
        self.pending = Gauge("sandbox_pending_executions", "Executions running or queued", registry=r)
        self.pool_ready = Gauge("sandbox_pool_ready_workers", "Warm workers waiting in the pool", registry=r)
        self.expired = Counter("sandbox_sessions_expired_total", "Sessions closed for idleness", registry=r)

    def record(self, endpoint: str, result: ExecResult) -> None:
        if result.limit:
            outcome = f"limit_{result.limit}"
        elif result.error is not None:
            outcome = "error"
        else:
            outcome = "ok"
        self.executions.labels(endpoint, outcome).inc()
        self.latency.labels(endpoint).observe(result.duration_s)


class ServerState:
    def __init__(self, settings: SandboxSettings, sandbox: LocalSandbox | None = None) -> None:
        self.settings = settings
        self.sandbox = sandbox
        self.owns_sandbox = sandbox is None
        self.metrics = Metrics()
        self.pending = 0
        self.opening = 0  # sessions being created: they count against max_sessions already
        self.limiter: asyncio.Semaphore | None = None
        self.zygote: Zygote | None = None
        """The one-shot fork server behind /run_code (settings.oneshot == "zygote"), or None."""
        self._expiry: asyncio.Task[None] | None = None
        self.started = time.monotonic()

    async def start(self) -> None:
        s = self.settings
        if self.sandbox is None:
            self.sandbox = await anyio.to_thread.run_sync(
                lambda: LocalSandbox(
                    limits=s.default_limits,
                    max_limits=s.max_limits,
                    pool_size=s.pool_size,
                    isolation=s.isolation,
                    require_isolation=s.require_isolation,
                    launch=_launch_config(s),
                    batch_concurrency=s.max_concurrent_executions,
                )
            )
        if s.oneshot == "zygote" and self.sb.isolation == "bwrap":
            # Per-request memory comes with each /run_code request (up to the server maximum).
            limits = replace(s.default_limits, memory_mb=s.max_limits.memory_mb)
            self.zygote = Zygote(_launch_config(s), limits, slots=s.max_concurrent_executions)
            await anyio.to_thread.run_sync(self.zygote.start)
        # asyncio's semaphore, not anyio's CapacityLimiter: that one yields to the event loop on
        # every acquire even when a slot is free, an extra loop turn per warm execution.
        self.limiter = asyncio.Semaphore(s.max_concurrent_executions)
        self._expiry = asyncio.create_task(self._expire_loop())

    async def stop(self) -> None:
        if self.zygote is not None:
            await anyio.to_thread.run_sync(self.zygote.close)
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
        if self.sandbox is not None and self.owns_sandbox:
            await anyio.to_thread.run_sync(self.sandbox.close)

    @property
    def sb(self) -> LocalSandbox:
        assert self.sandbox is not None, "server not started"
        return self.sandbox

    def admit(self, n: int = 1) -> None:
        """Take ``n`` queue slots at once, or none (429): a batch is admitted whole or refused.

        Synchronous on purpose: no other request can run between the check and the taking, so
        concurrent requests cannot all see the same free slots (two batches once overfilled the
        queue that way, and the programs that found it full failed the request with a 500).
        """
        if self.pending + n > self.settings.max_queued_executions:
            self.metrics.rejected.labels("queue_full").inc()
            raise Overloaded(
                f"{self.pending} executions are running or queued and {n} more do not fit "
                f"(max {self.settings.max_queued_executions})"
            )
        self.pending += n
        self.metrics.pending.set(self.pending)

    async def run_admitted(self, make: Callable[[], Awaitable[T]]) -> T:
        """Run one execution that ``admit`` let in, under the concurrency cap; frees its slot."""
        try:
            assert self.limiter is not None
            async with self.limiter:
                return await make()
        finally:
            self.pending -= 1
            self.metrics.pending.set(self.pending)

    async def execute(self, make: Callable[[], Awaitable[T]]) -> T:
        """Run one execution under the concurrency cap, or refuse at once when the queue is full."""
        self.admit(1)
        return await self.run_admitted(make)

    async def execute_queued(self, make: Callable[[], Awaitable[T]], wait_s: float) -> T:
        """Like ``execute``, but wait up to ``wait_s`` for a running slot instead of refusing.

        For SandboxFusion clients, which treat 429 as a failed program: a request waits (bounded
        by ``max_queued_executions`` waiting at once and ``wait_s`` each) and only then gets
        QueueTimeout, which the app answers with 504, the one status verl retries.
        """
        if self.pending >= self.settings.max_queued_executions:
            self.metrics.rejected.labels("queue_full").inc()
            raise QueueTimeout(f"{self.pending} executions are running or queued")
        self.pending += 1
        self.metrics.pending.set(self.pending)
        try:
            assert self.limiter is not None
            try:
                if self.limiter.locked():
                    await asyncio.wait_for(self.limiter.acquire(), wait_s)
                else:
                    await self.limiter.acquire()  # a free slot: no timer, no extra task
            except asyncio.TimeoutError:
                self.metrics.rejected.labels("queue_wait").inc()
                raise QueueTimeout(f"no execution slot within {wait_s:g} s") from None
            try:
                return await make()
            finally:
                self.limiter.release()
        finally:
            self.pending -= 1
            self.metrics.pending.set(self.pending)

    @contextlib.contextmanager
    def opening_session(self) -> Iterator[None]:
        """Count a session against ``max_sessions`` from the check on, not from when it exists.

        Creating a session waits for a worker; without this, 40 concurrent creates with a cap of 8
        all passed the check before any of them existed (29 were made).
        """
        live = len(self.sb.sessions) + self.opening
        if live >= self.settings.max_sessions:
            self.metrics.rejected.labels("sessions_full").inc()
            raise Overloaded(f"{self.settings.max_sessions} sessions are open; delete one or wait for expiry")
        self.opening += 1
        try:
            yield
        finally:
            self.opening -= 1

    async def _expire_loop(self) -> None:
        period = min(5.0, self.settings.session_idle_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                await self.expire_idle()
            except Exception as e:  # expiry must never die silently
                log.error("sandbox/expiry: %s", e)

    async def expire_idle(self) -> int:
        now = time.monotonic()
        idle = [
            s
            for s in self.sb.sessions.values()
            if not s.core.busy and now - s.core.last_used > self.settings.session_idle_timeout_s
        ]
        for s in idle:
            await anyio.to_thread.run_sync(s.close)
            self.metrics.expired.inc()
        self.refresh_gauges()
        return len(idle)

    def refresh_gauges(self) -> None:
        if self.sandbox is not None:
            self.metrics.sessions.set(len(self.sandbox.sessions))
            self.metrics.pool_ready.set(self.sandbox.pool.ready_count)


def _launch_config(s: SandboxSettings) -> Any:
    from sandbox.bwrap.launcher import LaunchConfig

    return LaunchConfig(python=s.python, recycle=s.recycle)
