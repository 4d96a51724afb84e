"""Start one worker process confined by bubblewrap (or, as a loud fallback, by rlimits only).

What is covered: new user/pid/net/ipc/uts/cgroup namespaces; a read-only /usr and a few /etc
files; private tmpfs /workspace and /tmp with a size quota; no host home, secrets or environment
(``--clearenv``, and the bwrap process itself starts with an empty environment); a distinct
unprivileged uid per worker when we run as root (so RLIMIT_NPROC is per session); memory and pid
cgroups where writable; ``--die-with-parent``. Killing a worker kills the pid namespace's init, so
the kernel kills and reaps every process in it.

``--die-with-parent`` is ``PR_SET_PDEATHSIG``, which fires when the *thread* that forked bubblewrap
exits, not the process. Every worker is therefore forked by one spawner thread that lives as long
as the process (``_Spawner``): a worker started for a request on a short-lived helper thread would
otherwise be killed, state and all, the moment that thread ended.

What is not covered: seccomp filtering, CPU shares, and GPU devices. The rlimits fallback (no
bubblewrap) shares the host's filesystem view and network with the executed code.

Sessions reuse their sandbox: sandbox/session_template.py. With ``LaunchConfig.recycle`` (the
default) the program bubblewrap runs is a session template, and each session's worker is a clone
of it in fresh user/pid/mount/ipc/uts namespaces with its own /tmp, /workspace and /dev/shm; when a
session closes cleanly, ``WorkerProcess.recycle`` asks the template for the next one (a few ms)
instead of the pool booting a new bubblewrap and interpreter (~21 ms of CPU). What sessions of one
sandbox share, one after the other (the host uid, the cgroups, a loopback-only network namespace),
and what they cannot pass on, is listed there; the tests are tests/sandbox/bwrap/test_recycle.py.

Fork server for one-shots: sandbox/zygote.py. Each one-shot here costs a full worker start
(bubblewrap's namespaces and mounts, an interpreter, our side). SandboxFusion's ``/run_code`` for
Python instead goes to a zygote started through this launcher (``ZygoteLauncher``: the same
confinement, another program), which clones a child per request into fresh namespaces. What it
gives up against one worker per one-shot (a shared host uid and shared cgroups across concurrent
requests) is listed there, and its hostile suite is tests/sandbox/test_zygote.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import logging
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from sandbox.bwrap.cgroups import CgroupManager, WorkerCgroup
from sandbox.limits import Limits
from sandbox.result import SandboxUnavailable
from sandbox.session.protocol import ChannelError, WorkerChannel
from sandbox.session_template import ISOLATION_MESSAGE

log = logging.getLogger("sandbox")

WORKER_PATH = Path(__file__).resolve().parents[1] / "worker.py"
TEMPLATE_PATHS = tuple(WORKER_PATH.with_name(n) for n in ("namespaces.py", "session_template.py"))
_BOOTSTRAP = """\
import marshal, os
def _read(n):
    b = b""
    while len(b) < n:
        chunk = os.read(0, n - len(b))
        if not chunk:
            os._exit(3)
        b += chunk
    return b
exec(marshal.loads(_read(int.from_bytes(_read(4), "big"))))
"""
"""Reads the worker's compiled code (length-prefixed, from stdin) and runs it as ``__main__``."""
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives", "/etc/mime.types")
_counter = itertools.count()
T = TypeVar("T")


class _Spawner:
    """Runs process starts on one daemon thread that never exits (see the module doc for why).

    Only the fork/exec runs there (about 1-2 ms); waiting for the worker to be ready stays on the
    caller, so starts still overlap. After ``fork()`` the child has no threads, so the first call in
    a new process starts that process's own spawner thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # may have been held by a thread that does not exist here
        self._pid = -1

    def call(self, fn: Callable[[], T]) -> T:
        with self._lock:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                self._queue = queue.SimpleQueue()
                threading.Thread(
                    target=self._serve, args=(self._queue,), name="sandbox-spawner", daemon=True
                ).start()
            q = self._queue
        done: Future[T] = Future()
        q.put((fn, done))
        return done.result()

    @staticmethod
    def _serve(q: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]]) -> None:
        while True:
            fn, done = q.get()
            try:
                done.set_result(fn())
            except BaseException as e:  # handed to the caller, which re-raises it
                done.set_exception(e)


SPAWNER = _Spawner()


def default_python() -> str:
    """An interpreter any uid can execute: Debian's /usr/bin/python3 when it exists."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("python3") or "python3"


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


