"""Fixtures: one warm LocalSandbox per module, and an in-process server for the HTTP tests."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sandbox import LocalSandbox


def need_bwrap() -> None:
    """Isolation tests need bubblewrap; in CI its absence is a failure, not a skip."""
    if shutil.which("bwrap") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("bubblewrap is required in CI: apt-get install -y bubblewrap")
        pytest.skip("bubblewrap not installed")


@pytest.fixture(scope="module")
def sb() -> Iterator[LocalSandbox]:
    need_bwrap()
    box = LocalSandbox(pool_size=2, isolation="bwrap")
    yield box
    box.close()


def _my_children() -> list[tuple[str, str]]:
    """(pid, state letter) of every process whose parent is this test process."""
    me = str(os.getpid())
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[1] == me:
            found.append((pid, fields[0]))
    return found


def cmdline(pid: int) -> str:
    """A process's command line, for naming a leftover in an assertion message."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "(gone)"


def zombies() -> list[str]:
    """Zombie processes whose parent is this test process (ours to reap)."""
    return [pid for pid, state in _my_children() if state == "Z"]


def children() -> list[int]:
    return [int(pid) for pid, _ in _my_children()]


def settled_zombies(timeout_s: float = 5.0) -> list[str]:
    """Zombies still unreaped after ``timeout_s`` (workers are reaped on a background thread)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        found = zombies()
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def wait_for(cond: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Poll ``cond`` until it holds (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
