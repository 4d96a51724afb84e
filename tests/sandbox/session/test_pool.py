"""WorkerPool's refill policy, with a fake launcher: concurrency, adaptive size, waiting, failures."""

from __future__ import annotations

import threading
import time

import pytest

from sandbox.limits import DEFAULT_LIMITS
from sandbox.result import SandboxUnavailable
from sandbox.session.pool import WorkerPool
from tests.sandbox.conftest import wait_for


class FakeWorker:
    def __init__(self, background: bool = False) -> None:
        self.killed = False
        self.started_in_background = background
        self.background = background

    def foreground(self) -> None:
        self.background = False

    def alive(self) -> bool:
        return not self.killed

    def kill(self) -> None:
        self.killed = True


class RecyclableWorker(FakeWorker):
    """A worker whose sandbox can take another session (sandbox/session_template.py)."""

    def __init__(self, background: bool = False, ok: bool = True) -> None:
        super().__init__(background)
        self.ok = ok
        self.sessions = 1

    @property
    def recyclable(self) -> bool:
        return not self.killed

    def recycle(self) -> bool:
        if self.ok:
            self.sessions += 1
        return self.ok


class FakeLauncher:
    """Starts take ``start_s``; records how many ran at once; can be made to fail."""

    def __init__(self, start_s: float = 0.05) -> None:
        self.start_s = start_s
        self.worker_type: type[FakeWorker] = FakeWorker
        self.fail: Exception | None = None
        self.running = 0
        self.most_at_once = 0
        self.started = 0
        self.spawning_threads: set[int] = set()
        self._lock = threading.Lock()

    def spawn(self, limits: object, background: bool = False) -> FakeWorker:
        if self.fail is not None:
            raise self.fail
        with self._lock:
            self.spawning_threads.add(threading.get_ident())
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        time.sleep(self.start_s)
        with self._lock:
            self.running -= 1
            self.started += 1
        return self.worker_type(background)


def test_fills_to_size_with_concurrent_starts() -> None:
    launcher = FakeLauncher(start_s=0.1)
    pool = WorkerPool(launcher, DEFAULT_LIMITS, 4, max_starting=4)  # type: ignore[arg-type]
    try:
        assert pool.wait_ready(timeout_s=5)
        assert launcher.most_at_once == 4  # not one at a time
        time.sleep(0.2)
        assert pool.ready_count == 4  # and no more than asked for while idle
    finally:
        pool.close()


def test_refills_ahead_of_demand_boot_in_the_background_and_are_handed_out_in_the_foreground() -> None:
    launcher = FakeLauncher(start_s=0.05)
    pool = WorkerPool(launcher, DEFAULT_LIMITS, 3, max_starting=1)  # type: ignore[arg-type]
    try:
        assert pool.wait_ready(timeout_s=5)
        first = [pool.acquire() for _ in range(3)]  # the pool is empty: a caller may be waiting
        assert all(not w.background for w in first)  # handed out in the foreground, whatever they booted as
        assert any(not w.started_in_background for w in first)  # the first start: no warm worker beside it
        assert pool.wait_ready(timeout_s=5)
        refills = [w for _, w in pool._ready]
        assert any(w.started_in_background for w in refills)  # started while others were warm
        assert any(w.background for w in refills)  # still low until handed out
        handed = pool.acquire()
        assert not handed.background
    finally:
        pool.close()


def test_target_grows_with_demand_and_shrinks_back() -> None:
    launcher = FakeLauncher(start_s=0.05)
    pool = WorkerPool(launcher, DEFAULT_LIMITS, 2, max_size=8, idle_retire_s=0.3)  # type: ignore[arg-type]
    try:
        assert pool.wait_ready(timeout_s=5)
        assert pool.target == 2
        for _ in range(100):  # 100 acquisitions in well under a second: 20/s over the window
            pool.release(pool.acquire())
        assert pool.target > 2
        assert wait_for(lambda: pool.ready_count > 2)  # it keeps more warm workers
        pool._demand.clear()  # demand stops
        assert pool.target == 2
        assert wait_for(lambda: pool.ready_count == 2)  # surplus retired after idle_retire_s
    finally:
        pool.close()


def test_an_empty_pool_hands_a_caller_a_worker_already_starting() -> None:
    launcher = FakeLauncher(start_s=0.2)
    pool = WorkerPool(launcher, DEFAULT_LIMITS, 1, max_starting=2)  # type: ignore[arg-type]
    try:
        assert pool.wait_ready(timeout_s=5)
        pool.acquire()  # empties the pool; the fillers start its replacement
        assert wait_for(lambda: pool._starting > 0)
        pool.acquire()  # waits for that start instead of adding one of its own
        assert threading.get_ident() not in launcher.spawning_threads
    finally:
        pool.close()


