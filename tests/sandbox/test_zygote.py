"""Hostile suite for one-shot ``/run_code``, run against both paths: the zygote and pooled workers.

Each test sends what a hostile or careless program would through the real HTTP app (in-process),
then checks from the host that nothing leaked: files, processes, signals, network, capabilities.
The zygote-only tests cover what a fork server adds: its own survival, crash replacement, and no
descriptor or memory growth over 1000 requests.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from sandbox import LocalSandbox
from sandbox.bwrap.launcher import LaunchConfig
from sandbox.http.server.app import create_app
from sandbox.http.settings import SandboxSettings
from sandbox.limits import DEFAULT_LIMITS
from sandbox.zygote import Zygote
from tests.sandbox.conftest import need_bwrap

PATHS = ("zygote", "worker")


@pytest.fixture(scope="module", params=PATHS)
def http(request: pytest.FixtureRequest, sb: LocalSandbox) -> Iterator[TestClient]:
    with TestClient(create_app(SandboxSettings(oneshot=request.param), sandbox=sb)) as client:
        state = client.app.state.sandbox_state  # type: ignore[attr-defined]
        assert (state.zygote is not None) == (request.param == "zygote")
        yield client


def run(http: TestClient, code: str, **body: Any) -> dict[str, Any]:
    r = http.post("/run_code", json={"code": code, "language": "python", "run_timeout": 10, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stdout(answer: dict[str, Any]) -> str:
    assert answer["run_result"] is not None, answer
    return answer["run_result"]["stdout"]


def zygote_of(http: TestClient) -> Zygote | None:
    return http.app.state.sandbox_state.zygote  # type: ignore[attr-defined]


def host_processes(marker: str) -> list[int]:
    """Host pids whose command line contains ``marker`` (a sandboxed process is visible here)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read().replace(b"\0", b" "):
                        found.append(int(pid))
            except OSError:
                continue
    return found


