"""Driver-side learner-rank pieces that need no cluster: config checks, shards, metric reduction."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from agent_rl.batch import batch_from_tensors, gather_rows  # noqa: E402
from agent_rl.config import ConfigError, build_config  # noqa: E402
from agent_rl.distributed.learner import reduce_update_metrics, shard_rows  # noqa: E402
from agent_rl.parallel import Shard  # noqa: E402


def test_learner_ranks_need_ray_and_a_group_each() -> None:
    with pytest.raises(ConfigError, match=r"scale\.backend=ray"):
        build_config({}, ["scale.learner_workers=2"])
    with pytest.raises(ConfigError, match="at least as many groups"):
        build_config({}, ["scale.backend=ray", "scale.learner_workers=3", "rollout.prompts_per_step=2"])
    cfg = build_config({}, ["scale.backend=ray", "scale.learner_workers=2", "scale.worker_timeout_s=30"])
    assert cfg.scale.learner_workers == 2 and cfg.scale.worker_timeout_s == 30.0
    with pytest.raises(ConfigError, match="worker_timeout_s"):
        build_config({}, ["scale.worker_timeout_s=0"])


def test_shards_hold_whole_groups_and_gather_restores_the_order() -> None:
    groups = torch.tensor([4, 4, 7, 7, 7, 2, 9, 9])  # ids need not be sorted, sizes may differ
    rows = shard_rows(groups, 2)
    assert [r.tolist() for r in rows] == [[0, 1, 2, 3, 4], [5, 6, 7]]
    assert [r.tolist() for r in shard_rows(groups, 4)] == [[0, 1], [2, 3, 4], [5], [6, 7]]
    with pytest.raises(ValueError, match="4 groups but there are 5 learner ranks"):
        shard_rows(groups, 5)
    # Interleaved groups (not produced by collate, but allowed): shards are still whole groups.
    mixed = torch.tensor([0, 1, 0, 1])
    rows = shard_rows(mixed, 2)
    assert [r.tolist() for r in rows] == [[0, 2], [1, 3]]
    ids = torch.arange(4)[:, None] * 10 + torch.arange(3)  # (4, 3): row i starts at 10 i
    batch = batch_from_tensors(ids, torch.ones(4, 2), torch.zeros(4, 2), torch.zeros(4, 2), mixed)
    gathered = gather_rows([batch.rows(r) for r in rows], rows)
    assert torch.equal(gathered.input_ids, ids) and torch.equal(gathered.group_index, mixed)


def test_shard_keeps_its_rows_of_a_global_minibatch_in_order() -> None:
    shard = Shard(rows=torch.tensor([5, 6, 7]), total=8)
    assert shard.local(torch.tensor([7, 0, 5, 3])).tolist() == [2, 0]
    assert shard.local(torch.tensor([0, 1])).tolist() == []


def test_rank_metrics_reduce_to_the_single_process_values() -> None:
    """Two optimiser steps; rank 0 ran two micro-batches in step 0, rank 1 one (and none in step 1)."""

    def rec(loss: float, clip: float, rmax: float, n: float) -> dict[str, float]:
        return {"losses/loss": loss, "losses/clipfrac": clip, "losses/ratio_max": rmax, "losses/n_tokens": n}

    grad = {"grad/norm": 0.5, "grad/max_norm": 0.7, "perf/lr": 1e-3}
    rank0 = (
        {**grad, "losses/loss": -1.0},
        [(0, rec(0.1, 0.5, 1.1, 2)), (0, rec(0.2, 0.0, 1.3, 6)), (1, rec(0.4, 1.0, 0.9, 4))],
    )
    rank1 = ({**grad, "losses/loss": -2.0}, [(0, rec(0.3, 0.25, 1.2, 8))])
    out = reduce_update_metrics([rank0, rank1])
    # step 0: loss 0.1+0.2+0.3, clipfrac token-weighted (0.5*2+0*6+0.25*8)/16, max 1.3; step 1 alone.
    # Python float sums of a few decimal literals: ~1e-16 relative, inside isclose's default rel 1e-9.
    assert math.isclose(out["losses/loss"], (0.6 + 0.4) / 2)
    assert math.isclose(out["losses/clipfrac"], ((3.0 / 16) + 1.0) / 2)
    assert math.isclose(out["losses/ratio_max"], (1.3 + 0.9) / 2)
    assert math.isclose(out["losses/n_tokens"], (16 + 4) / 2)
    assert {k: out[k] for k in grad} == grad  # identical on every rank: taken from rank 0
