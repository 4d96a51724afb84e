"""Trajectory records: the self-check, JSONL/Parquet round trips, and the learner's collate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agent_rl.rollout.trajectory import (
    Trajectory,
    TrajectoryWriter,
    TurnRecord,
    collate,
    read_trajectories,
    step_files,
)


def make(traj_id: str = "t0", prompt: int = 3, group: int = 0, infra: str | None = None) -> Trajectory:
    return Trajectory(
        traj_id=traj_id,
        group_id=group,
        sample_index=0,
        task={"seed": 1, "options": [1, 2]},
        prompt_ids=list(range(10, 10 + prompt)),
        response_ids=[5, 6, 7, 8, 9],
        response_mask=[1, 1, 0, 0, 1],
        log_probs=[-0.1, -0.2, 0.0, 0.0, -0.3],
        token_rewards=[0.0, 0.5, 0.0, 0.0, 1.0],
        turns=[
            TurnRecord(policy_tokens=2, tool_tokens=2, reward=0.5, info={"x": 1}),
            TurnRecord(policy_tokens=1, reward=1.0),
        ],
        reward=1.5,
        num_policy_tokens=3,
        num_tool_tokens=2,
        stop_reason="terminated",
        infra_error=infra,
        timings={"total": 0.5},
    )


def test_check_catches_misaligned_lists() -> None:
    traj = make()
    traj.check()
    traj.log_probs.append(-1.0)
    with pytest.raises(AssertionError, match="5 response ids"):
        traj.check()
    traj = make()
    traj.response_mask[2] = 1  # a tool token slipped under the mask
    with pytest.raises(AssertionError, match="mask marks 4 tokens but 3 were sampled"):
        traj.check()
    traj = make()
    traj.log_probs[2] = -0.7
    with pytest.raises(AssertionError, match="mask-0 token"):
        traj.check()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_writer_round_trip(tmp_path: Path, fmt: str) -> None:
    trajs = [make("a"), make("b", prompt=5, group=1, infra="env.step: boom")]
    trajs[0].advantages = [0.5, -0.5, 0.0, 0.0, 1.0]
    writer = TrajectoryWriter(tmp_path, fmt=fmt)
    writer.write(0, trajs)
    path = writer.write(3, trajs)
    assert [p.name for p in step_files(tmp_path)] == [f"step_000000.{fmt}", f"step_000003.{fmt}"]
    back = read_trajectories(path)
    assert back == trajs
    assert not back[1].valid and back[0].valid


def test_collate_pads_prompts_left_and_responses_right() -> None:
    short, long = make("a", prompt=2), make("b", prompt=4, group=1, infra="boom")
    long.response_ids, long.response_mask = long.response_ids[:3], long.response_mask[:3]
    long.log_probs, long.token_rewards = long.log_probs[:3], long.token_rewards[:3]
    long.num_policy_tokens, long.num_tool_tokens = 2, 1
    batch = collate([short, long], pad_id=0)
    assert batch["prompt_length"] == 4
    assert batch["input_ids"].shape == (2, 9)
    assert batch["input_ids"][0].tolist() == [0, 0, 10, 11, 5, 6, 7, 8, 9]
    assert batch["attention_mask"][1].tolist() == [1, 1, 1, 1, 1, 1, 1, 0, 0]
    assert batch["position_ids"][0].tolist()[2:] == list(range(7))
    assert batch["responses"].tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]]
    assert batch["response_mask"][1].tolist() == [1, 1, 0, 0, 0]
    assert torch.allclose(batch["old_log_probs"][0], torch.tensor([-0.1, -0.2, 0.0, 0.0, -0.3]))
    assert batch["token_rewards"][0].tolist() == [0.0, 0.5, 0.0, 0.0, 1.0]
    assert batch["group_index"].tolist() == [0, 1]
    assert batch["valid"].tolist() == [True, False]


def test_collate_rejects_empty_and_broken_input() -> None:
    with pytest.raises(ValueError, match="at least one"):
        collate([], pad_id=0)
    broken = make()
    broken.response_mask.pop()
    with pytest.raises(AssertionError):
        collate([broken], pad_id=0)
