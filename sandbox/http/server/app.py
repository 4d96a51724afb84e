"""The HTTP service: ``create_app(settings)`` builds it; nothing is started at import time.

Routes: ``/v1/sessions`` (create, get, delete), ``/v1/sessions/{id}/execute``, ``/v1/execute``
(one-shot), ``/v1/batch``, SandboxFusion's ``/run_code``, ``/healthz``, ``/readyz``, ``/metrics``
and the OpenAPI docs at ``/docs``. Every bad request gets a 4xx with a message; overload gets 429
with Retry-After at once, never a hang; infrastructure failure gets 503.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sandbox import languages
from sandbox.bwrap.local import LocalSandbox
from sandbox.http.server import fastpath
from sandbox.http.server.fusion import (
    fetch_cell,
    fusion_response,
    jupyter_budget,
    jupyter_response,
    plan_request,
    zygote_answer,
    zygote_run,
)
from sandbox.http.server.schemas import (
    BatchIn,
    BatchPublic,
    ErrorOut,
    ExecResultPublic,
    ExecuteIn,
    RunCodeRequest,
    RunCodeResponse,
    RunJupyterRequest,
    RunJupyterResponse,
    SessionCreate,
    SessionPublic,
    error_responses,
)
from sandbox.http.server.state import Overloaded, QueueTimeout, ServerState
from sandbox.http.settings import SandboxSettings
from sandbox.limits import PER_EXECUTION, LimitError
from sandbox.result import ExecResult, SandboxUnavailable, SessionClosed
from sandbox.session.box import Session

log = logging.getLogger("sandbox")


async def get_state(request: Request) -> ServerState:
    # async on purpose, like every dependency here: FastAPI runs a plain ``def`` dependency on a
    # worker thread, and two thread hops per request cost more than a warm execution itself.
    return request.app.state.sandbox_state


StateDep = Annotated[ServerState, Depends(get_state)]


async def require_token(request: Request) -> None:
    token = request.app.state.sandbox_state.settings.auth_token
    if token is None or request.scope.get(PATH_TOKEN_OK):
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.encode(), token.get_secret_value().encode()
    ):
        raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})


def _check_code(state: ServerState, code: str) -> None:
    size = len(code.encode("utf-8", "surrogatepass"))
    if size > state.settings.max_code_bytes:
        raise HTTPException(413, f"code is {size} bytes; the limit is {state.settings.max_code_bytes}")


def _split_limits(body: ExecuteIn) -> tuple[dict[str, Any], dict[str, Any]]:
    given = body.limits.given()
    if body.timeout_s is not None:
        given["wall_s"] = body.timeout_s
    per_exec = {k: v for k, v in given.items() if k in PER_EXECUTION}
    return per_exec, {k: v for k, v in given.items() if k not in PER_EXECUTION}


def _public(result: ExecResult) -> Any:
    # A ready-made response skips FastAPI's second validation pass: this is the hot path.
    return JSONResponse(result.to_dict())


def _session_public(s: Session) -> SessionPublic:
    return SessionPublic(
        id=s.id,
        limits=s.limits.to_dict(),
        executions=s.core.executions,
        restarts=s.core.restarts,
        idle_s=time.monotonic() - s.core.last_used,
    )


def _get_session(state: ServerState, session_id: str) -> Session:
    s = state.sb.get_session(session_id)
    if s is None:
        raise HTTPException(404, f"unknown session {session_id!r} (expired, deleted, or never created)")
    return s


v1 = APIRouter(
    prefix="/v1",
    dependencies=[Depends(require_token)],
    tags=["v1"],
    responses=error_responses(400, 401, 413, 422, 429, 503),
)


@v1.post("/sessions", status_code=201, response_model=SessionPublic)
async def create_session(state: StateDep, body: SessionCreate | None = None) -> SessionPublic:
    body = body or SessionCreate()
    limits = body.limits.given()
    state.sb.limits.updated(limits, state.sb.max_limits)  # reject bad limits before starting anything
    with state.opening_session():
        s = await anyio.to_thread.run_sync(lambda: state.sb.session(**limits))
    state.refresh_gauges()
    return _session_public(s)


@v1.get("/sessions/{session_id}", response_model=SessionPublic, responses=error_responses(404))
async def get_session(state: StateDep, session_id: str) -> SessionPublic:
    return _session_public(_get_session(state, session_id))


@v1.delete("/sessions/{session_id}", status_code=204, responses=error_responses(404))
async def delete_session(state: StateDep, session_id: str) -> Response:
    s = _get_session(state, session_id)
    await anyio.to_thread.run_sync(s.close)
    state.refresh_gauges()
    return Response(status_code=204)


@v1.post(
    "/sessions/{session_id}/execute",
    response_model=ExecResultPublic,
    responses=error_responses(404, 409),
)
async def execute_in_session(state: StateDep, session_id: str, body: ExecuteIn) -> Any:
    _check_code(state, body.code)
    s = _get_session(state, session_id)
    per_exec, per_session = _split_limits(body)
    if per_session:
        raise LimitError(f"limits {sorted(per_session)} are fixed when the session is created")
    s.sandbox.limits.updated(per_exec, state.sb.max_limits)
    result = await state.execute(
        lambda: s.run_async(
            body.code, want_value=body.want_value, stdin=body.stdin, files=body.files, **per_exec
        )
    )
    state.metrics.record("session", result)
    return _public(result)


async def _one_shot(state: ServerState, body: ExecuteIn) -> ExecResult:
    per_exec, per_session = _split_limits(body)
    return await state.sb.run_async(
        body.code, want_value=body.want_value, stdin=body.stdin, files=body.files, **per_exec, **per_session
    )


def _validate_one_shot(state: ServerState, body: ExecuteIn) -> None:
    _check_code(state, body.code)
    per_exec, per_session = _split_limits(body)
    state.sb.limits.updated({**per_exec, **per_session}, state.sb.max_limits)


@v1.post("/execute", response_model=ExecResultPublic)
async def execute_once(state: StateDep, body: ExecuteIn) -> Any:
    _validate_one_shot(state, body)
    result = await state.execute(lambda: _one_shot(state, body))
    state.metrics.record("execute", result)
    return _public(result)


@v1.post("/batch", response_model=BatchPublic)
async def execute_batch(state: StateDep, body: BatchIn) -> Any:
    if len(body.programs) > state.settings.max_batch:
        raise HTTPException(
            413, f"batch of {len(body.programs)} programs; the limit is {state.settings.max_batch}"
        )
    for p in body.programs:
        _validate_one_shot(state, p)
    state.admit(len(body.programs))  # all slots or none, before anything runs
    # gather, not a task group: a program whose worker cannot start must reach the 503 handler
    # as itself, not wrapped in an ExceptionGroup that no handler matches (a 500).
    outcomes = await asyncio.gather(
        *(state.run_admitted(functools.partial(_one_shot, state, p)) for p in body.programs),
        return_exceptions=True,
    )
    results: list[ExecResult] = []
    for r in outcomes:
        if isinstance(r, BaseException):
            raise r
        state.metrics.record("batch", r)
        results.append(r)
    return JSONResponse({"results": [r.to_dict() for r in results]})


fusion = APIRouter(
    dependencies=[Depends(require_token)],
    tags=["sandboxfusion"],
    responses={
        **error_responses(400, 401, 413, 422),
        504: {"model": ErrorOut, "description": "No execution slot within fusion_queue_wait_s: retry"},
    },
)


@fusion.post("/run_code", response_model=RunCodeResponse)
async def run_code(state: StateDep, body: RunCodeRequest) -> Any:
    """SandboxFusion-compatible run of one program (python, bash, cpp, c); see server/fusion.py.

    HTTP 200 for every outcome of the program, SandboxError included; 4xx only for a request
    that cannot be run (unknown language, bad field); 504 when no slot freed up in time.
    """
    if body.language not in languages.available():
        raise HTTPException(400, languages.unsupported_message(body.language))
    _check_code(state, body.code)
    plan = plan_request(body, state.settings)
    files = {k: v for k, v in body.files.items() if v is not None}
    run = None if files or state.zygote is None else zygote_run(plan)
    if run is not None:  # the fork server (sandbox/zygote.py); plain requests: server/fastpath.py
        return JSONResponse(await zygote_answer(state, plan, run))
    result = await state.execute_queued(
        lambda: state.sb.run_async(plan.spec.cell(), want_value=False, files=files or None, **plan.limits),
        state.settings.fusion_queue_wait_s,
    )
    state.metrics.record("run_code", result)
    return JSONResponse(fusion_response(result, plan).model_dump())


async def _run_cells(state: ServerState, body: RunJupyterRequest, per_cell: float, total: float) -> Any:
    """Run the cells in order in one session; stop at the notebook's total time."""
    files = {k: v for k, v in body.files.items() if v}
    with state.opening_session():
        s = await anyio.to_thread.run_sync(state.sb.session)
    results: list[ExecResult] = []
    t0, timed_out = time.monotonic(), False
    try:
        for i, cell in enumerate(body.cells):
            left = total - (time.monotonic() - t0)
            if left <= 0:
                timed_out = True
                break
            r = await s.run_async(cell, timeout_s=min(per_cell, left), files=files if i == 0 else None)
            results.append(r)
            if r.timed_out and min(per_cell, left) == left:
                timed_out = True
                break
        fetched: dict[str, str] = {}
        if body.fetch_files and not timed_out:
            got = await s.run_async(fetch_cell(body.fetch_files), want_value=False)
            fetched = json.loads(got.stdout or "{}") if got.ok else {}
    finally:
        await anyio.to_thread.run_sync(s.close)
    return jupyter_response(results, time.monotonic() - t0, timed_out, fetched)


