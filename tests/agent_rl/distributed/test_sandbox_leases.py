"""The sandbox lease table (pure asyncio, no Ray): balancing, queueing, release and reclaim."""

from __future__ import annotations

import asyncio

import pytest

from agent_rl.distributed.sandbox_leases import (
    DEFAULT_CAPACITY,
    LeasedSession,
    LeaseTable,
    parse_sandbox_url,
)


def test_parse_sandbox_url() -> None:
    assert parse_sandbox_url("http://h:8080#capacity=4") == ("http://h:8080", 4)
    assert parse_sandbox_url("https://h/api/") == ("https://h/api", DEFAULT_CAPACITY)
    for bad in ("h:8080", "http://h#capacity=0", "http://h#capacity=x", "http://h#slots=2"):
        with pytest.raises(ValueError):
            parse_sandbox_url(bad)


async def test_least_loaded_service_first() -> None:
    table = LeaseTable([("a", 2), ("b", 4)])
    got = [await table.acquire("w") for _ in range(6)]
    assert sorted(got) == ["a", "a", "b", "b", "b", "b"]
    # Relative load: b (capacity 4) takes the first lease after a's first, never a third on a.
    assert got[:2] == ["a", "b"]
    assert table.in_use == 6 and table.peak_in_use == 6


async def test_acquire_queues_when_full_and_release_wakes_it() -> None:
    table = LeaseTable([("a", 1)])
    first = await table.acquire("w1")
    waiter = asyncio.create_task(table.acquire("w2"))
    await asyncio.sleep(0.05)
    assert not waiter.done(), "a second lease on a full pool must wait, not fail"
    await table.release("w1", first)
    assert await asyncio.wait_for(waiter, 1.0) == "a"
    assert table.queued == 1 and table.peak_in_use == 1


async def test_timeout_and_reclaim_from_a_dead_owner() -> None:
    table = LeaseTable([("a", 2)])
    await table.acquire("dead")
    await table.acquire("dead")
    with pytest.raises(TimeoutError):
        await table.acquire("live", timeout_s=0.05)
    assert await table.release_owner("dead") == 2
    assert table.in_use == 0
    assert await table.acquire("live", timeout_s=0.05) == "a"
    await table.release("dead", "a")  # stale release after reclaim: ignored, no negative count
    assert table.in_use == 1


def test_duplicate_or_empty_pool_rejected() -> None:
    with pytest.raises(ValueError):
        LeaseTable([])
    with pytest.raises(ValueError):
        LeaseTable([("a", 1), ("a", 2)])


def test_leased_session_releases_once_even_when_close_fails() -> None:
    released = []

    class Broken:
        def close(self) -> None:
            raise RuntimeError("server gone")

    session = LeasedSession(Broken(), lambda: released.append(1))
    with pytest.raises(RuntimeError):
        session.close()
    session.close()
    assert released == [1]
