"""A reduced grid through the real experiment runner: a smoke test of the machinery, not of the claim."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

pytest.importorskip("torch")

from agent_rl.experiment import load_experiment, run_experiment, summarize_run

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
    assert (report.parent / "success_and_grad_norm_vs_tokens.png").stat().st_size > 0
    assert (report.parent / "warm_model" / "config.json").exists()
    results = json.loads((report.parent / "results.json").read_text())
    for runs in results.values():
        assert runs[0]["steps"] >= 1 and runs[0]["tokens_used"] > 0
        assert math.isfinite(runs[0]["grad_variance"])  # measured with grad_variance_every
        assert 0.0 <= runs[0]["heldout_success"] <= 1.0  # greedy eval of the final checkpoint
    assert "the warmed-up start: " in text
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
    assert again["tir_otb-N4"] == results["tir_otb-N4"] and again["grpo-N4"] == results["grpo-N4"]
