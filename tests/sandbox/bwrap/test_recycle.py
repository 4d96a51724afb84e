"""Recycled workers (sandbox/session_template.py): a session must find nothing of the last one.

Each test runs one session that leaves as much behind as it can, closes it, waits for the pool to
recycle its worker into the same sandbox (same bubblewrap process), and checks from the next
session that nothing is left, with a positive control where a check could pass by being blind.
"""

from __future__ import annotations

import json
import time

import pytest

from sandbox import ExecResult, LocalSandbox
from sandbox.bwrap.launcher import LaunchConfig
from sandbox.session.box import Session
from tests.sandbox.conftest import need_bwrap, wait_for

pytestmark = pytest.mark.slow

# A 4 KiB run no cell writes out in full: byte i is (7 i + 13) mod 251. The scanner looks for an
# 8-byte prefix and checks the rest position by position, so it never puts the run in memory itself.
MAKE_RUN = "bytes((7 * i + 13) % 251 for i in range(4096))"
SCAN = """
def scan():
    import re
    head = bytes((7 * i + 13) % 251 for i in range(8))
    found = 0
    with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if not perms.startswith('r') or '[vvar' in line or '[vsyscall' in line:
                continue
            lo, hi = (int(x, 16) for x in span.split('-'))
            try:
                mem.seek(lo)
                data = mem.read(hi - lo)
            except (OSError, ValueError, OverflowError):
                continue
            for m in re.finditer(re.escape(head), data):
                tail = data[m.start(): m.start() + 4096]
                if len(tail) == 4096 and all(b == (7 * i + 13) % 251 for i, b in enumerate(tail)):
                    found += 1
    return found
"""

STRAYS = """
def strays():  # processes of the left-behind daemon, found by its command line
    out = []
    for p in os.listdir('/proc'):
        if p.isdigit() and int(p) != os.getpid():
            try:
                cmd = open(f'/proc/{p}/cmdline', 'rb').read()
            except OSError:
                continue
            out += [int(p)] if b'left-behind' in cmd else []
    return out
"""

LEAVE_BEHIND = STRAYS + """
import ctypes, os, socket, subprocess, sys
for d in ('/tmp', '/workspace', '/dev/shm'):
    open(os.path.join(d, 'left-behind'), 'w').write('x')
writable = [r for r, _, _ in os.walk('/') if not r.startswith(('/proc', '/sys')) and os.access(r, os.W_OK)]
assert sorted(writable) == ['/dev/pts', '/dev/shm', '/tmp', '/workspace'], writable  # devpts: ptys only
try:
    open('/dev/left-behind', 'w')  # bubblewrap's /dev outlives the session: read-only for it
    raise AssertionError('/dev is writable')
except OSError:
    pass
os.environ['LEFT_BEHIND'] = '1'
libc = ctypes.CDLL(None, use_errno=True)
assert libc.shmget(0x5eed, 4096, 0o1666) >= 0, ctypes.get_errno()  # IPC_CREAT | 0666
daemon = '''
import os, socket, time
if os.fork():
    os._exit(0)
os.setsid()
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(b"\\\\0agent-rl-left-behind")
s.listen()
open("/tmp/daemon-up", "w").close()
time.sleep(600)
'''
subprocess.run([sys.executable, '-c', daemon], check=True)
import time
deadline = time.monotonic() + 10
while not os.path.exists('/tmp/daemon-up') and time.monotonic() < deadline:
    time.sleep(0.01)
probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
probe.connect(b'\\0agent-rl-left-behind')  # the daemon is up and bound
print(len(strays()))
"""

FIND_LEFTOVERS = STRAYS + """
import ctypes, json, os, socket
left = []
for d in ('/tmp', '/workspace', '/dev/shm'):
    left += [os.path.join(d, f) for f in os.listdir(d)]
left += ['/dev/left-behind'] if os.path.exists('/dev/left-behind') else []
if 'LEFT_BEHIND' in os.environ:
    left.append('environ')
if ctypes.CDLL(None).shmget(0x5eed, 0, 0) >= 0:
    left.append('sysv shm')
try:
    socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect(b'\\0agent-rl-left-behind')
    left.append('abstract socket')
except ConnectionRefusedError:
    pass
procs = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
print(json.dumps({'left': left, 'procs': procs, 'strays': strays(), 'global': 'left_global' in globals()}))
"""


