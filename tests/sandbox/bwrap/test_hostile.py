"""Hostile programs: each must be contained, then the sandbox must still answer ``1 + 1``.

One test per attack. After each: the session (or a fresh one) computes 2 and the pool is healthy.
After the suite: no zombies of ours, no sandbox processes, no leftover files or cgroups.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from sandbox import ExecResult, LocalSandbox
from sandbox.bwrap.launcher import WorkerProcess
from sandbox.limits import Limits
from tests.sandbox.conftest import children, cmdline, need_bwrap, settled_zombies

pytestmark = pytest.mark.slow

SECRET = "hostile-suite-secret-value"


@pytest.fixture(scope="module")
def box() -> LocalSandbox:
    need_bwrap()
    # Other tests in the same run leave long-lived helpers (a Ray cluster, the shared verifier, the
    # environments' shared LocalSandbox, whose pool refills and retires workers on its own threads):
    # so the leak check follows the processes this box started, by pid, not every new child.
    before_dirs = set(Path("/tmp").glob("agent-rl-sandbox-w*"))
    cg = Path("/sys/fs/cgroup/memory/agent-rl-sandbox")
    before_cgroups = set(cg.glob(f"w{os.getpid()}-*"))
    os.environ["AGENT_RL_TEST_SECRET"] = SECRET  # must never reach executed code
    b = LocalSandbox(pool_size=2, isolation="bwrap")
    started: list[WorkerProcess] = []
    spawn = b.launcher.spawn

    def recording_spawn(limits: Limits) -> WorkerProcess:
        worker = spawn(limits)
        started.append(worker)
        return worker

    b.launcher.spawn = recording_spawn  # type: ignore[method-assign]
    b.pool.wait_ready()  # the fillers may have started the first workers before the patch
    with b.pool._cond:
        started.extend(w for _, w in b.pool._ready if w not in started)
    yield b
    b.close()
    os.environ.pop("AGENT_RL_TEST_SECRET", None)
    ours = {w.proc.pid for w in started}
    assert len(started) > 2, "the suite should have used up and replaced workers"
    # A killed worker's bwrap monitor exits only once the kernel has torn its namespaces down,
    # which took over 0.2 s on a loaded CI machine: wait for it, boundedly, before calling
    # anything left over a leak.
    deadline = time.monotonic() + 10
    while ours & set(children()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert settled_zombies() == []
    left = ours & set(children())
    assert left == set(), {pid: cmdline(pid) for pid in left}
    assert set(Path("/tmp").glob("agent-rl-sandbox-w*")) - before_dirs == set()
    assert set(cg.glob(f"w{os.getpid()}-*")) - before_cgroups == set()


def attack(box: LocalSandbox, code: str, **kw: object) -> ExecResult:
    with box.session() as s:
        r = s.run(code, **kw)
        after = s.run("1 + 1")
        assert after.value == "2" and after.ok, after
    assert box.run("1 + 1").value == "2"
    assert settled_zombies() == []
    return r


def test_fork_bomb(box: LocalSandbox) -> None:
    r = attack(box, "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass", timeout_s=2)
    assert r.timed_out and r.session_restarted


def test_memory_bomb(box: LocalSandbox) -> None:
    r = attack(box, "l = []\nwhile True: l.append(bytearray(10**7))")
    assert r.memory_exceeded and r.limit == "memory"


def test_infinite_loop(box: LocalSandbox) -> None:
    assert attack(box, "while True: pass", timeout_s=1).limit == "wall_time"


def test_sleep_forever(box: LocalSandbox) -> None:
    t = time.monotonic()
    r = attack(box, "import time; time.sleep(10**6)", timeout_s=0.5)
    assert r.timed_out and time.monotonic() - t < 10


def test_sigterm_ignored(box: LocalSandbox) -> None:
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(100)"
    assert attack(box, code, timeout_s=0.5).timed_out


def test_huge_stdout_and_stderr(box: LocalSandbox) -> None:
    code = "import sys\nfor _ in range(200000):\n    print('o' * 100)\n    print('e' * 100, file=sys.stderr)"
    r = attack(box, code, timeout_s=30)
    assert r.truncated and len(r.stdout) < (1 << 20) + 200 and len(r.stderr) < (1 << 20) + 200


def test_disk_fill(box: LocalSandbox) -> None:
    code = "i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20)); i += 1"
    r = attack(box, code, timeout_s=30)
    assert r.error is not None and ("No space" in r.error.message or "too large" in r.error.message)


def test_reading_host_files_and_environment(box: LocalSandbox) -> None:
    code = (
        "import os\nprint(sorted(os.environ))\n"
        "for p in ['/root', '/home', '/work', '/etc/shadow', '/proc/1/environ']:\n"
        "    try:\n        print(p, os.listdir(p) if os.path.isdir(p) else open(p).read())\n"
        "    except OSError as e:\n        print(p, 'denied', type(e).__name__)\n"
    )
    r = attack(box, code)
    assert SECRET not in r.stdout and "AGENT_RL_TEST_SECRET" not in r.stdout
    for p in ["/root", "/home", "/work", "/etc/shadow"]:
        assert f"{p} denied" in r.stdout
    # pid 1 is the session's init (sandbox/session_template.py): not dumpable, so its environment
    # cannot be read; without templates it is bubblewrap's, started with only PATH and LANG.
    if box.launcher.template:
        assert "/proc/1/environ denied PermissionError" in r.stdout
    else:
        assert "/proc/1/environ PATH=/usr/bin:/bin" in r.stdout


def test_writing_outside_workspace(box: LocalSandbox) -> None:
    code = (
        "for p in ['/usr/evil', '/etc/evil', '/evil']:\n"
        "    try:\n        open(p, 'w').write('x'); print(p, 'written')\n"
        "    except OSError:\n        print(p, 'refused')\n"
    )
    r = attack(box, code)
    assert "written" not in r.stdout and r.stdout.count("refused") == 3
    assert not Path("/usr/evil").exists()


def test_symlink_escape(box: LocalSandbox) -> None:
    code = (
        "import os\nos.symlink('/root', 'root')\nos.symlink('/etc/passwd', 'pw')\n"
        "try:\n    print(os.listdir('root'))\nexcept OSError:\n    print('no root')\n"
        "print(os.path.exists('pw'))"
    )
    r = attack(box, code)
    assert "no root" in r.stdout and r.stdout.endswith("False\n")


def test_network_egress_to_host_loopback(box: LocalSandbox) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    hit = threading.Event()

    def accept() -> None:
        server.settimeout(5)
        try:
            server.accept()
            hit.set()
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    code = (
        f"import socket\ns = socket.socket()\ns.settimeout(2)\n"
        f"try:\n    s.connect(('127.0.0.1', {port})); print('connected')\n"
        f"except OSError as e:\n    print('blocked', e)\n"
    )
    r = attack(box, code)
    t.join()
    server.close()
    assert r.stdout.startswith("blocked") and not hit.is_set()


def test_kill_parent_and_process_group(box: LocalSandbox) -> None:
    r = attack(box, "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('alive')")
    assert r.stdout == "alive\n"  # the namespace's init ignores signals from inside
    r = attack(box, "import os, signal\nos.killpg(0, signal.SIGKILL)")
    assert r.session_restarted and r.error is not None


def test_os_exit(box: LocalSandbox) -> None:
    r = attack(box, "import os; os._exit(0)")
    assert r.session_restarted and r.exit_code == 0


def test_segfault_via_ctypes(box: LocalSandbox) -> None:
    r = attack(box, "import ctypes; ctypes.string_at(0)")
    assert r.error is not None and r.error.type == "WorkerCrashed" and r.session_restarted


def test_recursion_bomb(box: LocalSandbox) -> None:
    r = attack(box, "def f(n): return f(n + 1)\nf(0)")
    assert r.error is not None and r.error.type == "RecursionError"
    r = attack(box, "import sys\nsys.setrecursionlimit(10**8)\ndef f(n): return f(n + 1)\nf(0)", timeout_s=10)
    assert not r.ok and r.session_restarted


def test_thread_bomb(box: LocalSandbox) -> None:
    code = "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(100,), daemon=True).start()"
    r = attack(box, code, timeout_s=10)
    assert r.error is not None and "thread" in r.error.message


def test_fd_exhaustion(box: LocalSandbox) -> None:
    r = attack(box, "fs = []\nwhile True: fs.append(open('/dev/null'))")
    assert r.error is not None and "Too many open files" in r.error.message


def test_double_fork_daemon_does_not_survive_the_execution(box: LocalSandbox) -> None:
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        open('daemon.pid', 'w').write(str(os.getpid()))\n        time.sleep(1000)\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"
    )
    with box.session() as s:
        s.run(code)
        r = s.run(
            "import os\npid = int(open('daemon.pid').read())\n[p for p in os.listdir('/proc') if p == str(pid)]"
        )
        assert r.value == "[]"
        assert s.run("1 + 1").value == "2"
