"""HTTP clients with LocalSandbox's shape: ``Client`` (sync) and ``AsyncClient`` (asyncio).

Both keep a pool of keep-alive connections. Failures of the service (unreachable, 5xx, still
overloaded after the retries that Retry-After asks for) raise ``SandboxUnavailable``; a request the
server rejects as bad (4xx) raises ``SandboxRequestError``; the user's code failing is an
``ExecResult`` like any other.

Admission: opening a session when the server already holds ``max_sessions`` answers 429. A trainer
that runs more episodes at once than the server has sessions must wait for one to close, not fail
the episode, so ``session()`` keeps asking (backing off up to the server's Retry-After) for up to
``session_wait_s`` seconds, then raises ``SandboxUnavailable`` naming the bound. The time spent
waiting is counted in ``client.session_waits`` (``SessionWaits``).

``Client`` speaks HTTP through the standard library's ``http.client``, not httpx: a warm execution
is a fraction of a millisecond of server work, and httpx spends about 1 ms of client CPU on each
request (URL merging, cookies, h11's state machine) against about 0.3 ms for ``http.client``.
``AsyncClient`` uses httpx's asyncio transport.

Several replicas: ``url`` may list several servers, comma-separated (``http://a:8080,http://b:8080``).
A session lives in one replica's memory, so each new session goes to the next replica in turn and
all its requests follow it there; one-shots and batches take turns the same way.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import logging
import random
import select
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from sandbox.result import ExecResult, SandboxUnavailable

_HTTP_SLACK_S = 30.0  # the server kills a cell at its wall limit; allow for restart and transfer
SESSION_WAIT_S = 600.0
"""Default bound on waiting for session capacity: an episode of a busy trainer may hold a session for
minutes, and failing the waiting episode instead would lose it (the issue this bound replaces)."""

log = logging.getLogger(__name__)


def _readable(sock: object) -> bool:
    """Whether an idle keep-alive socket has something to read: EOF (the server closed it) or
    unexpected bytes. poll, not select: select fails on descriptors above 1024, which a trainer
    with a model and Ray open easily has."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


class SandboxRequestError(ValueError):
    """The server rejected the request (4xx): bad code size, limits, unknown session, ..."""

    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail


def split_urls(url: str) -> list[str]:
    """The replicas in a comma-separated ``url``; each must be http(s)://host[:port][/prefix]."""
    urls = [u.strip().rstrip("/") for u in url.split(",") if u.strip()]
    if not urls:
        raise ValueError(f"sandbox URL is empty: {url!r}")
    for u in urls:
        parts = urlsplit(u)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"sandbox URL must be http(s)://host[:port][/prefix], got {u!r} in {url!r}")
        try:
            parts.port  # noqa: B018 - raises on a port that is not a number
        except ValueError as e:
            raise ValueError(f"sandbox URL {u!r} has a bad port: {e}") from e
    return urls


class _Replicas:
    """Round-robin over replicas; a session stays on the replica that created it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._turn = itertools.count()

    def next(self) -> int:
        return next(self._turn) % self.n


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _exec_body(code: str, timeout_s: float | None, limits: dict[str, Any], **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"code": code, "limits": limits}
    if timeout_s is not None:
        body["timeout_s"] = timeout_s
    body.update({k: v for k, v in extra.items() if v is not None})
    return body


def _json_bytes(obj: Any) -> bytes:
    # ASCII escapes keep any str (lone surrogates included) valid on the wire, as httpx would refuse.
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def _http_timeout(timeout_s: float | None, limits: dict[str, Any]) -> float:
    wall = timeout_s or limits.get("wall_s") or 300.0
    return float(wall) + _HTTP_SLACK_S


class _Response:
    """The parts of an HTTP response that ``_decode`` and ``_retry_after`` read (httpx's names)."""

    def __init__(self, status_code: int, headers: dict[str, str], content: bytes) -> None:
        self.status_code = status_code
        self.headers = headers
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)


IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
"""Methods that may be sent twice: a session DELETE answered 404 the second time is still closed."""
_RESET = (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected, http.client.BadStatusLine)
"""What a keep-alive connection the server closed at the moment of reuse fails with."""


class _ConnectionPool:
    """Thread-safe keep-alive ``http.client`` connections to one server.

    A connection is used by one request at a time and goes back to the pool once its response has
    been read. Before reuse it is checked for readability, as httpcore does: an idle connection
    the server has closed (keep-alive expiry) reads as EOF and is replaced rather than failing the
    request. That check races the server's own timer (uvicorn closes idle connections after 5 s:
    4-6 resets per 10,000 requests), so two more rules close the gap:

    * a connection idle for ``max_idle_s`` (below the server's keep-alive) is not reused at all;
    * an idempotent request (``IDEMPOTENT``) that fails on a *reused* connection with a reset
      before any answer is sent once more on a fresh connection. Executions are POSTs and are
      never re-sent: the server may have run the code.
    """

    def __init__(
        self,
        url: str,
        headers: dict[str, str],
        timeout_s: float,
        max_idle: int = 64,
        max_idle_s: float = 4.0,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"sandbox URL must be http(s)://host[:port][/prefix], got {url!r}")
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")
        self.headers = {"Host": parts.netloc, "Accept": "application/json", **headers}
        self.timeout_s = timeout_s
        self.max_idle = max_idle
        self.max_idle_s = max_idle_s
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []  # (connection, idle since)
        self._lock = threading.Lock()
        self._ssl = ssl.create_default_context() if self.https else None

    def _reusable(self, timeout_s: float) -> http.client.HTTPConnection | None:
        while True:
            with self._lock:
                conn, since = self._idle.pop() if self._idle else (None, 0.0)
            if conn is None:
                return None
            sock = conn.sock
            if sock is not None and time.monotonic() - since < self.max_idle_s and not _readable(sock):
                sock.settimeout(timeout_s)
                return conn
            conn.close()  # too old, closed by the server while idle, or unexpected bytes

    def _fresh(self, timeout_s: float) -> http.client.HTTPConnection:
        if self.https:
            conn = http.client.HTTPSConnection(self.host, self.port, timeout=timeout_s, context=self._ssl)
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        conn.connect()  # sets TCP_NODELAY
        return conn

    def request(
        self, method: str, path: str, body: bytes | None = None, timeout: float | None = None
    ) -> _Response:
        timeout_s = self.timeout_s if timeout is None else timeout
        headers = dict(self.headers)
        if body is not None:
            headers["Content-Type"] = "application/json"
        reused = self._reusable(timeout_s)
        conn = reused or self._fresh(timeout_s)
        try:
            return self._exchange(conn, method, path, body, headers)
        except _RESET:
            if reused is None or method not in IDEMPOTENT:
                raise
        return self._exchange(self._fresh(timeout_s), method, path, body, headers)

    def _exchange(
        self,
        conn: http.client.HTTPConnection,
        method: str,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
    ) -> _Response:
        """One request and its response on ``conn``, which then goes back to the pool or is closed."""
        try:
            conn.request(method, self.prefix + path, body=body, headers=headers)
            resp = conn.getresponse()
            content = resp.read()
        except BaseException:
            conn.close()
            raise
        result = _Response(resp.status, {k.lower(): v for k, v in resp.getheaders()}, content)
        if resp.will_close or conn.sock is None:
            conn.close()
            return result
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append((conn, time.monotonic()))
                return result
        conn.close()
        return result

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()


def _decode(resp: httpx.Response | _Response) -> Any:
    if resp.status_code >= 500:
        raise SandboxUnavailable(f"sandbox server error {resp.status_code}: {resp.text[:500]}")
    if resp.status_code >= 400:
        try:
            detail = resp.json().get("detail")
        except ValueError:
            detail = resp.text[:500]
        raise SandboxRequestError(resp.status_code, detail)
    if resp.status_code == 204:
        return None
    try:
        return resp.json()
    except ValueError as e:
        raise SandboxUnavailable(f"sandbox server sent invalid JSON: {e}") from e


