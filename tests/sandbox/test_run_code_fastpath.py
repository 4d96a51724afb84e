"""``POST /run_code``'s fast route (sandbox/http/server/fastpath.py) against the FastAPI route.

A plain request answered by the fast route must read exactly as the FastAPI route's answer to the
same request: the route is forced with a field that ``RunCodeRequest`` ignores, which the fast
route hands over unchanged. Spies on the fast route's answer and on its hand-over make each test
fail if the request did not take the route it is meant to.
"""

from __future__ import annotations

import base64
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from sandbox import LocalSandbox
from sandbox.http.server import create_app, fastpath
from sandbox.http.settings import SandboxSettings
from sandbox.result import SandboxUnavailable

TOKEN = "fast-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FORCE_FULL_ROUTE = {"ignored_by_the_model": 1}


class Spy:
    """Counts what the fast route answered itself and what it handed to the FastAPI route."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fast = 0
        self.delegated: list[bytes] = []
        answer, delegate = fastpath.zygote_answer, fastpath._FastEndpoint._delegate

        async def counting_answer(*args: Any) -> Any:
            self.fast += 1
            return await answer(*args)

        async def counting_delegate(endpoint: Any, scope: Any, receive: Any, send: Any, body: bytes) -> None:
            if scope["path"] == "/run_code":
                self.delegated.append(body)
            await delegate(endpoint, scope, receive, send, body)

        monkeypatch.setattr(fastpath, "zygote_answer", counting_answer)
        monkeypatch.setattr(fastpath._FastEndpoint, "_delegate", counting_delegate)

    def counts(self) -> tuple[int, int]:
        return self.fast, len(self.delegated)


def make_client(sb: LocalSandbox, **settings: Any) -> TestClient:
    return TestClient(create_app(SandboxSettings(auth_token=TOKEN, **settings), sandbox=sb))


@pytest.fixture(scope="module")
def http(sb: LocalSandbox) -> Iterator[TestClient]:
    with make_client(sb) as c:
        assert c.app.state.sandbox_state.zygote is not None  # type: ignore[attr-defined]
        yield c


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    return Spy(monkeypatch)


def _timeless(text: str) -> str:
    """The answer's bytes with the measured run time (different on every run) blanked out."""
    return re.sub(r'"execution_time":[0-9.eE+-]+', '"execution_time":T', text)


def both_routes(http: TestClient, spy: Spy, body: dict[str, Any], path: str = "/run_code") -> str:
    """The answer's text, after checking the fast and the FastAPI route gave the same bytes."""
    before = spy.counts()
    fast = http.post(path, json=body, headers=AUTH)
    assert spy.counts() == (before[0] + 1, before[1]), "the fast route did not answer"
    full = http.post(path, json={**body, **FORCE_FULL_ROUTE}, headers=AUTH)
    assert spy.counts() == (before[0] + 1, before[1] + 1), "the FastAPI route did not answer"
    assert fast.status_code == full.status_code
    assert fast.headers["content-type"] == full.headers["content-type"]
    assert _timeless(fast.text) == _timeless(full.text)
    return fast.text


PLAIN = [
    {"code": "print(sum(range(10)))", "language": "python", "run_timeout": 10},
    {"code": "import sys\nprint('out')\nsys.stderr.write('err\\n')\nsys.exit(3)"},
    {"code": "raise ValueError('boom')", "compile_timeout": 10, "run_timeout": 5.5},
    {"code": "print(input()[::-1])", "stdin": "olleh", "files": {}, "fetch_files": []},
    {"code": "print('x' * (3 << 20))", "memory_limit_MB": -1},
    {"code": "print('ok')", "run_timeout": 1000, "compile_timeout": 1000, "memory_limit_MB": 10**6},
    {"code": "open('out.txt', 'w').write('hi')", "fetch_files": ["out.txt", "absent.txt"]},
    {"code": "b = bytearray(300 << 20)", "memory_limit_MB": 128, "stdin": None},
]


@pytest.mark.parametrize("body", PLAIN, ids=lambda b: b["code"][:24])
def test_plain_requests_read_the_same_from_both_routes(http: TestClient, spy: Spy, body: dict) -> None:
    answer = both_routes(http, spy, body)
    assert '"status":"SandboxError"' not in answer


def test_the_answers_compared_are_the_outcomes_they_claim(http: TestClient, spy: Spy) -> None:
    """Guards the comparison above: each outcome (stderr, exit, truncation, fetch) really occurs."""
    import json

    ok, failed, _, rev, big, clamped, fetched, mem = (json.loads(both_routes(http, spy, b)) for b in PLAIN)
    assert ok["status"] == "Success" and ok["run_result"]["stdout"] == "45\n"
    assert failed["status"] == "Failed" and failed["run_result"]["return_code"] == 3
    assert failed["run_result"]["stderr"] == "err\n"
    assert rev["run_result"]["stdout"] == "hello\n"
    assert len(big["run_result"]["stdout"]) < 3 << 20  # cut at the output cap
    assert any("run_timeout=1000 clamped" in w for w in clamped["warnings"])
    assert fetched["files"] == {"out.txt": base64.b64encode(b"hi").decode()}
    assert mem["run_result"]["return_code"] == 1 and "MemoryError" in mem["run_result"]["stderr"]


