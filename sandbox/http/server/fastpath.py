"""The hot routes, ``POST /v1/sessions/{id}/execute`` and ``POST /run_code``, answered without
FastAPI's per-request machinery.

A warm execution is ~0.15 ms of worker time and a zygote one-shot a few ms of CPU; FastAPI's
dependency solving, parameter extraction and pydantic validation of the body cost a sizeable part
of that on every call. For a *plain* request each route here does the same work directly:

- session execute: a JSON object with only ``code`` (str) and any of ``want_value`` (bool),
  ``stdin`` (str or null), ``timeout_s`` (a number within the server maximum), ``language``
  ("python"), ``limits`` ({}) and ``files`` (null), for a live session, with room in the queue.
  That is what ``Client`` sends.
- ``/run_code``: a JSON object with ``code`` and only other fields of ``RunCodeRequest``, valid
  for that model, with ``language`` "python", no ``files`` to upload and limits that plan
  without an error, while the zygote serves one-shots. That is what verl and the SandboxFusion
  SDK send.

Both also need an authorised client and a body of the JSON content type. Everything else (other
fields or types, another language, files to upload, an unknown session, a bad token, a full
session queue, any other error) is handed with its body to the FastAPI route, so validation
messages, 4xx/429 answers and the OpenAPI schema have exactly one implementation; the answer
itself is built by the same functions the FastAPI route calls. Errors raised while executing (the
session closed meanwhile, the sandbox failing, no queue slot in time) reach the app's exception
handlers like any other.
"""

from __future__ import annotations

import hmac
import json
import math
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Route
from starlette.types import Receive, Scope, Send

from sandbox.http.server.fusion import plan_request, zygote_answer, zygote_run
from sandbox.http.server.schemas import RunCodeRequest
from sandbox.limits import LimitError

PATH = "/v1/sessions/{session_id}/execute"
RUN_CODE_PATH = "/run_code"
_OPTIONAL = {"want_value", "stdin", "timeout_s", "language", "limits", "files"}
_RUN_CODE_OPTIONAL = set(RunCodeRequest.model_fields) - {"code"}


def install(app: Any) -> None:
    """Put the fast routes in front of the FastAPI routes for the same paths (which stay documented).

    A fast route hands a request back by re-entering the app's router with a marker in the scope
    that makes every fast route step aside, so the FastAPI route is found however this FastAPI
    version stores included routers (flattened into the app's routes, or nested), and errors
    still reach the app's exception handlers.
    """
    fast = [(PATH, _FastSessionExecute(app.router)), (RUN_CODE_PATH, _FastRunCode(app.router))]
    for path, endpoint in reversed(fast):
        app.router.routes.insert(0, _FastRoute(path, endpoint, methods=["POST"]))


_DELEGATED = "agent_rl.fastpath.delegated"
PATH_TOKEN_OK = "agent_rl.path_token_ok"
"""Scope key the app's PathToken middleware sets when the URL carried the token."""


class _FastRoute(Route):
    def __init__(self, path: str, endpoint: Any, methods: list[str]) -> None:
        super().__init__(path, endpoint, methods=methods, include_in_schema=False)

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope.get(_DELEGATED):
            return Match.NONE, {}
        return super().matches(scope)


class _FastEndpoint:
    """Read the body once, answer it here when ``answer`` can, else replay it to the FastAPI route."""

    def __init__(self, router: Any) -> None:
        self.router = router

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        state = scope["app"].state.sandbox_state
        data = _json_object(state, scope, body)
        response = None if data is None else await self.answer(state, scope, data)
        if response is None:
            await self._delegate(scope, receive, send, body)
            return
        await response(scope, receive, send)

    async def answer(self, state: Any, scope: Scope, data: dict[str, Any]) -> Response | None:
        """The response for an authorised JSON object, or None to hand it to the FastAPI route."""
        raise NotImplementedError

    async def _delegate(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # a disconnect, if the client goes away

        await self.router({**scope, _DELEGATED: True}, replay, send)


class _FastSessionExecute(_FastEndpoint):
    async def answer(self, state: Any, scope: Scope, data: dict[str, Any]) -> Response | None:
        plain = _plain(state, scope, data)
        if plain is None:
            return None
        session, code, kwargs = plain
        result = await state.execute(lambda: session.run_async(code, **kwargs))
        state.metrics.record("session", result)
        return JSONResponse(result.to_dict())


class _FastRunCode(_FastEndpoint):
    async def answer(self, state: Any, scope: Scope, data: dict[str, Any]) -> Response | None:
        if state.zygote is None:
            return None
        body = _plain_run_code(state, data)
        if body is None:
            return None
        try:
            plan = plan_request(body, state.settings)
        except LimitError:
            return None  # the FastAPI route answers it (422, from the app's handler)
        run = zygote_run(plan)
        if run is None:
            return None
        return JSONResponse(await zygote_answer(state, plan, run))


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _authorised(state: Any, scope: Scope) -> bool:
    token = state.settings.auth_token
    if token is None or scope.get(PATH_TOKEN_OK):
        return True
    for key, value in scope["headers"]:
        if key == b"authorization":
            scheme, _, given = value.partition(b" ")
            return scheme.lower() == b"bearer" and hmac.compare_digest(
                given, token.get_secret_value().encode()
            )
    return False


def _json_object(state: Any, scope: Scope, body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object when it is one, labelled as JSON, from an authorised client."""
    content_type = b""
    for key, value in scope["headers"]:
        if key == b"content-type":
            content_type = value
    if not content_type.startswith(b"application/json") or not _authorised(state, scope):
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return data if type(data) is dict else None


def _fits_code(state: Any, code: Any) -> bool:
    return type(code) is str and len(code.encode("utf-8", "surrogatepass")) <= state.settings.max_code_bytes


def _plain(state: Any, scope: Scope, data: dict[str, Any]) -> tuple[Any, str, dict[str, Any]] | None:
    """(session, code, run_async kwargs) when the request is plain (see the module doc), else None."""
    if set(data) - _OPTIONAL != {"code"}:
        return None
    code = data["code"]
    want_value = data.get("want_value", True)
    stdin = data.get("stdin")
    timeout_s = data.get("timeout_s")
    if (
        not _fits_code(state, code)
        or type(want_value) is not bool
        or (stdin is not None and type(stdin) is not str)
        or data.get("language", "python") != "python"
        or data.get("limits", {}) != {}
        or data.get("files") is not None
    ):
        return None
    kwargs: dict[str, Any] = {"want_value": want_value, "stdin": stdin}
    if timeout_s is not None:
        if not _finite(timeout_s) or not 0 < timeout_s <= state.sb.max_limits.wall_s:
            return None
        kwargs["wall_s"] = float(timeout_s)
    session = state.sb.get_session(scope["path_params"]["session_id"])
    if session is None or session.closed or state.pending >= state.settings.max_queued_executions:
        return None
    return session, code, kwargs


def _finite(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _plain_run_code(state: Any, data: dict[str, Any]) -> RunCodeRequest | None:
    """The request's model when it is plain (see the module doc), else None.

    Validated by the very model the FastAPI route uses (about a microsecond: it is FastAPI's
    machinery around it that costs), so a plain request plans exactly as it would there; a body
    that fails validation goes to the FastAPI route for its 422.
    """
    if set(data) - _RUN_CODE_OPTIONAL != {"code"}:
        return None
    try:
        body = RunCodeRequest.model_validate(data)
    except ValidationError:
        return None
    if body.language != "python" or body.files or not _fits_code(state, body.code):
        return None
    return body
