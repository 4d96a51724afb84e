"""DAPO's shaping on the learner side: clip-higher, overlong filter and soft overlong penalty."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agent_rl.batch import batch_from_tensors  # noqa: E402
from agent_rl.config import AlgoConfig, TrainConfig, build_config  # noqa: E402
from agent_rl.overlong import (  # noqa: E402
    OverlongConfig,
    overlong_loss_mask,
    overlong_penalties,
    shape_overlong_rewards,
)


def _batch(lengths: list[int], truncated: list[bool], rewards: list[float], width: int = 8):
    """Prompts of 2 tokens; row i has lengths[i] response tokens (mask 1), right-padded to `width`."""
    b = len(lengths)
    ids = torch.randint(10, 300, (b, 2 + width), generator=torch.Generator().manual_seed(0))
    attention = torch.zeros(b, 2 + width, dtype=torch.long)
    mask = torch.zeros(b, width)
    token_rewards = torch.zeros(b, width)
    for i, n in enumerate(lengths):
        attention[i, : 2 + n] = 1
        mask[i, :n] = 1
        token_rewards[i, n - 1] = rewards[i]
    return batch_from_tensors(
        ids,
        mask,
        torch.zeros(b, width),
        token_rewards,
        torch.tensor([0] * b),
        attention_mask=attention,
        truncated=torch.tensor(truncated),
    )


def test_penalty_hand_computed_with_ramp() -> None:
    # budget 10 tokens, ramp over the last 4: total lengths 4, 8, 9, 10 (prompt 2 + response)
    batch = _batch([2, 6, 7, 8], [False, False, False, True], [1.0, 1.0, 0.0, 0.0])
    cfg = OverlongConfig(mode="penalty", penalty=0.5, buffer=4, max_tokens=10)
    # ramp = clamp((L - 6) / 4, 0, 1): 0, 0.5, 0.75, 1 (and the truncated row gets the full 0.5)
    torch.testing.assert_close(overlong_penalties(batch, cfg), torch.tensor([0.0, 0.25, 0.375, 0.5]))
    shaped = shape_overlong_rewards(batch, cfg)
    torch.testing.assert_close(shaped.token_rewards.sum(1), torch.tensor([1.0, 0.75, -0.375, -0.5]))
    # the penalty sits on the last policy token, where the outcome reward is
    assert shaped.token_rewards[1, 5] == 0.75 and shaped.token_rewards[1, :5].abs().sum() == 0


def test_penalty_without_ramp_hits_only_truncated_rows_and_not_invalid_ones() -> None:
    batch = _batch([3, 8, 8], [False, True, True], [1.0, 0.0, 0.0])
    batch = type(batch)(**{**batch.__dict__, "valid": torch.tensor([True, True, False])})
    cfg = OverlongConfig(mode="penalty", penalty=1.0)
    torch.testing.assert_close(overlong_penalties(batch, cfg), torch.tensor([0.0, 1.0, 0.0]))


def test_filter_masks_truncated_rows_and_keep_changes_nothing() -> None:
    batch = _batch([3, 8], [False, True], [1.0, 0.0])
    mask = overlong_loss_mask(batch, OverlongConfig(mode="filter"))
    assert mask is not None and mask[0].sum() == 8 and mask[1].sum() == 0
    assert overlong_loss_mask(batch, OverlongConfig(mode="keep")) is None
    assert shape_overlong_rewards(batch, OverlongConfig(mode="keep")) is batch


def test_missing_truncation_flags_raise_with_the_fix() -> None:
    batch = _batch([3], [False], [1.0])
    batch = type(batch)(**{**batch.__dict__, "truncated": None})
    with pytest.raises(ValueError, match=r"algo\.overlong=keep"):
        overlong_loss_mask(batch, OverlongConfig(mode="filter"))


def test_config_fills_the_budget_and_rejects_a_ramp_wider_than_it() -> None:
    cfg = build_config({}, ["rollout.max_total_tokens=300"])
    assert cfg.algo.overlong == "keep" and cfg.algo.overlong_max_tokens == 300
    with pytest.raises(ValueError, match="overlong_buffer"):
        build_config({}, ["rollout.max_total_tokens=300", "algo.overlong_buffer=300"])


@pytest.fixture()
def model(tiny_model_dir):
    from agent_rl.build import load_model_and_tokenizer

    torch.manual_seed(0)
    m, _ = load_model_and_tokenizer(tiny_model_dir)
    return m


def _grads(model, algo: AlgoConfig, batch) -> torch.Tensor:
    from agent_rl.learner import Learner

    learner = Learner(model, algo, TrainConfig(lr=1e-3))
    scored = learner.prepare(batch)
    model.zero_grad(set_to_none=True)
    learner._accumulate(scored, learner._denominator(scored))
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return grads


def test_filtered_rows_contribute_no_gradient(model) -> None:
    """With overlong=filter, changing a truncated row's tokens does not change the gradient."""
    batch = _batch([3, 8, 5, 8], [False, True, False, True], [1.0, 0.0, 0.0, 0.0])
    other = type(batch)(**{**batch.__dict__, "input_ids": batch.input_ids.clone()})
    other.input_ids[1, 2:] = 7  # a different truncated episode
    algo = AlgoConfig(estimator="grpo", overlong="filter")
    torch.testing.assert_close(_grads(model, algo, batch), _grads(model, algo, other))
    kept = AlgoConfig(estimator="grpo", overlong="keep")
    assert not torch.allclose(_grads(model, kept, batch), _grads(model, kept, other))


def test_penalty_changes_the_advantages(model) -> None:
    from agent_rl.learner import Learner

    batch = _batch([3, 8, 5, 8], [False, True, False, False], [0.0, 0.0, 0.0, 0.0])
    plain = Learner(model, AlgoConfig(estimator="grpo"), TrainConfig()).prepare(batch)
    assert plain.advantages.abs().max() == 0  # all rewards equal: no signal
    penal = Learner(model, AlgoConfig(estimator="grpo", overlong="penalty"), TrainConfig()).prepare(batch)
    assert penal.advantages[1].max() < 0 and penal.advantages[0].max() > 0


def test_clip_higher_reaches_the_loss(model) -> None:
    from agent_rl.learner import Learner

    symmetric = Learner(model, AlgoConfig(clip_eps=0.2), TrainConfig()).loss_config
    assert symmetric.clip_ratio_low == symmetric.clip_ratio_high == 0.2
    dapo = Learner(model, AlgoConfig(clip_eps=0.2, clip_eps_high=0.28), TrainConfig()).loss_config
    assert (dapo.clip_ratio_low, dapo.clip_ratio_high) == (0.2, 0.28)
