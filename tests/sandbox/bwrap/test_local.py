"""LocalSandbox: sessions, results, limits and restarts, against real bubblewrap workers."""

from __future__ import annotations

import base64
import os

import pytest

from sandbox import ExecResult, LimitError, LocalSandbox


def test_session_globals_persist(sb: LocalSandbox) -> None:
    with sb.session() as s:
        s.run("x = 41")
        r = s.run("print(x + 1)")
    assert r.stdout == "42\n"
    assert r.ok and r.error is None and not r.timed_out and not r.truncated


def test_trailing_expression_value_not_printed(sb: LocalSandbox) -> None:
    with sb.session() as s:
        r = s.run("a = [1, 2]\na + [3]")
        assert r.value == "[1, 2, 3]" and r.stdout == ""
        assert s.run("a = 1").value is None
        assert s.run("a", want_value=False).value is None


def test_exception_traceback_is_trimmed_to_user_frames(sb: LocalSandbox) -> None:
    with sb.session() as s:
        r = s.run("def f():\n    raise ValueError('bad')\nf()")
    assert not r.ok and r.error is not None
    assert r.error.type == "ValueError" and r.error.message == "bad"
    assert "<cell-" in r.error.traceback and "raise ValueError('bad')" in r.error.traceback
    assert "worker" not in r.error.traceback and "exec(" not in r.error.traceback
    assert not r.session_restarted


def test_tracebacks_show_cell_source_lines(sb: LocalSandbox) -> None:
    """The worker imports linecache lazily; cell sources must still reach every traceback."""
    printed_by_the_cell = (
        "import traceback\ntry:\n    1 / 0\nexcept ZeroDivisionError:\n    traceback.print_exc()"
    )
    r = sb.run(printed_by_the_cell)  # a fresh worker: nothing has imported linecache before this cell
    assert "    1 / 0\n" in r.stderr and "ZeroDivisionError" in r.stderr
    with sb.session() as s:
        s.run("def g():\n    return {}['missing key']")
        r = s.run("g()")
    assert r.error is not None and r.error.type == "KeyError"
    assert "return {}['missing key']" in r.error.traceback and "<cell-1>" in r.error.traceback


def test_syntax_error_is_reported(sb: LocalSandbox) -> None:
    r = sb.run("def (:")
    assert r.error is not None and r.error.type == "SyntaxError"


def test_stdout_stderr_and_subprocess_output_captured(sb: LocalSandbox) -> None:
    r = sb.run(
        "import sys, os\nprint('out')\nprint('err', file=sys.stderr)\nsys.stdout.flush()\nos.system('echo child')"
    )
    assert r.stdout == "out\nchild\n"
    assert r.stderr == "err\n"


def test_output_keeps_its_order_across_the_cells_own_writes_and_other_processes(sb: LocalSandbox) -> None:
    """The cell's own prints go straight into the capture, other processes' output through a pipe:
    what reached the pipe first comes first, and a forked child's prints are not lost in its copy."""
    r = sb.run(
        # PyDLL: write(2) with the GIL held, so the capture thread cannot drain the pipe before the print.
        "import ctypes, os, sys\nctypes.PyDLL(None).write(1, b'fd ', 3)\nprint('own', flush=True)\n"
        "os.system('echo shell')\nprint('end', flush=True)\n"
        "pid = os.fork()\nif pid == 0:\n    print('child', flush=True)\n    os._exit(0)\nos.waitpid(pid, 0)\n"
        "print('parent', file=sys.stderr)"
    )
    assert r.stdout == "fd own\nshell\nend\nchild\n", r
    assert r.stderr == "parent\n"


def test_output_truncated_with_marker(sb: LocalSandbox) -> None:
    r = sb.run("print('x' * 5000)", output_bytes=1000)
    assert r.truncated
    assert r.stdout.startswith("x" * 1000)
    assert "output truncated" in r.stdout and len(r.stdout) < 1200