def gone(marker: str, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while host_processes(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- scratch ----------------------------------------------------------------------------------
def test_a_file_written_by_one_request_is_not_seen_by_the_next(http: TestClient) -> None:
    write = "import os\nfor p in ('/tmp/left', 'left', '/dev/shm/left'):\n    open(p, 'w').write('x')\nprint('ok')"
    assert stdout(run(http, write)) == "ok\n"
    # /dev is the zygote's, shared by every program: read-only for them.
    dev = "try:\n    open('/dev/left', 'w')\nexcept OSError as e:\n    print(e.errno)"
    assert stdout(run(http, dev)) == "30\n"  # EROFS
    look = "import os\nprint([os.path.exists(p) for p in ('/tmp/left', 'left', '/dev/shm/left', '/dev/left')])"
    assert stdout(run(http, look)) == "[False, False, False, False]\n"


# -- memory -----------------------------------------------------------------------------------
_SCAN = (
    "import ctypes, re\n"
    "own = input()\n"  # its own stdin, in its memory: the positive control
    "found = set()\n"
    "for line in open('/proc/self/maps'):\n"
    "    m = re.match(r'([0-9a-f]+)-([0-9a-f]+) r', line)\n"
    "    if m and '[v' not in line:\n"
    "        a, b = int(m.group(1), 16), int(m.group(2), 16)\n"
    "        found.update(re.findall(rb'MARK[0-9]{3}:[a-z]+', ctypes.string_at(a, b - a)))\n"
    "print(sorted(x.decode() for x in found))\n"
)


def test_a_program_reads_no_other_requests_code_stdin_or_output_from_its_memory(http: TestClient) -> None:
    """A fork server's memory holds every request it served; a program must not inherit it."""
    mark = "MARK{}:{}".format  # built at run time: this test's own source holds no whole marker
    for i in range(3):  # requests served before the scan
        past = f"print('{mark(100 + i, 'stdout')}')\n# {mark(100 + i, 'code')}\ninput()"
        assert stdout(run(http, past, stdin=mark(100 + i, "stdin") + "\n")).startswith("MARK")
    live = (
        f"import sys, time\nprint('{mark(200, 'stdout')}', flush=True)\n# {mark(200, 'code')}\ntime.sleep(3)"
    )
    t = threading.Thread(target=run, args=(http, live), kwargs={"stdin": mark(200, "stdin")})
    t.start()
    time.sleep(1.0)
    seen = stdout(run(http, _SCAN, stdin=mark(300, "stdin")))
    t.join()
    assert seen == "['MARK300:stdin']\n"  # its own stdin only: the scan works and finds nothing else


# -- processes --------------------------------------------------------------------------------
def test_a_fork_bomb_is_contained(http: TestClient) -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    zygote = zygote_of(http)
    before = zygote.pid if zygote else None
    answer = run(http, bomb, run_timeout=2)
    assert answer["run_result"]["status"] == "TimeLimitExceeded"
    assert stdout(run(http, "print(6 * 7)")) == "42\n"
    if zygote is not None:
        assert zygote.pid == before and zygote.ping()["running"] == 0


def test_a_daemon_does_not_outlive_its_request(http: TestClient) -> None:
    daemon = (
        "import os\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.execv('/bin/sleep', ['sleep', '4321.5'])\n"
        "    os._exit(0)\n"
        "print('parent done')\n"
    )
    assert stdout(run(http, daemon)) == "parent done\n"
    assert gone("sleep 4321.5")


def test_a_timeout_kills_the_tree_and_keeps_what_was_printed(http: TestClient) -> None:
    code = (
        "print('before the timeout', flush=True)\n"
        "import subprocess, time\n"
        "subprocess.Popen(['/bin/sleep', '4321.6'])\n"
        "time.sleep(60)\n"
    )
    t0 = time.monotonic()
    answer = run(http, code, run_timeout=4)
    assert answer["run_result"]["status"] == "TimeLimitExceeded"
    assert "before the timeout" in stdout(answer)
    assert time.monotonic() - t0 < 20
    assert gone("sleep 4321.6")


def test_a_memory_hog_fails_within_its_own_limit(http: TestClient) -> None:
    zygote = zygote_of(http)
    before = zygote.pid if zygote else None
    answer = run(http, "x = bytearray(1 << 30)\nprint('allocated')", memory_limit_MB=256)
    result = answer["run_result"]
    assert "allocated" not in result["stdout"]
    assert result["return_code"] != 0
    assert "MemoryError" in result["stderr"] or result["return_code"] in (-9, 137)
    assert stdout(run(http, "print('still here')")) == "still here\n"
    if zygote is not None:
        assert zygote.pid == before


def test_a_request_cannot_signal_or_trace_anything_outside_itself(http: TestClient) -> None:
    """A hostile request kills every pid it can name and tries to ptrace pid 1; a concurrent
    request and the zygote carry on. Under the zygote the program is pid 1 of its namespace and
    alone in it: there is nothing else to trace or signal."""
    hostile = (
        "import ctypes, os, signal\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "traced = libc.ptrace(16, 1, 0, 0)\n"  # PTRACE_ATTACH to pid 1
        "try:\n"
        "    os.listdir('/proc/1/fd'); fds = 'readable'\n"
        "except OSError:\n"
        "    fds = 'denied'\n"
        "me = os.getpid()\n"
        "for pid in range(1, 4096):\n"
        "    if pid != me:\n"
        "        try:\n"
        "            os.kill(pid, signal.SIGKILL)\n"
        "        except OSError:\n"
        "            pass\n"
        "alone = [int(p) for p in os.listdir('/proc') if p.isdigit()] == [me]\n"
        "print(traced, fds, me, alone)\n"
    )
    zygote = zygote_of(http)
    before = zygote.pid if zygote else None
    bystander: dict[str, Any] = {}

    def patient() -> None:
        bystander.update(run(http, "import time\ntime.sleep(3)\nprint('alive')"))

    t = threading.Thread(target=patient)
    t.start()
    time.sleep(1.0)
    answer = run(http, hostile)
    t.join()
    assert stdout(bystander) == "alive\n"
    if zygote is not None:
        assert stdout(answer) == "-1 readable 1 True\n"  # pid 1 is the program: itself, alone
        assert zygote.pid == before and stdout(run(http, "print(1)")) == "1\n"


def test_no_capabilities_and_no_new_privileges(http: TestClient) -> None:
    code = (
        "import os\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
        "print(os.getuid() != 0, status['CapEff'].strip(), status['NoNewPrivs'].strip())\n"
    )
    out = stdout(run(http, code)).split()
    assert out[0] == "True" and int(out[1], 16) == 0
    if zygote_of(http) is not None:
        assert out[2] == "1" and "0000000000000000" in stdout(
            run(http, "print(open('/proc/self/status').read().split('CapBnd:')[1].split()[0])")
        )


def test_only_the_requests_own_descriptors_are_open(http: TestClient) -> None:
    code = "import os\nprint(sorted(int(f) for f in os.listdir('/proc/self/fd'))[:3])"
    assert stdout(run(http, code)) == "[0, 1, 2]\n"
    if zygote_of(http) is not None:
        code = "import os\nprint(len(os.listdir('/proc/self/fd')))"
        assert stdout(run(http, code)) == "4\n"  # 0, 1, 2 and the listing itself


# -- network ----------------------------------------------------------------------------------
def test_no_network_and_no_loopback_shared_between_requests(http: TestClient) -> None:
    outside = (
        "import socket\n"
        "for addr in (('1.1.1.1', 80), ('10.0.2.2', 80)):\n"
        "    try:\n"
        "        socket.create_connection(addr, timeout=1); print('connected')\n"
        "    except OSError:\n"
        "        print('refused')\n"
    )
    assert stdout(run(http, outside)) == "refused\nrefused\n"
    listen = (
        "import socket, time\n"
        "s = socket.socket()\n"
        "try:\n"
        "    s.bind(('127.0.0.1', 47123)); s.listen(); print('listening', flush=True)\n"
        "except OSError as e:\n"
        "    print('no loopback', flush=True)\n"
        "time.sleep(3)\n"
    )
    t = threading.Thread(target=run, args=(http, listen))
    t.start()
    time.sleep(1.0)
    probe = (
        "import socket\n"
        "try:\n"
        "    socket.create_connection(('127.0.0.1', 47123), timeout=1); print('reached')\n"
        "except OSError:\n"
        "    print('isolated')\n"
    )
    assert stdout(run(http, probe)) == "isolated\n"
    t.join()


# -- semantics a script relies on -------------------------------------------------------------
def test_script_semantics(http: TestClient) -> None:
    code = (
        "import sys\n"
        "print(__name__, sys.argv[0].endswith('.py'), input())\n"
        "sys.stderr.write('err\\n')\n"
        "raise SystemExit(3)\n"
    )
    answer = run(http, code, stdin="hello")
    result = answer["run_result"]
    assert (result["stdout"], result["stderr"], result["return_code"]) == (
        "__main__ True hello\n",
        "err\n",
        3,
    )
    boom = run(http, "def f():\n    raise ValueError('boom')\nf()")["run_result"]
    assert boom["return_code"] == 1 and boom["stderr"].startswith("Traceback")
    assert "ValueError: boom" in boom["stderr"] and "sandbox" not in boom["stderr"]
    seeds = {stdout(run(http, "import random\nprint(random.random())")) for _ in range(3)}
    assert len(seeds) == 3  # each request reseeds: no shared random state


SELF_SIGNALS = (
    # (program, return code, stdout): each one ends the way it would as an ordinary process
    ("os.kill(os.getpid(), signal.SIGTERM)", -15, "before\n"),
    ("os.kill(os.getpid(), signal.SIGKILL)", -9, "before\n"),
    ("os.killpg(0, signal.SIGKILL)", -9, "before\n"),
    ("signal.raise_signal(signal.SIGUSR1)", -10, "before\n"),
    ("signal.signal(signal.SIGTERM, signal.SIG_DFL)\nos.kill(os.getpid(), signal.SIGTERM)", -15, "before\n"),
    ("os.abort()", -6, "before\n"),
    ("signal.alarm(1)\ntime.sleep(20)", -14, "before\n"),
    ("subprocess.run(['/bin/sh', '-c', 'kill -HUP $PPID'])\ntime.sleep(20)", -1, "before\n"),
    ("signal.signal(signal.SIGTERM, lambda *a: print('caught'))\nos.kill(os.getpid(), signal.SIGTERM)", 0,
     "before\ncaught\nafter\n"),
    ("pid = os.fork()\nif pid == 0:\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(20)\n"
     "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))", 0, "before\n-15\nafter\n"),
)  # fmt: skip


@pytest.mark.parametrize(("call", "code", "out"), SELF_SIGNALS, ids=range(len(SELF_SIGNALS)))
def test_a_program_that_signals_itself_ends_as_an_ordinary_process_would(
    http: TestClient, call: str, code: int, out: str
) -> None:
    """Under the zygote the program is pid 1 of its namespace, whose unhandled signals the kernel
    drops; the report must not show it: same return code and output on both paths."""
    program = f"import os, signal, subprocess, time\nprint('before', flush=True)\n{call}\nprint('after')\n"
    result = run(http, program, run_timeout=10)["run_result"]
    assert (result["status"], result["return_code"], result["stdout"]) == ("Finished", code, out), result


def test_signals_the_host_ignored_are_at_their_default_in_every_program() -> None:
    """A server started under nohup ignores SIGHUP, and an ignored signal stays ignored across
    exec: without a reset every worker, zygote and program would ignore it too (the case above,
    `kill -HUP $PPID`, then sleeps out its timeout). Workers and the zygote are started here while
    this process ignores SIGHUP and SIGTSTP; programs in a session and in a worker one-shot must
    see both at their default, and a zygote program (whose deadly signals have handlers: see
    zygote_main) SIGTSTP at its default and a SIGHUP to itself ending it."""
    need_bwrap()
    both = "import signal\nprint(*(signal.getsignal(s) == signal.SIG_DFL for s in (signal.SIGHUP, signal.SIGTSTP)))"
    hup = "import os, signal, time\nprint(signal.getsignal(signal.SIGTSTP) == signal.SIG_DFL, flush=True)\n"
    hup += "os.kill(os.getpid(), signal.SIGHUP)\ntime.sleep(20)"
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGHUP, signal.SIGTSTP)}
    try:
        sb = LocalSandbox(pool_size=2)
        assert sb.pool.wait_ready(timeout_s=60)  # both workers started while the two were ignored
        zygote = Zygote(LaunchConfig(), DEFAULT_LIMITS, slots=2)
        zygote.start()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    try:
        with sb.session() as s:
            assert s.run(both).stdout == "True True\n"
        assert sb.run(both).stdout == "True True\n"
        report = zygote.run(code=hup, timeout_s=10)["run"]
        assert (report["stdout"], report["return_code"]) == ("True\n", -1), report
    finally:
        zygote.close()
        sb.close()