def _retry_after(resp: httpx.Response | _Response) -> float:
    try:
        return min(30.0, max(0.05, float(resp.headers.get("retry-after", "1"))))
    except ValueError:
        return 1.0


def _capacity_delay(attempt: int, hint_s: float) -> float:
    """How long to wait before asking for a session again: 50 ms, doubling up to the server's
    Retry-After. Short at first because a slot frees the moment any episode ends; jittered so the
    clients that wait together do not all come back in the same instant."""
    return random.uniform(0.5, 1.0) * min(hint_s, 0.05 * 2**attempt)


@dataclass
class SessionWaits:
    """Time ``session()`` spent waiting for capacity (the server answering 429), since the client
    was made: ``waits`` sessions had to wait, ``total_s`` seconds in all, ``longest_s`` at most."""

    waits: int = 0
    total_s: float = 0.0
    longest_s: float = 0.0

    def add(self, waited_s: float) -> None:
        self.waits += 1
        self.total_s += waited_s
        self.longest_s = max(self.longest_s, waited_s)


class _CapacityWait:
    """One session creation's wait for capacity, bounded by ``bound_s``.

    ``next_delay`` gives the pause before the next try, or raises ``SandboxUnavailable`` once the
    bound would be passed; ``done`` records the time waited in ``stats``.
    """

    def __init__(self, bound_s: float, stats: SessionWaits, lock: threading.Lock, url: str) -> None:
        self.bound_s = bound_s
        self.stats = stats
        self.lock = lock
        self.url = url
        self.started = time.monotonic()
        self.attempt = 0

    def next_delay(self, resp: httpx.Response | _Response) -> float:
        waited = time.monotonic() - self.started
        delay = _capacity_delay(self.attempt, _retry_after(resp))
        self.attempt += 1
        if waited + delay > self.bound_s:
            raise SandboxUnavailable(
                f"sandbox server {self.url} had no session free for {waited:.1f}s (session_wait_s="
                f"{self.bound_s:g}): more episodes run at once than its max_sessions allows and none "
                f"ended in time; raise session_wait_s or the server's max_sessions. Last answer: "
                f"{resp.text[:200]}"
            )
        if self.attempt == 1:
            log.info("sandbox %s: no session free (429); waiting up to %gs", self.url, self.bound_s)
        return delay

    def done(self) -> None:
        if self.attempt:
            with self.lock:
                self.stats.add(time.monotonic() - self.started)


def _check_wait(seconds: float) -> float:
    if not seconds >= 0:  # NaN too
        raise ValueError(f"session_wait_s must be >= 0 seconds, got {seconds!r}")
    return float(seconds)