def test_invalid_utf8_output_is_escaped(sb: LocalSandbox) -> None:
    r = sb.run("import sys\nsys.stdout.buffer.write(b'\\xff ok\\n')\nsys.stdout.flush()\nprint('\\udcff')")
    assert r.stdout == "\\xff ok\n\\udcff\n"
    r.stdout.encode("utf-8")  # always valid UTF-8


def test_wall_timeout_restarts_session(sb: LocalSandbox) -> None:
    with sb.session() as s:
        s.run("x = 1")
        r = s.run("while True: pass", timeout_s=0.5)
        assert r.timed_out and r.limit == "wall_time" and r.session_restarted and not r.ok
        after = s.run("'x' in globals()")
        assert after.value == "False" and not after.session_restarted
        assert s.run("1 + 1").value == "2"


def test_cpu_limit_fires(sb: LocalSandbox) -> None:
    with sb.session() as s:
        r = s.run("while True: pass", cpu_s=1, timeout_s=20)
        assert r.limit == "cpu_time" and not r.timed_out and r.session_restarted
        assert r.duration_s < 10
        assert s.run("1 + 1").value == "2"


def test_memory_limit_fires(sb: LocalSandbox) -> None:
    with sb.session(memory_mb=256) as s:
        r = s.run("x = bytearray(512 * 1024 * 1024)")
        assert r.memory_exceeded and r.limit == "memory" and r.session_restarted
        assert s.run("1 + 1").value == "2"


def test_process_limit(sb: LocalSandbox) -> None:
    code = (
        "import subprocess\nps = []\ntry:\n"
        "    for _ in range(50): ps.append(subprocess.Popen(['sleep', '5']))\n"
        "except OSError as e:\n    print('refused', len(ps))\n"
    )
    with sb.session(processes=8) as s:
        r = s.run(code)
    assert r.stdout.startswith("refused") and int(r.stdout.split()[1]) < 10


def test_open_files_limit(sb: LocalSandbox) -> None:
    with sb.session(open_files=64) as s:
        r = s.run("fs = [open('/dev/null') for _ in range(100)]")
    assert r.error is not None and "Too many open files" in r.error.message


def test_file_size_limit(sb: LocalSandbox) -> None:
    with sb.session(file_size_mb=1) as s:
        r = s.run("open('big', 'wb').write(b'x' * (2 << 20))")
    assert r.error is not None and "File too large" in r.error.message


def test_disk_quota(sb: LocalSandbox) -> None:
    code = "for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))"
    with sb.session(disk_mb=8, file_size_mb=4) as s:
        r = s.run(code)
    assert r.error is not None and "No space left" in r.error.message


def test_exit_code_and_crash_restart(sb: LocalSandbox) -> None:
    with sb.session() as s:
        r = s.run("import sys; sys.exit(4)")
        assert r.exit_code == 4 and r.error is not None and not r.session_restarted
        r = s.run("import os; os._exit(3)")
        assert r.exit_code == 3 and r.session_restarted
        r = s.run("import ctypes; ctypes.string_at(0)")
        assert r.error is not None and r.error.type == "WorkerCrashed" and r.exit_code == 139
        assert s.run("1 + 1").value == "2"


def test_stdin_and_files(sb: LocalSandbox) -> None:
    files = {"data/in.txt": base64.b64encode(b"hello").decode()}
    r = sb.run("import sys\nprint(input(), open('data/in.txt').read())", stdin="typed\n", files=files)
    assert r.stdout == "typed hello\n"
    bad = sb.run("1", files={"../escape": base64.b64encode(b"x").decode()})
    assert bad.error is not None and "escapes" in bad.error.message


def test_one_shots_do_not_share_state(sb: LocalSandbox) -> None:
    sb.run("y = 5")
    r = sb.run("y")
    assert r.error is not None and r.error.type == "NameError"


def test_run_batch_keeps_order(sb: LocalSandbox) -> None:
    results = sb.run_batch([f"print({i})" for i in range(6)] + ["1/0"])
    assert [r.stdout for r in results[:6]] == [f"{i}\n" for i in range(6)]
    assert results[6].error is not None and results[6].error.type == "ZeroDivisionError"