@fusion.post("/run_jupyter", response_model=RunJupyterResponse, responses=error_responses(429))
async def run_jupyter(state: StateDep, body: RunJupyterRequest) -> Any:
    """SandboxFusion's notebook run: ``cells`` in one persistent Python session, in order."""
    for cell in body.cells:
        _check_code(state, cell)
    per_cell, total, warnings = jupyter_budget(body, state.settings.max_limits)
    response = await state.execute_queued(
        lambda: _run_cells(state, body, per_cell, total), state.settings.fusion_queue_wait_s
    )
    response.warnings = warnings
    return JSONResponse(response.model_dump())


ops = APIRouter(tags=["ops"])


@ops.get("/v1/ping")
async def ping() -> str:
    """SandboxFusion's liveness probe: answers "pong" (no token needed, like /healthz)."""
    return "pong"


@ops.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


def _has_token(state: ServerState, request: Request) -> bool:
    token = state.settings.auth_token
    if token is None or request.scope.get(PATH_TOKEN_OK):
        return True
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.encode(), token.get_secret_value().encode()
    )


@ops.get("/readyz", responses={503: {"description": "Not ready (same body, ready false)"}})
async def readyz(state: StateDep, request: Request) -> JSONResponse:
    """Ready or not for anyone; the details (isolation, load, last error) only with the token."""
    sb = state.sandbox
    ready = sb is not None and not sb.closed and (sb.pool.ready_count > 0 or sb.pool.last_error is None)
    body: dict[str, Any] = {"ready": ready}
    if _has_token(state, request):
        body.update(
            isolation=sb.isolation if sb else None,
            pool_ready=sb.pool.ready_count if sb else 0,
            sessions=len(sb.sessions) if sb else 0,
            pending_executions=state.pending,
            last_error=sb.pool.last_error if sb else None,
        )
    return JSONResponse(body, status_code=200 if ready else 503)


