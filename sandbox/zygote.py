"""One-shot Python programs from a zygote: a warm, sandboxed interpreter that forks per request.

A one-shot through a pooled worker costs a whole worker start (bubblewrap's namespaces, an
interpreter boot) plus the program's own interpreter: ~26 ms of CPU. The zygote pays those once. It
is started exactly like a worker (``Launcher``: bubblewrap, its own uid, memory and pid cgroups,
no network, ``--die-with-parent``) and then, for each request, clones one process into fresh
user/mount/pid/ipc/uts namespaces with its own tmpfs scratch, rlimits and no capabilities, inside
the network namespace of one of ``slots`` slots (kept across requests, one request at a time),
which runs the program as pid 1 of its namespace while the zygote feeds its stdin, keeps its output
and enforces its timeout. Programs are cloned from per-slot holders started before any request, so
none inherits memory that held another request's data (sandbox/zygote_main.py explains the design
and what each step guards).

What is shared between concurrent requests, unlike separate workers: the host uid (the per-request
RLIMIT_NPROC is counted in the request's own user namespace, the zygote's pid cgroup caps them
all), and the zygote's memory and pid cgroups (sized for ``slots`` requests at their limits). A
memory hog is stopped by its own RLIMIT_AS long before the cgroup. Only Python programs without
``files`` go through the zygote; the rest keep the worker path.

Failure handling: if the zygote dies or its channel breaks, every pending request fails with
``SandboxUnavailable`` and the next request starts a fresh zygote.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from sandbox.bwrap.launcher import LaunchConfig, Launcher, WorkerProcess, compile_worker
from sandbox.limits import Limits
from sandbox.output_pipes import prepend_to
from sandbox.result import SandboxUnavailable
from sandbox.session.protocol import ChannelError

log = logging.getLogger("sandbox")

ZYGOTE_PATH = Path(__file__).resolve().parent / "zygote_main.py"
NAMESPACES_PATH = ZYGOTE_PATH.with_name("namespaces.py")
REPLY_GRACE_S = 10.0
"""How long past a request's own timeout the host waits for the zygote before giving up on it."""


