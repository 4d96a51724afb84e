"""Fixtures for env tests: the real LocalSandbox (shared), and a fault-injecting fake backend.

The fake is used only where a real sandbox cannot be made to fail on demand (outages).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

import envs
from sandbox import ExecResult, LocalSandbox, SandboxUnavailable


@pytest.fixture(scope="session")
def sandbox() -> Iterator[envs.Shared]:
    sb = LocalSandbox()
    yield envs.Shared(sb)
    sb.close()


@dataclass
class FaultyBackend:
    """Opens sessions that echo `print(...)` literals; fails on open or run when told to."""

    fail_open: bool = False
    fail_run: bool = False
    opened: int = 0
    closed: int = 0
    codes: list[str] = field(default_factory=list)

    def session(self, **limits: object) -> FaultySession:
        if self.fail_open:
            raise SandboxUnavailable("worker pool exhausted (injected)")
        self.opened += 1
        return FaultySession(self)


@dataclass
class FaultySession:
    backend: FaultyBackend

    def run(self, code: str, *, timeout_s: float | None = None) -> ExecResult:
        if self.backend.fail_run:
            raise SandboxUnavailable("connection reset (injected)")
        self.backend.codes.append(code)
        return ExecResult(stdout="ran\n")

    def close(self) -> None:
        self.backend.closed += 1

    def __enter__(self) -> FaultySession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
