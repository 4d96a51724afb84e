"""DockerSandbox: one hardened container per worker, driven over the container's attached stdio.

Why a container per session: it is the strongest isolation this project offers without a VM.
Each session gets its own kernel namespaces, cgroup (memory, pids, cpu), read-only root and
private tmpfs workspace, with no network and no capabilities, so executed code cannot see the
host, other sessions or the outside world, and a limit it hits cannot hurt anyone else.

How: the container's main process is tini (PID 1, reaps zombies) running the stdlib-only
sandbox worker (sandbox/worker.py, copied into the image as ``WORKER_PATH``). We attach to the
container's stdin/stdout before starting it and speak the worker's framed JSON protocol over
that socket, so there is no port, no network and no extra server in the container.

Only the container is Docker's: ``DockerLauncher`` is a ``Launcher`` (sandbox/session/core.py),
and everything above it is shared with the local backend: the session core (the same ``run``
signature with ``want_value``, ``stdin``, ``files`` and per-execution limits, and the same error
taxonomy: a CPU-time kill is ``CpuTimeExceeded`` here too), the wire protocol (``WorkerChannel``
with Docker's stream headers stripped by ``_Demux``) and the warm pool, which hides the few hundred
milliseconds a container takes to start.

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

import contextlib
import json
import os
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from sandbox.limits import DEFAULT_LIMITS, Limits
from sandbox.result import SandboxUnavailable
from sandbox.session.box import PooledSandbox
from sandbox.session.protocol import ChannelError, WorkerChannel

DEFAULT_IMAGE = "agent-rl/sandbox:latest"
WORKER_PATH = "/opt/venv/sandbox-worker.py"
SANDBOX_UID = "10001:10001"

LABEL_ROLE = "org.agent-rl.sandbox.role"
LABEL_OWNER = "org.agent-rl.sandbox.owner"
ROLE_WORKER = "session-worker"

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
# One container: its attach stream and the WorkerHandle the session core drives
# ---------------------------------------------------------------------------------------------
class _Demux:
    """Docker's attach stream without a TTY: each chunk has an 8-byte header (stream id, length).

    Fed the raw bytes read from the socket, it returns the stdout bytes (the protocol) and keeps
    the tail of stderr for error messages.
    """

    HEADER = struct.Struct(">BxxxI")

    def __init__(self) -> None:
        self._pending = bytearray()
        self.stderr: deque[bytes] = deque(maxlen=64)

    def __call__(self, data: bytes) -> bytes:
        self._pending += data
        out = bytearray()
        size_of = self.HEADER.size
        while len(self._pending) >= size_of:
            stream, size = self.HEADER.unpack_from(self._pending)
            if len(self._pending) < size_of + size:
                break
            payload = bytes(self._pending[size_of : size_of + size])
            del self._pending[: size_of + size]
            if stream == 1:
                out += payload
            else:
                self.stderr.append(payload)
        return bytes(out)

    def stderr_tail(self) -> str:
        return b"".join(self.stderr).decode("utf-8", "backslashreplace")[-2000:]


class DockerWorker:
    """A started container whose stdin/stdout carry the worker protocol (a ``WorkerHandle``)."""

    def __init__(self, launcher: DockerLauncher, container: Any, raw: Any) -> None:
        self.launcher = launcher
        self.container = container
        self.id: str = container.id
        self._raw = raw  # the SDK's wrapper owns the socket: keep it alive as long as we read it
        self.sock: socket.socket = getattr(raw, "_sock", raw)
        self.demux = _Demux()
        self.channel = WorkerChannel(self.sock.fileno(), self.sock.fileno(), decode=self.demux)
        self._killed = False
        self._stopped_by: str | None = None
        self._lock = threading.Lock()

    def alive(self) -> bool:
        return not self._killed and "exit_code" not in self.launcher.exit_info(self.id, 0.0)

    def wait_exit(self, timeout_s: float) -> int | None:
        # The engine's die event can trail the end of the stream by a moment.
        return self.launcher.exit_info(self.id, max(timeout_s, 2.0)).get("exit_code")

    def oom_killed(self) -> bool:
        return bool(self.launcher.exit_info(self.id, 0.0).get("oom"))

    def terminate(self, reason: str) -> None:
        with self._lock:
            if self._killed:
                return
            self._stopped_by = reason
        with contextlib.suppress(Exception):
            self.container.kill()

    def lost_reason(self) -> str | None:
        return self._stopped_by

    def kill(self) -> None:
        """Remove the container; safe to call twice and after a crash (it may have auto-removed)."""
        with self._lock:
            if self._killed:
                return
            self._killed = True
        with contextlib.suppress(Exception):
            self.sock.close()
        with contextlib.suppress(Exception):
            self.container.remove(force=True)  # may race auto-remove: NotFound / 409 are fine
        self.launcher.forget(self.id)


# ---------------------------------------------------------------------------------------------
# The launcher: containers for the shared pool
# ---------------------------------------------------------------------------------------------
class DockerLauncher:
    """Starts one container per worker; the engine's events say how each one ended."""

    def __init__(
        self,
        image: str,
        *,
        cpus: float,
        start_timeout_s: float,
        runtime: str | None,
        client: Any,
        reap_orphans: bool,
    ) -> None:
        if not 0 < cpus <= 1024:
            raise ValueError(f"cpus must be in (0, 1024], got {cpus}")
        self.image = image
        self.cpus = float(cpus)
        self.start_timeout_s = start_timeout_s
        self.runtime = runtime
        self.client = client if client is not None else _connect()
        self._check_image()
        self.owner = owner_label()
        self.started = 0
        self.removed = 0
        self._exits: dict[str, dict[str, Any]] = {}
        self._wake = threading.Condition()
        self._events = _EngineEvents(self.client, self.owner, self._record_exit)
        if reap_orphans:
            reap_orphans_now(self.client)

    def _check_image(self) -> None:
        import docker.errors

        try:
            self.client.images.get(self.image)
        except docker.errors.ImageNotFound as exc:
            raise SandboxUnavailable(
                f"Docker image {self.image!r} not found; build it with "
                f"`docker compose build sandbox` or `docker build -f sandbox/Dockerfile -t {self.image} .` "
                "(docs/docker.md covers machines without a registry)"
            ) from exc
        except docker.errors.DockerException as exc:
            raise SandboxUnavailable(f"cannot query the Docker engine: {exc}") from exc

    def create_kwargs(self, limits: Limits) -> dict[str, Any]:
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
            "labels": {LABEL_ROLE: ROLE_WORKER, LABEL_OWNER: self.owner},
            **container_kwargs(limits, self.cpus),
        }
        if self.runtime:
            kwargs["runtime"] = self.runtime
        return kwargs

    def spawn(self, limits: Limits, background: bool = False) -> DockerWorker:
        import docker.errors

        container = None
        try:
            container = self.client.containers.create(self.image, **self.create_kwargs(limits))
            # Attach before start so not a byte of the worker's output is missed.
            raw = self.client.api.attach_socket(
                container.id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
            )
            worker = DockerWorker(self, container, raw)
            container.start()
            with self._wake:
                self.started += 1
            ready = worker.channel.recv(self.start_timeout_s)
            if ready.get("op") != "ready":
                raise SandboxUnavailable(f"worker sent {ready!r} instead of ready")
            return worker
        except (docker.errors.DockerException, ChannelError, OSError, ValueError) as exc:
            if container is not None:
                with contextlib.suppress(Exception):
                    container.remove(force=True)
            raise SandboxUnavailable(
                f"could not start a sandbox container from {self.image!r}: {exc}"
            ) from exc

    def _record_exit(self, container_id: str, key: str, value: Any) -> None:
        with self._wake:
            self._exits.setdefault(container_id, {})[key] = value
            self._wake.notify_all()

    def exit_info(self, container_id: str, wait_s: float) -> dict[str, Any]:
        """The container's exit code and OOM flag from the engine's events, waiting up to ``wait_s``."""
        deadline = time.monotonic() + wait_s
        with self._wake:
            while "exit_code" not in self._exits.get(container_id, {}):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._wake.wait(left)
            return dict(self._exits.get(container_id, {}))

    def forget(self, container_id: str) -> None:
        with self._wake:
            self.removed += 1
            self._exits.pop(container_id, None)

    def close(self) -> None:
        self._events.close()


