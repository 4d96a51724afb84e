"""Who owns a worker: sessions outlive the thread that started them, closing cancels a running cell,
and a worker killed by the sandbox's side is an infrastructure failure, not the program's result."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from sandbox import LocalSandbox, SandboxUnavailable
from sandbox.result import SessionClosed
from tests.sandbox.conftest import need_bwrap, settled_zombies


@pytest.fixture
def cold() -> Iterator[LocalSandbox]:
    """No warm pool: every worker is started by the thread that asks for it."""
    need_bwrap()
    box = LocalSandbox(pool_size=0, isolation="bwrap")
    yield box
    box.close()


def _on_a_thread_that_exits(fn):  # type: ignore[no-untyped-def]
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(fn()))
    t.start()
    t.join(30)
    assert not t.is_alive() and got
    return got[0]


def test_a_session_outlives_the_thread_that_started_its_worker(cold: LocalSandbox) -> None:
    # bwrap's --die-with-parent follows the forking *thread*: before the fix every one of these
    # sessions lost its worker (WorkerCrashed, SIGKILL) as soon as its helper thread ended.
    sessions = [_on_a_thread_that_exits(cold.session) for _ in range(4)]
    for i, s in enumerate(sessions):
        assert s.run(f"x = {i}").ok  # type: ignore[attr-defined]
    time.sleep(0.3)
    for i, s in enumerate(sessions):
        r = s.run("x")  # type: ignore[attr-defined]
        assert r.ok and r.value == str(i) and not r.session_restarted, r
        s.close()  # type: ignore[attr-defined]


def test_a_worker_killed_from_outside_is_an_infrastructure_failure(cold: LocalSandbox) -> None:
    with cold.session() as s:
        s.run("x = 1")
        monitor = s.core.worker.proc.pid  # type: ignore[union-attr]
        threading.Timer(0.3, os.kill, (monitor, signal.SIGKILL)).start()
        with pytest.raises(SandboxUnavailable, match="killed from outside the sandbox"):
            s.run("import time; time.sleep(10)")
        # The session goes on in a fresh worker (its state is gone, which the error said).
        r = s.run("'x' in globals()")
        assert r.ok and r.value == "False"
    # The code killing itself is still the program's own result.
    with cold.session() as s:
        r = s.run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
        assert r.error is not None and r.error.type == "WorkerCrashed" and r.session_restarted


def test_closing_a_busy_session_cancels_its_cell_at_once(cold: LocalSandbox) -> None:
    s = cold.session()
    outcome: list[BaseException | object] = []

    def run() -> None:
        try:
            outcome.append(s.run("import time; time.sleep(15)", timeout_s=20))
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    s.close()
    closed_in = time.monotonic() - t0
    t.join(5)
    assert closed_in < 2.0, f"close waited {closed_in:.1f} s for the running cell"
    assert not t.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], SessionClosed), outcome
    assert not settled_zombies()


def test_closing_the_sandbox_cancels_running_cells_and_one_shots() -> None:
    need_bwrap()
    box = LocalSandbox(pool_size=1, isolation="bwrap")
    s = box.session()
    errors: list[BaseException] = []

    def run(fn) -> None:  # type: ignore[no-untyped-def]
        try:
            fn("import time; time.sleep(15)", timeout_s=20)
        except SandboxUnavailable as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(f,)) for f in (s.run, box.run)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    box.close()
    took = time.monotonic() - t0
    for t in threads:
        t.join(5)
    assert took < 3.0, f"shutdown waited {took:.1f} s for running cells"
    assert len(errors) == 2 and all(isinstance(e, SessionClosed) for e in errors), errors
