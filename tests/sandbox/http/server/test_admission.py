"""Admission and exposure under concurrency: queue slots, the session cap, body caps, cancelling,
and what answers without a token."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi.testclient import TestClient

from sandbox import LocalSandbox
from sandbox.http.server import app as app_module
from sandbox.http.server import create_app
from sandbox.http.server.schemas import BatchIn
from sandbox.http.server.state import Overloaded, ServerState
from sandbox.http.settings import SandboxSettings
from tests.sandbox.conftest import need_bwrap


@pytest.fixture(scope="module")
def box() -> Iterator[LocalSandbox]:
    need_bwrap()
    b = LocalSandbox(pool_size=2, isolation="bwrap")
    yield b
    b.close()


async def _state(box: LocalSandbox, **settings: object) -> ServerState:
    state = ServerState(SandboxSettings(**settings), sandbox=box)
    await state.start()
    return state


async def test_two_batches_that_overfill_the_queue_get_200_and_429_never_500(box: LocalSandbox) -> None:
    # Both requests pass their checks before either one's programs start: before the fix both were
    # admitted, the programs that found the queue full raised, and the request failed with a 500.
    state = await _state(box, max_queued_executions=4)
    body = BatchIn.model_validate({"programs": [{"code": f"print({i})"} for i in range(3)]})
    try:
        first, second = await asyncio.gather(
            app_module.execute_batch(state, body), app_module.execute_batch(state, body), return_exceptions=True
        )
        assert isinstance(second, Overloaded), second
        results = json.loads(first.body)["results"]  # type: ignore[union-attr]
        assert [r["stdout"] for r in results] == ["0\n", "1\n", "2\n"]
        assert state.pending == 0  # every slot given back
    finally:
        await state.stop()


async def test_concurrent_creates_respect_max_sessions(box: LocalSandbox) -> None:
    state = await _state(box, max_sessions=8)
    try:
        outcomes = await asyncio.gather(
            *(app_module.create_session(state, None) for _ in range(40)), return_exceptions=True
        )
        made = [o for o in outcomes if not isinstance(o, BaseException)]
        refused = [o for o in outcomes if isinstance(o, Overloaded)]
        assert len(made) == 8 and len(refused) == 32, outcomes  # before the fix: 29 were made
        assert len(box.sessions) == 8 and state.opening == 0
    finally:
        for s in list(box.sessions.values()):
            s.close()
        await state.stop()


def test_deleting_a_busy_session_cancels_its_cell(box: LocalSandbox) -> None:
    with TestClient(create_app(SandboxSettings(), sandbox=box)) as api:
        sid = api.post("/v1/sessions", json={}).json()["id"]
        answers: list[object] = []
        cell = {"code": "import time; time.sleep(15)", "timeout_s": 20, "want_value": True}
        t = threading.Thread(target=lambda: answers.append(api.post(f"/v1/sessions/{sid}/execute", json=cell)))
        t.start()
        time.sleep(0.8)
        t0 = time.monotonic()
        assert api.delete(f"/v1/sessions/{sid}").status_code == 204
        took = time.monotonic() - t0
        t.join(5)
        assert took < 2.0, f"DELETE waited {took:.1f} s for the running cell (before the fix: ~14 s)"
        r = answers[0]
        assert r.status_code == 409 and "cancelled" in r.json()["detail"]  # type: ignore[attr-defined]


def test_docs_schema_and_readiness_details_need_the_token(box: LocalSandbox) -> None:
    with TestClient(create_app(SandboxSettings(auth_token="s3cret"), sandbox=box)) as api:
        auth = {"Authorization": "Bearer s3cret"}
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert api.get(path).status_code == 401, path
            assert api.get(path, headers=auth).status_code == 200, path
        assert "/v1/sessions/{session_id}/execute" in api.get("/openapi.json", headers=auth).text
        assert api.get("/readyz").json() == {"ready": True}  # nothing about the internals
        detailed = api.get("/readyz", headers=auth).json()
        assert detailed["ready"] and detailed["isolation"] == "bwrap" and "last_error" in detailed
        assert api.get("/healthz").json() == {"status": "ok"}


@pytest.fixture(scope="module")
def small_cap_server(box: LocalSandbox) -> Iterator[tuple[int, int]]:
    """A real uvicorn server (chunked uploads need a real HTTP stack) with a ~4 MiB body cap."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(SandboxSettings(max_code_bytes=1000), sandbox=box)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    yield port, 4 * (2 * 1000 + (1 << 20))
    server.should_exit = True
    t.join(30)


def test_a_chunked_body_over_the_cap_is_refused_while_it_streams(small_cap_server: tuple[int, int]) -> None:
    port, cap = small_cap_server
    total = 40 << 20
    chunk = b"x" * (64 << 10)
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/execute HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        pieces = [b'{"code": "'] + [chunk] * (total // len(chunk)) + [b'"}']
        try:
            for piece in pieces:
                if select.select([sock], [], [], 0)[0]:
                    break  # the server has answered: stop uploading
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                sent += len(piece)
            else:
                sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:300]
    assert b"request body too large" in body  # not "code is N bytes": refused before it was parsed
    # The cap is ~4 MiB; loopback socket buffers hold several more MiB of what was sent.
    assert sent < total // 2, f"{sent} of {total} bytes went out before the refusal (cap {cap})"
