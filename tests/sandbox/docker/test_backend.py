"""DockerSandbox against a real engine: one property per test, each followed by a sanity run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.docker

from sandbox.docker.backend import (  # noqa: E402
    LABEL_OWNER,
    LABEL_ROLE,
    ROLE_WORKER,
    DockerSandbox,
    owner_label,
    reap_orphans_now,
)
from sandbox.limits import LimitError  # noqa: E402
from sandbox.result import SandboxUnavailable  # noqa: E402


@pytest.fixture(scope="module")
def backend(sandbox_image):
    sb = DockerSandbox(sandbox_image, pool_size=1)
    yield sb
    sb.close()


def _ours(docker_client) -> list[str]:
    found = docker_client.containers.list(all=True, filters={"label": f"{LABEL_OWNER}={owner_label()}"})
    return sorted(c.id for c in found)


def _gone(docker_client, container_id: str, timeout_s: float = 20.0) -> bool:
    import docker.errors

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            docker_client.containers.get(container_id)
        except docker.errors.NotFound:
            return True
        time.sleep(0.2)
    return False


def test_session_round_trip_keeps_globals(backend):
    with backend.session() as s:
        assert s.run("x = 41").ok
        r = s.run("print(x + 1)\nx * 2")
        assert (r.stdout, r.value, r.ok) == ("42\n", "82", True)
        err = s.run("1 / 0")
        assert err.error is not None and err.error.type == "ZeroDivisionError"
        assert s.run("x").value == "41"  # an exception does not cost the session its state


def test_container_is_hardened(backend, docker_client):
    with backend.session() as s:
        attrs = docker_client.containers.get(s.worker_id).attrs
        host = attrs["HostConfig"]
        assert host["NetworkMode"] == "none"
        assert host["ReadonlyRootfs"] is True
        assert host["CapDrop"] == ["ALL"] and not host["CapAdd"]
        assert "no-new-privileges" in host["SecurityOpt"]
        assert host["Privileged"] is False and host["AutoRemove"] is True
        assert host["Memory"] == backend.limits.memory_mb * 2**20 == host["MemorySwap"]
        assert host["PidsLimit"] == backend.limits.processes
        assert attrs["Config"]["User"] == "10001:10001"
        assert attrs["Config"]["Labels"][LABEL_ROLE] == ROLE_WORKER
        # And the same from inside: what executed code can actually do.
        probe = s.run(
            textwrap.dedent(
                """
                import os, socket
                out = {"uid": os.getuid()}
                for path in ("/etc/evil", "/usr/evil", "/workspace/ok", "/tmp/ok"):
                    try:
                        open(path, "w").write("x"); out[path] = "written"
                    except OSError as e:
                        out[path] = e.errno
                try:
                    socket.create_connection(("1.1.1.1", 53), timeout=2); out["net"] = "open"
                except OSError as e:
                    out["net"] = e.errno
                out["caps"] = [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")]
                out
                """
            )
        )
        info = eval(probe.value)  # our own probe's repr of a dict of ints and str
        assert info["uid"] == 10001
        assert info["/etc/evil"] == 30 and info["/usr/evil"] == 30  # EROFS
        assert info["/workspace/ok"] == "written" and info["/tmp/ok"] == "written"
        assert info["net"] == 101  # ENETUNREACH: no interface but loopback
        assert info["caps"] == ["0000000000000000"]


def test_wall_timeout_kills_and_restarts_the_session(backend, docker_client):
    with backend.session() as s:
        s.run("kept = 1")
        first = s.worker_id
        r = s.run("while True: pass", timeout_s=1.0)
        assert r.timed_out and r.limit == "wall_time" and r.session_restarted and not r.ok
        assert _gone(docker_client, first), "the timed-out container is still there"
        after = s.run("'kept' in globals(), 1 + 1")
        assert after.value == "(False, 2)"  # a fresh container: state gone, service fine


def test_memory_limit_holds_in_process(backend):
    with backend.session(memory_mb=128) as s:
        r = s.run("blob = bytearray(512 * 2**20)")
        assert r.memory_exceeded and r.limit == "memory" and r.session_restarted
        assert s.run("1 + 1").value == "2"


def test_memory_limit_holds_for_child_processes(backend):
    """Children each get their own RLIMIT_AS; the container's cgroup bounds them together."""
    code = textwrap.dedent(
        """
        import os, signal
        pids = []
        for _ in range(6):
            pid = os.fork()
            if pid == 0:
                blob = bytearray(100 * 2**20)
                for i in range(0, len(blob), 4096):
                    blob[i] = 1
                import time; time.sleep(5)
                os._exit(0)
            pids.append(pid)
        statuses = [os.waitpid(pid, 0)[1] for pid in pids]
        survivors = sum(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 0 for s in statuses)
        killed = sum(os.WIFSIGNALED(s) and os.WTERMSIG(s) == signal.SIGKILL for s in statuses)
        survivors, killed
        """
    )
    with backend.session(memory_mb=256) as s:
        r = s.run(code, timeout_s=60)
        if r.value is not None:  # the kernel killed children only: the cell saw it happen
            survivors, killed = eval(r.value)
            assert survivors * 100 <= 256 and killed >= 6 - 2
        else:  # the OOM killer picked the worker itself: reported as the memory limit
            assert r.memory_exceeded and r.session_restarted
        assert s.run("1 + 1").value == "2"


def test_pid_limit_holds(backend):
    code = textwrap.dedent(
        """
        import os, time
        started = 0
        try:
            for _ in range(200):
                if os.fork() == 0:
                    time.sleep(20); os._exit(0)
                started += 1
        except OSError as e:
            failure = e.errno
        started, failure
        """
    )
    with backend.session(processes=16) as s:
        r = s.run(code, timeout_s=30)
        started, errno = eval(r.value)
        assert started < 16 and errno == 11  # EAGAIN from the pids cgroup
        assert s.run("1 + 1").value == "2"  # strays were reaped after the cell


def test_session_close_removes_its_container(backend, docker_client):
    s = backend.session()
    cid = s.worker_id
    assert s.run("1").ok
    s.close()
    assert _gone(docker_client, cid)
    s.close()  # idempotent


def test_warm_pool_serves_sessions_and_close_removes_everything(sandbox_image, docker_client):
    sb = DockerSandbox(sandbox_image, pool_size=2)
    try:
        sb.wait_warm(120)
        before = sb.stats.warm_hits
        with sb.session() as s:
            assert s.run("print('hi')").stdout == "hi\n"
        assert sb.stats.warm_hits == before + 1
        held = sb.container_ids()
        assert len(held) == 2 or sb.stats.cold_starts == 0
    finally:
        sb.close()
    assert all(_gone(docker_client, cid) for cid in held)
    with pytest.raises(SandboxUnavailable):
        sb.session()


def test_bad_requests_fail_clearly(backend):
    with pytest.raises(LimitError, match="memory_mb"):
        backend.session(memory_mb=-5)
    with pytest.raises(LimitError, match="unknown limit"):
        backend.session(bananas=3)
    with pytest.raises(LimitError, match="maximum"):
        backend.session(processes=10**6)
    with backend.session() as s:
        with pytest.raises(TypeError):
            s.run(b"print(1)")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            s.run("1", timeout_s=-1)
        assert s.run("1 + 1").value == "2"


def test_missing_image_is_sandbox_unavailable(docker_client):
    with pytest.raises(SandboxUnavailable, match="docker build"):
        DockerSandbox("agent-rl/no-such-image:never", pool_size=0)


_CRASHER = textwrap.dedent(
    """
    import sys
    from sandbox.docker.backend import DockerSandbox
    sb = DockerSandbox(sys.argv[1], pool_size=0, reap_orphans=False)
    s = sb.session()
    print(s.worker_id, flush=True)
    if sys.argv[2] == "busy":
        s.run("while True: pass", timeout_s=290)
    else:
        import time; time.sleep(600)
    """
)


def _crash_owner(image: str, mode: str) -> str:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CRASHER, image, mode], stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    cid = proc.stdout.readline().strip()
    assert cid, "the crashing owner did not start a session"
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)  # no atexit, no close(): a real crash
    proc.wait(10)
    return cid


def test_idle_container_removes_itself_when_its_owner_crashes(sandbox_image, docker_client):
    cid = _crash_owner(sandbox_image, "idle")
    assert _gone(docker_client, cid), "stdin closed but the worker did not exit and auto-remove"


def test_reaper_removes_orphans_of_a_crashed_owner_only(backend, sandbox_image, docker_client):
    cid = _crash_owner(sandbox_image, "busy")
    time.sleep(1.0)
    assert docker_client.containers.get(cid).status == "running"  # a busy worker never sees EOF
    with backend.session() as live:
        report = reap_orphans_now(docker_client)
        assert cid in report.removed
        assert live.worker_id in report.kept  # a live owner's container is left alone
        assert live.run("1 + 1").value == "2"
    assert _gone(docker_client, cid)