@dataclass
class LaunchConfig:
    """How workers are started; shared by every worker of one LocalSandbox or server."""

    python: str = field(default_factory=default_python)
    isolation: str = "bwrap"
    """"bwrap" (namespaces) or "rlimits" (fallback: limits only, no filesystem/network isolation)."""
    uid_base: int = 200_000
    """First host uid handed to workers when running as root; each live worker gets its own."""
    uid_count: int = 10_000
    cgroups: bool = True
    extra_ro_binds: tuple[str, ...] = ()
    """Host paths bound read-only at the same place (e.g. a venv whose python the workers run)."""
    start_timeout_s: float = 20.0
    recycle: bool = True
    """Under bubblewrap, keep each worker's sandbox after its session and clone the next session's
    worker from a template in it (sandbox/session_template.py): ~21 ms of CPU per session becomes
    a few. Off: one bubblewrap process per session, as before."""


class UidAllocator:
    """Hands out distinct host uids so per-uid limits (RLIMIT_NPROC) are per worker.

    Uniqueness holds across processes too: each uid in use is held by an ``flock`` on a file in a
    root-only directory, which the kernel releases if this process dies.

    The file also records whether the uid was given back *clean* (its last worker is known to be
    gone with every process it started). Only then may ``take`` skip the scan of /proc for
    orphans, which cost about 2 ms of CPU per worker start. A taker marks the file busy first, so
    an owner that dies while holding the uid leaves it marked dirty.
    """

    CLEAN = b"clean"

    def __init__(self, base: int, count: int) -> None:
        # Resolved here, not at import: importing `sandbox` must work on a read-only root.
        self.LOCK_DIR = Path(tempfile.gettempdir()) / "agent-rl-sandbox-uids"
        self.base, self.count = base, count
        self._held: dict[int, int] = {}
        self._lock = threading.Lock()
        self._next = random.randrange(count)  # start elsewhere than a sibling process would
        self.LOCK_DIR.mkdir(mode=0o700, exist_ok=True)

    def take(self) -> int:
        with self._lock:
            for _ in range(self.count):
                uid = self.base + self._next
                self._next = (self._next + 1) % self.count
                if uid in self._held:
                    continue
                fd = os.open(self.LOCK_DIR / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    continue
                self._held[uid] = fd
                clean = os.pread(fd, len(self.CLEAN) + 1, 0) == self.CLEAN
                _mark(fd, b"busy")
                if not clean:
                    _kill_orphans(uid)
                return uid
        raise SandboxUnavailable("no free sandbox uid: too many live workers")

    def give(self, uid: int, *, clean: bool = False) -> None:
        """Release ``uid``; ``clean`` promises that no process runs as it any more."""
        with self._lock:
            fd = self._held.pop(uid, None)
        if fd is not None:
            if clean:
                _mark(fd, self.CLEAN)
            os.close(fd)  # releases the flock


def _mark(fd: int, state: bytes) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, state, 0)


