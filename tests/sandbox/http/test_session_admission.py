"""Admission on the client side: more episodes at once than the server's ``max_sessions`` wait for a
session instead of failing (issue 14, item 6), and the wait is bounded with a clear error."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from envs.tools.python import PythonTool
from sandbox import AsyncClient, Client, SandboxUnavailable
from sandbox.http.server import create_app
from sandbox.http.settings import SandboxSettings
from tests.sandbox.conftest import need_bwrap
from tests.sandbox.http.test_client import serving

EPISODES = 8
CALLS = 3
HOLD_S = 0.2
"""Each episode keeps its session for CALLS cells of HOLD_S seconds, as a multi-turn episode would."""


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    need_bwrap()
    settings = SandboxSettings(pool_size=2, isolation="bwrap", max_sessions=2)
    with serving(create_app(settings)) as u:
        yield u


def _episode(tool: PythonTool) -> list[str]:
    """One episode as the env runs it: open on reset, a few calls that use the session's state, close."""
    tool.open()
    try:
        outs = []
        for _ in range(CALLS):
            code = f"import time; n = globals().get('n', 0) + 1; time.sleep({HOLD_S}); print(n)"
            outs.append(tool.call({"code": code}).text)
        return outs
    finally:
        tool.close()


def test_eight_episodes_share_two_sessions_without_a_failure(url: str) -> None:
    # Before: session creation gave up after 5 tries of Retry-After (about 5 s) and the episode
    # failed as an infrastructure error ("overloaded") although nothing was wrong.
    # retries=1: executions give up after one Retry-After; session creation is not bound by it.
    client = Client(url, retries=1, session_wait_s=60.0)
    try:
        tools = [PythonTool(client, timeout_s=10.0) for _ in range(EPISODES)]
        started = time.monotonic()
        with ThreadPoolExecutor(EPISODES) as pool:
            results = list(pool.map(_episode, tools))
        elapsed = time.monotonic() - started
    finally:
        client.close()
    assert results == [["1", "2", "3"]] * EPISODES  # no failure, and each session's state is its own
    waits = client.session_waits
    # At most 2 of 8 start at once, so at least 6 waited; at least 3 rounds of CALLS*HOLD_S ran.
    assert waits.waits >= EPISODES - 2, waits
    assert elapsed >= (EPISODES // 2 - 1) * CALLS * HOLD_S
    # Bounded: no session waited longer than the whole run took.
    assert 0 < waits.longest_s <= elapsed
    assert waits.total_s >= waits.longest_s


def test_the_wait_is_bounded_and_says_what_to_change(url: str) -> None:
    client = Client(url, session_wait_s=0.5)
    held = [client.session(), client.session()]  # the server's two sessions
    try:
        started = time.monotonic()
        with pytest.raises(SandboxUnavailable, match=r"session_wait_s=0\.5.*max_sessions"):
            client.session()
        waited = time.monotonic() - started
        assert 0.2 <= waited <= 3.0, waited  # up to the bound, not one try and not forever
        held.pop().close()
        with client.session() as s:  # capacity back: the next one opens
            assert s.run("print(7)").stdout == "7\n"
    finally:
        for s in held:
            s.close()
        client.close()


def test_async_client_waits_for_capacity_too(url: str) -> None:
    async def main() -> list[str]:
        async with AsyncClient(url, session_wait_s=60.0) as client:

            async def one(i: int) -> str:
                async with client.session() as s:
                    r = await s.run(f"import time; time.sleep({HOLD_S}); print({i})")
                    return r.stdout

            outs = await asyncio.gather(*(one(i) for i in range(6)))
            assert client.session_waits.waits >= 4
            return list(outs)

    assert asyncio.run(main()) == [f"{i}\n" for i in range(6)]


def test_session_wait_must_be_a_non_negative_number() -> None:
    with pytest.raises(ValueError, match="session_wait_s"):
        Client("http://127.0.0.1:9", session_wait_s=-1)
    with pytest.raises(ValueError, match="session_wait_s"):
        AsyncClient("http://127.0.0.1:9", session_wait_s=float("nan"))
