"""Client and AsyncClient against a real uvicorn server on a loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from sandbox import AsyncClient, Client, LocalSandbox, SandboxUnavailable
from sandbox.http.client import RemoteSession, SandboxRequestError
from sandbox.http.server import create_app
from sandbox.http.settings import SandboxSettings
from tests.sandbox.conftest import need_bwrap


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app: object) -> Iterator[str]:
    """``app`` under a real uvicorn server on a free loopback port; yields its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(30)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    need_bwrap()
    settings = SandboxSettings(pool_size=2, isolation="bwrap", auth_token="tok")
    with serving(create_app(settings)) as u:
        yield u


def test_sync_client_session_shape(url: str) -> None:
    with Client(url, token="tok") as c:
        with c.session() as s:
            s.run("x = 41")
            r = s.run("print(x + 1)")
        assert r.stdout == "42\n" and r.ok and r.duration_s > 0
        assert c.run("print(1)").stdout == "1\n"
        assert [r.stdout for r in c.run_batch(["print(1)", "print(2)"])] == ["1\n", "2\n"]
        with pytest.raises(SandboxRequestError) as e:
            c.run("1", memory_mb=-1)
        assert e.value.status == 422


def test_wrong_token_and_unreachable_server(url: str) -> None:
    with Client(url, token="wrong") as c, pytest.raises(SandboxRequestError):
        c.run("1")
    with Client(f"http://127.0.0.1:{free_port()}") as c, pytest.raises(SandboxUnavailable):
        c.run("1")


async def test_async_client(url: str) -> None:
    async with AsyncClient(url, token="tok") as c:
        async with c.session() as s:
            await s.run("y = 2")
            r = await s.run("y * 21")
        assert r.value == "42"
        results = await asyncio.gather(*(c.run(f"print({i})") for i in range(8)))
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(8)]


def test_client_replaces_a_connection_the_server_closed_while_idle() -> None:
    """Keep-alive expiry on the server side must not fail the next request."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: list[socket.socket] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive

        def do_GET(self) -> None:
            seen.append(self.connection)
            body = b'{"status": "ok"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with Client(f"http://127.0.0.1:{server.server_port}") as c:
            assert c.healthy() and c.healthy()
            assert seen[0] is seen[1]  # the connection was kept alive and reused
            seen[0].shutdown(socket.SHUT_RDWR)  # the server drops it while the client holds it idle
            time.sleep(0.05)
            assert c.healthy()
            assert len(seen) == 3 and seen[2] is not seen[0]
            # A process with many descriptors open (a trainer: model files, Ray) puts the pooled
            # socket above 1024, where select() cannot look at it.
            import resource

            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            if soft < 1100 <= hard:
                resource.setrlimit(resource.RLIMIT_NOFILE, (1100, hard))
            while c._http._idle:  # so that the next request opens a new socket, above 1024
                c._http._idle.pop()[0].close()
            spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(1030)]
            try:
                assert c.healthy() and c.healthy()  # a fresh socket above 1024, then reused
                assert c._http._idle[0][0].sock.fileno() > 1024
            finally:
                for fd in spare:
                    os.close(fd)
                if soft < 1100 <= hard:
                    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    finally:
        server.shutdown()


def test_an_idempotent_request_is_resent_once_after_a_keep_alive_reset() -> None:
    """The server closes a kept-alive connection just as the client reuses it (keep-alive expiry):
    a GET or DELETE goes out again on a fresh connection; an execution (POST) is never re-sent."""
    import struct
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: list[tuple[str, int]] = []  # (method, request number on its connection)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def handle_one_request_(self, method: str) -> None:
            n = getattr(self, "count", 0) + 1
            self.count = n
            seen.append((method, n))
            if n == 2:  # read the request, then reset the connection without answering
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()
                return
            body = b'{"id": "s1"}'
            self.send_response(200 if method != "DELETE" else 204)
            self.send_header("Content-Length", str(len(body)) if method != "DELETE" else "0")
            self.end_headers()
            if method != "DELETE":
                self.wfile.write(body)

        def do_GET(self) -> None:
            self.handle_one_request_("GET")

        def do_DELETE(self) -> None:
            self.handle_one_request_("DELETE")

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.handle_one_request_("POST")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with Client(f"http://127.0.0.1:{server.server_port}", retries=0) as c:
            assert c._request("GET", "/v1/sessions/s1") == {"id": "s1"}
            assert c._request("GET", "/v1/sessions/s1") == {"id": "s1"}  # reset, then re-sent
            assert seen == [("GET", 1), ("GET", 2), ("GET", 1)]
            with pytest.raises(SandboxUnavailable):
                c.run("1")  # a POST, second on the new connection, reset: never re-sent
            assert seen[3:] == [("POST", 2)]
            c._request("GET", "/x")  # a fresh connection, kept alive
            RemoteSession(c, "s1").close()  # DELETE, second on it: reset, then re-sent
            assert seen[4:] == [("GET", 1), ("DELETE", 2), ("DELETE", 1)]
    finally:
        server.shutdown()


def test_sessions_spread_over_comma_separated_replicas_and_stay_on_theirs() -> None:
    need_bwrap()
    boxes = [LocalSandbox(pool_size=0, isolation="bwrap") for _ in range(2)]
    try:
        with serving(create_app(SandboxSettings(), sandbox=boxes[0])) as a, serving(
            create_app(SandboxSettings(), sandbox=boxes[1])
        ) as b, Client(f"{a}, {b}/") as c:
            assert c.urls == [a, b] and c.healthy()
            sessions = [c.session() for _ in range(4)]
            assert [len(box.sessions) for box in boxes] == [2, 2]  # round-robin
            for i, s in enumerate(sessions):
                s.run(f"v = {i}")
            for i, s in enumerate(sessions):  # each request went to its session's replica
                assert s.run("v").value == str(i)
                s.close()
            assert [len(box.sessions) for box in boxes] == [0, 0]
            assert {c.run("print(1)").stdout for _ in range(2)} == {"1\n"}
    finally:
        for box in boxes:
            box.close()


async def _async_replicas(url: str, boxes: list[LocalSandbox]) -> None:
    async with AsyncClient(url) as c:
        assert await c.healthy()
        sessions = [await c.session() for _ in range(2)]
        assert [len(box.sessions) for box in boxes] == [1, 1]
        for i, s in enumerate(sessions):
            await s.run(f"w = {i}")
        assert [(await s.run("w")).value for s in sessions] == ["0", "1"]
        for s in sessions:
            await s.close()


def test_a_bad_replica_list_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="bad port"):
        Client("http://127.0.0.1:8080,http://h:port")
    with pytest.raises(ValueError, match="http"):
        Client("http://127.0.0.1:8080,ftp://h")
    with pytest.raises(ValueError, match="empty"):
        Client(" , ")