def _kill_orphans(uid: int) -> None:
    """Kill whatever still runs as `uid` when we have just taken its lock.

    Nobody holds the lock, so any such process was left by an owner that died (e.g. `kill -9` of
    the server): bubblewrap's pid-1 init can outlive its parent. Taking the uid cleans it up.
    """
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    os.kill(int(entry.name), signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue


class Launcher:
    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.is_root = os.geteuid() == 0
        self.uids = UidAllocator(config.uid_base, config.uid_count) if self.is_root else None
        self.setpriv = shutil.which("setpriv") if self.is_root else None
        self.cgroups = CgroupManager(enabled=config.cgroups and config.isolation == "bwrap")
        self.template = config.isolation == "bwrap" and config.recycle
        """Whether workers are session templates (recyclable); off for good if the host cannot."""
        self._worker_source = WORKER_PATH.read_text()
        if self.template:
            self._worker_source = "\n".join([*(p.read_text() for p in TEMPLATE_PATHS), self._worker_source])
        self._worker_code = compile_worker(config.python, self._worker_source)
        if config.isolation == "bwrap" and not bwrap_path():
            raise SandboxUnavailable("bubblewrap (bwrap) is not installed: apt-get install -y bubblewrap")

    def worker_argv(self, config: dict[str, object]) -> list[str]:
        """The interpreter command line; the worker's code follows on stdin when it is precompiled."""
        code = self._worker_source if self._worker_code is None else _BOOTSTRAP
        return [self.config.python, "-I", "-c", code, json.dumps(config)]

    def send_worker_code(self, stdin_fd: int) -> None:
        if self._worker_code is not None:
            data = len(self._worker_code).to_bytes(4, "big") + self._worker_code
            view = memoryview(data)
            while view:
                view = view[os.write(stdin_fd, view) :]

    def spawn(self, limits: Limits, background: bool = False) -> WorkerProcess:
        """``background``: boot at the lowest CPU weight until ``foreground`` (see cgroups.py)."""
        uid = self.uids.take() if self.uids else None
        try:
            try:
                return WorkerProcess(self, limits, uid, background)
            except SandboxUnavailable as err:
                if not (self.template and ISOLATION_MESSAGE in str(err)):
                    raise
                log.warning("sandbox: no session templates on this host, one sandbox per session: %s", err)
                self.template = False
                return WorkerProcess(self, limits, uid, background)
        except BaseException as err:
            if uid is not None and self.uids:
                self.uids.give(uid)
            if isinstance(
                err, OSError
            ):  # e.g. EPERM/ENOMEM starting bwrap: infrastructure, not the user's code
                raise SandboxUnavailable(f"cannot start a sandbox worker: {err}") from err
            raise

    def worker_config(self, limits: Limits, workdir: str) -> dict[str, object]:
        return {
            "memory_bytes": limits.memory_mb << 20,
            # The uid is private to this worker, so its count is this session's processes + threads;
            # a few extra cover the worker's own capture thread and bubblewrap's init.
            "nproc": limits.processes + 4,
            "nofile": limits.open_files,
            "fsize_bytes": limits.file_size_mb << 20,
            "session_cpu_s": limits.session_cpu_s,
            "own_pid_namespace": self.config.isolation == "bwrap",
            "workdir": workdir,
            "template": self.template,
            "disk_bytes": limits.disk_mb << 20,
        }

    def bwrap_argv(self, limits: Limits, info_fd: int, block_fd: int) -> list[str]:
        disk = str(limits.disk_mb << 20)
        argv = [
            bwrap_path() or "bwrap",
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--clearenv",
            "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
            "--setenv", "HOME", "/workspace",
            "--setenv", "TMPDIR", "/tmp",
            "--setenv", "LANG", "C.UTF-8",
            "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
            # glibc gives every thread its own 64 MiB malloc arena; under RLIMIT_AS a thread bomb
            # then exhausts the address space and the worker's own reply fails to allocate.
            "--setenv", "MALLOC_ARENA_MAX", "2",
            "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr",
        ]  # fmt: skip
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                argv += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                argv += ["--ro-bind", top, top]
        for path in (*_ETC_FILES, *self.config.extra_ro_binds):
            argv += ["--ro-bind-try", path, path]
        python_dir = os.path.dirname(os.path.realpath(self.config.python))
        if not python_dir.startswith("/usr/"):
            argv += ["--ro-bind-try", python_dir, python_dir]
        argv += [
            "--proc", "/proc",
            "--dev", "/dev",
            "--size", disk, "--tmpfs", "/tmp",
            "--size", disk, "--tmpfs", "/workspace",
            "--remount-ro", "/",
            "--chdir", "/workspace",
            "--cap-drop", "ALL",
            "--info-fd", str(info_fd),
            "--block-fd", str(block_fd),
        ]  # fmt: skip
        return argv


class WorkerProcess:
    """One running worker; ``kill`` is idempotent and leaves no process, zombie, uid or cgroup behind."""

    def __init__(self, launcher: Launcher, limits: Limits, uid: int | None, background: bool = False) -> None:
        self.launcher = launcher
        self.background = background
        self.limits = limits
        self.uid = uid
        self.cgroup: WorkerCgroup | None = None
        self.ns_init_pid: int | None = None
        self.workdir_host: str | None = None
        self.control: socket.socket | None = None
        """The template's control socket (sandbox/session_template.py); None: one session only."""
        self.sessions = 0
        self._pipes: tuple[int, int] = (-1, -1)
        self._killed = False
        self._stopped_by: str | None = None
        self._lock = threading.Lock()
        self.name = f"w{os.getpid()}-{next(_counter)}"
        cfg = launcher.config
        try:
            if cfg.isolation == "bwrap":
                self._start_bwrap(limits)
            else:
                self._start_plain(limits)
            if self.control is None:
                launcher.send_worker_code(self.proc.stdin.fileno())
                self.channel = WorkerChannel(self.proc.stdout.fileno(), self.proc.stdin.fileno())
                self._wait_ready()
            else:
                launcher.send_worker_code(self.control.fileno())
                self._open_session()
        except ChannelError as e:
            err = self._stderr_tail()
            self.kill()
            raise SandboxUnavailable(f"worker failed to start: {e}; stderr: {err}") from e
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self) -> None:
        ready = self.channel.recv(self.launcher.config.start_timeout_s)
        if ready.get("op") != "ready":
            raise SandboxUnavailable(f"worker sent {ready!r} instead of ready")
        self.python_version = ready.get("python")

    def _open_session(self) -> None:
        """Send the template a fresh pair of pipes: it ends the last session, clones the next."""
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        old, self._pipes = self._pipes, (rep_r, req_w)
        try:
            assert self.control is not None
            socket.send_fds(self.control, [b"s"], [req_r, rep_w])
        finally:
            os.close(req_r)
            os.close(rep_w)
        self.channel = WorkerChannel(rep_r, req_w)
        # The old pipes stay open until the old session is gone: its worker would exit on EOF,
        # and the template would take that for a crash and end the sandbox.
        self._wait_ready()
        _close_all(old)
        self.sessions += 1

    @property
    def recyclable(self) -> bool:
        """Whether ``recycle`` may work: a template runs in this sandbox, not killed or stopped."""
        return self.control is not None and not self._killed and self._stopped_by is None

    def recycle(self) -> bool:
        """Make this sandbox ready for a new session (a fresh worker cloned from its template).

        False when it cannot be reused: no template, stopped, dead, or its cgroup saw an OOM kill
        (the counters that tell a limit from a crash would carry over). The caller then kills it.
        """
        with self._lock:
            if self._killed or self.control is None or self._stopped_by is not None:
                return False
        if self.proc.poll() is not None or self.oom_killed():
            return False
        try:
            self._open_session()
        except (OSError, ChannelError, SandboxUnavailable) as e:
            log.info("sandbox: worker %s not recycled: %s", self.name, e)
            return False
        self.name = f"w{os.getpid()}-{next(_counter)}"  # a new session's worker: a new id
        return True

    # -- start ------------------------------------------------------------------------------
    def _popen(self, argv: list[str], **extra: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` as this worker's uid, in a new session, with an almost empty environment.

        The uid switch is done by ``setpriv`` rather than Popen's ``user=``: with ``user=`` Python
        must fork() instead of vfork(), copying the page tables of this whole process. In a
        trainer with a model loaded that is tens of ms of CPU and 100+ ms per worker start (a
        1 GB parent: 30 ms of CPU, ~200 ms wall), against ~1.5 ms for the extra exec. The
        credentials are the same: real, effective and saved uid and gid, no supplementary groups.
        """
        kw: dict[str, object] = {
            "stdin": subprocess.PIPE,
            "stdout": subprocess.PIPE,
            "stderr": subprocess.PIPE,
            "env": {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            "start_new_session": True,
            "bufsize": 0,
            **extra,
        }
        if self.uid is not None:
            setpriv = self.launcher.setpriv
            if setpriv:
                u = str(self.uid)
                argv = [setpriv, f"--reuid={u}", f"--regid={u}", "--clear-groups", "--", *argv]
            else:
                kw.update(user=self.uid, group=self.uid, extra_groups=[])
        # On the process-lifetime spawner thread: bubblewrap's --die-with-parent follows the thread.
        return SPAWNER.call(lambda: subprocess.Popen(argv, **kw))  # type: ignore[call-overload]

    def _start_bwrap(self, limits: Limits) -> None:
        launcher = self.launcher
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        try:
            argv = launcher.bwrap_argv(limits, info_w, block_r)
            config = launcher.worker_config(limits, "/workspace")
            argv += launcher.worker_argv(config)
            self.cgroup = launcher.cgroups.create(
                self.name,
                (limits.memory_mb + 2 * limits.disk_mb) << 20,
                limits.processes + 8,
                background=self.background,
            )
            if launcher.template:
                self.control, theirs = socket.socketpair()
                with theirs:
                    self.proc = self._popen(argv, pass_fds=(info_w, block_r), stdin=theirs, stdout=theirs)
            else:
                self.proc = self._popen(argv, pass_fds=(info_w, block_r))
            os.close(info_w)
            info_w = -1
            os.close(block_r)
            block_r = -1
            info = _read_info(info_r, launcher.config.start_timeout_s)
            self.ns_init_pid = int(info["child-pid"])
            if self.cgroup is not None:
                try:
                    self.cgroup.add(self.ns_init_pid)
                except OSError as e:
                    log.warning("sandbox/cgroup: could not add worker to its cgroup: %s", e)
            os.write(block_w, b"1")  # release the sandbox: everything it forks inherits the cgroup
        finally:
            for fd in (info_r, info_w, block_r, block_w):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)

    def _start_plain(self, limits: Limits) -> None:
        self.workdir_host = tempfile.mkdtemp(prefix="agent-rl-sandbox-")
        if self.uid is not None:
            os.chown(self.workdir_host, self.uid, self.uid)
        config = self.launcher.worker_config(limits, self.workdir_host)
        env = {
            "PATH": "/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "HOME": self.workdir_host,
            "TMPDIR": self.workdir_host,
            "MALLOC_ARENA_MAX": "2",  # see the bwrap argv
        }
        self.proc = self._popen(self.launcher.worker_argv(config), cwd=self.workdir_host, env=env)

    def _stderr_tail(self) -> str:
        with contextlib.suppress(Exception):
            if self.proc.poll() is not None and self.proc.stderr is not None:
                return self.proc.stderr.read()[-2000:].decode("utf-8", "replace")
        return "<unavailable>"

    @property
    def id(self) -> str:
        return self.name

    # -- stop -------------------------------------------------------------------------------
    def foreground(self) -> None:
        """Handed to a session: the default CPU weight from now on (a no-op if it never was lower)."""
        if self.background and self.cgroup is not None:
            self.cgroup.set_background(False)
        self.background = False

    def alive(self) -> bool:
        return not self._killed and self.proc.poll() is None

    def wait_exit(self, timeout_s: float) -> int | None:
        """The worker's exit status (128+signal for a signal), or None if it is still running."""
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None
        return 128 - rc if rc < 0 else rc

    def oom_killed(self) -> bool:
        return self.cgroup is not None and self.cgroup.oom_killed()

    def terminate(self, reason: str) -> None:
        """Stop the worker's processes now, from any thread (to cancel a running cell).

        Only signals: the descriptors stay open for the thread that is reading them, which sees
        EOF, reports ``reason`` through ``lost_reason`` and then calls ``kill`` to clean up.
        """
        with self._lock:
            proc = getattr(self, "proc", None)
            if self._killed or proc is None or proc.returncode is not None:
                return
            self._stopped_by = reason
            with contextlib.suppress(OSError):
                if self.ns_init_pid is not None:
                    os.kill(self.ns_init_pid, signal.SIGKILL)  # the monitor reaps it, then exits
                else:
                    os.killpg(proc.pid, signal.SIGKILL)

    def lost_reason(self) -> str | None:
        """Why the worker died of something other than its own code, or None (call after it exited).

        Under bubblewrap the code runs in its own user and pid namespaces and cannot see, let alone
        signal, bubblewrap's monitor; bubblewrap exits with 128+n when the code dies of signal n.
        So a monitor that itself died of a signal was killed from outside: by this process exiting
        or losing a thread (--die-with-parent), an operator, or the host's OOM killer.
        """
        if self._stopped_by is not None:
            return self._stopped_by
        rc = self.proc.returncode
        if self.launcher.config.isolation == "bwrap" and rc is not None and rc < 0:
            return (
                f"the sandbox worker was killed from outside the sandbox ({_signal_name(-rc)} to "
                "bubblewrap), not by the executed code; the session's state is lost"
            )
        return None

    def kill(self) -> None:
        with self._lock:
            if self._killed:
                return
            self._killed = True
        proc = getattr(self, "proc", None)
        # Clean: bubblewrap's monitor ended on its own or once we killed the namespace's init. It
        # reaps the init, whose exit the kernel holds back until every other process in the pid
        # namespace is gone; so nothing runs as this worker's uid any more.
        clean = self.launcher.config.isolation == "bwrap" and self.ns_init_pid is not None
        if proc is not None:
            # Kill the namespace's init first: bubblewrap's monitor then reaps it and exits, and
            # the kernel kills and reaps everything else in the pid namespace. Only while our child
            # is unreaped are these pids guaranteed not to have been recycled.
            # Killing the monitor first would orphan the init to the host's pid 1, which may never
            # reap it; so the monitor is only killed if it does not exit by itself.
            if proc.poll() is None and self.ns_init_pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(self.ns_init_pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(2)
            if proc.poll() is None:
                clean = False
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
            if self.cgroup is not None:
                self.cgroup.kill_all()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    proc.kill()
                proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                with contextlib.suppress(Exception):
                    stream.close()
        else:
            clean = False
        if self.control is not None:
            self.control.close()
        _close_all(self._pipes)
        self._pipes = (-1, -1)
        if self.cgroup is not None:
            self.cgroup.remove()
        if self.workdir_host:
            shutil.rmtree(self.workdir_host, ignore_errors=True)
        if self.uid is not None and self.launcher.uids:
            self.launcher.uids.give(self.uid, clean=clean)
            self.uid = None


def _close_all(fds: tuple[int, ...]) -> None:
    for fd in fds:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def compile_worker(python: str, source: str) -> bytes | None:
    """The worker's code object, compiled once by the worker's own interpreter and marshalled.

    Compiling worker.py is about 3.5 ms of CPU, a quarter of a worker's start-up; loading the
    marshalled code is 0.1 ms. Marshal data only fits the interpreter version that wrote it, so that
    interpreter writes it. On any failure workers get the source (``python -c``) as before.
    """
    script = (
        "import marshal, sys\n"
        "code = compile(sys.stdin.buffer.read(), '<sandbox-worker>', 'exec')\n"
        "sys.stdout.buffer.write(marshal.dumps(code))\n"
    )
    try:
        out = subprocess.run(
            [python, "-I", "-c", script],
            input=source.encode(),
            capture_output=True,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("sandbox/launcher: cannot precompile the worker (%s); workers compile it", e)
        return None
    return out or None


def _read_info(fd: int, timeout_s: float) -> dict[str, object]:
    """Read bubblewrap's --info-fd JSON (written once the sandbox's init exists)."""
    import select

    deadline = time.monotonic() + timeout_s
    buf = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SandboxUnavailable("bubblewrap did not report its child pid")
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
        with contextlib.suppress(ValueError):
            return json.loads(buf)
    try:
        return json.loads(buf)
    except ValueError as e:
        raise SandboxUnavailable(f"bubblewrap failed to start (info: {buf!r})") from e
