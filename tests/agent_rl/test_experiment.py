"""A reduced grid through the real experiment runner: a smoke test of the machinery, not of the claim."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

pytest.importorskip("torch")

from agent_rl.experiment import (
    Cell,
    ExperimentConfig,
    Section,
    _cell_config,
    _claim,
    _runs,
    collapsed,
    load_experiment,
    run_experiment,
    summarize_run,
    summarize_section,
)

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "otb_vs_grpo.yaml"


def test_summary_of_a_hand_made_run() -> None:
    rows = [
        {"step": 0, "eval/success_rate": 0.0},
        *[
            {
                "step": i,
                "losses/loss": 0.1,
                "env/success_rate": s,
                "tokens/cumulative": 100 * i,
                "grad/norm": g,
                "perf/rollout_s": 45.0,
                "perf/update_s": 15.0,
            }
            for i, (s, g) in enumerate([(0.0, 1.0), (0.5, 1.0), (1.0, 9.0), (1.0, 1.0)], start=1)
        ],
    ]
    out = summarize_run(rows, target=0.5, spike_factor=3.0, window_tokens=250)
    assert out["tokens_to_target"] == 300  # moving average of (0, .5, 1) first reaches 0.5 at step 3
    # Python float means of halves and whole seconds: exact to ~1e-16; approx's default rel 1e-6
    assert out["final_success"] == pytest.approx((0.5 + 1.0 + 1.0) / 3)
    assert out["grad_spikes"] == 1 and out["steps"] == 4 and math.isnan(out["grad_variance"])
    assert out["minutes"] == pytest.approx(4.0)  # 4 steps of 45 s rollout + 15 s update
    assert out["peak_success"] == pytest.approx(out["final_success"]) and out["collapsed"] == 0.0
    assert out["success_at_equal_tokens"] == out["final_success"]  # no budget given: the end
    at = summarize_run(rows, target=0.5, spike_factor=3.0, window_tokens=250, equal_tokens=250)
    assert at["success_at_equal_tokens"] == pytest.approx(0.25)  # steps 1-2 are within 250 tokens


def test_collapse_is_lost_success_or_an_unrecovered_gradient_surge() -> None:
    assert collapsed([0.1, 0.6, 0.8, 0.3], [], drop=0.5, surge=10)  # 0.3 <= half the peak
    assert not collapsed([0.1, 0.6, 0.8, 0.5], [], drop=0.5, surge=10)
    assert not collapsed([0.0, 0.1, 0.0], [], drop=0.5, surge=10)  # never learned: not a collapse
    calm = [1.0] * 25
    assert not collapsed([0.5] * 30, [*calm, 50.0, *[1.0] * 4], drop=0.5, surge=10)  # recovered
    assert collapsed([0.5] * 30, [*calm, 50.0, *[40.0] * 4], drop=0.5, surge=10)


def _run(success: list[float], tokens_per_step: int) -> list[dict[str, float]]:
    return [
        {"losses/loss": 0.0, "env/success_rate": s, "tokens/cumulative": tokens_per_step * (i + 1)}
        for i, s in enumerate(success)
    ]


def test_equal_updates_section_reads_both_views() -> None:
    """N=32 spends more tokens per update (2x here): the equal-tokens budget is the N=4 cells', and
    tokens_to_best_large_n is when a cell first reaches the N=32 cell's final success."""
    exp = ExperimentConfig(
        cells=[Cell(estimator="tir_otb", group_size=4), Cell(estimator="grpo", group_size=32)],
        seeds=[0],
        max_steps=4,
        success_window=0.25,
    )
    rows = {
        "tir_otb-N4": {0: _run([0.2, 0.5, 0.7, 0.9], 100)},
        "grpo-N32": {0: _run([0.3, 0.6, 0.7, 0.8], 200)},
    }
    out = summarize_section(exp, Section("main", exp.cells, rows, equal_tokens=400.0))
    otb, big = out["tir_otb-N4"][0], out["grpo-N32"][0]
    assert otb["success_at_equal_tokens"] == pytest.approx(0.9)  # its whole run fits the budget
    assert big["success_at_equal_tokens"] == pytest.approx(0.6)  # its first 2 updates do
    assert big["final_success"] == pytest.approx(0.8) and otb["tokens_to_best_large_n"] == 400
    assert big["tokens_to_best_large_n"] == 800