@ops.get("/openapi.json", include_in_schema=False, dependencies=[Depends(require_token)])
async def openapi_schema(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@ops.get("/docs", include_in_schema=False, dependencies=[Depends(require_token)])
async def swagger_docs() -> Response:
    """With a token set, the browser page cannot fetch the schema itself: use the JSON with a header."""
    return get_swagger_ui_html(openapi_url="/openapi.json", title="agent-rl sandbox")


@ops.get("/redoc", include_in_schema=False, dependencies=[Depends(require_token)])
async def redoc_docs() -> Response:
    return get_redoc_html(openapi_url="/openapi.json", title="agent-rl sandbox")


@ops.get(
    "/metrics",
    dependencies=[Depends(require_token)],
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}, **error_responses(401)},
)
async def metrics(state: StateDep) -> Response:
    state.refresh_gauges()
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def create_app(settings: SandboxSettings | None = None, *, sandbox: LocalSandbox | None = None) -> FastAPI:
    """Build the service. ``sandbox`` lets tests inject a LocalSandbox (the app then won't close it)."""
    settings = settings or SandboxSettings()
    state = ServerState(settings, sandbox)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()  # kills and reaps every worker

    app = FastAPI(
        title="agent-rl sandbox",
        version="1",
        summary="Persistent, isolated Python sessions with hard limits",
        lifespan=lifespan,
        # The schema and its viewers are routes of ``ops`` instead, behind the token like the API.
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.sandbox_state = state
    app.include_router(v1)
    app.include_router(fusion)
    app.include_router(ops)
    fastpath.install(app)
    _install_handlers(app, settings)
    return app


class _BodyTooLarge(Exception):
    """Raised into the app by BodyCap's ``receive`` once a streamed body passes the cap."""


class BodyCap:
    """Refuse a body over the cap: at once from Content-Length, else as soon as the stream passes it.

    A chunked upload has no Content-Length, so the bytes are also counted as the app reads them;
    once past the cap the app's read fails, whatever the app would answer is dropped and the client
    gets 413 (before this, one 200 MB chunked body grew the server from 65 to 664 MB).
    A plain ASGI middleware on purpose: Starlette's ``@app.middleware("http")`` wraps every request
    in extra tasks and streams, which cost a sizeable share of a warm exec's ~ms latency.
    """

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    def _too_large(self) -> JSONResponse:
        return JSONResponse({"detail": f"request body too large (max about {self.limit} bytes)"}, 413)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for key, value in scope["headers"]:
            if key == b"content-length" and (not value.isdigit() or int(value) > self.limit):
                await self._too_large()(scope, receive, send)
                return
        seen, refused, started = 0, False, False

        async def capped_receive() -> Any:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    refused = True
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: Any) -> None:
            nonlocal started
            if refused:
                return  # the app's answer to a failed read (a 400) is replaced by the 413
            started = True
            await send(message)

        try:
            await self.app(scope, capped_receive, guarded_send)
        except Exception:
            if not refused:
                raise
        if refused and not started:
            await self._too_large()(scope, receive, send)


