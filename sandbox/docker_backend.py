"""DockerSandbox: one hardened container per session, driven over the container's attached stdio.

Why a container per session: it is the strongest isolation this project offers without a VM.
Each session gets its own kernel namespaces, cgroup (memory, pids, cpu), read-only root and
private tmpfs workspace, with no network and no capabilities, so executed code cannot see the
host, other sessions or the outside world, and a limit it hits cannot hurt anyone else.

How: the container's main process is tini (PID 1, reaps zombies) running the stdlib-only
sandbox worker (sandbox/worker.py, copied into the image as ``WORKER_PATH``). We attach to the
container's stdin/stdout before starting it and speak the worker's framed JSON protocol over
that socket, so there is no port, no network and no extra server in the container. Starting a
container costs a few hundred milliseconds, so a warm pool of started, ready containers hides
it; a session takes one from the pool and the pool refills in the background.

What is covered: per-session container limits (memory incl. swap, pids, cpu, tmpfs sizes, open
files, file size), wall-time timeouts (the container is killed and the session continues in a
fresh one with ``session_restarted``), clean-up on session end, on ``close()``/interpreter exit,
on a crash of the owning process (the worker sees stdin close and the container auto-removes),
and a reaper for labelled orphans that survived a crash anyway (e.g. a worker stuck in a loop).

What is not covered: the image itself (build it with sandbox/Dockerfile), Docker daemon
hardening (rootless mode, user-namespace remapping, gVisor: pass ``runtime=`` for the latter),
and per-session disk quota beyond the tmpfs sizes.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from sandbox.limits import DEFAULT_LIMITS, MAX_LIMITS, Limits
from sandbox.protocol import exec_request, result_from_reply
from sandbox.result import ExecError, ExecResult, SandboxUnavailable

DEFAULT_IMAGE = "agent-rl/sandbox:latest"
WORKER_PATH = "/opt/venv/sandbox-worker.py"
SANDBOX_UID = "10001:10001"

LABEL_ROLE = "org.agent-rl.sandbox.role"
LABEL_OWNER = "org.agent-rl.sandbox.owner"
ROLE_WORKER = "session-worker"

_FRAME = struct.Struct(">I")
_DOCKER_HEADER = struct.Struct(">BxxxI")  # stream id, 3 pad bytes, payload length
_MAX_FRAME = 256 * 1024 * 1024


# ---------------------------------------------------------------------------------------------
# Limits: the sandbox's Limits, mapped onto a container
# ---------------------------------------------------------------------------------------------
def container_kwargs(limits: Limits, cpus: float) -> dict[str, Any]:
    """Keyword arguments for ``containers.create`` that enforce the per-session limits."""
    memory = f"{limits.memory_mb}m"
    disk = f"size={limits.disk_mb}m"
    return {
        "mem_limit": memory,
        "memswap_limit": memory,  # equal to mem_limit: no swap on top
        "pids_limit": limits.processes,
        "nano_cpus": int(cpus * 1e9),
        "ulimits": [_ulimit("nofile", limits.open_files), _ulimit("core", 0)],
        # noexec: code may write files but not run binaries it dropped there.
        "tmpfs": {
            # uid/gid: this engine ignores mode= for a tmpfs over an image directory.
            "/workspace": f"rw,nosuid,nodev,noexec,{disk},uid=10001,gid=10001,mode=0700",
            "/tmp": f"rw,nosuid,nodev,noexec,{disk},mode=1777",
        },
    }


def worker_config(limits: Limits) -> dict[str, Any]:
    """The worker's CONFIG_JSON: the rlimits it applies to itself (see sandbox/worker.py)."""
    # RLIMIT_AS equals the cgroup limit, so an in-process allocation fails with MemoryError (a
    # clean report) before the kernel OOM-kills the container. No RLIMIT_NPROC: it counts every
    # process of the uid on the whole host and all session containers share one uid; the cgroup
    # pids limit is the per-session bound instead.
    return {
        "workdir": "/workspace",
        "memory_bytes": limits.memory_mb * 2**20,
        "nofile": limits.open_files,
        "fsize_bytes": limits.file_size_mb * 2**20,
        "session_cpu_s": limits.session_cpu_s,
    }


