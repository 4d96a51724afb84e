"""The HTTP service through FastAPI's TestClient: API, bad input, overload, auth, expiry, /run_code."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from sandbox import LocalSandbox
from sandbox.http.server import create_app
from sandbox.http.settings import SandboxSettings
from tests.sandbox.conftest import need_bwrap


@pytest.fixture(scope="module")
def box() -> Iterator[LocalSandbox]:
    need_bwrap()
    b = LocalSandbox(pool_size=2, isolation="bwrap")
    yield b
    b.close()


def make_client(box: LocalSandbox, **settings: object) -> TestClient:
    return TestClient(create_app(SandboxSettings(**settings), sandbox=box))


@pytest.fixture
def api(box: LocalSandbox) -> Iterator[TestClient]:
    with make_client(box) as c:
        yield c


def test_session_lifecycle(api: TestClient) -> None:
    r = api.post("/v1/sessions", json={"limits": {"memory_mb": 512}})
    assert r.status_code == 201
    sid = r.json()["id"]
    assert r.json()["limits"]["memory_mb"] == 512
    assert api.post(f"/v1/sessions/{sid}/execute", json={"code": "x = 41"}).json()["ok"]
    out = api.post(f"/v1/sessions/{sid}/execute", json={"code": "print(x + 1)\nx"}).json()
    assert out["stdout"] == "42\n" and out["value"] == "41"
    assert api.get(f"/v1/sessions/{sid}").json()["executions"] == 2
    assert api.delete(f"/v1/sessions/{sid}").status_code == 204
    assert api.post(f"/v1/sessions/{sid}/execute", json={"code": "1"}).status_code == 404


def test_one_shot_and_batch(api: TestClient) -> None:
    r = api.post("/v1/execute", json={"code": "print('hi')", "timeout_s": 5}).json()
    assert r["stdout"] == "hi\n" and r["ok"]
    b = api.post("/v1/batch", json={"programs": [{"code": f"print({i})"} for i in range(5)]}).json()
    assert [x["stdout"] for x in b["results"]] == [f"{i}\n" for i in range(5)]


def test_timeout_over_http_restarts_session(api: TestClient) -> None:
    sid = api.post("/v1/sessions", json={}).json()["id"]
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "while True: pass", "timeout_s": 0.3}).json()
    assert r["timed_out"] and r["limit"] == "wall_time" and r["session_restarted"]
    assert api.post(f"/v1/sessions/{sid}/execute", json={"code": "1+1"}).json()["value"] == "2"
    api.delete(f"/v1/sessions/{sid}")


@pytest.mark.parametrize(
    ("kwargs", "status", "needle"),
    [
        ({"content": b"{not json"}, 422, ""),
        ({"json": {"code": 3}}, 422, "string"),
        ({"json": {}}, 422, "code"),
        ({"json": {"code": "1", "language": "ruby"}}, 422, "python"),
        ({"json": {"code": "1", "limits": {"memory_mb": -5}}}, 422, "must be > 0"),
        ({"json": {"code": "1", "limits": {"memory_mb": 10**9}}}, 422, "maximum"),
        # A worker cannot start with 1 descriptor (true is 1 to pydantic): found by the schema fuzz.
        ({"json": {"code": "1", "limits": {"open_files": True}}}, 422, "least a sandbox worker needs"),
        ({"json": {"code": "1", "timeout_s": 1e9}}, 422, "maximum"),
        ({"json": {"code": "1", "limits": {"bogus": 1}}}, 422, ""),
        ({"json": {"code": "x" * 5000}}, 413, "limit"),
    ],
)
def test_bad_input_is_4xx_with_message(box: LocalSandbox, kwargs: dict, status: int, needle: str) -> None:
    with make_client(box, max_code_bytes=4096) as c:
        r = c.post("/v1/execute", headers={"content-type": "application/json"}, **kwargs)
        assert r.status_code == status, r.text
        assert needle in r.text
        assert c.post("/v1/execute", json={"code": "1+1"}).json()["value"] == "2"


def test_unknown_session_and_session_only_limits(api: TestClient) -> None:
    assert api.post("/v1/sessions/nope/execute", json={"code": "1"}).status_code == 404
    assert api.delete("/v1/sessions/nope").status_code == 404
    sid = api.post("/v1/sessions", json={}).json()["id"]
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "1", "limits": {"memory_mb": 10}})
    assert r.status_code == 422 and "fixed" in r.text
    api.delete(f"/v1/sessions/{sid}")


def test_session_cap_answers_429(box: LocalSandbox) -> None:
    with make_client(box, max_sessions=1) as c:
        first = c.post("/v1/sessions", json={})
        assert first.status_code == 201
        r = c.post("/v1/sessions", json={})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        c.delete(f"/v1/sessions/{first.json()['id']}")
        assert c.post("/v1/sessions", json={}).status_code == 201
        for s in list(box.sessions.values()):
            s.close()


def test_queue_cap_answers_429_without_hanging(box: LocalSandbox) -> None:
    import threading

    with make_client(box, max_queued_executions=1) as c:
        slow = threading.Thread(
            target=lambda: c.post("/v1/execute", json={"code": "import time; time.sleep(1.5)"})
        )
        slow.start()
        time.sleep(0.4)
        t = time.monotonic()
        r = c.post("/v1/execute", json={"code": "1"})
        assert r.status_code == 429 and "Retry-After" in r.headers
        assert time.monotonic() - t < 1.0
        slow.join()
        assert c.post("/v1/execute", json={"code": "1+1"}).json()["value"] == "2"


def test_idle_sessions_expire(box: LocalSandbox) -> None:
    app = create_app(SandboxSettings(session_idle_timeout_s=0.2), sandbox=box)
    with TestClient(app) as c:
        sid = c.post("/v1/sessions", json={}).json()["id"]
        time.sleep(0.5)  # the expiry loop runs every idle_timeout / 4
        assert c.post(f"/v1/sessions/{sid}/execute", json={"code": "1"}).status_code == 404
        assert "sandbox_sessions_expired_total 1.0" in c.get("/metrics").text


def test_auth_token_required_when_configured(box: LocalSandbox) -> None:
    with make_client(box, auth_token="s3cret") as c:
        assert c.post("/v1/execute", json={"code": "1"}).status_code == 401
        bad = c.post("/v1/execute", json={"code": "1"}, headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401
        ok = c.post("/v1/execute", json={"code": "1+1"}, headers={"Authorization": "Bearer s3cret"})
        assert ok.json()["value"] == "2"
        assert c.get("/healthz").status_code == 200  # probes stay open


def test_non_loopback_bind_requires_token() -> None:
    with pytest.raises(ValueError, match="requires an auth token"):
        SandboxSettings(host="0.0.0.0")
    assert SandboxSettings(host="0.0.0.0", auth_token="t").host == "0.0.0.0"
    s = SandboxSettings.from_env({"SANDBOX_AUTH_TOKEN": "tok", "SANDBOX_POOL_SIZE": "3"}, host="0.0.0.0")
    assert s.auth_token is not None and s.auth_token.get_secret_value() == "tok" and s.pool_size == 3


def test_sandbox_reuse_can_be_turned_off_from_the_environment() -> None:
    from sandbox.http.server.state import _launch_config

    assert _launch_config(SandboxSettings.from_env({})).recycle
    assert not _launch_config(SandboxSettings.from_env({"SANDBOX_RECYCLE": "false"})).recycle


def test_run_code_sandboxfusion_shape(api: TestClient) -> None:
    ok = api.post("/run_code", json={"code": "print(input())", "language": "python", "stdin": "hey\n"}).json()
    assert ok["status"] == "Success" and ok["run_result"]["status"] == "Finished"
    assert ok["run_result"]["stdout"] == "hey\n" and ok["run_result"]["return_code"] == 0
    files = {"a.txt": base64.b64encode(b"data").decode()}
    r = api.post(
        "/run_code", json={"code": "print(open('a.txt').read())", "language": "python", "files": files}
    )
    assert r.json()["run_result"]["stdout"] == "data\n"
    err = api.post("/run_code", json={"code": "1/0", "language": "python"}).json()
    assert err["status"] == "Failed" and err["run_result"]["return_code"] == 1
    assert "ZeroDivisionError" in err["run_result"]["stderr"]
    tle = api.post(
        "/run_code", json={"code": "while True: pass", "language": "python", "run_timeout": 0.5}
    ).json()
    assert tle["status"] == "Failed" and tle["run_result"]["status"] == "TimeLimitExceeded"
    ex = api.post("/run_code", json={"code": "import sys; sys.exit(3)", "language": "python"}).json()
    assert ex["run_result"]["return_code"] == 3 and ex["status"] == "Failed"
    mem = api.post(
        "/run_code", json={"code": "b = bytearray(300 << 20)", "language": "python", "memory_limit_MB": 128}
    )
    assert mem.json()["status"] == "Failed"
    assert api.post("/run_code", json={"code": "1", "language": "cobol"}).status_code == 400


def test_health_readiness_metrics_docs(api: TestClient) -> None:
    assert api.get("/healthz").json() == {"status": "ok"}
    ready = api.get("/readyz")
    assert ready.status_code == 200 and ready.json()["isolation"] == "bwrap"
    api.post("/v1/execute", json={"code": "1"})
    text = api.get("/metrics").text
    assert 'sandbox_executions_total{endpoint="execute",outcome="ok"}' in text
    assert "sandbox_execution_seconds_bucket" in text
    assert "/v1/sessions/{session_id}/execute" in api.get("/openapi.json").text


def test_oversized_body_is_refused_before_it_is_read(box: LocalSandbox) -> None:
    with make_client(box, max_code_bytes=1000) as api:
        big = b'{"code": "' + b"x" * (5 << 20) + b'"}'  # over the ~4 MiB body cap of this setting
        r = api.post("/v1/execute", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "request body too large" in r.json()["detail"]
        assert api.get("/healthz").status_code == 200


def test_session_execute_fast_path_agrees_with_the_full_route(box: LocalSandbox, monkeypatch) -> None:
    """Plain requests skip FastAPI's machinery (server/fastpath.py); anything else must not."""
    from sandbox.http.server import fastpath

    delegated: list[bytes] = []
    full_route = fastpath._FastSessionExecute._delegate

    async def counting(self, scope, receive, send, body):  # type: ignore[no-untyped-def]
        delegated.append(body)
        await full_route(self, scope, receive, send, body)

    monkeypatch.setattr(fastpath._FastSessionExecute, "_delegate", counting)
    with make_client(box, max_code_bytes=4096, auth_token="tok") as c:
        auth = {"Authorization": "Bearer tok"}
        sid = c.post("/v1/sessions", json={}, headers=auth).json()["id"]
        url = f"/v1/sessions/{sid}/execute"
        plain = c.post(url, json={"code": "x = 6\nx * 7", "limits": {}, "timeout_s": 5}, headers=auth)
        assert delegated == []
        coerced = c.post(url, json={"code": "x * 7", "want_value": 1}, headers=auth)  # the full route
        assert len(delegated) == 1
        assert plain.status_code == coerced.status_code == 200
        a, b = plain.json(), coerced.json()
        assert a["value"] == b["value"] == "42" and set(a) == set(b)
        assert c.post(url, json={"code": "1"}).status_code == 401
        assert c.post(url, json={"code": "1"}, headers={"Authorization": "Bearer no"}).status_code == 401
        assert c.post(url, json={"code": "x" * 5000}, headers=auth).status_code == 413
        r = c.post(url, json={"code": "1", "timeout_s": 1e9}, headers=auth)
        assert r.status_code == 422 and "maximum" in r.text
        assert c.post(url, json={"code": "1", "want_value": "maybe"}, headers=auth).status_code == 422
        assert c.post(url, json={"code": "1", "bogus": 1}, headers=auth).status_code == 422
        r = c.post(url, content=b"x = 1", headers={**auth, "content-type": "text/plain"})
        assert r.status_code == 422
        assert c.post("/v1/sessions/nope/execute", json={"code": "1"}, headers=auth).status_code == 404
        assert c.get(url, headers=auth).status_code == 405
        metrics = c.get("/metrics", headers=auth).text
        assert 'sandbox_executions_total{endpoint="session",outcome="ok"} 2.0' in metrics
        c.delete(f"/v1/sessions/{sid}", headers=auth)
