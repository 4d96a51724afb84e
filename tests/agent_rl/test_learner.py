"""The learner on real tiny-model forward passes with hand-built batches (no env, no engine)."""

from __future__ import annotations

import math
import random

import pytest

torch = pytest.importorskip("torch")

from agent_rl.batch import RolloutBatch, batch_from_tensors  # noqa: E402
from agent_rl.build import load_model_and_tokenizer  # noqa: E402
from agent_rl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from agent_rl.config import AlgoConfig, TrainConfig  # noqa: E402
from agent_rl.learner import Learner  # noqa: E402


def make_batch(
    rewards: list[float], groups: list[int], valid: list[bool] | None = None, seed: int = 0
) -> RolloutBatch:
    """Prompt of 6 tokens, response of 10 with a tool span (mask 0) in the middle, outcome reward at the end."""
    g = torch.Generator().manual_seed(seed)
    b, p, r = len(rewards), 6, 10
    ids = torch.randint(10, 300, (b, p + r), generator=g)
    mask = torch.ones(b, r)
    mask[:, 4:7] = 0  # tool output
    token_rewards = torch.zeros(b, r)
    token_rewards[:, -1] = torch.tensor(rewards)
    return batch_from_tensors(
        ids,
        mask,
        sampler_log_probs=torch.zeros(b, r),
        token_rewards=token_rewards,
        group_index=torch.tensor(groups),
        valid=torch.tensor(valid if valid is not None else [True] * b),
    )


@pytest.fixture()
def model(tiny_model_dir):
    torch.manual_seed(0)
    m, _ = load_model_and_tokenizer(tiny_model_dir)
    return m


def params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


@pytest.mark.parametrize("estimator", ["tir_otb", "otb", "grpo", "rloo", "opo", "reinforce"])
def test_step_is_finite_and_moves_weights(model, estimator: str) -> None:
    learner = Learner(model, AlgoConfig(estimator=estimator, micro_batch_size=3), TrainConfig(lr=1e-3))
    before = params(model)
    scored, metrics = learner.step(make_batch([1, 0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1]))
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert not torch.equal(before, params(model))
    # tool tokens and padding never carry an advantage
    assert torch.all(scored.advantages[:, 4:7] == 0)
    # one epoch, one minibatch: the first forward equals the scoring pass, so nothing is clipped
    # (the ratio is 1 up to float32 rounding, ~1e-6, far inside [0.8, 1.2]: an exact count)
    assert metrics["losses/clipfrac"] == 0.0


def test_invalid_rows_and_uniform_groups_give_no_update(model) -> None:
    """Groups whose rewards are all equal have zero advantage; invalid rows are excluded entirely."""
    learner = Learner(model, AlgoConfig(estimator="grpo"), TrainConfig(lr=1e-2))
    before = params(model)
    batch = make_batch([1, 1, 0, 0, 5], [0, 0, 1, 1, 2], valid=[True, True, True, True, False])
    scored, _ = learner.step(batch)
    assert torch.all(scored.advantages[4] == 0)
    # exact: equal rewards give A = R - mean = 0 exactly, so every gradient is 0 and AdamW
    # (weight_decay 0) moves nothing
    assert torch.equal(before, params(model))


