"""A 16-turn, 4k+-token chain episode end to end: collector, HF engine with KV reuse, tiny model.

The tiny model cannot solve a chain, so its turns are forced: `ForcedChainEngine` is the real
HFEngine (prefill, cross-turn KV reuse, decoding, stop rules) whose sampler picks the scripted
action's next token instead of a random one, and reports that token's log-prob under the model.
The test then checks what long horizons stress: budgets, the stop reason, the reward, KV reuse on
every turn after the first, and that a trainer forward over 4k+ recorded ids reproduces every
recorded log-prob.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from agent_rl.batch import collate
from agent_rl.rollout.collector import Collector, CollectorConfig
from agent_rl.rollout.engine import Completion, SamplingParams
from agent_rl.rollout.hf_engine import HFEngine
from envs.parsing import get_format
from envs.tasks.chain import ChainEnv

DEPTH = 15
"""15 lookups + the answer turn = 16 turns."""
LONG_TOLERANCE = 2e-4
"""Recorded vs recomputed log-probs over a 4k-token context, float32: the HF_TOLERANCE argument
(a few ulp of |log p| ~ 6) plus attention sums over 4k keys instead of a few hundred (rounding grows
~sqrt(length)); measured max 2e-6."""


class ForcedChainEngine(HFEngine):
    """HFEngine whose rows follow the chain script: lookup(last key) until DEPTH lookups, then answer."""

    def generate(self, prompts: Any, params: Any) -> list[Completion]:
        self._scripts = [self._script(list(p)) for p in prompts]
        self._step = 0
        return super().generate(prompts, params)

    def _script(self, prompt: list[int]) -> list[int]:
        text = self.tokenizer.decode(prompt)
        keys = re.findall(r"next: (\d{6})", text)
        depth = int(re.search(r"\((\d+) lookups", text).group(1))
        last = keys[-1] if keys else re.search(r"Start at key (\d{6})", text).group(1)
        action = (
            get_format("hermes").render_call("lookup", {"key": int(last)})
            if len(keys) < depth
            else f"\\boxed{{{last}}}"
        )
        return [*self.tokenizer.encode(action), self.eos_token_id]

    def _sample(self, logits, temperature, top_p, gens, active):  # type: ignore[no-untyped-def]
        log_probs = logits.log_softmax(dim=-1)  # (B, V) temperature 1, top_p 1: the model's own
        tokens, lps = [], []
        for i, script in enumerate(self._scripts):
            tok = script[min(self._step, len(script) - 1)] if active[i] else self.pad_token_id
            tokens.append(tok)
            lps.append(float(log_probs[i, tok]) if active[i] else 0.0)
        self._step += 1
        return tokens, lps


@pytest.mark.slow
def test_sixteen_turn_chain_of_4k_tokens_on_the_hf_engine(
    tiny_model_dir: Path, tokenizer: Any, reference_model: Any
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    engine = ForcedChainEngine(model, tokenizer, max_model_len=8192, kv_reuse=True)
    config = CollectorConfig(
        sampling=SamplingParams(temperature=1.0, max_new_tokens=96),
        max_turns=32,
        max_total_tokens=8192,
        max_tool_tokens=512,
    )
    collector = Collector(
        engine, tokenizer, lambda: ChainEnv(min_depth=DEPTH, max_depth=DEPTH, noise_lines=12), config
    )
    hits = engine.kv_store.hits
    trajs = collector.collect([{"task_index": 0}, {"task_index": 1}], group_size=1)
    for t in trajs:
        t.check()
        assert t.stop_reason == "terminated" and t.reward == 1.0, (t.stop_reason, t.turns[-1].info)
        assert len(t.turns) == DEPTH + 1
        assert len(t.prompt_ids) + len(t.response_ids) >= 4000
        assert all(turn.tool_truncated_tokens == 0 for turn in t.turns)
    # Every turn after the first reused its episode's cache; the cache is released after collect().
    assert engine.kv_store.hits - hits == 2 * DEPTH
    assert len(engine.kv_store) == 0

    batch = collate(trajs, pad_id=tokenizer.pad_token_id)
    r_len = batch.response_length
    with torch.no_grad():
        logits = reference_model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits.float()  # (B, L, V)
    recomputed = logits[:, -r_len - 1 : -1].log_softmax(-1).gather(-1, batch.responses[..., None])[..., 0]
    mask = batch.policy_mask
    assert mask.sum() == sum(t.num_policy_tokens for t in trajs)
    diff = (recomputed - batch.sampler_log_probs)[mask].abs().max()
    assert diff < LONG_TOLERANCE, diff


def test_budgets_end_a_long_chain_with_recorded_reasons(tiny_model_dir: Path, tokenizer: Any) -> None:
    """max_total_tokens and max_tool_tokens bind long before the chain ends: both are recorded."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    engine = ForcedChainEngine(model, tokenizer, max_model_len=8192)
    config = CollectorConfig(
        sampling=SamplingParams(max_new_tokens=96), max_turns=32, max_total_tokens=1500, max_tool_tokens=64
    )
    collector = Collector(
        engine, tokenizer, lambda: ChainEnv(min_depth=DEPTH, max_depth=DEPTH, noise_lines=12), config
    )
    (traj,) = collector.collect([{"task_index": 0}], group_size=1)
    assert traj.stop_reason == "max_total_tokens"
    assert len(traj.prompt_ids) + len(traj.response_ids) <= 1500
    assert all(turn.tool_truncated_tokens > 0 for turn in traj.turns[:-1])  # cut, with the marker
    tool_text = tokenizer.decode(
        [i for i, m in zip(traj.response_ids, traj.response_mask, strict=True) if not m]
    )
    assert "truncated" in tool_text
