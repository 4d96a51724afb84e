"""HFEngine specifics beyond the shared contract: sharing the trainer's module, dtypes (the nucleus
search and the draw: test_top_p.py)."""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
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


def test_lm_head_sees_only_the_last_position(hf_engine: Any) -> None:
    """A prefill of B x N prompt tokens needs B x V logits, not B x N x V (0.6 MB per prompt token at a
    152k vocabulary)."""
    rows: list[tuple[int, ...]] = []
    hook = hf_engine.model.lm_head.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape))
    try:
        hf_engine.generate([list(range(3, 40)), [5, 6]], SamplingParams(temperature=1.0, max_new_tokens=3, seed=0))
    finally:
        hook.remove()
    assert len(rows) == 3 and all(shape[:2] == (2, 1) for shape in rows)


FAULTS_PER_CALL = """
import resource, sys
from agent_rl.rollout.engine import SamplingParams
from agent_rl.rollout.hf_engine import HFEngine
engine = HFEngine.from_pretrained(sys.argv[1], max_model_len=512, keep_freed_memory=sys.argv[2] == "1")
prompts = [[3 + (i * 7 + j) % 200 for j in range(200)] for i in range(16)]
faults = []
for _ in range(12):
    engine.release_cache()
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8, seed=0))
    faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
print(faults)
"""


@pytest.mark.slow  # two subprocesses, ~10 s
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the malloc thresholds are glibc's")
def test_generate_calls_reuse_freed_memory_instead_of_faulting_it_back(tiny_model_dir: Path) -> None:
    """With keep_freed_memory (the default on CPU) a call after the first few faults in (almost) no
    fresh pages; glibc's defaults unmapped and re-faulted 0.5-4k pages a call even at this size."""

    def faults(keep: bool) -> list[int]:
        out = subprocess.run(
            [sys.executable, "-c", FAULTS_PER_CALL, str(tiny_model_dir), str(int(keep))],
            capture_output=True, text=True, check=True, timeout=120,
        )  # fmt: skip
        return json.loads(out.stdout.strip().splitlines()[-1])

    kept, default = faults(True)[-8:], faults(False)[-8:]
    assert statistics.median(kept) <= 50, (kept, default)  # a median: a call may still grow the heap once
    assert statistics.median(default) >= 300, (kept, default)  # the control: the same calls without it
