"""Pipelined training (rollout.async_steps=1) with Ray rollout workers matches it in process."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from agent_rl.config import build_config
from agent_rl.metrics import read_metrics
from agent_rl.rollout.trajectory import read_trajectories
from agent_rl.train import Trainer
from tests.agent_rl.test_train import COMPARED_PREFIXES, SMALL

pytestmark = pytest.mark.slow

PIPELINED = ["rollout.async_steps=1", "train.steps=3", "algo.entropy_coef=0.05", "train.lr=3e-3"]


def _train(tiny_model_dir: Path, out: Path, name: str, extra: list[str]) -> dict[int, dict[str, float]]:
    sets = [
        *SMALL,
        "train.warmup.demos=8",
        f"model.path={tiny_model_dir}",
        f"run.out_dir={out}",
        f"run.name={name}",
        *PIPELINED,
        *extra,
    ]
    trainer = Trainer(build_config({}, sets))
    try:
        trainer.fit()
    finally:
        if hasattr(trainer.sampler, "shutdown"):
            trainer.sampler.shutdown()
    keep = (*COMPARED_PREFIXES, "offpolicy/", "async/")
    return {
        r["step"]: {k: v for k, v in r.items() if k.startswith(keep)}
        for r in read_metrics(out / name)
        if "losses/loss" in r
    }


def test_pipelined_ray_workers_match_pipelined_in_process(
    ray_cluster: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The workers collect step t+1 while the driver updates; they sample with the weights published
    after step t-1 (version recorded on each trajectory), exactly as the in-process frozen copy does."""
    local = _train(tiny_model_dir, tmp_path, "local", [])
    remote = _train(tiny_model_dir, tmp_path, "ray", ["scale.backend=ray", "scale.rollout_workers=2"])
    assert sorted(remote) == sorted(local) == [1, 2, 3]
    assert [remote[s]["async/staleness_max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    for step, want in local.items():
        assert set(remote[step]) == set(want)
        for key, value in want.items():
            got = remote[step][key]
            if key.startswith(("env/", "tokens/", "async/")):
                assert got == value, (step, key, got, value)
            else:
                assert math.isclose(got, value, rel_tol=1e-4, abs_tol=1e-6), (step, key, got, value)
    versions = [
        {t.policy_version for t in read_trajectories(f)}
        for f in sorted((tmp_path / "ray" / "rollouts").glob("step_*.jsonl"))
    ]
    assert versions == [{0}, {0}, {1}]
