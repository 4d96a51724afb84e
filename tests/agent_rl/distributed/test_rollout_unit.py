"""Driver-side rollout pieces that need no cluster: sharding."""

from __future__ import annotations

from agent_rl.distributed.rollout import split_groups


def test_split_groups_contiguous_and_complete() -> None:
    assert split_groups(5, 2) == [[0, 1, 2], [3, 4]]
    assert split_groups(2, 4) == [[0], [1]]
    for b in range(1, 12):
        for w in range(1, 5):
            shards = split_groups(b, w)
            assert [g for s in shards for g in s] == list(range(b))
            assert all(shards) and max(map(len, shards)) - min(map(len, shards)) <= 1
