"""A lease table over sandbox services, shared by every rollout worker: load balancing and back-pressure.

Why a lease table in one Ray actor: a sandbox service refuses sessions beyond its limit (HTTP 429),
and the client gives up after a few retries, so N workers that each open sessions freely turn a
busy minute into infrastructure failures. Instead, every episode leases a slot before it opens
its session and returns it when the session closes; the table hands out the least-loaded
service and makes further episodes wait (queue) while all slots are taken.

A slot is one open session (an episode holds its Python session from reset to close). Capacity
per service comes from the URL: `http://host:8080#capacity=16`; without it, the service's own
default session limit applies. Leases are tagged with the worker that holds them so a dead
worker's slots can be reclaimed when it is replaced.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urldefrag

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 64
"""Sessions per service when the URL names none; the sandbox service's default `max_sessions`."""
DEFAULT_ACQUIRE_TIMEOUT_S = 600.0
"""How long an episode waits for a slot before it is recorded as an infrastructure failure."""


def parse_sandbox_url(spec: str) -> tuple[str, int]:
    """'http://h:8080#capacity=4' -> ('http://h:8080', 4); a missing capacity gives the default."""
    url, fragment = urldefrag(spec.strip())
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"sandbox url {spec!r} must start with http:// or https://")
    capacity = DEFAULT_CAPACITY
    if fragment:
        params = parse_qs(fragment, strict_parsing=True)
        unknown = set(params) - {"capacity"}
        if unknown:
            raise ValueError(
                f"sandbox url {spec!r}: unknown fragment keys {sorted(unknown)}; use #capacity=N"
            )
        try:
            capacity = int(params["capacity"][-1])
        except ValueError:
            raise ValueError(f"sandbox url {spec!r}: capacity must be an integer") from None
        if capacity < 1:
            raise ValueError(f"sandbox url {spec!r}: capacity must be >= 1, got {capacity}")
    return url.rstrip("/"), capacity


@dataclass
class Endpoint:
    url: str
    capacity: int
    in_use: int = 0
    served: int = 0


class LeaseTable:
    """Slots over several services; `acquire` waits while all are taken (pure asyncio, no Ray)."""

    def __init__(self, endpoints: list[tuple[str, int]]) -> None:
        if not endpoints:
            raise ValueError("a sandbox pool needs at least one service url")
        urls = [u for u, _ in endpoints]
        if len(set(urls)) != len(urls):
            raise ValueError(f"duplicate sandbox urls in the pool: {urls}")
        self.endpoints = {u: Endpoint(u, c) for u, c in endpoints}
        self._cond = asyncio.Condition()
        self._held: dict[str, Counter[str]] = {}
        self.peak_in_use = 0
        self.queued = 0
        """Acquisitions that had to wait for a slot (the back-pressure count)."""
        self.wait_s = 0.0

    @property
    def capacity(self) -> int:
        return sum(e.capacity for e in self.endpoints.values())

    @property
    def in_use(self) -> int:
        return sum(e.in_use for e in self.endpoints.values())

    def _free(self) -> list[Endpoint]:
        return [e for e in self.endpoints.values() if e.in_use < e.capacity]

    async def acquire(self, owner: str, timeout_s: float | None = DEFAULT_ACQUIRE_TIMEOUT_S) -> str:
        """A service URL with a free slot, charged to `owner`; least loaded first (relative load)."""
        started = time.perf_counter()
        async with self._cond:
            if not self._free():
                self.queued += 1
                try:
                    await asyncio.wait_for(self._cond.wait_for(lambda: bool(self._free())), timeout_s)
                except asyncio.TimeoutError:
                    raise TimeoutError(
                        f"no sandbox slot free within {timeout_s}s ({self.in_use}/{self.capacity} in use)"
                    ) from None
                self.wait_s += time.perf_counter() - started
            best = min(self._free(), key=lambda e: (e.in_use / e.capacity, e.served))
            best.in_use += 1
            best.served += 1
            self._held.setdefault(owner, Counter())[best.url] += 1
            self.peak_in_use = max(self.peak_in_use, self.in_use)
            return best.url

    async def release(self, owner: str, url: str) -> None:
        """Return one slot; unknown or already-reclaimed leases are ignored (release is idempotent)."""
        async with self._cond:
            held = self._held.get(owner)
            if not held or held[url] <= 0:
                return
            held[url] -= 1
            self.endpoints[url].in_use -= 1
            self._cond.notify_all()

    async def release_owner(self, owner: str) -> int:
        """Reclaim every slot a (dead) worker still holds; returns how many."""
        async with self._cond:
            held = self._held.pop(owner, Counter())
            for url, n in held.items():
                self.endpoints[url].in_use -= n
            self._cond.notify_all()
            return sum(held.values())

    def stats(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "in_use": self.in_use,
            "peak_in_use": self.peak_in_use,
            "queued": self.queued,
            "wait_s": self.wait_s,
            "served": {e.url: e.served for e in self.endpoints.values()},
        }


