"""A tiny TCP relay that lets the host reach sandbox replicas on a network with no way out.

Why it exists: in compose.yaml the sandbox service sits only on an ``internal`` network, so code
it executes has no route to the outside world. Docker cannot publish a port from such a network,
so this relay, which sits on both the internal network and a normal one, publishes the API on
127.0.0.1 and forwards bytes to the sandbox replicas. It never parses HTTP, holds no secrets and
runs without capabilities; the sandbox still checks the bearer token.

Replicas (``docker compose up --scale sandbox=N``) are found by resolving the service name on every
connection. A client address always maps to the same replica (sessions live in one replica's
memory), so every client on the host reaches one replica through here; spreading sessions over
replicas is the client's job inside the network (pass all replica URLs, comma-separated).

Run: ``python -m sandbox.docker_gateway --listen 0.0.0.0:8080 --upstream sandbox:8080``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import signal
import socket
import sys

log = logging.getLogger("sandbox.gateway")


def pick_replica(addresses: list[str], client: str) -> str:
    """A stable choice per client address, spread evenly over the sorted replica addresses."""
    ordered = sorted(set(addresses))
    digest = hashlib.sha256(client.encode()).digest()
    return ordered[int.from_bytes(digest[:4], "big") % len(ordered)]


async def _resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(Exception):
            if writer.can_write_eof():
                writer.write_eof()


class Relay:
    def __init__(self, upstream_host: str, upstream_port: int, connect_timeout_s: float = 5.0) -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.connect_timeout_s = connect_timeout_s

    async def handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        peer = client_w.get_extra_info("peername") or ("?", 0)
        try:
            replicas = await _resolve(self.upstream_host, self.upstream_port)
            target = pick_replica(replicas, str(peer[0]))
            up_r, up_w = await asyncio.wait_for(
                asyncio.open_connection(target, self.upstream_port), self.connect_timeout_s
            )
        except (OSError, asyncio.TimeoutError) as exc:
            log.warning("gateway: no upstream for %s: %s", peer[0], exc)
            client_w.close()
            return
        await asyncio.gather(_pump(client_r, up_w), _pump(up_r, client_w))
        for w in (up_w, client_w):
            w.close()


def _host_port(text: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise SystemExit(f"{flag} must look like HOST:PORT, got {text!r}")
    return host, int(port)


async def serve(listen: tuple[str, int], upstream: tuple[str, int]) -> None:
    relay = Relay(*upstream)
    server = await asyncio.start_server(relay.handle, *listen, reuse_address=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("gateway: %s:%d -> %s:%d", *listen, *upstream)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sandbox.docker_gateway", description=__doc__.splitlines()[0])
    p.add_argument("--listen", default="0.0.0.0:8080", help="HOST:PORT to accept connections on")
    p.add_argument("--upstream", default="sandbox:8080", help="HOST:PORT of the sandbox service")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(_host_port(args.listen, "--listen"), _host_port(args.upstream, "--upstream")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