class RemoteSession:
    def __init__(self, client: Client, session_id: str, replica: int = 0) -> None:
        self.client = client
        self.id = session_id
        self.replica = replica
        self.closed = False

    def run(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        want_value: bool = True,
        stdin: str | None = None,
        files: dict[str, str] | None = None,
        **limits: Any,
    ) -> ExecResult:
        body = _exec_body(code, timeout_s, limits, want_value=want_value, stdin=stdin, files=files)
        data = self.client._request(
            "POST",
            f"/v1/sessions/{self.id}/execute",
            json=body,
            timeout=_http_timeout(timeout_s, limits),
            replica=self.replica,
        )
        return ExecResult.from_dict(data)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.client._request("DELETE", f"/v1/sessions/{self.id}", replica=self.replica)
        except SandboxRequestError as e:
            if e.status != 404:  # already expired: nothing left to close
                raise

    def __enter__(self) -> RemoteSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client:
    """Synchronous client: ``with Client(url).session() as s: s.run("print(1)")``."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        retries: int = 5,
        timeout_s: float = 60.0,
        session_wait_s: float = SESSION_WAIT_S,
    ) -> None:
        """``retries``: tries after a 429 for executions and one-shots; ``session_wait_s``: how long
        ``session()`` waits for a free session (see the module docstring)."""
        self.urls = split_urls(url)
        self.url = self.urls[0] if len(self.urls) == 1 else ",".join(self.urls)
        self.retries = retries
        self.session_wait_s = _check_wait(session_wait_s)
        self.session_waits = SessionWaits()
        self._waits_lock = threading.Lock()
        self._pools = [_ConnectionPool(u, _headers(token), timeout_s) for u in self.urls]
        self._http = self._pools[0]
        self._replicas = _Replicas(len(self.urls))

    def _request(
        self,
        method: str,
        path: str,
        json: Any = None,
        timeout: float | None = None,
        replica: int | None = None,
    ) -> Any:
        """One request to ``replica`` (by default the next in turn), retried while it answers 429."""
        body = None if json is None else _json_bytes(json)
        replica = self._replicas.next() if replica is None else replica
        for attempt in range(self.retries + 1):
            resp = self._send(replica, method, path, body, timeout)
            if resp.status_code == 429 and attempt < self.retries:
                time.sleep(_retry_after(resp))
                continue
            if resp.status_code == 429:
                raise SandboxUnavailable(f"sandbox server overloaded: {resp.text[:300]}")
            return _decode(resp)
        raise AssertionError("unreachable")

    def _send(
        self, replica: int, method: str, path: str, body: bytes | None, timeout: float | None
    ) -> _Response:
        try:
            return self._pools[replica].request(method, path, body, timeout)
        except (OSError, http.client.HTTPException) as e:  # socket errors and timeouts too
            raise SandboxUnavailable(f"sandbox server {self.urls[replica]} unreachable: {e!r}") from e

    def session(self, **limits: Any) -> RemoteSession:
        """Open a session, waiting (at most ``session_wait_s``) while the server has none free."""
        replica = self._replicas.next()
        body = _json_bytes({"limits": limits})
        wait = _CapacityWait(self.session_wait_s, self.session_waits, self._waits_lock, self.urls[replica])
        while (resp := self._send(replica, "POST", "/v1/sessions", body, None)).status_code == 429:
            time.sleep(wait.next_delay(resp))
        wait.done()
        return RemoteSession(self, _decode(resp)["id"], replica)

    def run(
        self, code: str, *, timeout_s: float | None = None, stdin: str | None = None, **limits: Any
    ) -> ExecResult:
        body = _exec_body(code, timeout_s, limits, stdin=stdin)
        data = self._request("POST", "/v1/execute", json=body, timeout=_http_timeout(timeout_s, limits))
        return ExecResult.from_dict(data)

    def run_batch(
        self, codes: list[str], *, timeout_s: float | None = None, **limits: Any
    ) -> list[ExecResult]:
        body = {"programs": [_exec_body(c, timeout_s, limits) for c in codes]}
        data = self._request("POST", "/v1/batch", json=body, timeout=_http_timeout(timeout_s, limits) * 2)
        return [ExecResult.from_dict(r) for r in data["results"]]

    def healthy(self) -> bool:
        """Whether every replica answers its liveness probe."""
        try:
            return all(pool.request("GET", "/healthz").status_code == 200 for pool in self._pools)
        except (OSError, http.client.HTTPException):
            return False

    def close(self) -> None:
        for pool in self._pools:
            pool.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRemoteSession:
    def __init__(self, client: AsyncClient, session_id: str, replica: int = 0) -> None:
        self.client = client
        self.id = session_id
        self.replica = replica
        self.closed = False

    async def run(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        want_value: bool = True,
        stdin: str | None = None,
        files: dict[str, str] | None = None,
        **limits: Any,
    ) -> ExecResult:
        body = _exec_body(code, timeout_s, limits, want_value=want_value, stdin=stdin, files=files)
        data = await self.client._request(
            "POST",
            f"/v1/sessions/{self.id}/execute",
            json=body,
            timeout=_http_timeout(timeout_s, limits),
            replica=self.replica,
        )
        return ExecResult.from_dict(data)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            await self.client._request("DELETE", f"/v1/sessions/{self.id}", replica=self.replica)
        except SandboxRequestError as e:
            if e.status != 404:
                raise

    async def __aenter__(self) -> AsyncRemoteSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _SessionStarter:
    """``async with client.session() as s`` and ``s = await client.session()`` both work."""

    def __init__(self, client: AsyncClient, limits: dict[str, Any]) -> None:
        self.client = client
        self.limits = limits
        self.session: AsyncRemoteSession | None = None

    async def _open(self) -> AsyncRemoteSession:
        """Open a session, waiting (at most ``session_wait_s``) while the server has none free."""
        client = self.client
        replica = client._replicas.next()
        wait = _CapacityWait(
            client.session_wait_s, client.session_waits, client._waits_lock, client.urls[replica]
        )
        while (
            resp := await client._send(replica, "POST", "/v1/sessions", json={"limits": self.limits})
        ).status_code == 429:
            await asyncio.sleep(wait.next_delay(resp))
        wait.done()
        self.session = AsyncRemoteSession(client, _decode(resp)["id"], replica)
        return self.session

    def __await__(self) -> Any:
        return self._open().__await__()

    async def __aenter__(self) -> AsyncRemoteSession:
        return await self._open()

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()


class AsyncClient:
    """asyncio client over one pooled ``httpx.AsyncClient``."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        retries: int = 5,
        timeout_s: float = 60.0,
        max_connections: int = 256,
        session_wait_s: float = SESSION_WAIT_S,
    ) -> None:
        self.urls = split_urls(url)
        self.url = self.urls[0] if len(self.urls) == 1 else ",".join(self.urls)
        self.retries = retries
        self.session_wait_s = _check_wait(session_wait_s)
        self.session_waits = SessionWaits()
        self._waits_lock = threading.Lock()
        pool = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._clients = [
            httpx.AsyncClient(base_url=u, headers=_headers(token), timeout=timeout_s, limits=pool)
            for u in self.urls
        ]
        self._http = self._clients[0]
        self._replicas = _Replicas(len(self.urls))

    async def _request(self, method: str, path: str, replica: int | None = None, **kw: Any) -> Any:
        """One request to ``replica`` (by default the next in turn), retried while it answers 429."""
        replica = self._replicas.next() if replica is None else replica
        for attempt in range(self.retries + 1):
            resp = await self._send(replica, method, path, **kw)
            if resp.status_code == 429 and attempt < self.retries:
                await asyncio.sleep(_retry_after(resp))
                continue
            if resp.status_code == 429:
                raise SandboxUnavailable(f"sandbox server overloaded: {resp.text[:300]}")
            return _decode(resp)
        raise AssertionError("unreachable")

    async def _send(self, replica: int, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            return await self._clients[replica].request(method, path, **kw)
        except httpx.HTTPError as e:
            raise SandboxUnavailable(f"sandbox server {self.urls[replica]} unreachable: {e}") from e

    def session(self, **limits: Any) -> _SessionStarter:
        """Open a session (await it, or ``async with``), waiting at most ``session_wait_s`` for one."""
        return _SessionStarter(self, limits)

    async def run(
        self, code: str, *, timeout_s: float | None = None, stdin: str | None = None, **limits: Any
    ) -> ExecResult:
        body = _exec_body(code, timeout_s, limits, stdin=stdin)
        data = await self._request("POST", "/v1/execute", json=body, timeout=_http_timeout(timeout_s, limits))
        return ExecResult.from_dict(data)

    async def run_batch(
        self, codes: list[str], *, timeout_s: float | None = None, **limits: Any
    ) -> list[ExecResult]:
        body = {"programs": [_exec_body(c, timeout_s, limits) for c in codes]}
        data = await self._request(
            "POST", "/v1/batch", json=body, timeout=_http_timeout(timeout_s, limits) * 2
        )
        return [ExecResult.from_dict(r) for r in data["results"]]

    async def healthy(self) -> bool:
        """Whether every replica answers its liveness probe."""
        try:
            return all([(await c.get("/healthz")).status_code == 200 for c in self._clients])
        except httpx.HTTPError:
            return False

    async def aclose(self) -> None:
        for c in self._clients:
            await c.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