def _ulimit(name: str, value: int) -> Any:
    from docker.types import Ulimit

    return Ulimit(name=name, soft=value, hard=value)


# ---------------------------------------------------------------------------------------------
# One container and its attached protocol stream
# ---------------------------------------------------------------------------------------------
class WorkerGone(Exception):
    """The worker's stream ended: the container exited (killed, OOM, crashed)."""


class _AttachedWorker:
    """A started container whose stdin/stdout carry the worker protocol.

    Docker multiplexes stdout and stderr on one socket when the container has no TTY: every chunk
    is prefixed by an 8-byte header (stream id, length). We demultiplex here, keep stdout bytes in
    a buffer the protocol reads frames from, and keep the tail of stderr for error messages.
    """

    def __init__(self, container: Any, sock: socket.socket) -> None:
        self.container = container
        self.id: str = container.id
        self.sock = sock
        self._stdout = bytearray()
        self._stderr: deque[bytes] = deque(maxlen=64)
        self._pending = bytearray()  # raw bytes not yet demultiplexed
        self._next_id = 0
        self.python: str | None = None
        self.killed = False

    # -- low-level I/O -------------------------------------------------------------------------
    def _recv_raw(self, deadline: float | None) -> None:
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        if timeout == 0.0:
            raise TimeoutError
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(1 << 16)
        except TimeoutError as exc:
            raise TimeoutError from exc
        except OSError as exc:
            raise WorkerGone(f"attach socket failed: {exc}") from exc
        if not data:
            raise WorkerGone("the container's output stream ended")
        self._pending += data
        while len(self._pending) >= _DOCKER_HEADER.size:
            stream, size = _DOCKER_HEADER.unpack_from(self._pending)
            if len(self._pending) < _DOCKER_HEADER.size + size:
                break
            payload = bytes(self._pending[_DOCKER_HEADER.size : _DOCKER_HEADER.size + size])
            del self._pending[: _DOCKER_HEADER.size + size]
            if stream == 1:
                self._stdout += payload
            else:
                self._stderr.append(payload)

    def _read_exact(self, n: int, deadline: float | None) -> bytes:
        while len(self._stdout) < n:
            self._recv_raw(deadline)
        out = bytes(self._stdout[:n])
        del self._stdout[:n]
        return out

    def recv(self, deadline: float | None) -> dict[str, Any]:
        (n,) = _FRAME.unpack(self._read_exact(_FRAME.size, deadline))
        if n > _MAX_FRAME:
            raise WorkerGone(f"worker sent a {n}-byte frame; the stream is corrupt")
        return json.loads(self._read_exact(n, deadline))

    def send(self, message: dict[str, Any]) -> None:
        body = json.dumps(message).encode()
        try:
            self.sock.settimeout(30.0)
            self.sock.sendall(_FRAME.pack(len(body)) + body)
        except OSError as exc:
            raise WorkerGone(f"could not write to the worker: {exc}") from exc

    def stderr_tail(self) -> str:
        return b"".join(self._stderr).decode("utf-8", "backslashreplace")[-2000:]

    # -- protocol ------------------------------------------------------------------------------
    def wait_ready(self, timeout_s: float) -> None:
        hello = self.recv(time.monotonic() + timeout_s)
        if hello.get("op") != "ready":
            raise WorkerGone(f"expected the worker's ready message, got {hello!r}")
        self.python = hello.get("python")

    def call(self, message: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
        self._next_id += 1
        message = {**message, "id": self._next_id}
        self.send(message)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        reply = self.recv(deadline)
        if reply.get("id") != self._next_id:
            raise WorkerGone(f"reply id {reply.get('id')!r} does not match request {self._next_id}")
        return reply

    # -- lifecycle -----------------------------------------------------------------------------
    def exit_state(self) -> dict[str, Any]:
        """Best-effort container state after the stream ended (it may already be auto-removed)."""
        try:
            return dict(self.container.client.api.inspect_container(self.id).get("State") or {})
        except Exception:
            return {}

    def destroy(self) -> None:
        """Stop the worker and remove the container; safe to call twice and after a crash."""
        if not self.killed:
            self.killed = True
            with contextlib.suppress(Exception):
                self.send({"op": "shutdown"})
        with contextlib.suppress(Exception):
            self.sock.close()
        with contextlib.suppress(Exception):
            self.container.remove(force=True)  # may race auto-remove: NotFound / 409 are fine


# ---------------------------------------------------------------------------------------------
# Session
# ---------------------------------------------------------------------------------------------
class DockerSession:
    """A notebook-like session: globals persist across ``run`` calls until a limit restarts it."""

    def __init__(self, owner: DockerSandbox, worker: _AttachedWorker, limits: Limits) -> None:
        self._owner = owner
        self._worker: _AttachedWorker | None = worker
        self.limits = limits
        self._lock = threading.Lock()

    @property
    def container_id(self) -> str | None:
        """The container running this session now (None between a restart and the next run)."""
        return None if self._worker is None else self._worker.id

    def run(self, code: str, *, timeout_s: float | None = None) -> ExecResult:
        """Run ``code`` in the session; raises SandboxUnavailable only for infrastructure faults."""
        if not isinstance(code, str):
            raise TypeError(f"code must be str, not {type(code).__name__}")
        wall = self.limits.wall_s if timeout_s is None else float(timeout_s)
        if not 0 < wall <= self._owner.maxima.wall_s:
            raise ValueError(f"timeout_s must be in (0, {self._owner.maxima.wall_s}], got {timeout_s!r}")
        with self._lock:
            worker = self._ensure_worker()
            started = time.perf_counter()
            try:
                reply = worker.call(exec_request(code, self.limits), wall)
            except TimeoutError:
                self._discard_worker()
                return ExecResult(
                    error=ExecError("TimeoutError", f"execution exceeded the {wall:g} s wall-time limit"),
                    timed_out=True,
                    limit="wall_time",
                    session_restarted=True,
                    duration_s=time.perf_counter() - started,
                )
            except WorkerGone as exc:
                elapsed = time.perf_counter() - started
                exit_info = self._owner._exit_info(worker.id)
                self._discard_worker()
                return self._died(exc, worker, exit_info, elapsed)
            result = result_from_reply(reply, time.perf_counter() - started)
            if reply.get("restart"):
                self._discard_worker()
                result.session_restarted = True
            return result

    def _died(
        self, exc: Exception, worker: _AttachedWorker, info: dict[str, Any], elapsed: float
    ) -> ExecResult:
        """Explain a worker that vanished mid-execution, from the engine's die/oom events."""
        code = info.get("exit_code")
        if info.get("oom"):
            kind, limit = "MemoryError", "memory"
            message = f"the session exceeded its {self.limits.memory_mb} MiB memory limit"
        elif code == 128 + 24:  # SIGXCPU: RLIMIT_CPU ran out
            kind, limit = "TimeoutError", "cpu_time"
            message = f"execution exceeded its {self.limits.cpu_s:g} s CPU-time limit"
        else:
            kind, limit = "WorkerDied", None
            tail = worker.stderr_tail().strip()
            message = f"the worker exited ({exc}; container exit code {code})" + (f": {tail}" if tail else "")
        return ExecResult(
            error=ExecError(kind, message + "; the session was restarted", exit_code=code),
            memory_exceeded=limit == "memory",
            limit=limit,
            session_restarted=True,
            duration_s=elapsed,
            exit_code=code,
        )

    def _ensure_worker(self) -> _AttachedWorker:
        if self._worker is None:
            self._worker = self._owner._acquire(self.limits)
        return self._worker

    def _discard_worker(self) -> None:
        """Throw the container away; the next run starts from a fresh one."""
        worker, self._worker = self._worker, None
        if worker is not None:
            self._owner._release(worker)

    def close(self) -> None:
        """Remove the session's container; safe to call twice."""
        with self._lock:
            self._discard_worker()
            self._owner._forget(self)

    def __enter__(self) -> DockerSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------------------------
@dataclass
class DockerSandboxStats:
    """Counters for benchmarks and tests: how sessions got their containers."""

    warm_hits: int = 0
    cold_starts: int = 0
    containers_started: int = 0
    containers_removed: int = 0


_LIVE: weakref.WeakSet[DockerSandbox] = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    for sandbox in list(_LIVE):
        with contextlib.suppress(Exception):
            sandbox.close()


class DockerSandbox:
    """Sessions in containers: ``with DockerSandbox().session() as s: s.run("print(1)")``.

    ``session(**limits)`` takes the same limit names as LocalSandbox (see sandbox.limits.Limits);
    requests above ``maxima`` raise LimitError. ``pool_size`` containers with the default limits
    are kept started and ready; a session whose per-session limits differ starts its own container
    (a cold start). Needs a reachable Docker engine and the sandbox image (see docs/docker.md).
    """

    def __init__(
        self,
        image: str = DEFAULT_IMAGE,
        *,
        pool_size: int = 2,
        limits: Limits = DEFAULT_LIMITS,
        maxima: Limits = MAX_LIMITS,
        cpus: float = 1.0,
        start_timeout_s: float = 60.0,
        runtime: str | None = None,
        reap_orphans: bool = True,
        client: Any = None,
    ) -> None:
        if pool_size < 0:
            raise ValueError(f"pool_size must be >= 0, got {pool_size}")
        if not 0 < cpus <= 1024:
            raise ValueError(f"cpus must be in (0, 1024], got {cpus}")
        self.image = image
        self.pool_size = pool_size
        self.maxima = maxima
        self.limits = DEFAULT_LIMITS.updated({k: v for k, v in limits.to_dict().items()}, maxima)
        self.cpus = float(cpus)
        self.start_timeout_s = start_timeout_s
        self.runtime = runtime
        self.stats = DockerSandboxStats()
        self.closed = False
        self._client = client if client is not None else _connect()
        self._check_image()
        self._owner = owner_label()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pool: deque[_AttachedWorker] = deque()
        self._in_use: set[str] = set()
        self._sessions: weakref.WeakSet[DockerSession] = weakref.WeakSet()
        self._refill_error: str | None = None
        self._exits: dict[str, dict[str, Any]] = {}
        self._events = _EngineEvents(self._client, self._owner, self._record_exit)
        if reap_orphans:
            reap_orphans_now(self._client)
        self._refiller = threading.Thread(target=self._refill_loop, name="docker-sandbox-pool", daemon=True)
        self._refiller.start()
        _LIVE.add(self)

    # -- public API ----------------------------------------------------------------------------
    def session(self, **limits: Any) -> DockerSession:
        """Open a session; ``limits`` override this backend's defaults (names as in Limits)."""
        if self.closed:
            raise SandboxUnavailable("this DockerSandbox is closed")
        session_limits = self.limits.updated(limits, self.maxima)
        session = DockerSession(self, self._acquire(session_limits), session_limits)
        with self._lock:
            self._sessions.add(session)
        return session

    def wait_warm(self, timeout_s: float = 120.0) -> None:
        """Block until the pool is full (benchmarks and tests use this to measure warm starts)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while len(self._pool) < self.pool_size:
                if self._refill_error:
                    raise SandboxUnavailable(f"the warm pool cannot start containers: {self._refill_error}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SandboxUnavailable(f"the warm pool did not fill within {timeout_s:g} s")
                self._wake.wait(min(left, 0.5))

    def container_ids(self) -> list[str]:
        """Ids of every container this backend holds (pool and sessions)."""
        with self._lock:
            return [w.id for w in self._pool] + sorted(self._in_use)

    def close(self) -> None:
        """Remove every container this backend started; open sessions fail on their next run."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            pool, self._pool = list(self._pool), deque()
            sessions = list(self._sessions)
            self._wake.notify_all()
        for session in sessions:
            with contextlib.suppress(Exception):
                session.close()
        for worker in pool:
            self._destroy(worker)
        self._refiller.join(timeout=30)
        self._events.close()
        _LIVE.discard(self)

    def __enter__(self) -> DockerSandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- containers ----------------------------------------------------------------------------
    def _check_image(self) -> None:
        import docker.errors

        try:
            self._client.images.get(self.image)
        except docker.errors.ImageNotFound as exc:
            raise SandboxUnavailable(
                f"Docker image {self.image!r} not found; build it with "
                f"`docker compose build sandbox` or `docker build -f sandbox/Dockerfile -t {self.image} .` "
                "(docs/docker.md covers machines without a registry)"
            ) from exc
        except docker.errors.DockerException as exc:
            raise SandboxUnavailable(f"cannot query the Docker engine: {exc}") from exc

    def _start_worker(self, limits: Limits) -> _AttachedWorker:
        import docker.errors

        kwargs: dict[str, Any] = {
            "command": ["python3", "-I", "-S", WORKER_PATH, json.dumps(worker_config(limits))],
            "user": SANDBOX_UID,
            "working_dir": "/workspace",
            "stdin_open": True,  # docker-py also sets StdinOnce: if we vanish, the worker sees EOF
            "tty": False,
            "network_mode": "none",
            "read_only": True,
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "ipc_mode": "private",
            "auto_remove": True,
            "environment": {"PYTHONDONTWRITEBYTECODE": "1", "HOME": "/workspace"},
            "labels": {LABEL_ROLE: ROLE_WORKER, LABEL_OWNER: self._owner},
            **container_kwargs(limits, self.cpus),
        }
        if self.runtime:
            kwargs["runtime"] = self.runtime
        container = None
        try:
            container = self._client.containers.create(self.image, **kwargs)
            # Attach before start so not a byte of the worker's output is missed.
            raw = self._client.api.attach_socket(
                container.id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
            )
            worker = _AttachedWorker(container, getattr(raw, "_sock", raw))
            container.start()
            with self._lock:
                self.stats.containers_started += 1
            worker.wait_ready(self.start_timeout_s)
            return worker
        except (docker.errors.DockerException, WorkerGone, TimeoutError, OSError, ValueError) as exc:
            if container is not None:
                with contextlib.suppress(Exception):
                    container.remove(force=True)
            raise SandboxUnavailable(
                f"could not start a sandbox container from {self.image!r}: {exc}"
            ) from exc

    def _acquire(self, limits: Limits) -> _AttachedWorker:
        if self.closed:
            raise SandboxUnavailable("this DockerSandbox is closed; open a new one")
        worker = None
        if limits.session_key() == self.limits.session_key():
            with self._lock:
                if self._pool:
                    worker = self._pool.popleft()
                    self.stats.warm_hits += 1
                    self._wake.notify_all()
        if worker is None:
            worker = self._start_worker(limits)
            with self._lock:
                self.stats.cold_starts += 1
        with self._lock:
            self._in_use.add(worker.id)
        return worker

    def _release(self, worker: _AttachedWorker) -> None:
        with self._lock:
            self._in_use.discard(worker.id)
        self._destroy(worker)

    def _destroy(self, worker: _AttachedWorker) -> None:
        worker.destroy()
        with self._lock:
            self.stats.containers_removed += 1
            self._exits.pop(worker.id, None)

    def _forget(self, session: DockerSession) -> None:
        with self._lock:
            self._sessions.discard(session)

    def _record_exit(self, container_id: str, key: str, value: Any) -> None:
        with self._lock:
            self._exits.setdefault(container_id, {})[key] = value
            self._wake.notify_all()

    def _exit_info(self, container_id: str, wait_s: float = 2.0) -> dict[str, Any]:
        """The container's exit code and OOM flag, from the engine's events (waits briefly)."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while "exit_code" not in self._exits.get(container_id, {}):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._wake.wait(left)
            return dict(self._exits.get(container_id, {}))

    def _refill_loop(self) -> None:
        while True:
            with self._lock:
                while not self.closed and len(self._pool) >= self.pool_size:
                    self._wake.wait()
                if self.closed:
                    return
            try:
                worker = self._start_worker(self.limits)
            except Exception as exc:  # keep the reason for wait_warm; retry slowly
                with self._lock:
                    self._refill_error = str(exc)
                    self._wake.notify_all()
                time.sleep(2.0)
                continue
            with self._lock:
                self._refill_error = None
                keep = not self.closed
                if keep:
                    self._pool.append(worker)
                self._wake.notify_all()
            if not keep:
                self._destroy(worker)
                return


class _EngineEvents:
    """One streaming connection to the engine's events for our containers: die (exit code), oom.

    Containers auto-remove, so by the time a session notices its stream ended the container may
    be gone and ``inspect`` would 404; the events carry the facts we need regardless.
    """

    def __init__(self, client: Any, owner: str, record: Any) -> None:
        self._stream = client.events(
            decode=True,
            filters={"type": "container", "event": ["die", "oom"], "label": f"{LABEL_OWNER}={owner}"},
        )
        self._record = record
        self._thread = threading.Thread(target=self._run, name="docker-sandbox-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with contextlib.suppress(Exception):
            for event in self._stream:
                cid = event.get("id") or event.get("Actor", {}).get("ID", "")
                if event.get("status") == "oom" or event.get("Action") == "oom":
                    self._record(cid, "oom", True)
                elif event.get("Action") == "die":
                    code = event.get("Actor", {}).get("Attributes", {}).get("exitCode")
                    self._record(cid, "exit_code", int(code) if code is not None else None)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stream.close()


# ---------------------------------------------------------------------------------------------
# Engine connection, ownership labels and the orphan reaper
# ---------------------------------------------------------------------------------------------
def _connect() -> Any:
    try:
        import docker
    except ImportError as exc:
        raise SandboxUnavailable("the docker SDK is not installed: pip install 'agent-rl[docker]'") from exc
    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except docker.errors.DockerException as exc:
        raise SandboxUnavailable(
            f"no reachable Docker engine ({exc}); start dockerd or set DOCKER_HOST"
        ) from exc
    return client


def _process_start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (clock ticks since boot): tells a live owner from pid reuse."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 :].split()[19].decode()
    except (OSError, ValueError, IndexError):
        return None


def owner_label(pid: int | None = None) -> str:
    """``host:pid:start``: identifies the process that owns a container across pid reuse."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{_process_start_time(pid) or '?'}"


def owner_is_alive(label: str) -> bool:
    """False when the owner ran on this host and is gone; True when alive or on another host."""
    try:
        host, pid_text, start = label.rsplit(":", 2)
        pid = int(pid_text)
    except ValueError:
        return False  # unparseable: nobody can claim it
    if host != socket.gethostname():
        return True  # another machine sharing the engine: not ours to judge
    return _process_start_time(pid) == start


@dataclass
class ReapReport:
    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, list[str]]:
        return asdict(self)


def reap_orphans_now(client: Any = None, *, everything: bool = False) -> ReapReport:
    """Remove session containers whose owning process is gone (or all of them with ``everything``).

    Runs when a DockerSandbox starts; call it from cron or after a crash as well. Containers of
    live owners (this or another process) are left alone.
    """
    client = client if client is not None else _connect()
    report = ReapReport()
    for container in client.containers.list(all=True, filters={"label": f"{LABEL_ROLE}={ROLE_WORKER}"}):
        owner = container.labels.get(LABEL_OWNER, "")
        if everything or not owner_is_alive(owner):
            with contextlib.suppress(Exception):
                container.remove(force=True)
            report.removed.append(container.id)
        else:
            report.kept.append(container.id)
    return report


@contextlib.contextmanager
def docker_sandbox(**kwargs: Any) -> Iterator[DockerSandbox]:
    """``with docker_sandbox(pool_size=1) as sb:``: a DockerSandbox closed on exit."""
    sandbox = DockerSandbox(**kwargs)
    try:
        yield sandbox
    finally:
        sandbox.close()