def test_limits_validated(sb: LocalSandbox) -> None:
    with pytest.raises(LimitError, match="must be > 0"):
        sb.session(memory_mb=-1)
    with pytest.raises(LimitError, match="exceeds the server maximum"):
        sb.session(memory_mb=10**9)
    with pytest.raises(LimitError, match="unknown limit"):
        sb.session(gpus=1)
    # Too small for a worker to start: a clear error, not a sandbox that fails to come up.
    with pytest.raises(LimitError, match="'open_files'=1 is below 16"):
        sb.session(open_files=1)
    with pytest.raises(LimitError, match="'memory_mb'=8 is below 32"):
        sb.session(memory_mb=8)
    with sb.session(open_files=16) as s:  # the floor itself starts
        assert s.run("print(1)").stdout == "1\n"
    with sb.session() as s, pytest.raises(LimitError, match="fixed per session"):
        s.run("1", memory_mb=10)
    with pytest.raises(TypeError):
        sb.run(123)  # type: ignore[arg-type]


def test_result_round_trips_through_dict() -> None:
    r = ExecResult(stdout="a", limit="memory", memory_exceeded=True)
    d = r.to_dict()
    assert d["ok"] is False
    assert ExecResult.from_dict(d) == r


def test_require_isolation_refuses_rlimits() -> None:
    from sandbox import SandboxUnavailable

    with pytest.raises(SandboxUnavailable):
        LocalSandbox(isolation="rlimits", require_isolation=True)


async def test_async_session_run(sb: LocalSandbox) -> None:
    with sb.session() as s:
        await s.run_async("z = 2")
        r = await s.run_async("z * 21")
        assert r.value == "42"
        r = await s.run_async("while True: pass", timeout_s=0.3)
        assert r.timed_out and r.session_restarted
    r = await sb.run_async("print('once')")
    assert r.stdout == "once\n"