class SandboxLeaser:
    """The Ray actor around a LeaseTable (async actor: waiting acquisitions do not block releases)."""

    def __init__(self, endpoints: list[tuple[str, int]]) -> None:
        self.table = LeaseTable(endpoints)

    async def acquire(self, owner: str, timeout_s: float | None = DEFAULT_ACQUIRE_TIMEOUT_S) -> str:
        return await self.table.acquire(owner, timeout_s)

    async def release(self, owner: str, url: str) -> None:
        await self.table.release(owner, url)

    async def release_owner(self, owner: str) -> int:
        return await self.table.release_owner(owner)

    async def stats(self) -> dict[str, Any]:
        return self.table.stats()


def start_leaser(urls: list[str]) -> Any:
    """One leaser actor for the pool (no CPU reserved: it only counts)."""
    import ray

    endpoints = [parse_sandbox_url(u) for u in urls]
    return ray.remote(num_cpus=0, max_restarts=0)(SandboxLeaser).remote(endpoints)


class LeasedSession:
    """A sandbox session that gives its slot back when closed, whatever happened inside."""

    def __init__(self, session: Any, release: Any) -> None:
        self._session = session
        self._release = release
        self.closed = False

    def run(self, code: str, **kwargs: Any) -> Any:
        return self._session.run(code, **kwargs)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._session.close()
        finally:
            self._release()

    def __enter__(self) -> LeasedSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PooledSandbox:
    """A sandbox backend (`.session(**limits)`) that leases a slot from the shared pool first.

    Lives in a rollout worker; `session()` blocks (in the collector's env thread) until a slot
    is free, which is the back-pressure: episodes queue instead of overloading a service.
    """

    def __init__(
        self,
        leaser: Any,
        owner: str,
        token: str | None = None,
        acquire_timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S,
    ) -> None:
        self._leaser = leaser
        self._owner = owner
        self._token = token
        self._acquire_timeout_s = acquire_timeout_s
        self._clients: dict[str, Any] = {}

    def _client(self, url: str) -> Any:
        if url not in self._clients:
            from sandbox import Client

            self._clients[url] = Client(url, token=self._token)
        return self._clients[url]

    def session(self, **limits: Any) -> LeasedSession:
        import ray

        from sandbox import SandboxUnavailable

        try:
            url = ray.get(self._leaser.acquire.remote(self._owner, self._acquire_timeout_s))
        except Exception as err:  # a timed-out wait or a lost leaser: the infrastructure failed
            raise SandboxUnavailable(f"no sandbox slot from the pool: {err}") from err

        def release() -> None:
            # Waited for (one round trip per episode), so a slot is free again before the episode
            # counts as finished: the pool's accounting never lags behind the collector's.
            try:
                ray.get(self._leaser.release.remote(self._owner, url))
            except Exception as err:  # a lost leaser has no slot to return
                log.warning("could not return sandbox slot %s to the pool: %s", url, err)

        try:
            session = self._client(url).session(**limits)
        except BaseException:
            release()
            raise
        return LeasedSession(session, release)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