# -- the zygote itself ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    need_bwrap()
    z = Zygote(LaunchConfig(), DEFAULT_LIMITS, slots=8)
    z.start()
    yield z
    z.close()


def zygote_process(z: Zygote) -> int:
    """Host pid of the zygote's interpreter: the first process under bubblewrap's two."""
    pid = z.pid
    assert pid is not None
    while True:
        with open(f"/proc/{pid}/comm") as f:
            if f.read().strip() != "bwrap":
                return pid
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            pid = int(f.read().split()[0])


def test_a_dead_zygote_is_replaced_and_in_flight_requests_fail_cleanly(zygote: Zygote) -> None:
    assert zygote.run(code="print(1)", timeout_s=5)["run"]["stdout"] == "1\n"
    starts = zygote.starts
    errors: list[Exception] = []

    def slow() -> None:
        try:
            zygote.run(code="import time\ntime.sleep(5)", timeout_s=10)
        except Exception as e:
            errors.append(e)

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(1.0)
    os.kill(zygote_process(zygote), signal.SIGKILL)
    t.join(30)
    assert errors and "zygote" in str(errors[0])
    assert zygote.run(code="print(2)", timeout_s=5)["run"]["stdout"] == "2\n"
    assert zygote.starts == starts + 1


def test_nothing_of_a_request_outlives_the_zygote_even_without_its_parent_death_signal(
    zygote: Zygote,
) -> None:
    """The program is S itself and may clear its PDEATHSIG; bubblewrap's pid namespace around the
    zygote still takes it, and everything it started, down with the zygote."""
    code = (
        "import ctypes, subprocess, time\n"
        "ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)\n"  # PR_SET_PDEATHSIG 0
        "subprocess.Popen(['/bin/sleep', '4321.8'])\n"
        "time.sleep(60)\n"
    )
    errors: list[Exception] = []

    def victim() -> None:
        try:
            zygote.run(code=code, timeout_s=30)
        except Exception as e:
            errors.append(e)

    t = threading.Thread(target=victim)
    t.start()
    deadline = time.monotonic() + 10
    while not host_processes("sleep 4321.8") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert host_processes("sleep 4321.8")
    os.kill(zygote_process(zygote), signal.SIGKILL)
    t.join(30)
    assert errors and gone("sleep 4321.8")
    assert zygote.run(code="print(3)", timeout_s=5)["run"]["stdout"] == "3\n"