def test_worker_start_failure_is_an_infrastructure_error(monkeypatch) -> None:
    """An OSError starting a worker (EPERM, ENOMEM) surfaces as SandboxUnavailable, never a bare error."""
    from sandbox import SandboxUnavailable
    from sandbox.bwrap import launcher

    def refuse(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(launcher, "WorkerProcess", refuse)
    from sandbox.limits import DEFAULT_LIMITS

    lch = launcher.Launcher(launcher.LaunchConfig(isolation="rlimits"))
    with pytest.raises(SandboxUnavailable, match="cannot start a sandbox worker"):
        lch.spawn(DEFAULT_LIMITS)


@pytest.mark.skipif(os.geteuid() != 0, reason="per-worker uids are only used when the server runs as root")
def test_taking_a_uid_kills_what_a_dead_owner_left_running(tmp_path) -> None:
    """A process still running as a free sandbox uid (its owner was kill -9'd) is killed on reuse."""
    import subprocess
    import time

    from sandbox.bwrap.launcher import UidAllocator

    alloc = UidAllocator(base=299_990, count=1)
    orphan = subprocess.Popen(["sleep", "60"], user=299_990)
    try:
        uid = alloc.take()
        assert uid == 299_990
        deadline = time.monotonic() + 5
        while orphan.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert orphan.returncode == -9
    finally:
        orphan.kill()
        alloc.give(299_990)


@pytest.mark.skipif(os.geteuid() != 0, reason="per-worker uids are only used when the server runs as root")
def test_only_a_uid_given_back_clean_skips_the_orphan_scan(monkeypatch) -> None:
    from sandbox.bwrap import launcher
    from sandbox.limits import DEFAULT_LIMITS
    from sandbox.session.protocol import ChannelTimeout, exec_request

    # Uids of our own (by pid), so that a concurrent run of this suite cannot hold them.
    uid, worker_uid = 298_000 + 2 * (os.getpid() % 500), 298_001 + 2 * (os.getpid() % 500)
    scanned: list[int] = []
    monkeypatch.setattr(launcher, "_kill_orphans", scanned.append)
    alloc = launcher.UidAllocator(base=uid, count=1)
    alloc.give(alloc.take())  # not known to be clean
    assert alloc.take() == uid and scanned[-1:] == [uid]
    alloc.give(uid, clean=True)
    scanned.clear()
    alloc.take()
    assert scanned == []
    alloc.give(uid)

    # A worker killed mid-cell, with a child of its own running: afterwards nothing runs as its uid.
    lch = launcher.Launcher(launcher.LaunchConfig(isolation="bwrap", uid_base=worker_uid, uid_count=1))
    worker = lch.spawn(DEFAULT_LIMITS)
    code = "import subprocess, time\nsubprocess.Popen(['sleep', '60'])\ntime.sleep(60)"
    with pytest.raises(ChannelTimeout):
        worker.channel.request(exec_request(code, DEFAULT_LIMITS), 0.5)
    worker.kill()
    assert (lch.uids.LOCK_DIR / str(worker_uid)).read_bytes() == b"clean"
    assert [e for e in os.scandir("/proc") if e.name.isdigit() and e.stat().st_uid == worker_uid] == []


def test_a_worker_started_in_the_background_boots_at_the_lowest_cpu_weight_until_handed_out() -> None:
    from sandbox.bwrap import launcher
    from sandbox.bwrap.cgroups import BACKGROUND_WEIGHT, DEFAULT_WEIGHT
    from sandbox.limits import DEFAULT_LIMITS

    lch = launcher.Launcher(launcher.LaunchConfig(isolation="bwrap"))
    worker = lch.spawn(DEFAULT_LIMITS, background=True)
    try:
        if worker.cgroup is None or "cpu" not in worker.cgroup.dirs:
            if os.environ.get("CI") == "true" and os.geteuid() == 0:
                pytest.fail("CI runs as root: the cpu cgroup controller should be writable")
            pytest.skip("no writable cpu cgroup controller (not root)")
        d = worker.cgroup.dirs["cpu"]
        version = worker.cgroup.version
        weight = d / ("cpu.shares" if version == 1 else "cpu.weight")
        assert weight.read_text().strip() == BACKGROUND_WEIGHT[version]
        assert str(worker.ns_init_pid) in (d / "cgroup.procs").read_text().split()
        worker.foreground()
        assert weight.read_text().strip() == DEFAULT_WEIGHT[version]
    finally:
        worker.kill()
    assert not d.exists()


def test_cgroups_of_dead_owners_are_swept() -> None:
    from sandbox.bwrap.cgroups import CgroupManager

    mgr = CgroupManager()
    if not mgr.available:
        pytest.skip("no writable cgroup controllers (not root)")
    dead_pid = 4_000_000  # above pid_max: never a live process
    made = [parent / f"w{dead_pid}-1" for parent in mgr.parents.values()]
    for d in made:
        d.mkdir()
    mine = [parent / f"w{os.getpid()}-999999" for parent in mgr.parents.values()]
    for d in mine:
        d.mkdir()
    try:
        assert CgroupManager().sweep_dead_owners() == 0  # the constructor already swept them
        assert not any(d.exists() for d in made)
        assert all(d.exists() for d in mine)  # a live owner's cgroups stay
    finally:
        for d in mine + made:
            if d.exists():
                d.rmdir()


def test_a_new_session_starts_clean_after_the_workers_warm_up(sb: LocalSandbox) -> None:
    """Each worker runs one throwaway cell before it is ready (its first-touch costs, off the session's
    clock): the session's cells are numbered from 1 and its namespace is its own."""
    with sb.session() as s:
        first = s.run("print(sorted(globals()))")
        second = s.run("1 / 0")
    assert first.stdout == "['__builtins__', '__name__']\n", first
    assert second.error is not None and 'File "<cell-2>", line 1' in second.error.traceback