def test_a_timeout_reads_the_same_from_both_routes(http: TestClient, spy: Spy) -> None:
    body = {"code": "import time\nprint('before', flush=True)\ntime.sleep(30)", "run_timeout": 0.5}
    answer = both_routes(http, spy, body)
    assert '"status":"TimeLimitExceeded"' in answer and '"stdout":"before\\n"' in answer


BAD = [
    ({"run_timeout": "soon"}, 422, "run_timeout"),
    ({"memory_limit_MB": 1.5}, 422, "memory_limit_MB"),
    ({"run_timeout": 0}, 422, "run_timeout must be > 0"),
    ({"memory_limit_MB": 0}, 422, "memory_limit_MB must be > 0"),
    ({"fetch_files": "out.txt"}, 422, "fetch_files"),
    ({"language": "cobol"}, 400, "unsupported language"),
    ({"code": 7}, 422, "code"),
]


@pytest.mark.parametrize(("extra", "status", "needle"), BAD)
def test_requests_it_cannot_serve_get_the_full_routes_answer(
    http: TestClient, spy: Spy, extra: dict, status: int, needle: str
) -> None:
    body = {"code": "print(1)", **extra}
    r = http.post("/run_code", json=body, headers=AUTH)
    assert spy.counts() == (0, 1)
    assert r.status_code == status and needle in r.text
    full = http.post("/run_code", json={**body, **FORCE_FULL_ROUTE}, headers=AUTH)
    assert full.text == r.text  # the same (only) implementation of the error


def test_other_languages_files_and_bodies_go_to_the_full_route(http: TestClient, spy: Spy) -> None:
    bash = http.post("/run_code", json={"code": "echo $((6 * 7))", "language": "bash"}, headers=AUTH)
    assert bash.json()["run_result"]["stdout"] == "42\n"
    files = {"data.txt": base64.b64encode(b"from a file").decode()}
    body = {"code": "print(open('data.txt').read())", "files": files}
    assert http.post("/run_code", json=body, headers=AUTH).json()["run_result"]["stdout"] == "from a file\n"
    text = http.post(
        "/run_code", content=b'{"code": "print(1)"}', headers={**AUTH, "content-type": "text/plain"}
    )
    assert text.status_code == 422
    assert spy.counts() == (0, 3)
    assert http.get("/run_code", headers=AUTH).status_code == 405


def test_the_token_is_required_in_the_header_or_the_path(http: TestClient, spy: Spy) -> None:
    body = {"code": "print(1)"}
    assert http.post("/run_code", json=body).status_code == 401
    wrong = http.post("/run_code", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.headers["WWW-Authenticate"] == "Bearer"
    assert http.post("/run_code", json=body, headers={"Authorization": TOKEN}).status_code == 401
    assert spy.counts() == (0, 3)
    both_routes(http, spy, body)
    path = http.post(f"/{TOKEN}/run_code", json=body)
    assert path.status_code == 200 and path.json()["run_result"]["stdout"] == "1\n"
    assert spy.counts() == (2, 4)
    assert http.post("/wrong-token/run_code", json=body).status_code in (401, 404)


def test_metrics_count_both_routes_alike(sb: LocalSandbox, spy: Spy) -> None:
    with make_client(sb) as http:
        both_routes(http, spy, {"code": "print(1)"})
        both_routes(http, spy, {"code": "import time; time.sleep(5)", "run_timeout": 0.2})
        metrics = http.get("/metrics", headers=AUTH).text
    assert 'sandbox_executions_total{endpoint="run_code",outcome="ok"} 4.0' in metrics
    assert 'sandbox_execution_seconds_count{endpoint="run_code"} 4.0' in metrics


def test_no_slot_in_time_is_the_same_504(sb: LocalSandbox, spy: Spy) -> None:
    with make_client(sb, max_concurrent_executions=1, fusion_queue_wait_s=0.1) as http:
        body = {"code": "import time; time.sleep(2)"}
        busy = threading.Thread(target=lambda: http.post("/run_code", json=body, headers=AUTH))
        busy.start()
        time.sleep(0.5)
        fast = http.post("/run_code", json={"code": "print(1)"}, headers=AUTH)
        full = http.post("/run_code", json={"code": "print(1)", **FORCE_FULL_ROUTE}, headers=AUTH)
        busy.join()
        metrics = http.get("/metrics", headers=AUTH).text
    assert spy.counts() == (2, 1)
    assert fast.status_code == full.status_code == 504 and fast.headers["Retry-After"] == "1"
    assert fast.text == full.text and "no execution slot within 0.1 s" in fast.text
    assert 'sandbox_rejected_total{reason="queue_wait"} 2.0' in metrics


def test_a_failing_zygote_is_the_same_200_sandboxerror(sb: LocalSandbox, spy: Spy, monkeypatch) -> None:
    async def broken(**run: Any) -> Any:
        raise SandboxUnavailable("zygote: it broke (simulated)")

    with make_client(sb) as http:
        monkeypatch.setattr(http.app.state.sandbox_state.zygote, "run_async", broken)  # type: ignore[attr-defined]
        answer = both_routes(http, spy, {"code": "print(1)", "run_timeout": 1000})
    assert '"status":"SandboxError"' in answer and "simulated" in answer and "clamped" in answer


def test_without_the_zygote_everything_goes_to_the_full_route(sb: LocalSandbox, spy: Spy) -> None:
    with make_client(sb, oneshot="worker") as http:
        r = http.post("/run_code", json={"code": "print(6 * 7)"}, headers=AUTH)
    assert r.json()["run_result"]["stdout"] == "42\n" and spy.counts() == (0, 1)