def test_cell_overrides_and_label_reach_the_run_config(tmp_path: Path) -> None:
    exp = ExperimentConfig(cells=[Cell(estimator="grpo", group_size=4)], max_steps=3)
    cell = Cell(
        estimator="grpo",
        group_size=4,
        label="grpo-N4-deep",
        overrides={"train.lr": 1.0e-3, "env.kwargs": {"max_depth": 16}},
    )
    cfg = _cell_config(exp, cell, 2, tmp_path / "warm", tmp_path)
    assert cfg.train.lr == 1.0e-3 and cfg.env.kwargs == {"max_depth": 16}
    assert cfg.run.name == "grpo-N4-deep-s2" and cfg.train.max_rollout_tokens == 0 and cfg.train.steps == 3


def test_runs_go_cheapest_group_size_first_each_once_seeds_outermost() -> None:
    big, small, other = (
        Cell(estimator="grpo", group_size=32),
        Cell(estimator="grpo", group_size=4),
        Cell(estimator="rloo", group_size=4),
    )
    exp = ExperimentConfig(cells=[big, small], sections={"more": [small, other]}, seeds=[0, 1])
    order = [f"{cell.name}-s{seed}" for cell, seed in _runs(exp)]
    assert order == [
        "grpo-N4-s0", "grpo-N4-s1", "rloo-N4-s0", "rloo-N4-s1", "grpo-N32-s0", "grpo-N32-s1",
    ]  # fmt: skip