# ---------------------------------------------------------------------------------------------
# The backend: the shared sandbox front over the Docker launcher
# ---------------------------------------------------------------------------------------------
@dataclass
class DockerSandboxStats:
    """Counters for benchmarks and tests: how sessions got their containers."""

    warm_hits: int = 0
    cold_starts: int = 0
    containers_started: int = 0
    containers_removed: int = 0


class DockerSandbox(PooledSandbox):
    """Sessions in containers: ``with DockerSandbox().session() as s: s.run("print(1)")``.

    ``session(**limits)`` takes the same limit names as LocalSandbox (see sandbox.limits.Limits);
    requests above ``max_limits`` raise LimitError. ``pool_size`` containers with the default
    limits are kept started and ready; a session whose per-session limits differ starts its own
    container (a cold start). Needs a reachable Docker engine and the sandbox image (see
    docs/docker.md). ``maxima`` is the older name of ``max_limits``.
    """

    def __init__(
        self,
        image: str = DEFAULT_IMAGE,
        *,
        pool_size: int = 2,
        limits: Limits = DEFAULT_LIMITS,
        max_limits: Limits | None = None,
        maxima: Limits | None = None,
        cpus: float = 1.0,
        start_timeout_s: float = 60.0,
        runtime: str | None = None,
        reap_orphans: bool = True,
        client: Any = None,
        batch_concurrency: int = 8,
    ) -> None:
        if pool_size < 0:
            raise ValueError(f"pool_size must be >= 0, got {pool_size}")
        self.image = image
        self.pool_size = pool_size
        launcher = DockerLauncher(
            image,
            cpus=cpus,
            start_timeout_s=start_timeout_s,
            runtime=runtime,
            client=client,
            reap_orphans=reap_orphans,
        )
        # A fixed-size pool with at most two containers starting at once: a container is much
        # heavier than a bubblewrap worker, and the engine serialises much of its start anyway.
        super().__init__(
            launcher,
            limits=limits,
            max_limits=max_limits or maxima,
            pool_size=pool_size,
            batch_concurrency=batch_concurrency,
            max_size=pool_size,
            max_starting=max(1, min(pool_size, 2)),
        )
        self.docker_launcher = launcher

    @property
    def maxima(self) -> Limits:
        return self.max_limits

    @property
    def stats(self) -> DockerSandboxStats:
        pool, launcher = self.pool, self.docker_launcher
        return DockerSandboxStats(pool.warm_hits, pool.cold_starts, launcher.started, launcher.removed)

    def wait_warm(self, timeout_s: float = 120.0) -> None:
        """Block until the pool is full (benchmarks and tests use this to measure warm starts)."""
        deadline = time.monotonic() + timeout_s
        while not self.pool.wait_ready(self.pool_size, timeout_s=0.5):
            if self.pool.spawn_failures and self.pool.last_error:
                raise SandboxUnavailable(f"the warm pool cannot start containers: {self.pool.last_error}")
            if time.monotonic() > deadline:
                raise SandboxUnavailable(f"the warm pool did not fill within {timeout_s:g} s")

    def container_ids(self) -> list[str]:
        """Ids of every container this backend holds (warm ones, then the sessions')."""
        in_use = [s.worker_id for s in self.sessions.values()]
        return self.pool.warm_ids() + sorted(cid for cid in in_use if cid is not None)

    def close(self) -> None:
        """Remove every container this backend started; running cells are cancelled."""
        super().close()
        self.docker_launcher.close()


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
