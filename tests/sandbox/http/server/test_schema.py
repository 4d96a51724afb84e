"""The OpenAPI schema says what the server answers: each status a route can return is documented,
and each answer's body validates against the documented schema (a bounded, hand-picked cousin of a
schema fuzzer: every error path of every route)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from fastapi.testclient import TestClient

from sandbox import LocalSandbox
from sandbox.http.server import create_app
from sandbox.http.settings import SandboxSettings
from tests.sandbox.conftest import need_bwrap

AUTH = {"Authorization": "Bearer tok"}
_SPEC: dict[int, Any] = {}  # the schema, generated once per app


@pytest.fixture(scope="module")
def api() -> Iterator[TestClient]:
    need_bwrap()
    box = LocalSandbox(pool_size=1, isolation="bwrap")
    settings = SandboxSettings(auth_token="tok", max_code_bytes=1000, max_sessions=1, max_batch=2)
    with TestClient(create_app(settings, sandbox=box)) as client:
        yield client
    box.close()


def conforms(api: TestClient, method: str, route: str, response: Any) -> None:
    """``response`` is documented for ``method route`` and its JSON body fits the documented schema."""
    spec = _SPEC.get(id(api)) or _SPEC.setdefault(id(api), api.get("/openapi.json", headers=AUTH).json())
    documented = spec["paths"][route][method]["responses"]
    status = str(response.status_code)
    assert status in documented, f"{method.upper()} {route} answered {status}, documented {sorted(documented)}"
    content = documented[status].get("content", {}).get("application/json")
    if content is None:
        return
    schema = {**content["schema"], "components": spec["components"]}
    jsonschema.Draft202012Validator(schema).validate(response.json())


CASES = [
    # (method, route, url, kwargs, expected status)
    ("post", "/v1/execute", "/v1/execute", {"json": {"code": "1"}, "headers": {}}, 401),
    ("post", "/v1/execute", "/v1/execute", {"json": {"code": 3}}, 422),
    ("post", "/v1/execute", "/v1/execute", {"json": {"code": "1", "limits": {"memory_mb": -1}}}, 422),
    ("post", "/v1/execute", "/v1/execute", {"json": {"code": "x" * 2000}}, 413),
    ("post", "/v1/execute", "/v1/execute", {"json": {"code": "1", "timeout_s": 1}}, 200),
    ("post", "/v1/batch", "/v1/batch", {"json": {"programs": [{"code": "1"}] * 3}}, 413),
    ("post", "/v1/batch", "/v1/batch", {"json": {"programs": []}}, 422),
    ("get", "/v1/sessions/{session_id}", "/v1/sessions/nope", {}, 404),
    ("delete", "/v1/sessions/{session_id}", "/v1/sessions/nope", {}, 404),
    ("post", "/v1/sessions/{session_id}/execute", "/v1/sessions/nope/execute", {"json": {"code": "1"}}, 404),
    ("post", "/v1/sessions", "/v1/sessions", {"json": {"limits": {"bogus": 1}}}, 422),
    ("post", "/run_code", "/run_code", {"json": {"code": "1", "language": "cobol"}}, 400),
    ("post", "/run_code", "/run_code", {"json": {"code": "1", "run_timeout": -1}}, 422),
    ("post", "/run_code", "/run_code", {"json": {"code": "print(1)"}}, 200),
    ("get", "/metrics", "/metrics", {"headers": {}}, 401),
    ("get", "/readyz", "/readyz", {}, 200),
]


@pytest.mark.parametrize(("method", "route", "url", "kwargs", "status"), CASES)
def test_every_answer_is_documented_and_fits_its_schema(
    api: TestClient, method: str, route: str, url: str, kwargs: dict[str, Any], status: int
) -> None:
    kwargs = {"headers": AUTH, **kwargs}
    r = api.request(method.upper(), url, **kwargs)
    assert r.status_code == status, r.text
    conforms(api, method, route, r)


def test_overload_and_cancellation_answers_fit_too(api: TestClient) -> None:
    first = api.post("/v1/sessions", json={}, headers=AUTH)
    assert first.status_code == 201
    conforms(api, "post", "/v1/sessions", first)
    full = api.post("/v1/sessions", json={}, headers=AUTH)  # max_sessions=1
    assert full.status_code == 429
    conforms(api, "post", "/v1/sessions", full)
    assert api.delete(f"/v1/sessions/{first.json()['id']}", headers=AUTH).status_code == 204