class ZygoteLauncher(Launcher):
    """A ``Launcher`` whose "worker" program is the zygote (same bubblewrap confinement)."""

    def __init__(self, config: LaunchConfig, extra: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self.template = False  # its "worker" is the zygote, one process for many requests
        self.extra = dict(extra or {})
        self._worker_source = prepend_to(NAMESPACES_PATH.read_text() + "\n" + ZYGOTE_PATH.read_text())
        self._worker_code = compile_worker(config.python, self._worker_source)

    def worker_config(self, limits: Limits, workdir: str) -> dict[str, object]:
        return {**super().worker_config(limits, workdir), **self.extra}


def zygote_limits(limits: Limits, slots: int) -> Limits:
    """The zygote's own cgroup: room for ``slots`` concurrent requests at their per-request limits."""
    return replace(
        limits,
        memory_mb=64 + slots * (limits.memory_mb + limits.disk_mb),
        processes=8 + slots * (limits.processes + 2),
    )


class Zygote:
    """Runs one-shot Python programs in children of a sandboxed zygote; thread- and asyncio-safe."""

    def __init__(
        self,
        config: LaunchConfig,
        limits: Limits,
        slots: int = 32,
        *,
        preload: tuple[str, ...] | None = None,
        numpy: bool = False,
    ) -> None:
        if config.isolation != "bwrap":
            raise SandboxUnavailable("the zygote needs bubblewrap isolation (sandbox isolation=bwrap)")
        self.limits = limits
        self.slots = slots
        extra: dict[str, Any] = {"numpy": numpy, "slots": slots}
        if preload is not None:
            extra["preload"] = list(preload)
        self.launcher = ZygoteLauncher(config, extra)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._proc: WorkerProcess | None = None
        self._pending: dict[int, tuple[Any, Any]] = {}
        self._ids = itertools.count(1)
        self.starts = 0
        self.closed = False

    # -- lifecycle --------------------------------------------------------------------------
    def _ensure(self) -> WorkerProcess:
        """The live zygote, started (or replaced after a crash) on demand."""
        with self._lock:
            if self.closed:
                raise SandboxUnavailable("the sandbox is closed")
            proc = self._proc
            if proc is not None and proc.alive():
                return proc
            if proc is not None:
                self._fail_all(proc, "the zygote died; starting a new one")
            proc = self.launcher.spawn(zygote_limits(self.limits, self.slots))
            self._proc = proc
            self.starts += 1
            threading.Thread(target=self._read_loop, args=(proc,), name="sandbox-zygote", daemon=True).start()
            return proc

    def start(self) -> None:
        self._ensure()

    @property
    def pid(self) -> int | None:
        """The zygote's bubblewrap process on the host (for tests and metrics)."""
        proc = self._proc
        return None if proc is None else proc.proc.pid

    def close(self) -> None:
        with self._lock:
            self.closed = True
            proc, self._proc = self._proc, None
        if proc is not None:
            self._fail_all(proc, "the sandbox is closed")
            proc.kill()

    def _fail_all(self, proc: WorkerProcess, why: str) -> None:
        with self._send_lock:
            pending = [v for v in self._pending.values() if v[0] is proc]
            self._pending = {k: v for k, v in self._pending.items() if v[0] is not proc}
        for _, deliver in pending:
            deliver({"error": why, "unavailable": True})
        proc.kill()

    def _read_loop(self, proc: WorkerProcess) -> None:
        """Hand each reply to its waiter; on a broken channel fail them all and drop the zygote."""
        channel = proc.channel
        try:
            while True:
                reply = channel.recv(None)
                with self._send_lock:
                    waiter = self._pending.pop(reply.get("id"), None)
                if waiter is not None:
                    waiter[1](reply)
        except (ChannelError, OSError, ValueError) as e:
            if not self.closed:
                log.warning("sandbox/zygote: the zygote's channel broke (%s); it will be replaced", e)
            with self._lock:
                if self._proc is proc:
                    self._proc = None
            self._fail_all(proc, f"the zygote died mid-request ({e})")

    # -- requests ---------------------------------------------------------------------------
    def request(self, run: dict[str, Any]) -> dict[str, Any]:
        """The frame sent to the zygote for ``run`` (code, stdin, timeout_s, output_bytes, fetch)."""
        lim = self.limits
        return {
            "op": "run",
            "code": run["code"],
            "stdin": run.get("stdin") or "",
            "timeout_s": float(run["timeout_s"]),
            "output_bytes": int(run.get("output_bytes", lim.output_bytes)),
            "memory_bytes": int(run.get("memory_mb", lim.memory_mb)) << 20,
            "nproc": lim.processes,
            "fsize_bytes": lim.file_size_mb << 20,
            "nofile": lim.open_files,
            "cpu_s": float(run.get("cpu_s", lim.cpu_s)),
            "disk_bytes": lim.disk_mb << 20,
            "fetch_files": list(run.get("fetch_files") or ()),
            "fetch_bytes": int(run.get("fetch_bytes", 8 << 20)),
        }

    def _submit(self, run: dict[str, Any], deliver: Any) -> None:
        frame = self.request(run)
        proc = self._ensure()
        with self._send_lock:
            rid = next(self._ids)
            self._pending[rid] = (proc, deliver)
            try:
                proc.channel.send({**frame, "id": rid})
            except ChannelError as e:
                self._pending.pop(rid, None)
                raise SandboxUnavailable(f"cannot reach the zygote: {e}") from e

    def _cancel(self, run: dict[str, Any]) -> None:
        """A reply overdue by REPLY_GRACE_S: the zygote is wedged; replace it."""
        proc = self._proc
        if proc is not None:
            log.error("sandbox/zygote: no reply %.0f s past a request's timeout; replacing it", REPLY_GRACE_S)
            with self._lock:
                if self._proc is proc:
                    self._proc = None
            self._fail_all(proc, "the zygote stopped answering")

    def run(self, **run: Any) -> dict[str, Any]:
        """Blocking: the driver-style report (``{"compile", "run", "files", "missing"}``)."""
        done = threading.Event()
        box: list[dict[str, Any]] = []

        def deliver(reply: dict[str, Any]) -> None:
            box.append(reply)
            done.set()

        self._submit(run, deliver)
        if not done.wait(float(run["timeout_s"]) + REPLY_GRACE_S):
            self._cancel(run)
            done.wait(5)
        return _report(box[0] if box else {"error": "no reply", "unavailable": True})

    async def run_async(self, **run: Any) -> dict[str, Any]:
        """``run`` for the event loop: no thread is held while the program runs."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()

        def deliver(reply: dict[str, Any]) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(reply))

        self._submit(run, deliver)
        try:
            reply = await asyncio.wait_for(asyncio.shield(fut), float(run["timeout_s"]) + REPLY_GRACE_S)
        except asyncio.TimeoutError:
            self._cancel(run)
            reply = {"error": "no reply", "unavailable": True}
        return _report(reply)

    def ping(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The zygote's own answer (``running``: requests in flight), through the same channel."""
        done = threading.Event()
        box: list[dict[str, Any]] = []
        proc = self._ensure()
        with self._send_lock:
            rid = next(self._ids)
            self._pending[rid] = (proc, lambda r: (box.append(r), done.set()))
            proc.channel.send({"op": "ping", "id": rid})
        if not done.wait(timeout_s):
            raise SandboxUnavailable("the zygote did not answer a ping")
        return box[0]


def _report(reply: dict[str, Any]) -> dict[str, Any]:
    if "report" in reply:
        return reply["report"]
    raise SandboxUnavailable(f"zygote: {reply.get('error', 'no report')}")


def zygote_available() -> bool:
    """Whether this host can run the zygote at all (bubblewrap present, Linux)."""
    from sandbox.bwrap.launcher import bwrap_path

    return bwrap_path() is not None and os.uname().sysname == "Linux"