@pytest.mark.slow
def test_1000_requests_leak_no_descriptors_or_memory(zygote: Zygote) -> None:
    def one(i: int) -> None:
        out = zygote.run(code=f"print({i} * 2)", timeout_s=10)["run"]["stdout"]
        assert out == f"{i * 2}\n"

    for i in range(20):  # warm: lazily allocated buffers, the first replies
        one(i)
    pid = zygote_process(zygote)
    fds_before = len(os.listdir(f"/proc/{pid}/fd"))
    rss_before = _rss_kb(pid)
    threads = [threading.Thread(target=lambda k=k: [one(k * 125 + j) for j in range(125)]) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert zygote_process(zygote) == pid, "the zygote was replaced during the run"
    assert len(os.listdir(f"/proc/{pid}/fd")) == fds_before
    assert _rss_kb(pid) - rss_before < 2048, (rss_before, _rss_kb(pid))
    assert zygote.ping()["running"] == 0


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


_NETNS_AND_SOCKET = (
    "import os, socket, sys, time\n"
    "probe = socket.socket(socket.AF_UNIX)\n"
    "try:\n"
    "    probe.connect('\\0agent-rl-slot-test'); print('reached', end=' ')\n"
    "except OSError:\n"
    "    print('refused', end=' ')\n"
    "s = socket.socket(socket.AF_UNIX); s.bind('\\0agent-rl-slot-test'); s.listen()\n"
    "if os.fork() == 0:\n"
    "    os.setsid(); time.sleep(60)\n"  # a daemon holding the socket open
    "time.sleep(float(sys.stdin.read() or 0))\n"
    "print(os.stat('/proc/self/ns/net').st_ino)\n"
)


def test_a_slot_is_reused_but_nothing_of_the_last_request_is_left_in_it(zygote: Zygote) -> None:
    """One network namespace per slot, kept across requests: the next program finds the last one's
    socket (held open by its daemon) gone, and cannot configure the namespace itself."""
    first = zygote.run(code=_NETNS_AND_SOCKET, timeout_s=10)["run"]["stdout"].split()
    second = zygote.run(code=_NETNS_AND_SOCKET, timeout_s=10)["run"]["stdout"].split()
    assert first[0] == second[0] == "refused"
    assert first[1] == second[1], "the idle slot was not reused"
    configure = (
        "import fcntl, socket, struct\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "try:\n"
        "    fcntl.ioctl(s, 0x8914, struct.pack('16sH14x', b'lo', 1)); print('configured')\n"  # SIOCSIFFLAGS up
        "except PermissionError:\n"
        "    print('denied')\n"
        "try:\n"
        "    open('/proc/sys/net/ipv4/ip_forward', 'w').write('1'); print('wrote')\n"
        "except OSError:\n"
        "    print('read-only')\n"
    )
    assert zygote.run(code=configure, timeout_s=10)["run"]["stdout"] == "denied\nread-only\n"


def test_requests_beyond_the_slots_wait_for_one_and_concurrent_ones_never_share_a_namespace() -> None:
    need_bwrap()
    z = Zygote(LaunchConfig(), DEFAULT_LIMITS, slots=2)
    try:
        z.start()
        out: list[list[str]] = []
        threads = [
            threading.Thread(
                target=lambda: out.append(
                    z.run(code=_NETNS_AND_SOCKET, stdin="1", timeout_s=10)["run"]["stdout"].split()
                )
            )
            for _ in range(4)
        ]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(out) == 4 and all(o[0] == "refused" for o in out), out
        assert len({o[1] for o in out}) == 2  # two slots, each used twice, never at the same time
        assert time.monotonic() - t0 > 1.9  # two rounds of 1 s: the second pair waited
        assert z.ping()["running"] == 0
    finally:
        z.close()


def test_a_holder_killed_from_outside_costs_its_slot_not_a_request_and_the_last_restarts_the_zygote() -> None:
    need_bwrap()
    z = Zygote(LaunchConfig(), DEFAULT_LIMITS, slots=2)

    def children() -> list[int]:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]

    def pair(tag: str) -> list[str]:
        out: list[str] = []
        code = f"import time\ntime.sleep(0.3)\nprint('{tag}')"
        threads = [
            threading.Thread(target=lambda: out.append(z.run(code=code, timeout_s=5)["run"]["stdout"]))
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    try:
        z.start()
        pid = zygote_process(z)
        holders = children()
        assert len(holders) == 2  # idle: the zygote's only children are its slots' holders
        os.kill(holders[0], signal.SIGKILL)
        assert pair("a") == ["a\n", "a\n"]  # both slots tried: the dead one dropped, its request retried
        assert children() == holders[1:] and zygote_process(z) == pid and z.starts == 1
        os.kill(holders[1], signal.SIGKILL)
        with pytest.raises(Exception, match="zygote"):  # no slot left: the zygote ends itself
            z.run(code="print(1)", timeout_s=5)
        assert z.run(code="print(2)", timeout_s=5)["run"]["stdout"] == "2\n"
        assert z.starts == 2 and zygote_process(z) != pid
    finally:
        z.close()


def test_output_beyond_the_cap_is_dropped_without_blocking_the_program(zygote: Zygote) -> None:
    code = "import sys\nsys.stdout.write('o' * 3_000_000)\nsys.stderr.write('e' * 3_000_000)\nprint('end')"
    t0 = time.monotonic()
    step = zygote.run(code=code, timeout_s=20, output_bytes=1000)["run"]
    assert (step["status"], step["return_code"]) == ("Finished", 0)
    assert step["stdout"] == "o" * 1000 and step["stderr"] == "e" * 1000
    assert time.monotonic() - t0 < 10


def test_stdin_larger_than_a_pipe_is_fed_whole_and_an_unread_one_does_not_block(zygote: Zygote) -> None:
    data = "x" * 1_000_000 + "\n"
    step = zygote.run(code="import sys\nprint(len(sys.stdin.read()))", stdin=data, timeout_s=20)["run"]
    assert step["stdout"] == "1000001\n"
    step = zygote.run(code="print('ignored it')", stdin=data, timeout_s=20)["run"]
    assert (step["stdout"], step["return_code"]) == ("ignored it\n", 0)


def test_a_timeout_kills_the_program_and_every_process_in_its_namespace(zygote: Zygote) -> None:
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    os.execv('/bin/sleep', ['sleep', '4321.7'])\n"
        "print(os.getpid(), flush=True)\n"
        "while True:\n"
        "    pass\n"
    )
    t0 = time.monotonic()
    step = zygote.run(code=code, timeout_s=2)["run"]
    assert (step["status"], step["return_code"], step["stdout"]) == ("TimeLimitExceeded", None, "1\n")
    assert 1.9 < step["execution_time"] < 5 and time.monotonic() - t0 < 8
    assert gone("sleep 4321.7")
    assert zygote.ping()["running"] == 0


def test_fetch_files_are_read_after_the_program_even_on_a_timeout(zygote: Zygote) -> None:
    """fetch_files requests keep a supervisor that outlives the program and reads its /workspace."""
    code = "open('out.txt', 'w').write('kept')\nprint('wrote', flush=True)\nimport time\ntime.sleep(30)"
    report = zygote.run(code=code, timeout_s=2, fetch_files=["out.txt", "absent"])
    assert report["run"]["status"] == "TimeLimitExceeded" and report["run"]["stdout"] == "wrote\n"
    assert report["files"] == {"out.txt": "a2VwdA=="} and report["missing"] == ["absent"]
