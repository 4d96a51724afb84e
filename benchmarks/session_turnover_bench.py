"""CPU per RL episode's sandbox session: a reused sandbox against a new worker per session, same run.

An RL collect opens a sandbox session per episode, runs a few cells and closes it, for every
episode at once. What a session costs beyond its cells is the pool's turnover: either a fresh
worker (bubblewrap + an interpreter) booted to replace the closed one, or (the default,
``LaunchConfig.recycle``) the closed session's sandbox cloning a fresh worker from its template
(sandbox/session_template.py). Per round, ``--episodes`` sessions run ``--cells`` cells each on
threads, close together, and the pool is waited on until it is full again, as before a learner
step.

CPU is everything the sandbox spends: this process (the pool's threads, the sessions' host side)
and every worker, read from a cgroup v1 cpuacct group the benchmark moves itself into (workers are
born into it; the launcher's own cgroups are memory, pids and cpu, not cpuacct). Printed:
CPU ms per session, and the same per cell with the cells' own share in a session that is kept
open (the floor: no turnover at all).

    python benchmarks/session_turnover_bench.py [--episodes 32] [--cells 3] [--rounds 10]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sandbox import LocalSandbox
from sandbox.bwrap.launcher import LaunchConfig

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
GROUP = CPUACCT / "agent-rl-turnover-bench"
CELL = "x = 97\nprint(sum(i * i for i in range(x)))"


def own_cpuacct_group() -> bool:
    """Move this process into a cpuacct group of its own: its workers are born into it too."""
    try:
        GROUP.mkdir(exist_ok=True)
        (GROUP / "cgroup.procs").write_text(str(os.getpid()))
        return True
    except OSError:
        return False


def cpu_s() -> float:
    """CPU of this process and every process started from it (workers included), in seconds."""
    if (GROUP / "cpuacct.usage").exists():
        return int((GROUP / "cpuacct.usage").read_text()) / 1e9
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # workers count only once they exit
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def episode(box: LocalSandbox, cells: int) -> None:
    with box.session() as s:
        for _ in range(cells):
            assert s.run(CELL, timeout_s=10).stdout == "299536\n"


def kept_open(box: LocalSandbox, threads: ThreadPoolExecutor, episodes: int, cells: int) -> float:
    """CPU per cell in sessions kept open across rounds (no turnover at all)."""
    sessions = [box.session() for _ in range(episodes)]
    try:
        list(threads.map(lambda s: s.run("pass"), sessions))
        c0 = cpu_s()
        list(threads.map(lambda s: [s.run(CELL, timeout_s=10) for _ in range(cells)], sessions))
        return (cpu_s() - c0) / (episodes * cells)
    finally:
        for s in sessions:
            s.close()


def measure(recycle: bool, args: argparse.Namespace) -> tuple[list[float], float, int, int]:
    box = LocalSandbox(pool_size=args.episodes, isolation="bwrap", launch=LaunchConfig(recycle=recycle))
    try:
        assert box.launcher.template == recycle, "session templates unavailable on this host"
        threads = ThreadPoolExecutor(args.episodes)
        per_session = []
        for r in range(args.rounds + 1):
            box.pool.wait_ready(timeout_s=120)
            time.sleep(0.5)  # the last round's kills and boots settle, as before a learner step
            c0 = cpu_s()
            list(threads.map(lambda _: episode(box, args.cells), range(args.episodes)))
            box.pool.wait_ready(timeout_s=120)  # the turnover is part of the round's cost
            deadline = time.monotonic() + 30
            while box.pool.ready_count < args.episodes and time.monotonic() < deadline:
                time.sleep(0.01)
            if r:  # round 0 warms up
                per_session.append((cpu_s() - c0) / args.episodes)
        floor = kept_open(box, threads, args.episodes, args.cells)
        threads.shutdown()
        return per_session, floor, box.pool.booted + box.pool.cold_starts, box.pool.recycled
    finally:
        box.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--cells", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    if not own_cpuacct_group():
        print("note: no writable cgroup v1 cpuacct: a worker's CPU is counted only once it exits")
    print(f"load average at start: {[round(x, 1) for x in os.getloadavg()]}")
    rows = {}
    for recycle in (False, True, False, True):  # interleaved: load drifts hit both alike
        per_session, floor, boots, recycled = measure(recycle, args)
        rows.setdefault(recycle, []).append((per_session, floor, boots, recycled))
    print(f"\n{args.episodes} episodes x {args.cells} cells per round, {args.rounds} rounds x 2 runs, medians")
    print(f"{'worker per session':<24} {'CPU ms/session':>14} {'cells ms':>9} {'turnover ms':>11} {'boots':>6} {'reused':>6}")
    med = {}
    for recycle, name in ((False, "new (recycle=False)"), (True, "reused (default)")):
        runs = rows[recycle]
        session = statistics.median(x for r in runs for x in r[0]) * 1e3
        cells = statistics.median(r[1] for r in runs) * 1e3 * args.cells
        med[recycle] = session - cells
        boots, reused = sum(r[2] for r in runs), sum(r[3] for r in runs)
        print(f"{name:<24} {session:>14.2f} {cells:>9.2f} {session - cells:>11.2f} {boots:>6} {reused:>6}")
    if GROUP.exists():
        (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
        GROUP.rmdir()
    print(f"\nturnover per session: {med[False] / max(med[True], 1e-9):.1f}x less CPU with the sandbox reused")


if __name__ == "__main__":
    main()
