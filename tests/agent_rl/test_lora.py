"""LoRA on the policy: only adapters train, samplers get exactly the merged weights, a checkpoint is
the adapter alone, and a resumed run reproduces the straight one."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

pytest.importorskip("torch")

import torch

from agent_rl.build import load_model_and_tokenizer
from agent_rl.config import ConfigError, LoraConfig, build_config
from agent_rl.lora import apply_lora, load_policy_state, policy_state, sampler_weights
from agent_rl.metrics import read_metrics
from agent_rl.train import Trainer
from tests.agent_rl.test_train import SMALL, _compared

if os.environ.get("CI") != "true":  # CI installs peft ([all]): a skip there would hide a failure
    pytest.importorskip("peft")


def _lora_model(tiny_model_dir: Path) -> torch.nn.Module:
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    model = apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # peft starts B at 0 (a no-op adapter); give it a real delta to merge
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def test_merged_weights_give_the_adapted_models_logits(tiny_model_dir: Path) -> None:
    model = _lora_model(tiny_model_dir)
    plain, _ = load_model_and_tokenizer(tiny_model_dir)
    merged = sampler_weights(model)
    missing, unexpected = plain.load_state_dict(merged, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    ids = torch.randint(0, plain.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = model(input_ids=ids).logits, plain(input_ids=ids).logits
    # merging re-associates one float32 sum per weight (W + s*BA vs Wx + s*B(Ax)): ~1e-6 relative
    assert (want - got).abs().max() <= 1e-4 * want.abs().max()
    base = copy.deepcopy(model).merge_and_unload()  # peft's own (destructive) merge, on a copy
    for name, tensor in base.state_dict().items():
        assert torch.allclose(merged[name], tensor, atol=1e-6), name


def test_only_the_adapter_is_trained_and_checkpointed(tiny_model_dir: Path) -> None:
    model = _lora_model(tiny_model_dir)
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())
    state = policy_state(model)
    assert state and all("lora_" in k for k in state)
    fresh = apply_lora(load_model_and_tokenizer(tiny_model_dir)[0], LoraConfig(rank=4, alpha=8.0))
    load_policy_state(fresh, state)
    for k, v in policy_state(fresh).items():
        assert torch.equal(v, state[k]), k
    with pytest.raises(KeyError, match="does not match"):
        load_policy_state(fresh, {k: v for k, v in list(state.items())[1:]})


def test_lora_is_refused_where_it_is_not_wired() -> None:
    with pytest.raises(ConfigError, match="lora"):
        build_config({}, ["model.lora.rank=4", "scale.backend=ray"])


def _run(tiny_model_dir: Path, out: Path, name: str, steps: int, *extra: str) -> Trainer:
    sets = [
        *SMALL,
        f"model.path={tiny_model_dir}",
        f"run.out_dir={out}",
        f"run.name={name}",
        f"train.steps={steps}",
        "train.checkpoint_every=1",
        "model.lora.rank=4",
        "train.lr=1e-2",
        *extra,
    ]
    trainer = Trainer(build_config({}, sets))
    trainer.fit()
    return trainer


@pytest.mark.slow
def test_lora_training_moves_only_adapters_and_resumes_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    base, _ = load_model_and_tokenizer(tiny_model_dir)
    straight = _run(tiny_model_dir, tmp_path, "straight", 3)
    trained = sampler_weights(straight.model)
    frozen = straight.model.get_base_model().state_dict()
    for name, tensor in base.state_dict().items():
        module, leaf = name.rsplit(".", 1)
        key = name if name in frozen else f"{module}.base_layer.{leaf}"  # adapted modules wrap theirs
        assert torch.equal(frozen[key], tensor), name  # the base never moves
    assert any(not torch.equal(trained[n], t) for n, t in base.state_dict().items() if "proj" in n)
    saved = torch.load(tmp_path / "straight" / "checkpoints" / "step_000003" / "state.pt", weights_only=False)
    assert all("lora_" in k for k in saved["learner"]["model"])

    _run(tiny_model_dir, tmp_path, "resumed", 2)
    _run(tiny_model_dir, tmp_path, "resumed", 3)  # picks up from step 2's checkpoint
    assert _compared(tmp_path / "resumed") == _compared(tmp_path / "straight")


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_samples_with_the_merged_adapter(tiny_model_dir: Path, tmp_path: Path) -> None:
    """vLLM holds the plain architecture: after each update it must get the merged weights, or its
    log-probs would drift from the trainer's LoRA model's as the adapter grows."""
    if os.environ.get("CI") != "true":
        pytest.importorskip("vllm")
    _run(tiny_model_dir, tmp_path, "v", 3, "rollout.engine=vllm", "algo.entropy_coef=0.05")
    rows = [r for r in read_metrics(tmp_path / "v") if "losses/loss" in r]
    assert len(rows) == 3 and all(r["grad/norm"] > 0 for r in rows)
    # the same bound as the full-weight vLLM training test (tests/agent_rl/test_train.py)
    for r in rows:
        assert r["policy/sampler_trainer_logp_diff"] < 1e-3, r["policy/sampler_trainer_logp_diff"]
