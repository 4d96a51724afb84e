"""A tiny relay that lets TCP clients reach sandbox replicas that have no network at all.

Why it exists: in compose.yaml the sandbox service runs with ``network_mode: none``, so code it
executes has no network interface but loopback: no internet, no other containers, and no host
services either (a Docker ``internal`` network would still let it reach every port the host
listens on through the bridge address). The server listens on a Unix socket in a volume it
shares with this relay, one socket per replica (``<hostname>.sock``). The relay sits on normal
networks, publishes the API (on 127.0.0.1 only, see compose.yaml) and forwards bytes. It never
parses HTTP, holds no secrets and runs without capabilities; the sandbox still checks the bearer
token. Stdlib only: the image runs it as a plain script.

Replicas (``docker compose up --scale sandbox=N``) are found by listing the socket folder on every
connection. A client address always maps to the same live replica, because a session lives in one
replica's memory: every client host (and every trainer container) stays on one replica while
different clients spread over all of them.

Run: ``python3 gateway.py --upstream-dir /run/sandbox`` (or ``--upstream HOST:PORT`` to
relay to a TCP service instead). It listens on 127.0.0.1:8080 unless told otherwise: the relay has
no authentication of its own, so only pass ``--listen 0.0.0.0:PORT`` where the network in front of
it is private, as in compose.yaml (the container's port is published on the host's loopback only,
and the sandbox behind it still requires its bearer token). Listening beyond loopback is logged as
a warning.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import os
import signal
import sys

log = logging.getLogger("sandbox.gateway")
DEFAULT_LISTEN = "127.0.0.1:8080"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def rank_replicas(replicas: list[str], client: str) -> list[str]:
    """Replicas in the order this client should try them: stable per client, spread over clients.

    Rendezvous hashing: when a replica goes away only its own clients move elsewhere.
    """

    def score(replica: str) -> bytes:
        return hashlib.sha256(f"{client}|{replica}".encode()).digest()

    return sorted(set(replicas), key=score, reverse=True)


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
    """Forwards each accepted connection to one upstream: a Unix socket in a folder, or TCP."""

    def __init__(
        self,
        *,
        socket_dir: str | None = None,
        tcp: tuple[str, int] | None = None,
        connect_timeout_s: float = 5.0,
    ) -> None:
        if (socket_dir is None) == (tcp is None):
            raise ValueError("give exactly one of socket_dir and tcp")
        self.socket_dir = socket_dir
        self.tcp = tcp
        self.connect_timeout_s = connect_timeout_s

    def replicas(self) -> list[str]:
        if self.socket_dir is None:
            return []
        try:
            names = os.listdir(self.socket_dir)
        except OSError:
            return []
        return [os.path.join(self.socket_dir, n) for n in names if n.endswith(".sock")]

    async def _connect(self, client: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.tcp is not None:
            return await asyncio.wait_for(asyncio.open_connection(*self.tcp), self.connect_timeout_s)
        errors = []
        for path in rank_replicas(self.replicas(), client):
            try:  # a stale socket of a replica that went away refuses: try the next one
                return await asyncio.wait_for(asyncio.open_unix_connection(path), self.connect_timeout_s)
            except (OSError, asyncio.TimeoutError) as exc:
                errors.append(f"{os.path.basename(path)}: {exc}")
        raise ConnectionError("no live sandbox replica" + (f" ({'; '.join(errors)})" if errors else ""))

    async def handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        peer = client_w.get_extra_info("peername") or ("?", 0)
        try:
            up_r, up_w = await self._connect(str(peer[0]))
        except (OSError, asyncio.TimeoutError) as exc:
            log.warning("gateway: cannot serve %s: %s", peer[0], exc)
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


async def serve(listen: tuple[str, int], relay: Relay) -> None:
    server = await asyncio.start_server(relay.handle, *listen, reuse_address=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("gateway: listening on %s:%d -> %s", *listen, relay.socket_dir or relay.tcp)
    async with server:
        await stop.wait()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sandbox-gateway", description=(__doc__ or "").splitlines()[0])
    p.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        help="HOST:PORT to accept connections on (default: loopback; the relay has no auth of its own)",
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--upstream-dir", help="folder of the replicas' Unix sockets (*.sock)")
    target.add_argument("--upstream", help="HOST:PORT of a TCP upstream")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.upstream_dir:
        relay = Relay(socket_dir=args.upstream_dir)
    else:
        relay = Relay(tcp=_host_port(args.upstream, "--upstream"))
    listen = _host_port(args.listen, "--listen")
    if not _is_loopback(listen[0]):
        log.warning(
            "gateway: listening on %s, beyond loopback, with no authentication of its own; only the "
            "sandbox's bearer token protects it: keep this port on a private network",
            args.listen,
        )
    asyncio.run(serve(listen, relay))
    return 0


if __name__ == "__main__":
    sys.exit(main())