def test_concurrent_starts_follow_demand_beyond_the_fillers() -> None:
    launcher = FakeLauncher(start_s=0.1)
    pool = WorkerPool(launcher, DEFAULT_LIMITS, 1, max_starting=2)  # type: ignore[arg-type]
    try:
        got: list[FakeWorker] = []
        threads = [threading.Thread(target=lambda: got.append(pool.acquire())) for _ in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(got) == 10 and len({id(w) for w in got}) == 10
        assert launcher.most_at_once > 2  # callers beyond the starts under way start their own
    finally:
        pool.close()


def test_a_failing_launcher_surfaces_its_error_instead_of_hanging() -> None:
    launcher = FakeLauncher()
    launcher.fail = SandboxUnavailable("cannot start a sandbox worker: no bwrap")
    pool = WorkerPool(launcher, DEFAULT_LIMITS, 2)  # type: ignore[arg-type]
    try:
        t = time.monotonic()
        with pytest.raises(SandboxUnavailable, match="no bwrap"):
            pool.acquire()
        assert time.monotonic() - t < 3
        assert pool.spawn_failures >= 1 and "no bwrap" in (pool.last_error or "")
    finally:
        pool.close()


def test_other_limits_and_a_zero_size_pool_start_their_own_worker() -> None:
    launcher = FakeLauncher(start_s=0.0)
    pool = WorkerPool(launcher, DEFAULT_LIMITS, 0)  # type: ignore[arg-type]
    try:
        assert pool.acquire() is not None and pool.ready_count == 0 and pool.target == 0
        other = DEFAULT_LIMITS.updated({"memory_mb": 256}, DEFAULT_LIMITS)
        assert pool.try_acquire(other) is None and pool.acquire(other) is not None
    finally:
        pool.close()


def test_released_workers_come_back_instead_of_being_replaced() -> None:
    launcher = FakeLauncher(start_s=0.02)
    launcher.worker_type = RecyclableWorker
    pool = WorkerPool(launcher, DEFAULT_LIMITS, 2, max_starting=2)  # type: ignore[arg-type]
    try:
        assert pool.wait_ready(timeout_s=5)
        started = launcher.started
        for _ in range(5):  # an RL collect: every episode takes a worker, all end together
            got = [pool.acquire() for _ in range(2)]
            time.sleep(0.1)  # the engine generates: the fillers must not boot replacements
            assert launcher.started == started, "out workers count as coming back"
            for w in got:
                pool.release(w)
            assert wait_for(lambda: pool.ready_count == 2)
        assert pool.recycled == 10 and launcher.started == started
        assert all(not w.killed and w.sessions == 6 for _, w in pool._ready)
    finally:
        pool.close()


def test_a_worker_that_cannot_come_back_is_killed_and_replaced() -> None:
    launcher = FakeLauncher(start_s=0.02)
    launcher.worker_type = RecyclableWorker
    pool = WorkerPool(launcher, DEFAULT_LIMITS, 1)  # type: ignore[arg-type]
    try:
        assert pool.wait_ready(timeout_s=5)
        w = pool.acquire()
        w.ok = False  # e.g. its cgroup saw an OOM kill
        pool.release(w)
        assert wait_for(lambda: w.killed and pool.ready_count == 1)
        assert pool.recycled == 0 and launcher.started == 2
        # A worker its session killed (a limit, a crash) stops counting as coming back at once.
        dead = pool.acquire()
        dead.kill()
        assert wait_for(lambda: pool.ready_count == 1) and launcher.started == 3
    finally:
        pool.close()


def test_a_waiter_does_not_wait_for_workers_coming_back() -> None:
    launcher = FakeLauncher(start_s=0.02)
    launcher.worker_type = RecyclableWorker
    pool = WorkerPool(launcher, DEFAULT_LIMITS, 1, max_size=1)  # type: ignore[arg-type]
    try:
        assert pool.wait_ready(timeout_s=5)
        held = pool.acquire()
        t = time.monotonic()
        other = pool.acquire()  # nothing warm, one out: this caller gets a start, not a wait
        assert other is not held and time.monotonic() - t < 1
        pool.release(held)
        pool.release(other)
        assert wait_for(lambda: pool.recycled + sum(w.killed for w in (held, other)) == 2)
        assert pool.ready_count <= pool.max_size  # the pool keeps its bound
    finally:
        pool.close()
