"""The typed batch: collate's padding and fields, the policy mask made once, rows and re-gathering."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agent_rl.batch import PolicyScores, ScoredBatch, collate, gather_rows  # noqa: E402
from tests.agent_rl.rollout.test_trajectory import make  # noqa: E402


def _two() -> list:
    short, long = make("a", prompt=2), make("b", prompt=4, group=1, infra="boom")
    long.response_ids, long.response_mask = long.response_ids[:3], long.response_mask[:3]
    long.log_probs, long.token_rewards = long.log_probs[:3], long.token_rewards[:3]
    long.num_policy_tokens, long.num_tool_tokens = 2, 1
    return [short, long]


def test_collate_pads_prompts_left_and_responses_right() -> None:
    batch = collate(_two(), pad_id=0)
    assert batch.input_ids.shape == (2, 9) and batch.response_length == 5 and len(batch) == 2
    assert batch.input_ids[0].tolist() == [0, 0, 10, 11, 5, 6, 7, 8, 9]
    assert batch.attention_mask[1].tolist() == [1, 1, 1, 1, 1, 1, 1, 0, 0]
    assert batch.position_ids[0].tolist()[2:] == list(range(7))
    assert batch.responses.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]]
    assert batch.response_mask[1].tolist() == [1, 1, 0, 0, 0]
    # the same Python floats rounded to float32 on both sides: equal (allclose's default rtol 1e-5: ample)
    assert torch.allclose(batch.sampler_log_probs[0], torch.tensor([-0.1, -0.2, 0.0, 0.0, -0.3]))
    assert batch.token_rewards[0].tolist() == [0.0, 0.5, 0.0, 0.0, 1.0]
    assert batch.group_index.tolist() == [0, 1]
    assert batch.valid.tolist() == [True, False]


def test_policy_mask_is_sampled_tokens_of_valid_rows_only() -> None:
    batch = collate(_two(), pad_id=0)
    assert batch.policy_mask.dtype == torch.bool
    assert batch.policy_mask[0].tolist() == [True, True, False, False, True]
    assert not batch.policy_mask[1].any()  # the infrastructure failure has mask 1 tokens, none count
    assert batch.rows(torch.tensor([1, 0])).policy_mask[1].tolist() == [True, True, False, False, True]


def test_collate_rejects_empty_and_broken_input() -> None:
    with pytest.raises(ValueError, match="at least one"):
        collate([], pad_id=0)
    broken = make()
    broken.response_mask.pop()
    with pytest.raises(AssertionError):
        collate([broken], pad_id=0)


def test_batches_are_frozen_so_a_field_keeps_its_meaning() -> None:
    batch = collate(_two(), pad_id=0)
    with pytest.raises(AttributeError):
        batch.sampler_log_probs = torch.zeros(2, 5)  # type: ignore[misc]


def test_gather_rows_puts_scored_shards_back_in_batch_order() -> None:
    trajs = [make(str(i), group=i) for i in range(4)]
    batch = collate(trajs, pad_id=0)
    scores = PolicyScores(
        trainer_log_probs=torch.arange(20.0).view(4, 5),
        sum_pi_squared=torch.ones(4, 5),
        entropy=torch.zeros(4, 5),
    )
    scored = ScoredBatch(batch, scores, advantages=torch.arange(4.0)[:, None].expand(4, 5))
    rows = [torch.tensor([2, 0]), torch.tensor([3, 1])]
    parts = [scored.rows(r) for r in rows]
    back = gather_rows(parts, rows)
    assert torch.equal(back.advantages, scored.advantages)
    assert torch.equal(back.scores.trainer_log_probs, scores.trainer_log_probs)
    assert back.rollout.group_index.tolist() == [0, 1, 2, 3] and back.scores.ref_log_probs is None
