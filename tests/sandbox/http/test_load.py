"""The load benchmark's quick mode (benchmarks/sandbox_load.py --quick) as a CI check: 500 mixed
requests at concurrency 64 against a real server subprocess, with nothing lost and nothing leaked."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.sandbox.conftest import need_bwrap

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "sandbox_load.py"


def _bench() -> object:
    spec = importlib.util.spec_from_file_location("sandbox_load", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_quick_mixed_load_loses_nothing() -> None:
    need_bwrap()
    bench = _bench()
    report = bench.run(500, 64, seed=0)  # type: ignore[attr-defined]
    assert report.problems() == []
    assert report.server_errors == 0 and report.connection_errors == 0 and report.zombies == 0
    # Every kind of request was sent and answered: 300 session executions, 150 /run_code, 50 bad.
    statuses = report.tally.statuses
    assert statuses[("session", 200)] == 300
    assert statuses[("run_code", 200)] == 150
    assert sum(n for (kind, s), n in statuses.items() if kind.startswith("bad:") and 400 <= s < 500) == 50
    assert sum(report.tally.executed.values()) == 300 and report.mismatched == {}


def test_the_mix_is_fixed_by_its_seed() -> None:
    bench = _bench()
    ops = bench.make_ops(1000, seed=1)  # type: ignore[attr-defined]
    kinds = [op.kind for op in ops]
    assert (kinds.count("session"), kinds.count("run_code"), kinds.count("bad")) == (600, 300, 100)
    assert [(o.kind, o.arg) for o in ops] == [(o.kind, o.arg) for o in bench.make_ops(1000, seed=1)]  # type: ignore[attr-defined]