@pytest.mark.slow
def test_reduced_grid_writes_a_report(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exp = load_experiment(
        CONFIG,
        [
            f"out_dir={tmp_path}",
            "seeds=[0]",
            "max_rollout_tokens=400",
            "max_steps=2",
            "eval_tasks=4",
            f"base.model.path={tiny_model_dir}",
            "base.train.warmup.steps=2",
            "base.train.warmup.demos=8",
            "base.rollout.prompts_per_step=2",
            "base.rollout.max_new_tokens=16",
        ],
    )
    exp.cells = exp.cells[:2]  # tir_otb N=4 and grpo N=4
    report = run_experiment(exp)
    text = report.read_text()
    assert "| tir_otb-N4 |" in text and "| grpo-N4 |" in text
    assert (report.parent / "plot_main.png").stat().st_size > 0
    assert (report.parent / "warm_model" / "config.json").exists()
    results = json.loads((report.parent / "results.json").read_text())
    for runs in results["main"].values():
        assert runs[0]["steps"] >= 1 and runs[0]["tokens_used"] > 0
        assert math.isfinite(runs[0]["grad_variance"])  # measured with grad_variance_every
        assert 0.0 <= runs[0]["heldout_success"] <= 1.0  # greedy eval of the final checkpoint
    assert all(0.0 <= r[0]["start_heldout"] <= 1.0 for r in results["main"].values())
    assert json.loads((report.parent / "runs" / "grpo-N4-s0" / "final_eval.json").read_text())["tasks"] == 4

    # Run again with one more cell: the finished runs are reused, only the new one trains.
    import agent_rl.train

    trained: list[str] = []
    fit = agent_rl.train.Trainer.fit

    def counting_fit(self):  # type: ignore[no-untyped-def]
        trained.append(self.cfg.run.name)
        return fit(self)

    monkeypatch.setattr(agent_rl.train.Trainer, "fit", counting_fit)
    # A run saved before a setting existed (here: one dropped from its config.yaml) is still finished.
    saved = report.parent / "runs" / "tir_otb-N4-s0" / "config.yaml"
    old = yaml.safe_load(saved.read_text())
    del old["scale"]["worker_timeout_s"]
    saved.write_text(yaml.safe_dump(old))
    exp.cells = [*exp.cells, exp.cells[0].model_copy(update={"estimator": "rloo"})]
    again = json.loads((run_experiment(exp).parent / "results.json").read_text())
    assert trained == ["rloo-N4-s0"]
    assert again["main"]["tir_otb-N4"] == results["main"]["tir_otb-N4"]
    assert again["main"]["grpo-N4"] == results["main"]["grpo-N4"]


LONG = CONFIG.parent / "long_horizon.yaml"


@pytest.mark.slow
def test_long_horizon_grid_by_a_worker_then_one_report(tiny_model_dir: Path, tmp_path: Path) -> None:
    """configs/long_horizon.yaml reduced to its machinery: the shared warm-up, a worker that
    trains the runs, and a report with a table and a plot per section (main, lr frontier,
    horizon), the sections sharing the main table's runs."""
    exp = load_experiment(
        LONG,
        [
            f"out_dir={tmp_path}",
            "seeds=[0]",
            "max_steps=2",
            "eval_tasks=2",
            "warmup_threads=1",
            f"base.model.path={tiny_model_dir}",
            "base.train.warmup.steps=2",
            "base.train.warmup.demos=4",
            "base.train.warmup.check_demos=0",
            "base.rollout.max_new_tokens=24",
            "base.env.kwargs.max_depth=4",
        ],
    )
    main = exp.cells[:2]  # tir_otb-N4 and grpo-N4, depth 1..8
    depth2 = [c for c in exp.sections["horizon"] if c.name == "tir_otb-N4-d2"]
    exp.cells, exp.sections = main, {"lr_frontier": [main[1]], "horizon": [*depth2, main[0]]}
    warm = run_experiment(exp, "warmup")
    assert (warm / "config.json").exists() and not (warm.parent / "runs").exists()
    run_experiment(exp, "worker")  # a second worker beside it would claim other runs (test below)
    runs = sorted(p.name for p in (warm.parent / "runs").iterdir() if not p.name.startswith("start-"))
    assert runs == ["grpo-N4-s0", "tir_otb-N4-d2-s0", "tir_otb-N4-s0"]  # each once, shared by sections
    assert len([p for p in (warm.parent / "runs").iterdir() if p.name.startswith("start-")]) == 2
    report = run_experiment(exp)
    text = report.read_text()
    for section in ("main", "lr_frontier", "horizon"):
        assert f"## {section}" in text and (report.parent / f"plot_{section}.png").stat().st_size > 0
    results = json.loads((report.parent / "results.json").read_text())
    assert results["horizon"]["tir_otb-N4"] == results["main"]["tir_otb-N4"]  # the same run
    assert results["main"]["grpo-N4"][0]["steps"] == 2 and "collapsed" in results["main"]["grpo-N4"][0]


def test_a_warm_up_below_the_accuracy_floor_stops_the_experiment(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """An untrained start copies no key (per-turn accuracy 0): no warm model is saved and no
    run starts; the check's record says why."""
    exp = load_experiment(
        LONG,
        [
            f"out_dir={tmp_path}",
            "warmup_threads=1",
            "min_turn_accuracy=0.5",
            f"base.model.path={tiny_model_dir}",
            "base.train.warmup.steps=1",
            "base.train.warmup.demos=2",
            "base.train.warmup.check_demos=2",
            "base.env.kwargs.max_depth=2",
        ],
    )
    with pytest.raises(RuntimeError, match="min_turn_accuracy"):
        run_experiment(exp, "worker")
    out = tmp_path / exp.name
    assert json.loads((out / "warmup_failed.json").read_text())["turn_accuracy"] == 0.0
    assert not (out / "warm_model").exists() and not (out / "runs").exists()


def test_two_different_cells_may_not_share_a_name(tmp_path: Path) -> None:
    from agent_rl.config import ConfigError

    path = tmp_path / "exp.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "cells": [{"estimator": "grpo", "group_size": 4}],
                "sections": {
                    "other": [{"estimator": "grpo", "group_size": 4, "overrides": {"train.lr": 0.1}}]
                },
            }
        )
    )
    with pytest.raises(ConfigError, match="grpo-N4"):
        load_experiment(path)


def test_a_run_is_claimed_by_one_live_process_and_taken_over_from_a_dead_one(tmp_path: Path) -> None:
    import os
    import subprocess

    first = _claim(tmp_path, "grpo-N4-s0")
    assert first is not None and first.read_text() == str(os.getpid())
    assert _claim(tmp_path, "grpo-N4-s0") is None  # held by a live process (this one)
    assert _claim(tmp_path, "grpo-N4-s1") is not None  # other runs stay free
    gone = subprocess.Popen(["true"])
    gone.wait()
    first.write_text(str(gone.pid))  # as if a crashed worker held it
    again = _claim(tmp_path, "grpo-N4-s0")
    assert again is not None and again.read_text() == str(os.getpid())
    assert sorted(p.name for p in (tmp_path / "claims").iterdir()) == ["grpo-N4-s0", "grpo-N4-s1"]
