"""``python -m sandbox serve``: run the HTTP service (``agent-rl sandbox ...`` forwards here)."""

from __future__ import annotations

import argparse
import logging
import sys

from pydantic import ValidationError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sandbox", description="Isolated persistent Python execution service")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP API (SANDBOX_* environment variables also apply)")
    serve.add_argument("--host", default=None, help="bind address (default 127.0.0.1; others need a token)")
    serve.add_argument("--port", type=int, default=None, help="port (default 8080)")
    serve.add_argument("--workers-pool-size", dest="pool_size", type=int, default=None, help="warm workers")
    serve.add_argument("--max-sessions", type=int, default=None)
    serve.add_argument("--max-concurrent-executions", type=int, default=None)
    serve.add_argument("--max-queued-executions", type=int, default=None)
    serve.add_argument("--session-idle-timeout-s", type=float, default=None)
    serve.add_argument("--isolation", choices=["auto", "bwrap", "rlimits"], default=None)
    serve.add_argument(
        "--require-isolation", action="store_true", default=None, help="refuse to run without bwrap"
    )
    serve.add_argument(
        "--python", default=None, help="interpreter the workers run (default /usr/bin/python3)"
    )
    serve.add_argument("--auth-token-env", default=None, help="variable holding the bearer token")
    serve.add_argument("--log-level", default="info")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "serve":
        return 2
    import uvicorn

    from sandbox.http.server import create_app
    from sandbox.http.settings import SandboxSettings

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "log_level")}
    try:
        settings = SandboxSettings.from_env(**overrides)
    except (ValidationError, ValueError) as e:
        print(f"sandbox: bad settings: {e}", file=sys.stderr)
        return 2
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level, access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
