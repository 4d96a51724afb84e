"""Mixed load against a real sandbox server: nothing lost, nothing leaked (issue 14).

Starts ``python -m sandbox serve`` on a loopback port (with a token), opens a set of sessions that
each hold a counter, then sends a fixed, seeded mix of requests from ``--concurrency`` closed-loop
clients: 60% session executions (``n += 1`` in a random session), 30% SandboxFusion ``/run_code``
one-shots, 10% bad requests (broken JSON, wrong types, unknown sessions, bad limits, a wrong
token, an unknown language). Then it reads every session's counter back and closes the sessions.

It prints a table per kind of request (answers by status, p50/p99 latency) and checks:

* 0 answers 5xx and 0 connection errors (refused, reset, timed out);
* every session's counter equals the number of its executions answered 200 (no session lost its
  worker or its state, and none ran a cell twice);
* every bad request answered 4xx, every good one 200 with the expected output;
* 0 zombie children of the server once the sessions are closed;
* the server's RSS before and after (reported; the check is that it stays within 2x + 64 MB,
  a leak of 10,000 requests' bodies would not).

    python benchmarks/sandbox_load.py              # 10,000 requests at concurrency 64
    python benchmarks/sandbox_load.py --quick      # 500 requests (CI runs this, tests/sandbox/http/test_load.py)

Exit status 0 when every check holds. Loopback only; bounded by the request count.

Measured on the 2-core dev box while other jobs ran (load average 4-10), commit after 741809f:

    10000 requests at concurrency 64 in 241.1s (41 req/s), 32 sessions
    kind                       answers (status: count)              p50 ms   p99 ms
    bad: bad language          400: 166                              853.6   6465.9
    bad: bad limits            422: 167                              821.5   5397.4
    bad: broken json           422: 167                             1016.4   5096.8
    bad: unknown session       404: 167                              991.2   6735.2
    bad: wrong token           401: 166                              936.0   6356.1
    bad: wrong type            422: 167                             1030.5   6801.3
    run_code                   200: 3000                            1227.2   6987.9
    session                    200: 6000                             970.5   7018.2
    5xx answers 0, connection errors 0, sessions exact 32/32, wrong answers 0, zombies after 0,
    server RSS 55 MB before -> 58 MB after.

Latencies are queueing behind 64 clients on two shared cores (the one-shots' bubblewrap starts
dominate), not a speed target: benchmarks/sandbox_bench.py measures speed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
SESSIONS = 32
"""Sessions held through the run (the server's default cap is 64)."""
RUN_CODE = {"code": "print(sum(range(10)))", "language": "python"}
BAD_KINDS = ("broken json", "wrong type", "unknown session", "bad limits", "wrong token", "bad language")


@dataclass
class Op:
    """One request of the mix: ``kind`` is "session", "run_code" or "bad"; ``arg`` the session
    index or the bad request's variant."""

    kind: str
    arg: int


@dataclass
class Tally:
    """What came back, per kind of request."""

    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    latencies: dict[str, list[float]] = field(default_factory=dict)
    conn_errors: Counter[str] = field(default_factory=Counter)
    wrong: list[str] = field(default_factory=list)
    """Answers that had the right status class but the wrong content, or a bad request not refused."""
    executed: Counter[int] = field(default_factory=Counter)
    """Session index -> executions answered 200."""

    def record(self, kind: str, status: int, seconds: float) -> None:
        self.statuses[(kind, status)] += 1
        self.latencies.setdefault(kind, []).append(seconds)


@dataclass
class Report:
    requests: int
    concurrency: int
    wall_s: float
    tally: Tally
    mismatched: dict[int, tuple[int, str]]
    """Session index -> (executions answered 200, counter read back) where they differ."""
    zombies: int
    rss_before_mb: float
    rss_after_mb: float

    @property
    def server_errors(self) -> int:
        return sum(n for (_, status), n in self.tally.statuses.items() if status >= 500)

    @property
    def connection_errors(self) -> int:
        return sum(self.tally.conn_errors.values())

    def problems(self) -> list[str]:
        """Every check that failed, in words; empty when the run was clean."""
        out = []
        if self.server_errors:
            out.append(f"{self.server_errors} answers were 5xx")
        if self.connection_errors:
            out.append(f"{self.connection_errors} connection errors: {dict(self.tally.conn_errors)}")
        if self.mismatched:
            out.append(f"{len(self.mismatched)} sessions lost state: {self.mismatched}")
        if self.tally.wrong:
            out.append(f"{len(self.tally.wrong)} wrong answers, e.g. {self.tally.wrong[:3]}")
        if self.zombies:
            out.append(f"{self.zombies} zombie children of the server")
        if self.rss_after_mb > 2 * self.rss_before_mb + 64:
            out.append(f"server RSS grew {self.rss_before_mb:.0f} -> {self.rss_after_mb:.0f} MB")
        return out


def make_ops(n: int, seed: int) -> list[Op]:
    """The fixed mix: 60% session executions, 30% /run_code, 10% bad requests, shuffled."""
    rng = random.Random(seed)
    n_session, n_run = n * 6 // 10, n * 3 // 10
    ops = [Op("session", rng.randrange(SESSIONS)) for _ in range(n_session)]
    ops += [Op("run_code", 0) for _ in range(n_run)]
    ops += [Op("bad", i % len(BAD_KINDS)) for i in range(n - n_session - n_run)]
    rng.shuffle(ops)
    return ops


def bad_request(variant: int, sids: list[str]) -> tuple[str, str, dict[str, str], bytes]:
    """(method, path, extra headers, body) of one malformed request; each must answer 4xx."""
    js = {"Content-Type": "application/json"}
    kind = BAD_KINDS[variant]
    if kind == "broken json":
        return "POST", f"/v1/sessions/{sids[0]}/execute", js, b'{"code": "print(1)"'
    if kind == "wrong type":
        return "POST", "/v1/execute", js, b'{"code": 5}'
    if kind == "unknown session":
        return "POST", "/v1/sessions/no-such-session/execute", js, b'{"code": "1"}'
    if kind == "bad limits":
        return "POST", "/v1/execute", js, b'{"code": "1", "limits": {"wall_s": -1}}'
    if kind == "wrong token":
        return "POST", "/v1/execute", {**js, "Authorization": "Bearer wrong"}, b'{"code": "1"}'
    return "POST", "/run_code", js, b'{"code": "1", "language": "cobol"}'


async def send(client: httpx.AsyncClient, op: Op, sids: list[str], tally: Tally) -> None:
    """Send one request and record what came back."""
    if op.kind == "session":
        method, path, headers = (
            "POST",
            f"/v1/sessions/{sids[op.arg]}/execute",
            {"Content-Type": "application/json"},
        )
        body = b'{"code": "n += 1\\nprint(n)", "want_value": false}'
    elif op.kind == "run_code":
        method, path, headers, body = "POST", "/run_code", {"Content-Type": "application/json"}, None
    else:
        method, path, headers, body = bad_request(op.arg, sids)
    kind = op.kind if op.kind != "bad" else f"bad: {BAD_KINDS[op.arg]}"
    t0 = time.perf_counter()
    try:
        if body is None:
            resp = await client.post(path, json=RUN_CODE)
        else:
            resp = await client.request(method, path, content=body, headers=headers)
    except httpx.TransportError as e:
        tally.conn_errors[type(e).__name__] += 1
        return
    tally.record(kind, resp.status_code, time.perf_counter() - t0)
    check_answer(op, kind, resp, tally)


def check_answer(op: Op, kind: str, resp: httpx.Response, tally: Tally) -> None:
    status = resp.status_code
    if op.kind == "bad":
        if not 400 <= status < 500:
            tally.wrong.append(f"{kind}: {status} {resp.text[:100]}")
        return
    if status != 200:
        if status < 500:  # 5xx are counted apart
            tally.wrong.append(f"{kind}: {status} {resp.text[:100]}")
        return
    data = resp.json()
    if op.kind == "session":
        tally.executed[op.arg] += 1
        if data.get("error") is not None or not data.get("stdout", "").strip().isdigit():
            tally.wrong.append(f"session exec: {resp.text[:160]}")
    elif data.get("status") != "Success" or data["run_result"]["stdout"] != "45\n":
        tally.wrong.append(f"run_code: {resp.text[:160]}")


async def drive(
    url: str, token: str, ops: list[Op], concurrency: int
) -> tuple[Tally, dict[int, tuple[int, str]], float]:
    """Open the sessions, run ``ops`` from ``concurrency`` closed-loop clients, read every counter
    back and close the sessions. Returns the tally, the mismatched sessions and the load's wall time."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=120) as client:
        sids = []
        for _ in range(SESSIONS):
            r = await client.post("/v1/sessions", json={})
            r.raise_for_status()
            sids.append(r.json()["id"])
            (await client.post(f"/v1/sessions/{sids[-1]}/execute", json={"code": "n = 0"})).raise_for_status()
        tally, queue = Tally(), iter(ops)

        async def worker() -> None:
            for op in queue:  # one shared iterator: each op is sent once
                await send(client, op, sids, tally)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        mismatched = {}
        for i, sid in enumerate(sids):
            r = await client.post(f"/v1/sessions/{sid}/execute", json={"code": "print(n)"})
            got = r.json().get("stdout", "").strip() if r.status_code == 200 else f"HTTP {r.status_code}"
            if got != str(tally.executed[i]):
                mismatched[i] = (tally.executed[i], got)
            await client.delete(f"/v1/sessions/{sid}")
    return tally, mismatched, wall


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(token: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "SANDBOX_AUTH_TOKEN": token}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandbox", "serve", "--port", str(port), "--workers-pool-size", "4",
         "--max-sessions", "64", "--log-level", "warning"],
        cwd=ROOT, env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/healthz").status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("sandbox server did not become ready")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def zombie_children(pid: int, settle_s: float = 10.0) -> int:
    """Zombie children of ``pid`` still there after ``settle_s`` (the server reaps on a thread)."""
    deadline = time.monotonic() + settle_s
    while True:
        found = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            found += fields[1] == str(pid) and fields[0] == "Z"
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def run(requests: int, concurrency: int, seed: int = 0) -> Report:
    """One whole run against a fresh server; the server is stopped before this returns."""
    token = secrets.token_hex(16)
    proc, url = start_server(token)
    try:
        rss_before = rss_mb(proc.pid)
        tally, mismatched, wall = asyncio.run(drive(url, token, make_ops(requests, seed), concurrency))
        zombies = zombie_children(proc.pid)
        rss_after = rss_mb(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return Report(requests, concurrency, wall, tally, mismatched, zombies, rss_before, rss_after)


def print_report(r: Report) -> None:
    print(f"{r.requests} requests at concurrency {r.concurrency} in {r.wall_s:.1f}s "
          f"({r.requests / r.wall_s:.0f} req/s), {SESSIONS} sessions")  # fmt: skip
    print(f"{'kind':26} {'answers (status: count)':34} {'p50 ms':>8} {'p99 ms':>8}")
    for kind in sorted(r.tally.latencies):
        lat = sorted(r.tally.latencies[kind])
        counts = ", ".join(f"{s}: {n}" for (k, s), n in sorted(r.tally.statuses.items()) if k == kind)
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        print(f"{kind:26} {counts:34} {statistics.median(lat) * 1e3:8.1f} {p99 * 1e3:8.1f}")
    exact = SESSIONS - len(r.mismatched)
    print(f"5xx answers           {r.server_errors}")
    print(f"connection errors     {r.connection_errors}")
    print(f"sessions exact        {exact}/{SESSIONS}")
    print(f"wrong answers         {len(r.tally.wrong)}")
    print(f"zombies after         {r.zombies}")
    print(f"server RSS MB         {r.rss_before_mb:.0f} before -> {r.rss_after_mb:.0f} after")
    problems = r.problems()
    print("RESULT: " + ("ok" if not problems else "FAILED: " + "; ".join(problems)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="500 requests instead of 10,000")
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    n = args.requests or (500 if args.quick else 10_000)
    if n < 10 or args.concurrency < 1:
        p.error("--requests must be >= 10 and --concurrency >= 1")
    report = run(n, args.concurrency, args.seed)
    print_report(report)
    return 0 if not report.problems() else 1


if __name__ == "__main__":
    sys.exit(main())
