"""Per-worker memory and pid cgroups, where the host lets us write them (v1 or v2).

Rlimits are per process; a cgroup caps the whole session's tree (forks, tmpfs pages included) and
tells us afterwards whether the kernel's OOM killer fired, which an exit status alone cannot.
When nothing is writable, ``CgroupManager.available`` is False and callers rely on rlimits only.

Where the cpu controller is writable too, a worker the pool starts ahead of demand boots at the
lowest CPU weight (``background``) and gets the default weight when it is handed out: a refill
(~26 ms of CPU per worker: an interpreter booting) then takes only CPU that running sessions'
cells leave idle. Without it, the 32 refills after 32 episodes start slowed those episodes' cells
by half on a busy core (a batch of 32 cells: 12.8 against 8.4 ms).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
GROUP = "agent-rl-sandbox"


def remove_cgroup_dir(path: Path, *, tries: int, wait_s: float) -> None:
    """rmdir a cgroup, retrying while its last tasks are still exiting (EBUSY); gone already is fine."""
    for _ in range(tries):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(wait_s)


# (v1 cpu.shares, v2 cpu.weight): the lowest each allows, and the default.
BACKGROUND_WEIGHT = {1: "2", 2: "1"}
DEFAULT_WEIGHT = {1: "1024", 2: "100"}


class WorkerCgroup:
    def __init__(self, dirs: dict[str, Path], version: int) -> None:
        self.dirs = dirs
        self.version = version

    def set_background(self, background: bool) -> bool:
        """Lowest or default CPU weight; False where the cpu controller is not ours to write."""
        d = self.dirs.get("cpu")
        if d is None:
            return False
        weight = (BACKGROUND_WEIGHT if background else DEFAULT_WEIGHT)[self.version]
        try:
            (d / ("cpu.shares" if self.version == 1 else "cpu.weight")).write_text(weight)
        except OSError:
            return False
        return True

    def _unique(self) -> list[Path]:
        return list(dict.fromkeys(self.dirs.values()))

    def add(self, pid: int) -> None:
        for d in self._unique():
            (d / "cgroup.procs").write_text(str(pid))

    def oom_killed(self) -> bool:
        d = self.dirs.get("memory")
        if d is None:
            return False
        try:
            if self.version == 1:
                for line in (d / "memory.oom_control").read_text().splitlines():
                    if line.startswith("oom_kill ") and int(line.split()[1]) > 0:
                        return True
                return int((d / "memory.failcnt").read_text()) > 0
            for line in (d / "memory.events").read_text().splitlines():
                if line.startswith("oom_kill ") and int(line.split()[1]) > 0:
                    return True
        except (OSError, ValueError):
            return False
        return False

    def kill_all(self) -> None:
        """SIGKILL everything left in the group (belt and braces after the namespace is gone)."""
        for d in self._unique():
            with contextlib.suppress(OSError, ValueError):
                for pid in (d / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), 9)

    def remove(self) -> None:
        for d in self._unique():
            remove_cgroup_dir(d, tries=50, wait_s=0.01)


class CgroupManager:
    def __init__(self, enabled: bool = True) -> None:
        self.version = 0
        self.parents: dict[str, Path] = {}
        if not enabled:
            return
        with contextlib.suppress(OSError):
            self._detect()
        self.sweep_dead_owners()

    def sweep_dead_owners(self) -> int:
        """Remove worker cgroups (``w<pid>-<n>``) whose owning process is gone; returns how many.

        An owner killed by a signal cannot clean up after itself; without this sweep every
        ``kill -9`` of a server would leave its pool's cgroups behind for good.
        """
        removed = 0
        for parent in self.parents.values():
            for d in parent.glob("w*-*"):
                pid = d.name[1:].split("-", 1)[0]
                if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                    with contextlib.suppress(OSError):  # still has tasks: leave it
                        d.rmdir()
                        removed += 1
        return removed

    @property
    def available(self) -> bool:
        return bool(self.parents)

    def _detect(self) -> None:
        v1 = {c: ROOT / c for c in ("memory", "pids") if (ROOT / c / "cgroup.procs").exists()}
        if v1 and all(os.access(p, os.W_OK) for p in v1.values()):
            cpu = ROOT / "cpu"
            if (cpu / "cgroup.procs").exists() and os.access(cpu, os.W_OK):
                v1["cpu"] = cpu  # optional: only the refills' CPU weight (see the module's doc)
            for c, p in v1.items():
                (p / GROUP).mkdir(exist_ok=True)
                self.parents[c] = p / GROUP
            self.version = 1
            return
        controllers = ROOT / "cgroup.controllers"
        if controllers.exists() and os.access(ROOT, os.W_OK):
            have = set(controllers.read_text().split())
            if {"memory", "pids"} <= have:
                parent = ROOT / GROUP
                parent.mkdir(exist_ok=True)
                (ROOT / "cgroup.subtree_control").write_text("+memory +pids")
                (parent / "cgroup.subtree_control").write_text("+memory +pids")
                if "cpu" in have:  # optional, as on v1
                    with contextlib.suppress(OSError):
                        (ROOT / "cgroup.subtree_control").write_text("+cpu")
                        (parent / "cgroup.subtree_control").write_text("+cpu")
                self.parents = {"unified": parent}
                self.version = 2

    def create(
        self, name: str, memory_bytes: int, pids: int, background: bool = False
    ) -> WorkerCgroup | None:
        if not self.available:
            return None
        dirs: dict[str, Path] = {}
        try:
            if self.version == 1:
                dirs["memory"] = self.parents["memory"] / name
                dirs["pids"] = self.parents["pids"] / name
                if "cpu" in self.parents:
                    dirs["cpu"] = self.parents["cpu"] / name
                for d in dirs.values():
                    d.mkdir(exist_ok=True)
                (dirs["memory"] / "memory.limit_in_bytes").write_text(str(memory_bytes))
                with contextlib.suppress(OSError):
                    (dirs["memory"] / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
                (dirs["pids"] / "pids.max").write_text(str(pids))
            else:
                d = self.parents["unified"] / name
                d.mkdir(exist_ok=True)
                (d / "memory.max").write_text(str(memory_bytes))
                with contextlib.suppress(OSError):
                    (d / "memory.swap.max").write_text("0")
                (d / "pids.max").write_text(str(pids))
                dirs = {"memory": d}
                if (d / "cpu.weight").exists():
                    dirs["cpu"] = d  # the same directory (add, kill_all and remove visit it once)
        except OSError:
            WorkerCgroup(dirs, self.version).remove()
            return None
        group = WorkerCgroup(dirs, self.version)
        if background:
            group.set_background(True)
        return group