FUSION_PATHS = frozenset({"/run_code", "/run_jupyter"})
PATH_TOKEN_OK = fastpath.PATH_TOKEN_OK
"""Scope key PathToken sets when the URL carried the token; ``require_token`` then lets it in."""


class PathToken:
    """Accept ``/<token>/<route>`` as ``/<route>`` with the token given (for header-less clients).

    verl's ``sandbox_fusion_url`` (and the SDK's endpoint) is used as it is, so a URL such as
    ``http://127.0.0.1:8080/<token>/run_code`` authenticates a client that cannot send a header.
    A first segment that is not the token is left alone (and then needs the header as usual).
    """

    def __init__(self, app: Any, token: str) -> None:
        self.app, self.prefix = app, f"/{token}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            raw: bytes = scope.get("raw_path") or scope["path"].encode()
            head, sep, _ = raw[1:].partition(b"/")
            if sep and hmac.compare_digest(b"/" + head, self.prefix):
                rest = raw[len(self.prefix) :]
                scope = {
                    **scope,
                    "raw_path": rest,
                    "path": scope["path"][len(self.prefix) :],
                    PATH_TOKEN_OK: True,
                }
        await self.app(scope, receive, send)


def _install_handlers(app: FastAPI, settings: SandboxSettings) -> None:
    body_cap = 2 * settings.max_code_bytes + (1 << 20)

    app.add_middleware(BodyCap, limit=body_cap * 4)
    if settings.auth_token is not None and settings.token_in_path:
        app.add_middleware(PathToken, token=settings.auth_token.get_secret_value())

    @app.exception_handler(LimitError)
    async def _limit(request: Request, exc: LimitError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=422)

    @app.exception_handler(TypeError)
    async def _type(request: Request, exc: TypeError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=422)

    @app.exception_handler(QueueTimeout)
    async def _queue_timeout(request: Request, exc: QueueTimeout) -> JSONResponse:
        return JSONResponse(
            {"detail": f"server busy, try again: {exc}"},
            status_code=504,
            headers={"Retry-After": str(settings.retry_after_s)},
        )

    @app.exception_handler(Overloaded)
    async def _overloaded(request: Request, exc: Overloaded) -> JSONResponse:
        return JSONResponse(
            {"detail": f"server busy: {exc}"},
            status_code=429,
            headers={"Retry-After": str(settings.retry_after_s)},
        )

    @app.exception_handler(SessionClosed)
    async def _closed(request: Request, exc: SessionClosed) -> JSONResponse:
        return JSONResponse({"detail": f"cancelled: {exc}"}, status_code=409)

    @app.exception_handler(SandboxUnavailable)
    async def _unavailable(request: Request, exc: SandboxUnavailable) -> JSONResponse:
        log.error("sandbox/infra: %s", exc)
        if request.scope["path"] in FUSION_PATHS:
            # SandboxFusion answers its own failures with 200 and status SandboxError; verl
            # scores any other HTTP status as an API error.
            return JSONResponse(RunCodeResponse(status="SandboxError", message=str(exc)).model_dump(), 200)
        return JSONResponse({"detail": f"sandbox unavailable: {exc}"}, status_code=503)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in exc.errors()
        ]
        return JSONResponse({"detail": errors}, status_code=422)
