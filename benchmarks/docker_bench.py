"""What containers cost: session start (cold vs warm pool) and exec latency, beside the local backend.

Measured in one run on the same machine, so the ratios mean something on a noisy shared box:

- local: LocalSandbox (bubblewrap workers in this process), the baseline;
- docker: DockerSandbox, one container per session, cold (pool_size=0) and warm (pool refilled
  before every start);
- compose: the compose stack's sandbox service through the loopback gateway, with sandbox.Client
  (started here under a throwaway project name unless --compose-url is given).

Prints p50/p99 in milliseconds and each p50 as a multiple of the local backend's.

    python benchmarks/docker_bench.py [--quick] [--no-compose] [--compose-url URL --token TOKEN]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sandbox import Client, DockerSandbox, LocalSandbox  # noqa: E402

IMAGE = os.environ.get("AGENT_RL_SANDBOX_IMAGE", "agent-rl/sandbox:latest")
EXEC_CODE = "x = x + 1 if 'x' in globals() else 0\nx"


@dataclass
class Row:
    backend: str
    op: str
    n: int
    p50_ms: float
    p99_ms: float


def _quantiles(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    p99 = s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]
    return statistics.median(s) * 1e3, p99 * 1e3


def timed(backend: str, op: str, n: int, fn: Callable[[], None]) -> Row:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return Row(backend, op, n, *_quantiles(samples))


def bench_exec(backend: str, session, n: int) -> Row:
    session.run("0")  # first run pays any lazy set-up
    return timed(backend, "exec p50", n, lambda: _check(session.run(EXEC_CODE)))


def _check(result) -> None:
    if not result.ok:
        raise RuntimeError(f"benchmark execution failed: {result.error}")


def _wait_for(ready: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError("the local pool did not refill in time")
        time.sleep(0.005)


def bench_local(n_start: int, n_exec: int) -> list[Row]:
    with LocalSandbox(pool_size=2) as sb:
        samples = []
        for _ in range(n_start):
            _wait_for(lambda: sb.pool.ready_count >= 1)  # warm: a worker is ready, as for docker
            t0 = time.perf_counter()
            s = sb.session()
            samples.append(time.perf_counter() - t0)
            s.close()
        rows = [Row("local", "session start (warm pool)", n_start, *_quantiles(samples))]
        with sb.session() as s:
            rows.append(bench_exec("local", s, n_exec))
    return rows


def bench_docker(n_start: int, n_exec: int) -> list[Row]:
    rows = []
    with DockerSandbox(IMAGE, pool_size=0) as cold:
        rows.append(timed("docker", "session start (cold)", n_start, lambda: cold.session().close()))
    with DockerSandbox(IMAGE, pool_size=1) as warm:
        samples = []
        for _ in range(n_start):
            warm.wait_warm(120)  # a warm start means the pool had a container ready
            t0 = time.perf_counter()
            s = warm.session()
            samples.append(time.perf_counter() - t0)
            s.close()
        rows.append(Row("docker", "session start (warm pool)", n_start, *_quantiles(samples)))
        with warm.session() as s:
            rows.append(bench_exec("docker", s, n_exec))
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def compose_stack() -> Iterator[tuple[str, str]]:
    """Bring the sandbox + gateway up under a throwaway project; always take it down again."""
    token = secrets.token_urlsafe(24)
    port = _free_port()
    project = f"agentrl-bench-{os.getpid()}"
    offline = subprocess.run(["docker", "image", "inspect", "agent-rl/base:bookworm"], capture_output=True)
    base = os.environ.get("BASE_IMAGE") or ("agent-rl/base:bookworm" if offline.returncode == 0 else "")
    with tempfile.NamedTemporaryFile("w", suffix=".env") as env:
        env.write(
            f"SANDBOX_AUTH_TOKEN={token}\nSANDBOX_PORT={port}\n" + (f"BASE_IMAGE={base}\n" if base else "")
        )
        env.flush()
        cmd = ["docker", "compose", "-p", project, "--env-file", env.name]
        try:
            subprocess.run(
                [*cmd, "up", "-d", "--wait", "--build", "sandbox", "gateway"], cwd=ROOT, check=True
            )
            yield f"http://127.0.0.1:{port}", token
        finally:
            subprocess.run([*cmd, "down", "-v", "--timeout", "10"], cwd=ROOT, capture_output=True)


def bench_compose(url: str, token: str, n_start: int, n_exec: int) -> list[Row]:
    client = Client(url, token=token)
    client.session().close()
    rows = [timed("compose", "session start (warm pool)", n_start, lambda: client.session().close())]
    with client.session() as s:
        rows.append(bench_exec("compose", s, n_exec))
    return rows


def print_table(rows: list[Row]) -> None:
    base = {r.op: r.p50_ms for r in rows if r.backend == "local"}
    base["session start (cold)"] = base.get("session start (warm pool)", float("nan"))
    print(f"{'backend':<9} {'operation':<27} {'n':>5} {'p50 ms':>9} {'p99 ms':>9} {'p50 / local':>12}")
    for r in rows:
        ratio = r.p50_ms / base[r.op] if base.get(r.op) else float("nan")
        print(f"{r.backend:<9} {r.op:<27} {r.n:>5} {r.p50_ms:>9.2f} {r.p99_ms:>9.2f} {ratio:>11.1f}x")
    print("(a cold start is compared with the local warm start: LocalSandbox has no cold path to compare)")
    by = {(r.backend, r.op): r.p50_ms for r in rows}
    cold, warm = by.get(("docker", "session start (cold)")), by.get(("docker", "session start (warm pool)"))
    if cold and warm:
        print(
            f"docker warm pool: session start p50 {warm:.2f} ms vs cold {cold:.0f} ms ({cold / warm:,.0f}x faster)"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer samples (smoke run)")
    p.add_argument("--no-compose", action="store_true", help="skip the compose service")
    p.add_argument("--compose-url", help="an already running stack's gateway URL")
    p.add_argument("--token", default=os.environ.get("SANDBOX_AUTH_TOKEN"), help="its bearer token")
    args = p.parse_args(argv)
    n_start, n_exec = (5, 50) if args.quick else (20, 300)
    rows = bench_local(n_start, n_exec) + bench_docker(n_start, n_exec)
    if not args.no_compose:
        if args.compose_url:
            rows += bench_compose(args.compose_url, args.token, n_start, n_exec)
        else:
            with compose_stack() as (url, token):
                rows += bench_compose(url, token, n_start, n_exec)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
