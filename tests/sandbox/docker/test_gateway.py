"""The gateway relay without Docker: replica choice, Unix-socket relaying, dead replicas skipped."""

from __future__ import annotations

import asyncio
import os
from collections import Counter

import pytest

from sandbox.docker.gateway import Relay, build_parser, rank_replicas


def test_rank_is_stable_per_client_and_spreads_clients():
    replicas = [f"/run/sandbox/r{i}.sock" for i in range(3)]
    assert rank_replicas(replicas, "10.0.0.7") == rank_replicas(list(reversed(replicas)), "10.0.0.7")
    firsts = Counter(rank_replicas(replicas, f"10.0.{i // 256}.{i % 256}")[0] for i in range(600))
    assert set(firsts) == set(replicas) and min(firsts.values()) > 120  # roughly even


def test_losing_a_replica_moves_only_its_own_clients():
    replicas = [f"r{i}" for i in range(4)]
    clients = [f"c{i}" for i in range(400)]
    before = {c: rank_replicas(replicas, c)[0] for c in clients}
    after = {c: rank_replicas(replicas[:-1], c)[0] for c in clients}
    moved = [c for c in clients if before[c] != after[c]]
    assert moved and all(before[c] == "r3" for c in moved)


async def _echo_server(path: str, tag: bytes) -> asyncio.AbstractServer:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        data = await r.read(1024)
        w.write(tag + data)
        await w.drain()
        w.close()

    return await asyncio.start_unix_server(handle, path)


async def test_relays_to_a_live_replica_and_skips_stale_sockets(tmp_path):
    live = str(tmp_path / "live.sock")
    # A stale socket that this client (127.0.0.1) tries first, so skipping it is really exercised.
    stale = next(
        p
        for p in (str(tmp_path / f"stale{i}.sock") for i in range(100))
        if rank_replicas([live, p], "127.0.0.1")[0] == p
    )
    server = await _echo_server(live, b"live:")
    dead = await _echo_server(stale, b"dead:")
    dead.close()
    await dead.wait_closed()
    if not os.path.exists(stale):  # some Pythons unlink on close; recreate a refusing socket file
        import socket

        s = socket.socket(socket.AF_UNIX)
        s.bind(stale)
        s.close()
    relay = Relay(socket_dir=str(tmp_path))
    front = await asyncio.start_server(relay.handle, "127.0.0.1", 0)
    port = front.sockets[0].getsockname()[1]
    try:
        for _ in range(5):  # whatever the client's rank order, the answer comes from the live one
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"ping")
            await w.drain()
            assert await asyncio.wait_for(r.read(), 5) == b"live:ping"
            w.close()
    finally:
        front.close()
        server.close()


async def test_no_replica_closes_the_connection(tmp_path):
    relay = Relay(socket_dir=str(tmp_path))
    front = await asyncio.start_server(relay.handle, "127.0.0.1", 0)
    port = front.sockets[0].getsockname()[1]
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(r.read(), 5) == b""
        w.close()
    finally:
        front.close()


def test_relay_needs_exactly_one_upstream():
    with pytest.raises(ValueError):
        Relay()
    with pytest.raises(ValueError):
        Relay(socket_dir="/x", tcp=("h", 1))


def test_listens_on_loopback_unless_told_otherwise():
    """The relay has no auth of its own: 0.0.0.0 must be asked for (compose.yaml does, privately)."""
    assert build_parser().parse_args(["--upstream-dir", "/run/sandbox"]).listen == "127.0.0.1:8080"
    explicit = build_parser().parse_args(["--listen", "0.0.0.0:8080", "--upstream-dir", "/run/sandbox"])
    assert explicit.listen == "0.0.0.0:8080"
