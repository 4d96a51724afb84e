"""A pool of pre-started workers, so a new session costs a pop from a list, not a process start.

Workers with the default per-session limits are started ahead of time by a filler thread. Sessions
that ask for other session limits start their own worker on demand. Dead workers are killed and
reaped on a reaper thread so that a one-shot execution does not wait for clean-up.
"""

from __future__ import annotations

import logging
import queue
import threading

from sandbox.launcher import Launcher, WorkerProcess
from sandbox.limits import Limits
from sandbox.result import SandboxUnavailable

log = logging.getLogger("sandbox")


class WorkerPool:
    def __init__(self, launcher: Launcher, limits: Limits, size: int) -> None:
        self.launcher = launcher
        self.limits = limits
        self.size = max(0, size)
        self._ready: list[WorkerProcess] = []
        self._cond = threading.Condition()
        self._closed = False
        self.spawn_failures = 0
        self.last_error: str | None = None
        self._reap_q: queue.Queue[WorkerProcess | None] = queue.Queue()
        self._reaper = threading.Thread(target=self._reap_loop, name="sandbox-reaper", daemon=True)
        self._reaper.start()
        self._filler = threading.Thread(target=self._fill_loop, name="sandbox-pool", daemon=True)
        self._filler.start()

    # -- filling ----------------------------------------------------------------------------
    def _fill_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and len(self._ready) >= self.size:
                    self._cond.wait()
                if self._closed:
                    return
            try:
                worker = self.launcher.spawn(self.limits)
            except Exception as e:
                self.spawn_failures += 1
                self.last_error = str(e)
                log.error("sandbox/pool: cannot start a worker: %s", e)
                with self._cond:
                    self._cond.wait(1.0)  # do not spin on a broken launcher
                continue
            with self._cond:
                if self._closed:
                    self._reap_q.put(worker)
                    return
                self._ready.append(worker)
                self._cond.notify_all()

    @property
    def ready_count(self) -> int:
        return len(self._ready)

    def wait_ready(self, n: int | None = None, timeout_s: float = 30.0) -> bool:
        """Block until ``n`` (default: all) warm workers exist; for start-up and benchmarks."""
        want = self.size if n is None else n
        with self._cond:
            return self._cond.wait_for(lambda: len(self._ready) >= want or self._closed, timeout_s)

    def try_acquire(self, limits: Limits | None = None) -> WorkerProcess | None:
        """A warm worker at once, or None (then call ``acquire`` on a thread: it may start one)."""
        limits = limits or self.limits
        if self._closed or limits.session_key() != self.limits.session_key():
            return None
        with self._cond:
            while self._ready:
                worker = self._ready.pop()
                self._cond.notify_all()
                if worker.alive():
                    return worker
                self._reap_q.put(worker)
        return None

    def acquire(self, limits: Limits | None = None) -> WorkerProcess:
        limits = limits or self.limits
        if self._closed:
            raise SandboxUnavailable("the sandbox is shut down")
        if limits.session_key() == self.limits.session_key():
            with self._cond:
                while self._ready:
                    worker = self._ready.pop()
                    self._cond.notify_all()
                    if worker.alive():
                        return worker
                    self._reap_q.put(worker)
                self._cond.notify_all()
        return self.launcher.spawn(limits)

    # -- clean-up ---------------------------------------------------------------------------
    def release(self, worker: WorkerProcess) -> None:
        self._reap_q.put(worker)

    def _reap_loop(self) -> None:
        while True:
            worker = self._reap_q.get()
            if worker is None:
                return
            try:
                worker.kill()
            except Exception as e:  # never let one bad worker stop clean-up of the rest
                log.error("sandbox/pool: failed to kill a worker: %s", e)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            ready, self._ready = self._ready, []
            self._cond.notify_all()
        self._filler.join(timeout=30)
        for worker in ready:
            worker.kill()
        self._reap_q.put(None)
        self._reaper.join(timeout=30)
