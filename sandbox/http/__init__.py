"""The HTTP backend: ``server`` (the FastAPI service over a LocalSandbox), ``client`` (``Client`` and
``AsyncClient``, with the sandbox's session shape) and ``settings`` (the service's configuration)."""

from __future__ import annotations
