"""Trajectory records: the self-check and JSONL/Parquet round trips."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_rl.rollout.trajectory import (
    Trajectory,
    TrajectoryWriter,
    TurnRecord,
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
    traj.check(deep=False)  # the collector's per-turn check reads lengths only
    traj = make()
    traj.num_tool_tokens += 1  # counts that disagree with the lists: found without reading tokens
    with pytest.raises(AssertionError, match="3 sampled \\+ 3 tool"):
        traj.check(deep=False)


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
