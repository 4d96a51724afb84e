"""The metrics log survives a crash mid-append; plots, the warm-up log and W&B get what was logged."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agent_rl.metrics import MetricsLogger, WandbSink, read_metrics, smooth, write_plots


def test_a_half_written_line_is_dropped_on_read_and_on_resume(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        logger.log(step, {"losses/loss": float(step)})
    logger.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "losses/lo')  # killed mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]

    resumed = MetricsLogger(tmp_path, tensorboard=False)
    resumed.truncate_after(2)  # the checkpoint was at step 2
    resumed.log(3, {"losses/loss": 30.0})
    assert [(r["step"], r["losses/loss"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("\n")


def test_smooth_is_a_trailing_mean() -> None:
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smooth([2.0, 4.0], 1) == [2.0, 4.0]


def test_plots_skip_repeats_and_write_a_summary(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, tensorboard=False)
    for step in range(3):
        logger.log_warmup(step, 2.0 - step / 2)
    logger.log(0, {"eval/success_rate": 0.25})
    for step in range(1, 13):
        ok = float(step > 6)
        logger.log(
            step,
            {"env/success_rate": ok, "env/reward_mean": ok, "tokens/cumulative": 100 * step, "grad/norm": 1.0},
        )
    logger.log(12, {"eval/success_rate": 0.75})
    logger.close()
    names = {p.name for p in write_plots(tmp_path)}
    assert names == {"success.png", "grad_norm.png", "warmup_loss.png", "success_vs_tokens.png", "summary.png"}
    assert [r["warmup/loss"] for r in _warmup_rows(tmp_path)] == [2.0, 1.5, 1.0]
    MetricsLogger(tmp_path, tensorboard=False).log_warmup(0, 9.0)  # a new warm-up starts the file afresh
    assert [r["warmup/loss"] for r in _warmup_rows(tmp_path)] == [9.0]


def test_plots_of_a_run_without_warmup_or_grad_stats(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(1, {"env/success_rate": 0.5})
    assert {p.name for p in write_plots(tmp_path)} == {"success.png", "summary.png"}


def _warmup_rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "warmup.jsonl").read_text().splitlines()]


def test_wandb_gets_every_row_offline(tmp_path: Path) -> None:
    if os.environ.get("CI") != "true":  # CI installs it ([all]): a skip there would hide a failure
        pytest.importorskip("wandb")
    sink = WandbSink(tmp_path, "unit", "agent-rl-tests", "offline", {"train": {"steps": 2}})
    logger = MetricsLogger(tmp_path, tensorboard=False, wandb=sink)
    logger.log_warmup(0, 1.5)
    logger.log(1, {"env/success_rate": 0.5, "perf/rollout_s": 2.0, "note": "not a number"})
    logger.close()
    [record] = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    data = record.read_bytes()
    for key in (b"warmup/loss", b"warmup/step", b"env/success_rate", b"perf/rollout_s", b"rl/step"):
        assert key in data, key
    assert b"not a number" not in data
