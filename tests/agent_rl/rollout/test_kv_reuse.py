"""HFEngine's cross-turn KV reuse: the same samples and log-probs as re-prefilling every turn."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from agent_rl.rollout.engine import SamplingParams
from agent_rl.rollout.hf_engine import HFEngine

REUSE_TOLERANCE = 1e-4
"""Reuse vs re-prefill, float32: the reused keys were computed one token at a time (decode) where
the re-prefill computes them in one matmul, so logits differ by a few ulp, and log-probs of
magnitude ~6 by a few 1e-7 (measured max 9.5e-7 under AVX-512 and AVX2). 1e-4 leaves 100x for other
kernels and stays ~100x below a real bug (a shifted position or a stale key moves log-probs by 1e-2+)."""


def play(engine: HFEngine, turns: int, seed: int = 0) -> list[list[Any]]:
    """A lock-step multi-turn rollout: each turn's prompt is the last prompt + the sampled turn +
    a tool reply of random ids; a new episode joins on turn 2 (a batch that mixes hits and misses)."""
    rng = random.Random(seed)
    history = [[1] + [rng.randrange(3, 250) for _ in range(rng.randrange(5, 40))] for _ in range(4)]
    results = []
    for turn in range(turns):
        params = [
            SamplingParams(
                temperature=0.9,
                top_p=0.95 if i % 2 else 1.0,
                max_new_tokens=rng.randrange(3, 25),
                seed=97 * turn + i,
            )
            for i in range(len(history))
        ]
        outs = engine.generate(history, params)
        results.append(outs)
        history = [
            h + o.token_ids + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 20))]
            for h, o in zip(history, outs, strict=True)
        ]
        if turn == 1:
            history.append([1, 5, 6, 7, 8])
    return results


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> tuple[HFEngine, HFEngine]:
    reuse = HFEngine.from_pretrained(tiny_model_dir, max_model_len=2048, kv_reuse=True)
    plain = HFEngine.from_pretrained(tiny_model_dir, max_model_len=2048, kv_reuse=False)
    return reuse, plain


def assert_same(a: list[list[Any]], b: list[list[Any]]) -> None:
    for turn, (outs_a, outs_b) in enumerate(zip(a, b, strict=True)):
        for row, (x, y) in enumerate(zip(outs_a, outs_b, strict=True)):
            assert x.token_ids == y.token_ids, f"turn {turn} row {row}"
            assert x.finish_reason == y.finish_reason
            diff = (torch.tensor(x.log_probs) - torch.tensor(y.log_probs)).abs().max()
            assert diff <= REUSE_TOLERANCE, f"turn {turn} row {row}: log-probs differ by {diff}"


def test_reuse_matches_re_prefill_turn_by_turn(engines: tuple[HFEngine, HFEngine]) -> None:
    reuse, plain = engines
    reuse.clear_kv_cache()
    hits_before = reuse.kv_store.hits
    assert_same(play(reuse, turns=5), play(plain, turns=5))
    # Every episode after its first turn extends its own cached sequence: 4 x 4 + 1 x 2 hits.
    assert reuse.kv_store.hits - hits_before == 18
    assert plain.kv_store.hits == 0 and len(plain.kv_store) == 0


def test_release_cache_frees_every_entry(engines: tuple[HFEngine, HFEngine]) -> None:
    reuse, _ = engines
    play(reuse, turns=2)
    assert len(reuse.kv_store) > 0 and reuse.kv_store.bytes > 0
    reuse.release_cache()
    assert len(reuse.kv_store) == 0 and reuse.kv_store.bytes == 0


def test_in_place_weight_change_of_a_shared_module_drops_stale_kv(tiny_model_dir: Path) -> None:
    """A trainer that shares its module with the engine never calls update_weights: an optimizer
    step must still invalidate the kept keys, or the next turn would attend to old-weight KV."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    twin = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reuse = HFEngine(model, tokenizer, max_model_len=512, kv_reuse=True)
    plain = HFEngine(twin, tokenizer, max_model_len=512, kv_reuse=False)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=4)
    prompt = [1, 9, 10, 11, 12]
    first = reuse.generate([prompt], params)[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    loss = model(torch.tensor([prompt + first.token_ids])).logits.logsumexp(-1).mean()
    loss.backward()
    optimizer.step()
    twin.load_state_dict(model.state_dict())
    follow = prompt + first.token_ids + [20, 21, 22]
    assert_same([reuse.generate([follow], params)], [plain.generate([follow], params)])
