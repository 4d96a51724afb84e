"""DAPO's dynamic sampling: which groups are dropped, how more are collected, and the trainer's wiring."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from agent_rl.dynamic_sampling import collect_informative, split_groups
from agent_rl.rollout.trajectory import Trajectory


def traj(group: int, reward: float, valid: bool = True, tokens: int = 5) -> Trajectory:
    return Trajectory(
        traj_id=f"g{group}-{reward}",
        group_id=group,
        sample_index=0,
        task=group,
        reward=reward,
        num_policy_tokens=tokens,
        infra_error=None if valid else "sandbox down",
    )


def test_split_groups_keeps_only_groups_with_differing_valid_rewards() -> None:
    trajs = [
        *(traj(0, r) for r in (1, 0)),  # informative
        *(traj(1, r) for r in (1, 1)),  # all equal
        traj(2, 1),
        traj(2, 0, valid=False),  # one valid member: nothing to compare
        *(traj(3, r) for r in (0, 0, 1)),  # informative
    ]
    informative, dropped = split_groups(trajs)
    assert [g[0].group_id for g in informative] == [0, 3]
    assert [g[0].group_id for g in dropped] == [1, 2]


def rounds_of(rewards_per_round: list[list[list[float]]]):
    """A collect_round that serves the given rounds in order (group ids from first_group)."""
    calls: list[int] = []

    def collect_round(first_group: int) -> list[Trajectory]:
        calls.append(first_group)
        groups = rewards_per_round[len(calls)]
        return [traj(first_group + g, r) for g, rs in enumerate(groups) for r in rs]

    first = [traj(g, r) for g, rs in enumerate(rewards_per_round[0]) for r in rs]
    return first, collect_round, calls


def test_collects_more_rounds_until_the_batch_is_full() -> None:
    first, more, calls = rounds_of([[[1, 1], [0, 1]], [[0, 0], [0, 0]], [[1, 0], [1, 0]]])
    result = collect_informative(first, more, prompts=2, max_rounds=5)
    assert result.rounds == 3 and calls == [2, 4]
    assert sorted({t.group_id for t in result.trajectories}) == [1, 4]  # one from round 1, one from round 3
    # round 1's uniform group, round 2's two, and round 3's surplus informative group were dropped
    assert result.metrics(group_size=2) == {
        "train/dynamic_dropped_groups": 4.0,
        "train/dynamic_kept_groups": 2.0,
        "train/dynamic_rounds": 3.0,
    }


def test_the_cap_stops_collection_and_trains_on_what_it_has() -> None:
    first, more, calls = rounds_of([[[1, 1], [0, 1]], [[0, 0], [0, 0]], [[1, 0], [1, 0]]])
    result = collect_informative(first, more, prompts=2, max_rounds=2)
    assert result.rounds == 2 and calls == [2]
    assert {t.group_id for t in result.trajectories} == {1}


def test_no_informative_group_at_all_keeps_the_first_collection() -> None:
    first, more, _ = rounds_of([[[1, 1]], [[0, 0]]])
    result = collect_informative(first, more, prompts=1, max_rounds=2)
    assert result.trajectories == first and [t.group_id for t in result.dropped] == [1, 1]


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="max_rounds"):
        collect_informative([], lambda g: [], prompts=1, max_rounds=0)


def test_trainer_reads_new_tasks_with_new_seeds_and_counts_dropped_tokens() -> None:
    """Trainer._informative on a stub collector: the cursor advances per round, seeds differ,
    group ids are renumbered after the first round's, dropped tokens count toward the budget."""
    from agent_rl.config import build_config
    from agent_rl.train import Trainer

    cfg = build_config(
        {}, ["rollout.prompts_per_step=2", "rollout.group_size=2", "algo.dynamic_sampling=true"]
    )
    seen: list[tuple[list[int], int]] = []

    def collect(tasks, group_size, *, seed):
        seen.append(([t["first"] for t in tasks], seed))
        rewards = [(1.0, 0.0), (1.0, 1.0)]  # per round: one informative group, one not
        return [traj(g, r, tokens=3) for g in range(len(tasks)) for r in rewards[g]]

    stub = SimpleNamespace(
        cfg=cfg,
        task_cursor=2,  # the step's first collection already read tasks 0 and 1
        tokens_total=0,
        collector=SimpleNamespace(collect=collect),
        tasks=SimpleNamespace(
            reset_options=lambda split, n, first, wrap: [{"first": first + i} for i in range(n)]
        ),
    )
    first = [traj(0, 1.0), traj(0, 1.0), traj(1, 0.0), traj(1, 1.0)]
    kept, metrics = Trainer._informative(stub, first, seed=7)
    assert seen == [([2, 3], 7 + 2**32)] and stub.task_cursor == 4
    assert sorted({t.group_id for t in kept}) == [1, 2]  # round 2's group 0 became group 2
    assert metrics["train/dynamic_rounds"] == 2.0 and metrics["train/dynamic_dropped_groups"] == 2.0
    assert metrics["tokens/dropped"] == stub.tokens_total == 5 + 5 + 3 + 3
