"""The hot route, ``POST /v1/sessions/{id}/execute``, answered without FastAPI's per-request machinery.

A warm execution is ~0.15 ms of worker time; FastAPI's dependency solving, parameter extraction
and pydantic validation of the body cost several times that on every call. For a *plain* request
this route does the same work directly: a JSON object with only ``code`` (str) and any of
``want_value`` (bool), ``stdin`` (str or null), ``timeout_s`` (a number within the server
maximum), ``language`` ("python"), ``limits`` ({}) and ``files`` (null), from an authorised
client, for a live session, with room in the queue. That is what ``Client`` sends.

Everything else (other fields or types, an unknown session, a bad token, a full queue, any other
error) is handed with its body to the FastAPI route, so validation messages, 4xx/429 answers and
the OpenAPI schema have exactly one implementation. Errors raised while executing (the session
closed meanwhile, the sandbox failing) reach the app's exception handlers like any other.
"""

from __future__ import annotations

import hmac
import json
import math
from typing import Any

from starlette.responses import JSONResponse
from starlette.routing import Match, Route
from starlette.types import Receive, Scope, Send

PATH = "/v1/sessions/{session_id}/execute"
_OPTIONAL = {"want_value", "stdin", "timeout_s", "language", "limits", "files"}


def install(app: Any) -> None:
    """Put the fast route in front of the FastAPI route for the same path (which stays documented).

    The fast route hands a request back by re-entering the app's router with a marker in the
    scope that makes it step aside, so the FastAPI route is found however this FastAPI version
    stores included routers (flattened into the app's routes, or nested), and errors still reach
    the app's exception handlers.
    """
    app.router.routes.insert(0, _FastRoute(PATH, _FastSessionExecute(app.router), methods=["POST"]))


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


class _FastSessionExecute:
    def __init__(self, router: Any) -> None:
        self.router = router

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        state = scope["app"].state.sandbox_state
        plain = _plain(state, scope, body)
        if plain is None:
            await self._delegate(scope, receive, send, body)
            return
        session, code, kwargs = plain
        result = await state.execute(lambda: session.run_async(code, **kwargs))
        state.metrics.record("session", result)
        await JSONResponse(result.to_dict())(scope, receive, send)

    async def _delegate(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # a disconnect, if the client goes away

        await self.router({**scope, _DELEGATED: True}, replay, send)


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


def _plain(state: Any, scope: Scope, body: bytes) -> tuple[Any, str, dict[str, Any]] | None:
    """(session, code, run_async kwargs) when the request is plain (see the module doc), else None."""
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
    if type(data) is not dict or set(data) - _OPTIONAL != {"code"}:
        return None
    code = data["code"]
    want_value = data.get("want_value", True)
    stdin = data.get("stdin")
    timeout_s = data.get("timeout_s")
    if (
        type(code) is not str
        or type(want_value) is not bool
        or (stdin is not None and type(stdin) is not str)
        or data.get("language", "python") != "python"
        or data.get("limits", {}) != {}
        or data.get("files") is not None
    ):
        return None
    kwargs: dict[str, Any] = {"want_value": want_value, "stdin": stdin}
    if timeout_s is not None:
        if type(timeout_s) not in (int, float) or not math.isfinite(timeout_s):
            return None
        if not 0 < timeout_s <= state.sb.max_limits.wall_s:
            return None
        kwargs["wall_s"] = float(timeout_s)
    if len(code.encode("utf-8", "surrogatepass")) > state.settings.max_code_bytes:
        return None
    session = state.sb.get_session(scope["path_params"]["session_id"])
    if session is None or session.closed or state.pending >= state.settings.max_queued_executions:
        return None
    return session, code, kwargs