def test_gradient_accumulation_matches_one_big_batch(tiny_model_dir) -> None:
    """Micro-batching changes how the minibatch gradient is summed, not what it is.

    Compared before the optimiser step: after one AdamW step a parameter whose gradient is ~0
    moves by about +-lr whatever the sign of its float noise, so parameters are the wrong thing
    to compare. Tolerance: the two runs add the same per-token terms in a different order and
    through matmuls of different shapes (each micro-batch pads to its own longest row), so in
    float32 each gradient entry may differ by about (terms summed) x 2^-24 x (its magnitude).
    With ~10^3 terms per entry here, 1e-4 of the largest entry bounds that with room to spare,
    while a real accumulation error (a missing micro-batch or a wrong normaliser) moves entries
    by a sizeable fraction of themselves.
    """
    batch = make_batch([1, 0, 1, 0, 0, 1], [0, 0, 0, 1, 1, 1])
    grads = []
    for micro in (6, 2):
        torch.manual_seed(0)
        m, _ = load_model_and_tokenizer(tiny_model_dir)
        learner = Learner(
            m, AlgoConfig(estimator="tir_otb", micro_batch_size=micro), TrainConfig(lr=1e-3, seed=0)
        )
        captured: list[torch.Tensor] = []
        learner.optimizer.step = lambda *a, _m=m, _c=captured, **k: _c.append(  # type: ignore[method-assign]
            torch.cat([p.grad.flatten().clone() for p in _m.parameters()])
        )
        learner.step(batch)
        assert len(captured) == 1, "one minibatch, one optimiser step"
        grads.append(captured[0])
    scale = grads[0].abs().max()
    assert scale > 0
    assert torch.allclose(grads[0], grads[1], rtol=0, atol=1e-4 * float(scale))
    # and the check has teeth: dropping one micro-batch's contribution is far outside it
    assert not torch.allclose(grads[0], grads[1] * 2 / 3, rtol=0, atol=1e-4 * float(scale))


def test_checkpoint_restores_learner_and_rngs(model, tmp_path) -> None:
    learner = Learner(model, AlgoConfig(), TrainConfig(lr=1e-3))
    learner.step(make_batch([1, 0, 1, 0], [0, 0, 1, 1]))
    random.seed(7)
    torch.manual_seed(7)
    save_checkpoint(tmp_path, 3, learner=learner, data={"task_cursor": 24})
    expected_rand, expected_torch = random.random(), torch.rand(3)
    saved = params(model)
    learner.step(make_batch([0, 1, 1, 0], [0, 0, 1, 1], seed=1))
    assert not torch.equal(saved, params(model))
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.name == "step_000003"
    rest = load_checkpoint(ckpt, learner=learner)
    assert rest["step"] == 3 and rest["data"] == {"task_cursor": 24}
    assert torch.equal(saved, params(model))  # exact: restoring copies the saved tensors
    assert random.random() == expected_rand and torch.equal(torch.rand(3), expected_torch)


def test_exact_optimal_and_gradient_diagnostics_run_on_the_tiny_model(model) -> None:
    learner = Learner(model, AlgoConfig(estimator="exact_optimal"), TrainConfig(lr=1e-3))
    assert learner.needs("grad_sq_norms")
    scored, metrics = learner.step(make_batch([1, 0, 1, 0, 0, 1], [0, 0, 0, 1, 1, 1]), diagnose=True)
    norms = scored.grad_sq_norms
    assert norms is not None
    assert norms.shape == (6,) and torch.all(norms > 0)
    assert metrics["grad/exact_pg_variance"] > 0
    assert -1.0 <= metrics["grad/proxy_spearman"] <= 1.0
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_activation_checkpointing_gives_the_same_gradient(tiny_model_dir) -> None:
    """Checkpointing recomputes the same layers in backward, so the minibatch gradient is the same
    computation: equal up to float32 rounding of the recomputation (same kernels, same shapes, so
    normally bit for bit; 1e-6 of the largest entry allows for a kernel that is not), and the
    scoring pass (no grad, eval mode) is untouched."""
    batch = make_batch([1, 0, 1, 0, 0, 1], [0, 0, 0, 1, 1, 1])
    grads, log_probs = [], []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        m, _ = load_model_and_tokenizer(tiny_model_dir)
        learner = Learner(
            m, AlgoConfig(micro_batch_size=3), TrainConfig(lr=1e-3, activation_checkpointing=checkpointing)
        )
        assert m.is_gradient_checkpointing is checkpointing
        captured: list[torch.Tensor] = []
        learner.optimizer.step = lambda *a, _m=m, _c=captured, **k: _c.append(  # type: ignore[method-assign]
            torch.cat([p.grad.flatten().clone() for p in _m.parameters()])
        )
        scored, _ = learner.step(batch)
        grads.append(captured[0])
        log_probs.append(scored.scores.trainer_log_probs)
    assert torch.equal(log_probs[0], log_probs[1])
    scale = float(grads[0].abs().max())
    assert scale > 0 and torch.allclose(grads[0], grads[1], rtol=0, atol=1e-6 * scale)
