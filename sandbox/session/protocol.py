"""Driver side of the worker protocol: frames over a pipe pair, with deadlines.

The worker (``sandbox/worker.py``, documented at its top) reads requests on its stdin and writes
replies on its stdout. Each message is a 4-byte big-endian length followed by that many bytes of
UTF-8 JSON. ``WorkerChannel`` is the reusable half that speaks it over any pair of file
descriptors: LocalSandbox gives it the pipes of a bubblewrap process, and DockerSandbox the attach
socket of a container, with a ``decode`` hook that strips Docker's stream headers. ``exec_request`` and ``result_from_reply`` translate between that wire
format and :class:`~sandbox.result.ExecResult`.

Typical use::

    ch = WorkerChannel(read_fd=proc.stdout.fileno(), write_fd=proc.stdin.fileno())
    ch.recv(timeout_s=10)                        # {"op": "ready", ...}
    reply = ch.request(exec_request("print(1)", limits), timeout_s=limits.wall_s)
    result = result_from_reply(reply)

Errors: ``ChannelTimeout`` (no reply before the deadline: the caller should kill the worker),
``ChannelClosed`` (the worker died), ``ProtocolError`` (garbage on the wire). All are
``ChannelError``.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import struct
import time
from collections.abc import Callable
from typing import Any

from sandbox.limits import Limits
from sandbox.result import ExecError, ExecResult

HEADER = struct.Struct(">I")
MAX_FRAME = 256 * 1024 * 1024


class ChannelError(Exception):
    """The worker channel cannot deliver a reply."""


class ChannelTimeout(ChannelError):
    pass


class ChannelClosed(ChannelError):
    pass


class ProtocolError(ChannelError):
    pass


def encode_frame(obj: dict[str, Any]) -> bytes:
    body = json.dumps(obj, ensure_ascii=False).encode("utf-8", "backslashreplace")
    return HEADER.pack(len(body)) + body


class WorkerChannel:
    """One request/one reply over a pair of file descriptors; not thread-safe (lock per session)."""

    def __init__(
        self, read_fd: int, write_fd: int, decode: Callable[[bytes], bytes] | None = None
    ) -> None:
        """``decode`` turns raw bytes read into protocol bytes (a container's stdout, demultiplexed)."""
        self.read_fd = read_fd
        self.write_fd = write_fd
        self._decode = decode
        self._buf = bytearray()
        self._next_id = 0
        os.set_blocking(read_fd, False)  # also the write side when both are one socket
        self._poll = select.poll()
        self._poll.register(read_fd, select.POLLIN | select.POLLHUP | select.POLLERR)

    def send(self, obj: dict[str, Any]) -> None:
        data = memoryview(encode_frame(obj))
        while data:
            try:
                n = os.write(self.write_fd, data)
            except InterruptedError:
                continue
            except BlockingIOError:  # a non-blocking socket whose buffer is full
                self._wait_writable()
                continue
            except OSError as e:
                raise ChannelClosed(f"worker closed its input: {e}") from e
            data = data[n:]

    def _wait_writable(self, timeout_s: float = 30.0) -> None:
        poll = select.poll()
        poll.register(self.write_fd, select.POLLOUT)
        if not poll.poll(int(timeout_s * 1000)):
            raise ChannelTimeout(f"the worker read none of its input for {timeout_s:g} s")

    def recv(self, timeout_s: float | None) -> dict[str, Any]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            frame = self._take_frame()
            if frame is not None:
                return frame
            wait_ms = None
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ChannelTimeout("no reply before the deadline")
                wait_ms = max(1, int(left * 1000))
            if not self._poll.poll(wait_ms):
                continue
            self._fill()

    def request(self, obj: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
        self._next_id += 1
        obj = {**obj, "id": self._next_id}
        self.send(obj)
        while True:
            reply = self.recv(timeout_s)
            if reply.get("id") == self._next_id:
                return reply
            # A reply without our id came from a process the cell forked: the channel is poisoned.
            raise ProtocolError(f"unexpected reply id {reply.get('id')!r} (expected {self._next_id})")

    async def request_async(self, obj: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
        """``request`` without a thread: the event loop watches the pipe (for the HTTP server)."""
        self._next_id += 1
        want = self._next_id
        self.send({**obj, "id": want})
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()

        def on_readable() -> None:
            if fut.done():
                return
            try:
                self._fill()
                frame = self._take_frame()
            except ChannelError as e:
                fut.set_exception(e)
                return
            if frame is not None:
                if frame.get("id") == want:
                    fut.set_result(frame)
                else:
                    fut.set_exception(
                        ProtocolError(f"unexpected reply id {frame.get('id')!r} (expected {want})")
                    )

        loop.add_reader(self.read_fd, on_readable)
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError as e:
            raise ChannelTimeout("no reply before the deadline") from e
        finally:
            loop.remove_reader(self.read_fd)

    def _fill(self) -> None:
        while True:
            try:
                chunk = os.read(self.read_fd, 1 << 20)
            except BlockingIOError:
                return
            except InterruptedError:
                continue
            except OSError as e:
                raise ChannelClosed(f"worker output unreadable: {e}") from e
            if not chunk:
                raise ChannelClosed("worker exited")
            self._buf += chunk if self._decode is None else self._decode(chunk)
            if len(chunk) < (1 << 20):
                return

    def _take_frame(self) -> dict[str, Any] | None:
        if len(self._buf) < HEADER.size:
            return None
        (n,) = HEADER.unpack_from(self._buf)
        if n > MAX_FRAME:
            raise ProtocolError(f"frame of {n} bytes exceeds the {MAX_FRAME} byte maximum")
        if len(self._buf) < HEADER.size + n:
            return None
        body = bytes(self._buf[HEADER.size : HEADER.size + n])
        del self._buf[: HEADER.size + n]
        try:
            obj = json.loads(body)
        except ValueError as e:
            raise ProtocolError(f"worker sent invalid JSON: {e}") from e
        if not isinstance(obj, dict):
            raise ProtocolError("worker sent a non-object frame")
        return obj


def exec_request(
    code: str, limits: Limits, *, want_value: bool = True, stdin: str | None = None
) -> dict[str, Any]:
    return {
        "op": "exec",
        "code": code,
        "cpu_s": limits.cpu_s,
        "max_output_bytes": limits.output_bytes,
        "want_value": want_value,
        "stdin": stdin,
    }


def result_from_reply(reply: dict[str, Any], duration_s: float) -> ExecResult:
    err = reply.get("error")
    error = None
    exit_code = None
    if err:
        error = ExecError(
            type=str(err.get("type", "Error")),
            message=str(err.get("message", "")),
            traceback=str(err.get("traceback", "")),
            exit_code=err.get("exit_code"),
        )
        if error.type == "SystemExit":
            exit_code = error.exit_code
            if exit_code == 0:
                error = None  # sys.exit(0) is a clean end, as in a script
    limit = reply.get("limit")
    return ExecResult(
        stdout=reply.get("stdout", ""),
        stderr=reply.get("stderr", ""),
        value=reply.get("value"),
        error=error,
        memory_exceeded=bool(reply.get("memory_exceeded")),
        truncated=bool(reply.get("truncated")),
        limit=limit,
        duration_s=duration_s,
        cpu_s=float(reply.get("cpu_s", 0.0)),
        exit_code=exit_code,
    )
