"""Driver-side pieces that need no cluster: sharding and config checks."""

from __future__ import annotations

import pytest

from agent_rl.config import build_config
from agent_rl.distributed.rollout import RayRollout, split_groups


def test_split_groups_contiguous_and_complete() -> None:
    assert split_groups(5, 2) == [[0, 1, 2], [3, 4]]
    assert split_groups(2, 4) == [[0], [1]]
    for b in range(1, 12):
        for w in range(1, 5):
            shards = split_groups(b, w)
            assert [g for s in shards for g in s] == list(range(b))
            assert all(shards) and max(map(len, shards)) - min(map(len, shards)) <= 1


def test_learner_workers_above_one_is_a_clear_error() -> None:
    cfg = build_config({}, ["scale.backend=ray", "scale.learner_workers=2"])
    with pytest.raises(NotImplementedError, match="learner_workers"):
        RayRollout.from_config(cfg, "/nonexistent")
