"""Shared fixtures. The tiny model is built once per run into a cache folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# One torch thread per process: on 2 shared cores, OpenMP threads that spin-wait against sandbox
# workers and subprocesses made tiny-model tests an order of magnitude slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

CACHE = Path(
    os.environ.get("AGENT_RL_TEST_CACHE", Path(__file__).resolve().parent.parent / ".cache" / "tests")
)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """Directory of the default tiny Qwen2 model + tokenizer (built on first use, then reused)."""
    pytest.importorskip("torch", reason="the train extra is not installed")
    from agent_rl.tiny_model import ensure_tiny_model

    return ensure_tiny_model(CACHE / "tiny-model")


NUMERICS_MODULES = {
    "test_advantages",
    "test_batch",
    "test_checkpoint",
    "test_grad_stats",
    "test_learner",
    "test_logprobs",
    "test_loss",
    "test_offpolicy",
    "test_overlong",
    "test_train",
    "test_warmup",
}
"""Test modules whose results are floating-point arithmetic (learner, log-probs, advantages,
resume). `scripts/test.sh` runs them a second time under ATEN_CPU_CAPABILITY=avx2: CPUs differ
in kernel paths (AVX2, AVX-512, AMX), and a tolerance must hold on all of them."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if module in NUMERICS_MODULES or module.startswith("test_advantages"):
            item.add_marker(pytest.mark.numerics)
