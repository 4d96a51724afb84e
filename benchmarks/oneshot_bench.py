"""CPU per one-shot ``/run_code`` and requests/s: the zygote against pooled workers, SandboxFusion's
own server and a plain ``subprocess.run([python, "-c", code])``, each measured in the same run in
its own CPU cgroup.

Why cgroups: with the kernel's autogroup scheduling every bubblewrap worker (its own session) gets
its own CPU share, which flatters a sandbox on a busy machine. Each system here runs in a cgroup of
its own (cgroup v1 ``cpu`` + ``cpuacct`` under /sys/fs/cgroup, or v2 where that is what is
mounted), so the kernel schedules it as one entity with one weight, and ``cpuacct.usage`` gives the
CPU of the whole tree (server, bubblewrap, zygote, every child). The groups get the weight of a
``nice 19`` task (this runs on a shared machine). The HTTP client runs outside the groups, so its
CPU is not counted.

Systems: ``zygote`` and ``worker`` are the real server (``python -m sandbox serve``) with
``SANDBOX_ONESHOT`` set, driven over HTTP with SandboxFusion's ``/run_code`` body (what verl sends);
``sandboxfusion`` is bytedance/SandboxFusion's server driven with the same body, started as its
image starts it (uvicorn, default ``local`` config: python isolation ``none``, one ``python file.py``
subprocess per request, no namespaces or cgroups of its own); it runs when ``--sandboxfusion PATH``
(or SANDBOXFUSION_DIR) names a checkout prepared by benchmarks/sandboxfusion_setup.sh and is skipped
with a printed line otherwise; ``subprocess`` is a process in its own group that runs
``subprocess.run`` from N threads (no HTTP: the floor for an unsandboxed fresh interpreter). Closed
loop: each client sends its next request when the last returns, for ``--seconds`` per cell.

    python benchmarks/oneshot_bench.py [--seconds 8] [--concurrency 1 8 64] [--sandboxfusion PATH]

Measured with ``--seconds 8 --concurrency 1 8 --sandboxfusion /tmp/sf`` (SandboxFusion 469de08) on
the 2-core dev box, 2026-12-05 (AMD EPYC, load average 1.2 -> 3.5, mostly the benchmark itself),
the zygote running each program as pid 1 of its namespace in one of its slots' kept network
namespaces (sandbox/zygote_main.py) and plain requests taking the server's fast route
(sandbox/http/server/fastpath.py):

    system       conc   reqs   req/s   p50 ms   p99 ms  CPU ms/req
    zygote          1   1509   188.6      5.2      6.9        4.52
    zygote          8   3500   436.8     17.7     30.0        3.53
    worker          1    152    18.9     52.1     65.3       43.58
    worker          8    301    36.9    213.3    295.2       50.28
    sandboxfusion   1    304    37.9     26.0     32.8       25.69
    sandboxfusion   8    559    69.5    113.6    170.3       24.71
    subprocess      1    542    67.3     14.7     16.8       14.79
    subprocess      8   1044   129.2     60.9     79.3       15.29

At concurrency 8 that is 6.3x SandboxFusion's req/s for 7.0x less CPU per request (4.6x and 5.3x
in the run after it, load 3.5 -> 4.3, zygote 4.49 / 4.48 ms). At concurrency 1 each request also
pays for waking idle processes, so its CPU is higher than at 8. One SandboxFusion cell in an
earlier run took ~210 ms of CPU per request (repeated alone and in full runs: 25-30 ms), so look
at two runs before trusting one.

CPU per request is the figure to trust on a busy machine; req/s is what a nice-19-weighted group
got while the machine was saturated, and moves a lot between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from sandbox.bwrap.cgroups import remove_cgroup_dir

ROOT = Path(__file__).resolve().parent.parent
CODE = "print(sum(range(10)))"
EXPECT = "45\n"
NICE19_SHARES = 15
"""cpu.shares of a nice-19 task (sched_prio_to_weight[39]): the groups yield like niced work."""


@dataclass
class Cell:
    system: str
    concurrency: int
    requests: int
    seconds: float
    cpu_ms: float
    latencies: list[float]

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def cpu_per_request(self) -> float:
        return self.cpu_ms / max(1, self.requests)

    def p(self, q: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


class CpuGroup:
    """One cgroup with CPU accounting: v1 cpu + cpuacct directories, or one v2 directory."""

    def __init__(self, name: str) -> None:
        base = Path("/sys/fs/cgroup")
        self.dirs: list[Path] = []
        if (base / "cpuacct" / "cpuacct.usage").exists():
            self.version = 1
            for controller in ("cpu", "cpuacct"):
                d = base / controller / "agent-rl-bench" / name
                d.mkdir(parents=True, exist_ok=True)
                self.dirs.append(d)
            (self.dirs[0] / "cpu.shares").write_text(str(NICE19_SHARES))
        elif (base / "cgroup.controllers").exists():
            self.version = 2
            parent = base / "agent-rl-bench"
            parent.mkdir(exist_ok=True)
            (parent / "cgroup.subtree_control").write_text("+cpu")
            d = parent / name
            d.mkdir(exist_ok=True)
            (d / "cpu.weight").write_text("1")
            self.dirs.append(d)
        else:
            raise SystemExit("no writable CPU cgroup here: run as root on a cgroup v1 or v2 host")

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def usage_ms(self) -> float:
        if self.version == 1:
            return int((self.dirs[1] / "cpuacct.usage").read_text()) / 1e6
        for line in (self.dirs[0] / "cpu.stat").read_text().splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e3
        return float("nan")

    def in_group(self, argv: list[str], **kw: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside this group (it joins before exec, so every descendant is in it)."""
        joins = "; ".join(f"echo $$ > {p}" for p in self.procs_files())
        return subprocess.Popen(["sh", "-c", f'{joins}; exec "$@"', "sh", *argv], **kw)  # type: ignore[call-overload]

    def remove(self) -> None:
        for d in self.dirs:
            remove_cgroup_dir(d, tries=100, wait_s=0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(group: CpuGroup, oneshot: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    # The worker path gets the benchmark's usual full pool; the zygote needs none for /run_code.
    pool = "8" if oneshot == "worker" else "1"
    env = {**os.environ, "SANDBOX_ONESHOT": oneshot, "SANDBOX_POOL_SIZE": pool}
    argv = ["nice", "-n", "19", sys.executable, "-m", "sandbox", "serve", "--port", str(port)]
    proc = group.in_group(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, wait_ready(proc, f"http://127.0.0.1:{port}", "/readyz", 120, f"the {oneshot} server")


def wait_ready(proc: subprocess.Popen[bytes], url: str, probe: str, timeout_s: float, name: str) -> str:
    """url once GET url+probe answers 200; kill proc and stop the benchmark if it dies or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + probe, timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{name} did not become ready")


def sandboxfusion_paths(checkout: str | None) -> tuple[Path, Path] | None:
    """The SandboxFusion checkout and the interpreter of its venv, or None (with why) when unset.

    benchmarks/sandboxfusion_setup.sh prepares both (deps in their own venv, never this project's).
    """
    where = checkout or os.environ.get("SANDBOXFUSION_DIR")
    if not where:
        print(
            "sandboxfusion: skipped (no --sandboxfusion PATH or SANDBOXFUSION_DIR; see sandboxfusion_setup.sh)"
        )
        return None
    root = Path(where).resolve()
    python = Path(os.environ.get("SANDBOXFUSION_PYTHON", "/tmp/sfvenv/bin/python"))
    if not (root / "sandbox" / "server" / "server.py").exists() or not python.exists():
        print(f"sandboxfusion: skipped ({root} is no SandboxFusion checkout, or {python} is missing)")
        return None
    return root, python


def start_sandboxfusion(group: CpuGroup, root: Path, python: Path) -> tuple[subprocess.Popen[bytes], str]:
    """SandboxFusion's server as its image runs it (``make run``: uvicorn, one process, the default
    ``local`` config, whose python isolation is ``none``: a ``python file.py`` subprocess per request,
    the container being the only wall), but with nice 19 like ours."""
    (root / "docs" / "build").mkdir(
        parents=True, exist_ok=True
    )  # the image builds docs there; it serves them
    port = free_port()
    env = {**os.environ, "SANDBOX_CONFIG": "local"}
    argv = ["nice", "-n", "19", str(python), "-m", "uvicorn", "sandbox.server.server:app"]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    proc = group.in_group(argv, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, wait_ready(proc, f"http://127.0.0.1:{port}", "/v1/ping", 180, "the SandboxFusion server")


def http_cell(system: str, url: str, group: CpuGroup, conc: int, seconds: float) -> Cell:
    body = {"code": CODE, "language": "python", "run_timeout": 10}
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client() -> None:
        with httpx.Client(timeout=60) as c:
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                r = c.post(url + "/run_code", json=body)
                dt = time.perf_counter() - t0
                assert r.status_code == 200 and r.json()["run_result"]["stdout"] == EXPECT, r.text
                with lock:
                    latencies.append(dt)

    u0, t0 = group.usage_ms(), time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Cell(system, conc, len(latencies), time.monotonic() - t0, group.usage_ms() - u0, latencies)


_SUBPROCESS_DRIVER = """
import json, subprocess, sys, threading, time
conc, seconds, python, code = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
lat, lock, stop = [], threading.Lock(), time.monotonic() + seconds
def loop():
    while time.monotonic() < stop:
        t0 = time.perf_counter()
        subprocess.run([python, "-c", code], capture_output=True, check=True)
        with lock:
            lat.append(time.perf_counter() - t0)
ts = [threading.Thread(target=loop) for _ in range(conc)]
[t.start() for t in ts]
[t.join() for t in ts]
print(json.dumps(lat))
"""


def subprocess_cell(group: CpuGroup, conc: int, seconds: float) -> Cell:
    argv = ["nice", "-n", "19", sys.executable, "-c", _SUBPROCESS_DRIVER, str(conc), str(seconds)]
    argv += ["/usr/bin/python3", CODE]
    u0, t0 = group.usage_ms(), time.monotonic()
    proc = group.in_group(argv, stdout=subprocess.PIPE)
    out, _ = proc.communicate()
    latencies = json.loads(out)
    return Cell("subprocess", conc, len(latencies), time.monotonic() - t0, group.usage_ms() - u0, latencies)


def print_table(cells: list[Cell]) -> None:
    print(f"{'system':<12}{'conc':>5}{'reqs':>7}{'req/s':>8}{'p50 ms':>9}{'p99 ms':>9}{'CPU ms/req':>12}")
    for c in cells:
        print(
            f"{c.system:<14}{c.concurrency:>5}{c.requests:>7}{c.rps:>8.1f}{c.p(0.5):>9.1f}{c.p(0.99):>9.1f}"
            f"{c.cpu_per_request:>12.2f}"
        )
    by = {(c.system, c.concurrency): c for c in cells}
    print("\nsame-run ratios (zygote vs each baseline):")
    for base in ("worker", "sandboxfusion", "subprocess"):
        for conc in sorted({c.concurrency for c in cells}):
            z, b = by.get(("zygote", conc)), by.get((base, conc))
            if z and b and z.requests and b.requests:
                print(
                    f"  conc {conc:>3}: {z.rps / b.rps:5.2f}x the req/s of {base}, "
                    f"{b.cpu_per_request / z.cpu_per_request:5.2f}x less CPU per request"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=8.0, help="closed-loop time per cell")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--systems", nargs="+", default=["zygote", "worker", "sandboxfusion", "subprocess"])
    ap.add_argument("--sandboxfusion", metavar="PATH", help="a SandboxFusion checkout (or SANDBOXFUSION_DIR)")
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()}; {os.cpu_count()} CPUs")
    fusion = sandboxfusion_paths(args.sandboxfusion) if "sandboxfusion" in args.systems else None
    cells: list[Cell] = []
    for system in [s for s in args.systems if s != "sandboxfusion" or fusion is not None]:
        group = CpuGroup(system)
        try:
            if system == "subprocess":
                cells += [subprocess_cell(group, conc, args.seconds) for conc in args.concurrency]
                continue
            proc, url = (
                start_sandboxfusion(group, *fusion)
                if fusion and system == "sandboxfusion"
                else start_server(group, system)
            )
            try:
                for conc in args.concurrency:
                    http_cell(system, url, group, 2, 3.0)  # warm: the pool filled, the zygote's first forks
                    cells.append(http_cell(system, url, group, conc, args.seconds))
            finally:
                proc.terminate()
                proc.wait(30)
        finally:
            group.remove()
    print(f"load average at end: {os.getloadavg()}\n")
    print_table(cells)


if __name__ == "__main__":
    main()
