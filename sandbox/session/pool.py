"""A pool of pre-started workers, so a new session costs a pop from a list, not a process start.

It is typed against the ``Launcher`` protocol (sandbox/session/core.py), so bubblewrap processes
and Docker containers share it; ``warm_hits`` and ``cold_starts`` say how sessions got theirs.

Workers with the default per-session limits are started ahead of time by filler threads. Sessions
that ask for other session limits start their own worker on demand. Dead and used workers are
killed and reaped on reaper threads so that a one-shot execution does not wait for clean-up.

Every one-shot execution consumes a worker, so under a stream of one-shots the pool is only as
good as its refill. Two things keep it ahead of demand:

* Several workers start at once (``max_starting``: one per CPU, at least 4). A start is mostly CPU
  work (namespaces, then an interpreter booting) with some waiting in the kernel, so one filler
  left cores idle; on 2 busy cores 4 fillers refilled ~1.6x faster than 2.
* The target size adapts. It is ``size`` at rest and grows with the recent rate of acquisitions
  times the time a start takes (Little's law: the workers used up while one is starting), doubled
  for bursts, up to ``max_size``. It shrinks back when demand stops; surplus warm workers are
  retired after ``idle_retire_s``.

Workers come back. A launcher whose workers can ``recycle`` (bubblewrap's, sandbox/session_template.py)
gets a session's worker back when the session closes cleanly: a fresh worker is cloned in the same
sandbox in a few ms, and it rejoins the warm list. So an RL collect that opens a session per episode
and closes them all at the end reuses the same sandboxes every step instead of booting a worker per
episode while the engine generates. Workers handed out in the last ``idle_retire_s`` count as
coming back, so the fillers do not boot replacements for them ahead of demand (a waiter still gets
a start at once); a worker that fails, hits a limit or is closed mid-cell is killed, never reused.

A start made ahead of demand (warm workers left, nobody waiting) boots at the lowest CPU weight
where the launcher can set one (sandbox/bwrap/cgroups.py) and gets the default weight when handed
out: running sessions' cells go before refills.

When the pool is empty, ``acquire`` waits for a worker the fillers are already starting in the
foreground, if one is not yet promised to an earlier waiter; otherwise it starts its own. So concurrent starts follow
demand, as with one process per call, instead of queueing N callers behind ``max_starting``
starts (on a shared machine that would hand most of the CPU to everything else). If the fillers
fail (a broken launcher), the caller starts one itself and so gets the real error.

SandboxFusion's ``/run_code`` for Python bypasses this pool by default: a fork server
(sandbox/zygote.py) makes those one-shots without starting a worker each.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import queue
import threading
import time

from sandbox.limits import Limits
from sandbox.result import SandboxUnavailable
from sandbox.session.core import Launcher, WorkerHandle

log = logging.getLogger("sandbox")

REAPERS = 4
DEMAND_WINDOW_S = 5.0
"""Acquisitions counted for the demand rate: long enough to smooth, short enough to follow."""


class WorkerPool:
    def __init__(
        self,
        launcher: Launcher,
        limits: Limits,
        size: int,
        *,
        max_size: int | None = None,
        max_starting: int | None = None,
        idle_retire_s: float = 30.0,
    ) -> None:
        self.launcher = launcher
        self.limits = limits
        self.size = max(0, size)
        self.max_size = max(self.size, 4 * self.size if max_size is None else max_size)
        self.max_starting = max(1, max_starting or max(4, os.cpu_count() or 1))
        self.idle_retire_s = idle_retire_s
        self._ready: collections.deque[tuple[float, WorkerHandle]] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._starting = 0
        self._starting_bg = 0
        """Of ``_starting``, those booting in the background: no waiter counts on them."""
        self._waiting = 0
        self._out: dict[WorkerHandle, float] = {}
        """Recyclable workers handed out, with when: they are expected back (see the module doc)."""
        self._recycling = 0
        self.recycled = 0
        """Workers that came back after a session (see the module doc)."""
        self.booted = 0
        """Workers the fillers started (cold starts are counted apart)."""
        self._demand: collections.deque[float] = collections.deque()
        self._start_s = 0.1  # moving average of how long a worker takes to start
        self._failed_at = 0.0
        self.spawn_failures = 0
        self.warm_hits = 0
        self.cold_starts = 0
        self.last_error: str | None = None
        self._reap_q: queue.Queue[tuple[WorkerHandle, bool] | None] = queue.Queue()
        """Workers to kill, or (flag set) to recycle back into the pool if they can be."""
        # A kill is ~0.7 ms of our CPU but 5-10 ms of waiting for the kernel to tear the
        # namespaces down; one reaper thread would cap one-shots at 100-200/s.
        self._reapers = [
            threading.Thread(target=self._reap_loop, name=f"sandbox-reaper-{i}", daemon=True)
            for i in range(REAPERS)
        ]
        for t in self._reapers:
            t.start()
        self._fillers = [
            threading.Thread(target=self._fill_loop, name=f"sandbox-pool-{i}", daemon=True)
            for i in range(self.max_starting if self.size else 0)
        ]
        for t in self._fillers:
            t.start()

    # -- sizing -----------------------------------------------------------------------------
    @property
    def target(self) -> int:
        """Warm workers wanted now: ``size``, more while demand is high, never above ``max_size``."""
        if not self.size:
            return 0
        now = time.monotonic()
        while self._demand and self._demand[0] < now - DEMAND_WINDOW_S:
            self._demand.popleft()
        rate = len(self._demand) / DEMAND_WINDOW_S
        return min(self.max_size, max(self.size, math.ceil(2 * rate * self._start_s)))

    def _note_demand(self) -> None:
        self._demand.append(time.monotonic())

    def _coming_back(self) -> int:
        """Workers being recycled or handed out recently enough to be expected back (lock held)."""
        recent = time.monotonic() - self.idle_retire_s
        for worker in [w for w, t in self._out.items() if t < recent or not w.recyclable]:
            del self._out[worker]  # out for long (a long-lived session) or killed (a limit, a crash)
        return self._recycling + len(self._out)

    def _wanted(self) -> int:
        """Workers to start now (call with the lock held): the shortfall, waiters included."""
        expected = self._coming_back() if self._waiting == 0 else 0
        short = self.target + self._waiting - len(self._ready) - self._starting - expected
        return min(short, self.max_starting - self._starting)

    # -- filling ----------------------------------------------------------------------------
    def _fill_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and self._wanted() <= 0:
                    self._cond.wait(self.idle_retire_s / 2)
                    self._retire_surplus()
                if self._closed:
                    return
                # Ahead of demand (warm workers left, nobody waiting): boot at the lowest CPU weight,
                # so running sessions' cells go first (sandbox/bwrap/cgroups.py).
                background = bool(self._ready) and self._waiting == 0
                self._starting += 1
                self._starting_bg += background
            t0 = time.monotonic()
            try:
                worker = self.launcher.spawn(self.limits, background=background)
            except Exception as e:
                with self._cond:
                    self._starting -= 1
                    self._starting_bg -= background
                    self.spawn_failures += 1
                    self.last_error = str(e)
                    self._failed_at = time.monotonic()
                    self._cond.notify_all()  # waiters start their own worker and see the error
                    log.error("sandbox/pool: cannot start a worker: %s", e)
                    self._cond.wait(1.0)  # do not spin on a broken launcher
                continue
            with self._cond:
                self._starting -= 1
                self._starting_bg -= background
                if not background:  # a background start's time is mostly waiting for idle CPU
                    self._start_s = 0.8 * self._start_s + 0.2 * (time.monotonic() - t0)
                if self._closed:
                    self._reap_q.put((worker, False))
                    return
                self.booted += 1
                self._ready.append((time.monotonic(), worker))
                self._cond.notify_all()

    def _retire_surplus(self) -> None:
        """Kill warm workers beyond the target that have waited ``idle_retire_s`` (lock held)."""
        now = time.monotonic()
        while len(self._ready) > self.target and now - self._ready[0][0] > self.idle_retire_s:
            self._reap_q.put((self._ready.popleft()[1], False))

    @property
    def ready_count(self) -> int:
        return len(self._ready)

    def wait_ready(self, n: int | None = None, timeout_s: float = 30.0) -> bool:
        """Block until ``n`` (default: ``size``) warm workers exist; for start-up and benchmarks."""
        want = self.size if n is None else n
        with self._cond:
            return self._cond.wait_for(lambda: len(self._ready) >= want or self._closed, timeout_s)

    # -- handing out ------------------------------------------------------------------------
    def _pop(self) -> WorkerHandle | None:
        """A live warm worker, or None (lock held). Dead ones go to the reaper."""
        while self._ready:
            worker = self._ready.pop()[1]  # the most recently started: the least likely to be dead
            if worker.alive():
                self._cond.notify_all()  # the fillers may start its replacement
                self.warm_hits += 1
                foreground = getattr(worker, "foreground", None)  # launchers without CPU weights lack it
                if foreground is not None:
                    foreground()
                self._hand_out(worker)
                return worker
            self._reap_q.put((worker, False))
        return None

    def _hand_out(self, worker: WorkerHandle) -> None:
        if getattr(worker, "recyclable", False):
            self._out[worker] = time.monotonic()

    def try_acquire(self, limits: Limits | None = None) -> WorkerHandle | None:
        """A warm worker at once, or None (then call ``acquire`` on a thread: it may wait)."""
        limits = limits or self.limits
        if self._closed or limits.session_key() != self.limits.session_key():
            return None
        with self._cond:
            worker = self._pop()
            if worker is not None:
                self._note_demand()
            return worker

    def acquire(self, limits: Limits | None = None) -> WorkerHandle:
        limits = limits or self.limits
        if self._closed:
            raise SandboxUnavailable("the sandbox is shut down")
        if limits.session_key() == self.limits.session_key() and self._fillers:
            with self._cond:
                self._note_demand()
                asked = time.monotonic()
                while True:
                    worker = self._pop()
                    if worker is not None:
                        return worker
                    if self._closed:
                        raise SandboxUnavailable("the sandbox is shut down")
                    if self._failed_at >= asked - 1.0:
                        break  # the fillers are failing: start one here to surface the error
                    if self._starting - self._starting_bg <= self._waiting:
                        break  # every foreground start under way is promised to an earlier waiter
                    self._waiting += 1
                    self._cond.notify_all()
                    try:
                        self._cond.wait(1.0)
                    finally:
                        self._waiting -= 1
        worker = self.launcher.spawn(limits)
        with self._cond:
            self.cold_starts += 1
            if limits.session_key() == self.limits.session_key():
                self._hand_out(worker)
        return worker

    def warm_ids(self) -> list[str]:
        """Ids of the warm workers waiting now."""
        with self._cond:
            return [w.id for _, w in self._ready]

    # -- clean-up ---------------------------------------------------------------------------
    def release(self, worker: WorkerHandle) -> None:
        """A session is done with ``worker``: it comes back to the pool if it can, else it is killed."""
        with self._cond:
            recycle = self._out.pop(worker, None) is not None and not self._closed
            self._recycling += recycle
        self._reap_q.put((worker, recycle))

    def _reap_loop(self) -> None:
        while True:
            item = self._reap_q.get()
            if item is None:
                return
            worker, recycle = item
            try:
                if not (recycle and self._recycle(worker)):
                    worker.kill()
            except Exception as e:  # never let one bad worker stop clean-up of the rest
                log.error("sandbox/pool: failed to kill a worker: %s", e)

    def _recycle(self, worker: WorkerHandle) -> bool:
        try:
            ok = worker.recycle()  # type: ignore[attr-defined]
        finally:
            with self._cond:
                self._recycling -= 1
                self._cond.notify_all()
        with self._cond:
            if not ok or self._closed or len(self._ready) >= self.max_size:
                return False
            self._ready.append((time.monotonic(), worker))
            self.recycled += 1
            self._cond.notify_all()
            return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            ready = [w for _, w in self._ready]
            self._ready.clear()
            self._cond.notify_all()
        for t in self._fillers:
            t.join(timeout=30)
        for worker in ready:
            worker.kill()
        self._out.clear()
        for _ in self._reapers:
            self._reap_q.put(None)
        for t in self._reapers:
            t.join(timeout=30)
