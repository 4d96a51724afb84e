"""The sandbox HTTP service (FastAPI); build it with ``create_app(settings)``."""

from __future__ import annotations

from sandbox.http.server.app import create_app

__all__ = ["create_app"]
