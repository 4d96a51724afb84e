"""HFEngine specifics beyond the shared contract: sharing the trainer's module, dtypes (the nucleus
search and the draw: test_top_p.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from agent_rl.rollout.engine import SamplingParams
from agent_rl.rollout.hf_engine import HFEngine


def test_shared_trainer_module_is_sampled_in_eval_mode_and_handed_back(
    tiny_model_dir: Path, tokenizer: Any
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.train()
    engine = HFEngine(model, tokenizer, max_model_len=256)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    before = engine.generate([[1, 2, 3]], params)[0]
    assert model.training  # the trainer's mode is restored
    with torch.no_grad():  # a trainer update through the shared module is seen without update_weights
        generator = torch.Generator().manual_seed(0)
        for weight in model.parameters():
            weight.add_(0.5 * weight.std() * torch.randn(weight.shape, generator=generator))
    after = engine.generate([[1, 2, 3]], params)[0]
    assert after.log_probs != before.log_probs


def test_bfloat16_engine_samples_with_float32_log_probs(tiny_model_dir: Path) -> None:
    engine = HFEngine.from_pretrained(tiny_model_dir, dtype="bfloat16", max_model_len=256)
    out = engine.generate([[1, 2, 3], [4]], SamplingParams(temperature=1.0, max_new_tokens=10, seed=0))
    assert all(len(o.token_ids) == len(o.log_probs) > 0 for o in out)
    assert all(lp <= 0 for o in out for lp in o.log_probs)
    with pytest.raises(ValueError, match="dtype"):
        HFEngine.from_pretrained(tiny_model_dir, dtype="int8")


def test_update_weights_rejects_partial_or_foreign_state(hf_engine: Any) -> None:
    state = hf_engine.model.state_dict()
    with pytest.raises(KeyError, match="not in the sampler"):
        hf_engine.update_weights({**state, "extra.weight": torch.zeros(1)})
    partial = {k: v for k, v in state.items() if "layers.1." not in k}
    with pytest.raises(KeyError, match="lacks"):
        hf_engine.update_weights(partial)
    name = "model.norm.weight"
    with pytest.raises(ValueError, match="shape"):
        hf_engine.update_weights({**state, name: torch.zeros(3)})
