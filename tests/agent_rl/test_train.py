"""End-to-end: the real trainer on the tiny model, the easy arithmetic env and the local sandbox."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from agent_rl.config import build_config
from agent_rl.metrics import read_metrics
from agent_rl.train import Trainer

SMALL = [
    "env.id=agent_rl/PythonArithEasy-v0",
    "env.eval_tasks=2",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=24",
    "rollout.max_turns=2",
    "train.warmup.steps=3",
    "train.warmup.batch_size=4",
    "train.lr=1e-3",
    "run.progress=false",
]
# Everything that depends on the sampled tokens and the update, nothing that depends on the clock.
COMPARED_PREFIXES = ("losses/", "grad/", "adv/", "env/", "tokens/", "policy/entropy", "policy/proxy_w_mean")


def test_smoke_training_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = build_config(
        {},
        [
            *SMALL,
            f"model.path={tiny_model_dir}",
            f"run.out_dir={tmp_path}",
            "run.name=smoke",
            "train.steps=2",
        ],
    )
    summary = Trainer(cfg).fit()
    run = tmp_path / "smoke"
    rows = [r for r in read_metrics(run) if "losses/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for k, v in r.items():
            if isinstance(v, float):
                assert math.isfinite(v), (k, v)
        assert r["tokens/policy"] > 0
    assert rows[-1]["tokens/cumulative"] == rows[0]["tokens/total"] + rows[1]["tokens/total"]
    for name in ("config.yaml", "summary.json", "rollouts/step_000000.jsonl", "rollouts/step_000001.jsonl"):
        assert (run / name).exists(), name
    assert (run / "checkpoints" / "step_000002").is_dir()
    assert {Path(p).name for p in summary["plots"]} >= {"success.png", "grad_norm.png", "summary.png"}
    assert summary["eval_after"]["eval/infra_errors"] == 0
    record = json.loads((run / "rollouts" / "step_000001.jsonl").read_text().splitlines()[0])
    assert len(record["advantages"]) == len(record["response_ids"]) == len(record["response_mask"])
    assert all(a == 0 for a, m in zip(record["advantages"], record["response_mask"]) if m == 0)


def _train_cmd(tiny_model_dir: Path, out: Path, name: str) -> list[str]:
    sets = [
        *SMALL,
        f"model.path={tiny_model_dir}",
        f"run.out_dir={out}",
        f"run.name={name}",
        "train.steps=4",
        "train.checkpoint_every=1",
    ]
    return [sys.executable, "-m", "agent_rl.cli", "train", *[a for s in sets for a in ("--set", s)]]


def _compared(run: Path) -> dict[int, dict[str, float]]:
    return {
        r["step"]: {k: v for k, v in r.items() if k.startswith(COMPARED_PREFIXES)}
        for r in read_metrics(run)
        if "losses/loss" in r
    }


@pytest.mark.slow
def test_kill_9_then_resume_reproduces_losses_bit_for_bit(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONHASHSEED="0")
    subprocess.run(_train_cmd(tiny_model_dir, tmp_path, "straight"), check=True, env=env, timeout=900)

    proc = subprocess.Popen(_train_cmd(tiny_model_dir, tmp_path, "killed"), env=env)
    ckpt = tmp_path / "killed" / "checkpoints" / "step_000002" / "state.pt"
    deadline = time.monotonic() + 600
    while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed; make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    subprocess.run(_train_cmd(tiny_model_dir, tmp_path, "killed"), check=True, env=env, timeout=900)

    straight, resumed = _compared(tmp_path / "straight"), _compared(tmp_path / "killed")
    assert sorted(resumed) == [1, 2, 3, 4]
    assert resumed == straight  # exact float equality, step by step


def test_eval_command_scores_the_latest_checkpoint(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    from agent_rl.cli import main

    sets = [*SMALL, f"model.path={tiny_model_dir}", f"run.out_dir={tmp_path}", "run.name=ev", "train.steps=1"]
    Trainer(build_config({}, sets)).fit()
    capsys.readouterr()
    assert main(["eval", *[a for s in sets for a in ("--set", s)], "--tasks", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["checkpoint"].endswith("step_000001") and out["tasks"] == 3
    assert 0.0 <= out["eval/success_rate"] <= 1.0 and out["eval/infra_errors"] == 0


@pytest.mark.vllm
@pytest.mark.slow
def test_training_with_the_vllm_engine_syncs_weights_in_place(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The same loop with vLLM sampling: the weights change every step (entropy bonus), and the
    learner's scoring pass still agrees with vLLM's log-probs, so each update reached the engine."""
    if os.environ.get("CI") != "true":
        pytest.importorskip("vllm")
    sets = [
        *SMALL,
        f"model.path={tiny_model_dir}",
        f"run.out_dir={tmp_path}",
        "run.name=v",
        "train.steps=3",
        "rollout.engine=vllm",
        "train.lr=3e-3",
        "algo.entropy_coef=0.05",
    ]
    Trainer(build_config({}, sets)).fit()
    rows = [r for r in read_metrics(tmp_path / "v") if "losses/loss" in r]
    assert len(rows) == 3
    assert all(r["grad/norm"] > 0 for r in rows)  # the entropy bonus moves the weights every step
    # a max over every policy token of a step: 5x the contract suite's VLLM_TOLERANCE (2e-4,
    # measured ~1e-6 per token; tests/agent_rl/rollout/conftest.py)
    for r in rows:
        assert r["policy/sampler_trainer_logp_diff"] < 1e-3, r["policy/sampler_trainer_logp_diff"]


class OutageSandbox:
    """A real LocalSandbox whose first `down` session opens fail, like a sandbox service restarting."""

    def __init__(self, down: int) -> None:
        from sandbox import LocalSandbox

        self.inner = LocalSandbox()
        self.down = down
        self.lock = threading.Lock()  # episodes open sessions from several env threads

    def session(self, **limits: object) -> object:
        with self.lock:
            failing = self.down > 0
            self.down -= failing
        if failing:
            raise ConnectionRefusedError("sandbox restarting")
        return self.inner.session(**limits)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize(("down", "skipped"), [(4, False), (8, True)])
def test_a_step_whose_episodes_all_fail_is_retried_then_skipped_and_training_goes_on(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, down: int, skipped: bool
) -> None:
    """All 4 episodes of step 1 fail at reset: one retry (4 more failures) brings the outage past it
    (down=4), or it is skipped without an update (down=8); step 2 trains either way."""
    from agent_rl import build

    monkeypatch.setattr(build, "make_sandbox", lambda cfg: OutageSandbox(down))
    sets = [*SMALL, f"model.path={tiny_model_dir}", f"run.out_dir={tmp_path}", "run.name=outage"]
    trainer = Trainer(build_config({}, [*sets, "train.steps=2", "train.warmup.steps=0", "env.eval_tasks=0"]))
    trainer.retry_backoff_s = (0.01,)
    trainer.fit()
    rows = {r["step"]: r for r in read_metrics(tmp_path / "outage") if "env/infra_errors" in r}
    assert rows[1]["perf/rollout_retries"] == 1
    if skipped:
        assert rows[1]["train/skipped_step"] == 1.0 and "losses/loss" not in rows[1]
        assert rows[1]["env/infra_errors"] == 4
    else:
        assert "losses/loss" in rows[1] and rows[1]["env/infra_errors"] == 0
    assert (
        "losses/loss" in rows[2] and rows[2]["env/infra_errors"] == 0 and rows[2]["perf/rollout_retries"] == 0
    )
    assert (tmp_path / "outage" / "checkpoints" / "step_000002").is_dir()