def back_in_pool(box: LocalSandbox, worker: object) -> bool:
    return wait_for(lambda: any(w is worker for _, w in box.pool._ready))


@pytest.fixture(scope="module")
def box() -> LocalSandbox:
    need_bwrap()
    b = LocalSandbox(pool_size=1, isolation="bwrap")
    if not b.launcher.template:
        b.close()
        pytest.fail("this host should run session templates (user namespaces inside bubblewrap)")
    yield b
    b.close()


def next_session_after(box: LocalSandbox, code: str) -> tuple[ExecResult, Session]:
    """Run ``code`` in a session, close it, and open the next one in the same sandbox."""
    with box.session() as s:
        first = s.run(code)
        assert first.ok, first
        worker = s.core.worker
        sessions = worker.sessions
    assert back_in_pool(box, worker), "the worker was not recycled"
    others: list[Session] = []  # sessions that got a worker the pool started meanwhile
    try:
        for _ in range(8):
            nxt = box.session()
            nxt.run("pass")
            if nxt.core.worker is worker:
                assert worker.sessions == sessions + 1
                return first, nxt
            others.append(nxt)
        raise AssertionError("the recycled worker was never handed out")
    finally:
        for o in others:
            o.close()


def test_next_session_finds_no_files_processes_sockets_ipc_or_globals(box: LocalSandbox) -> None:
    first, nxt = next_session_after(box, "left_global = 1\n" + LEAVE_BEHIND)
    with nxt:
        r = nxt.run(FIND_LEFTOVERS)
    assert r.ok, r
    found = json.loads(r.stdout)
    assert found["left"] == [] and not found["global"], found
    # Only the session's own init (1) and its worker (2), which runs the cell.
    assert found["procs"] == [1, 2] and found["strays"] == [], found
    assert first.stdout == "1\n", "the first session should have seen its daemon (positive control)"


def test_next_session_cannot_find_the_last_sessions_memory(box: LocalSandbox) -> None:
    _, nxt = next_session_after(box, f"secret_run = {MAKE_RUN}\n" + SCAN + "assert scan() >= 1")
    with nxt:
        assert nxt.run(SCAN + "print(scan())").stdout == "0\n"
        # Positive control: the same scanner finds the run once this session makes it.
        assert nxt.run(f"mine = {MAKE_RUN}\n" + SCAN + "print(scan())").stdout != "0\n"


def test_a_crashed_worker_is_not_recycled(box: LocalSandbox) -> None:
    with box.session() as s:
        s.run("pass")
        crashed = s.core.worker
        r = s.run("import os; os._exit(3)")
        assert r.exit_code == 3 and r.session_restarted, r
        assert s.run("1 + 1").value == "2"  # the session goes on in a fresh worker
        fresh = s.core.worker
    # The template ends its sandbox with the session's status: the host saw a crash, as without
    # templates, and the sandbox is gone; the fresh worker comes back.
    assert crashed.wait_exit(5.0) == 3 and not crashed.recycle()
    assert back_in_pool(box, fresh)
    assert not any(w is crashed for _, w in box.pool._ready)


def test_limits_hold_in_a_recycled_worker(box: LocalSandbox) -> None:
    _, nxt = next_session_after(box, "pass")
    with nxt:
        r = nxt.run("x = bytearray(3 << 30)")  # over the 1 GiB default
        assert not r.ok and r.error is not None and r.error.type == "MemoryError", r
        r = nxt.run("while True: pass", timeout_s=0.5)
        assert r.timed_out and r.session_restarted
        assert nxt.run("1 + 1").value == "2"


def test_recycle_off_gives_a_new_sandbox_per_session() -> None:
    need_bwrap()
    with LocalSandbox(pool_size=1, isolation="bwrap", launch=LaunchConfig(recycle=False)) as b:
        assert not b.launcher.template
        with b.session() as s:
            pid = s.run("import os; os.getpid()").value
            first = s.core.worker
        time.sleep(0.3)
        with b.session() as s:
            assert s.run("open('/proc/1/environ').read().split('\\0')[0]").value == "'PATH=/usr/bin:/bin'"
            assert s.core.worker is not first
        assert b.pool.recycled == 0 and pid == "2"
