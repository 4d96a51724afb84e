"""One-step-off-policy pipelining (rollout.async_steps=1): agent_rl.pipeline and the trainer's use of it."""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import torch

from agent_rl.config import ConfigError, build_config
from agent_rl.metrics import read_metrics
from agent_rl.pipeline import Collected, Prefetch, drop_stale, staleness_metrics
from agent_rl.rollout.trajectory import Trajectory, read_trajectories
from agent_rl.train import Trainer
from tests.agent_rl.test_train import COMPARED_PREFIXES, SMALL

ASYNC = ["rollout.async_steps=1"]


def _traj(i: int, version: int | None) -> Trajectory:
    return Trajectory(traj_id=f"t{i}", group_id=i, sample_index=0, task=i, policy_version=version)


# ------------------------------------------------------------------------------------ units
def test_drop_stale_keeps_samples_within_the_bound_and_refuses_unversioned_ones() -> None:
    trajs = [_traj(0, 5), _traj(1, 4), _traj(2, 3), _traj(3, 2)]
    kept, dropped = drop_stale(trajs, learner_version=5, max_staleness=1)
    assert [t.traj_id for t in kept] == ["t0", "t1"] and [t.traj_id for t in dropped] == ["t2", "t3"]
    kept, dropped = drop_stale(trajs, learner_version=5, max_staleness=3)
    assert len(kept) == 4 and not dropped
    with pytest.raises(ValueError, match="no policy_version"):
        drop_stale([_traj(0, None)], learner_version=0, max_staleness=1)
    got = Collected(trajs, version=2)
    assert staleness_metrics(got, 5, dropped=2) == {
        "async/staleness_max": 3.0,
        "async/staleness_mean": 1.5,
        "async/dropped_stale": 2.0,
    }


def test_prefetch_runs_in_the_background_and_hands_over_one_batch() -> None:
    prefetch = Prefetch()
    assert prefetch.take() is None  # nothing submitted
    release = threading.Event()
    main = threading.get_ident()

    def job() -> Collected:
        assert threading.get_ident() != main
        release.wait(5)
        return Collected([_traj(0, 3)], version=3)

    prefetch.submit(job)
    with pytest.raises(RuntimeError, match="in flight"):
        prefetch.submit(job)  # one batch in flight at most
    with pytest.raises(RuntimeError, match="still in flight"):
        prefetch.peek()
    release.set()
    prefetch.wait()
    assert prefetch.peek() is not None and prefetch.peek().version == 3
    got = prefetch.take()
    assert got is not None and got.trajectories[0].traj_id == "t0"
    assert prefetch.take() is None

    def broken() -> Collected:
        raise OSError("sandbox down")

    prefetch.submit(broken)
    with pytest.raises(OSError, match="sandbox down"):
        prefetch.take()  # the collection's error reaches the trainer
    prefetch.close()


def test_collected_state_round_trips_exactly() -> None:
    t = _traj(0, 4)
    t.response_ids, t.response_mask, t.log_probs = [5, 6], [1, 0], [-0.123456789012345678, 0.0]
    t.token_rewards = [0.0, 0.0]
    got = Collected([t], 4, retries=1, dynamic={"tokens/dropped": 7}, stats={"a": 1.5}, rollout_s=0.25)
    back = Collected.from_state(copy.deepcopy(got.state()))
    assert back.trajectories[0].to_record() == t.to_record()
    assert (back.version, back.retries, back.dynamic, back.stats, back.rollout_s) == (
        4,
        1,
        {"tokens/dropped": 7},
        {"a": 1.5},
        0.25,
    )


def test_config_defaults_and_refusals() -> None:
    sync = build_config({}, [])
    assert sync.rollout.async_steps == 0 and sync.algo.is_correction == "off"
    pipelined = build_config({}, ASYNC)
    assert pipelined.rollout.max_staleness == 1
    assert pipelined.algo.is_correction == "token"  # stale samples are corrected by default
    assert build_config({}, [*ASYNC, "algo.is_correction=sequence"]).algo.is_correction == "sequence"
    with pytest.raises(ConfigError, match="max_staleness"):
        build_config({}, [*ASYNC, "rollout.max_staleness=0"])
    with pytest.raises(ConfigError, match="async_steps"):
        build_config({}, ["rollout.async_steps=2"])


# ------------------------------------------------------------------------------- training runs
def _cfg(tiny_model_dir: Path, out: Path, name: str, extra: list[str]) -> Any:
    # 8 demonstrations are enough for 3 warm-up steps (the demos play through the sandbox: slow).
    sets = [
        *SMALL,
        "train.warmup.demos=8",
        f"model.path={tiny_model_dir}",
        f"run.out_dir={out}",
        f"run.name={name}",
        *extra,
    ]
    return build_config({}, sets)


def _rows(run: Path) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in read_metrics(run) if "losses/loss" in r}


def _sampler_logprob_gap(model: torch.nn.Module, trajs: list[Trajectory], pad_id: int) -> float:
    """Largest |log p_model - sampler log-prob| over the policy tokens of `trajs`."""
    from agent_rl.batch import collate
    from agent_rl.logprobs import causal_lm_token_stats

    batch = collate(trajs, pad_id)
    with torch.no_grad():
        stats = causal_lm_token_stats(
            model.eval(),
            batch.input_ids,
            batch.attention_mask,
            response_length=batch.response_length,
            position_ids=batch.position_ids,
            with_entropy=False,
            with_sum_pi_squared=False,
        )
    mask = batch.response_mask.bool()
    return float((stats.log_probs - batch.sampler_log_probs)[mask].abs().max())


@pytest.mark.slow
def test_pipelined_run_samples_from_the_frozen_previous_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    """3 pipelined steps: the engine has its own model; batch t+1 is sampled by version t-1 (the
    log-probs on its trajectories are those of the weights before step t's update, not after);
    staleness is recorded and logged, and the correction reweights the stale samples."""
    cfg = _cfg(
        tiny_model_dir, tmp_path, "pipe", [*ASYNC, "train.steps=3", "train.lr=1e-2", "algo.entropy_coef=0.05"]
    )
    trainer = Trainer(cfg)
    assert trainer.sampler.model is not trainer.model  # a frozen copy, not the learner's module
    trainer.warmup()
    v0 = copy.deepcopy(trainer.model)
    rows = []
    for _ in range(2):
        rows.append(trainer.rl_step())
        trainer.step += 1
    v2 = copy.deepcopy(trainer.model)
    rows.append(trainer.rl_step())
    trainer.step += 1
    trainer.prefetch.close()
    files = sorted((tmp_path / "pipe" / "rollouts").glob("step_*.jsonl"))
    batches = [read_trajectories(f) for f in files]
    assert [{t.policy_version for t in b} for b in batches] == [{0}, {0}, {1}]
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["async/dropped_stale"] == 0.0 for r in rows)
    assert trainer.policy_version == trainer.sampler_version == 3
    pad = trainer.tokenizer.pad_token_id
    # Batch 1 came from the warmed-up weights v0 although the learner had moved to v1 meanwhile.
    assert _sampler_logprob_gap(v0, batches[1], pad) < 1e-4
    assert _sampler_logprob_gap(v2, batches[1], pad) > 1e-3  # the weights did move
    # The correction is on (token mode) and sees the stale samples: ratio != 1 from step 2 on.
    assert all("offpolicy/weight_mean" in r for r in rows)
    assert abs(rows[0]["offpolicy/ratio_max"] - 1) < 1e-4  # step 1: sampled by the same weights
    assert max(abs(rows[2]["offpolicy/ratio_max"] - 1), abs(rows[2]["offpolicy/ratio_min"] - 1)) > 1e-3


@pytest.mark.slow
def test_sync_mode_shares_the_learner_module_and_records_version_zero_staleness(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = _cfg(tiny_model_dir, tmp_path, "sync", ["train.steps=2"])
    trainer = Trainer(cfg)
    assert trainer.prefetch is None and trainer.sampler.model is trainer.model
    trainer.fit()
    files = sorted((tmp_path / "sync" / "rollouts").glob("step_*.jsonl"))
    assert [{t.policy_version for t in read_trajectories(f)} for f in files] == [{0}, {1}]
    rows = _rows(tmp_path / "sync")
    assert not any(k.startswith("async/") for r in rows.values() for k in r)


class Crash(Exception):
    """Stands in for kill -9 after a checkpoint (checkpoints are written atomically)."""


def _crash_after(step: int) -> Any:
    original = Trainer.rl_step

    def rl_step(self: Trainer) -> dict[str, float]:
        if self.step == step:
            raise Crash(f"stopped before step {step + 1}")
        return original(self)

    return rl_step


@pytest.mark.slow
def test_pipelined_resume_reproduces_the_straight_run(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exact resume under pipelining: the checkpoint holds the batch collected ahead (sampled from
    the previous weights), so a run stopped after step 2 and resumed trains on the same samples
    with the same weights as a run that never stopped."""
    # The entropy bonus moves the weights every step, so sampling from the wrong version would show.
    extra = [*ASYNC, "train.steps=4", "train.checkpoint_every=1", "algo.entropy_coef=0.05", "train.lr=3e-3"]
    Trainer(_cfg(tiny_model_dir, tmp_path, "straight", extra)).fit()
    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "rl_step", _crash_after(2))
        with pytest.raises(Crash):
            Trainer(_cfg(tiny_model_dir, tmp_path, "stopped", extra)).fit()
    state = torch.load(tmp_path / "stopped" / "checkpoints" / "step_000002" / "state.pt", weights_only=False)
    pending = state["data"]["pending"]
    assert pending is not None and pending["version"] == 1  # batch 3, sampled by version 1
    resumed = Trainer(_cfg(tiny_model_dir, tmp_path, "stopped", extra))
    summary = resumed.fit()
    assert summary["resumed_from_step"] == 2

    def compared(run: Path) -> dict[int, dict[str, float]]:
        keep = (*COMPARED_PREFIXES, "offpolicy/", "async/")
        return {s: {k: v for k, v in r.items() if k.startswith(keep)} for s, r in _rows(run).items()}

    straight, stopped = compared(tmp_path / "straight"), compared(tmp_path / "stopped")
    assert sorted(stopped) == [1, 2, 3, 4]
    assert stopped == straight  # exact float equality, step by step
    for name in ("step_000002.jsonl", "step_000003.jsonl"):
        a = [json.loads(x) for x in (tmp_path / "straight" / "rollouts" / name).read_text().splitlines()]
        b = [json.loads(x) for x in (tmp_path / "stopped" / "rollouts" / name).read_text().splitlines()]
        drop = ("timings",)
        assert [{k: v for k, v in r.items() if k not in drop} for r in a] == [
            {k: v for k, v in r.items() if k not in drop} for r in b
        ]


@pytest.mark.slow
def test_too_stale_samples_are_dropped_before_the_update(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A batch that lags beyond max_staleness (here: the learner's version jumped by 5 while it was
    in flight) never reaches the update: the step is skipped and the drop is logged."""
    trainer = Trainer(_cfg(tiny_model_dir, tmp_path, "stale", [*ASYNC, "train.steps=3"]))
    trainer.warmup()
    trainer.rl_step()
    trainer.step += 1
    trainer.policy_version += 5  # the prefetched batch (version 0) is now 6 versions behind
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.rl_step()
    trainer.prefetch.close()
    samples = trainer.cfg.rollout.prompts_per_step * trainer.cfg.rollout.group_size
    assert metrics["async/dropped_stale"] == samples and metrics["async/staleness_max"] == 6.0
    assert metrics.get("train/skipped_step") == 1.0 and "losses/loss" not in metrics
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


# ------------------------------------------------------------------------ the in-process vLLM engine
class UpdateGate:
    """Orders a pipelined collection's engine calls around the concurrent update.

    Why: whether a premature weight publish (one before the collection in flight is joined) reaches
    the sampler depends on timing, and the tiny model's episodes are one engine call each. The gate
    makes it certain. Each background engine call is split in two: the first prompt is sampled while
    the update runs (the update starts only once that call has begun, so vLLM really samples while
    the main thread runs torch); the rest waits until the update has ended plus GRACE_S, time in
    which a premature publish lands. A trainer that publishes only after the join passes unaffected
    (vLLM seeds each request, so splitting a call does not change what it samples).
    """

    GRACE_S = 0.3

    def __init__(self, trainer: Trainer) -> None:
        assert trainer.prefetch is not None, "a pipelined trainer (rollout.async_steps=1)"
        self.cond = threading.Condition()
        self.started = self.finished = self.overlapped = self.after_update = 0
        """Updates begun and ended; background engine calls begun during and after an update."""
        self._target: int | None = None  # while a collection is in flight: the update beside it
        self._first = False  # the collection in flight has not made its first engine call yet
        self._submit, self._learn = trainer.prefetch.submit, trainer._learn
        self._generate = trainer.sampler.generate
        trainer.prefetch.submit = self.submit  # type: ignore[method-assign]
        trainer._learn = self.learn  # type: ignore[method-assign]
        trainer.sampler.generate = self.generate  # type: ignore[method-assign]

    def submit(self, job: Callable[[], Collected]) -> None:
        def ahead() -> Collected:
            try:
                return job()
            finally:
                self._target = None

        with self.cond:  # set before the update starts: the trainer submits first
            self._target, self._first = self.finished + 1, True
        self._submit(ahead)

    def learn(self, trajs: list[Trajectory]) -> dict[str, float]:
        with self.cond:
            self.started += 1
            self.cond.notify_all()
            if self._target is not None:  # update once the collection's first call is under way
                assert self.cond.wait_for(lambda: not self._first, timeout=120)
        try:
            return self._learn(trajs)
        finally:
            with self.cond:
                self.finished += 1
                self.cond.notify_all()

    def generate(self, prompts: list[Any], params: Any) -> list[Any]:
        target = self._target
        if target is None:
            return self._generate(prompts, params)  # synchronous collections and evaluations
        head: list[Any] = []
        with self.cond:
            assert self.cond.wait_for(lambda: self.started >= target, timeout=120)
            first, self._first = self._first, False
            self.cond.notify_all()
        if first and len(prompts) > 1:  # sample one prompt during the update
            self.overlapped += 1
            split = (params[:1], params[1:]) if isinstance(params, list) else (params, params)
            head = self._generate(prompts[:1], split[0])
            prompts, params = prompts[1:], split[1]
        with self.cond:
            assert self.cond.wait_for(lambda: self.finished >= target, timeout=120)
        if first:
            self.after_update += 1
            time.sleep(self.GRACE_S)
        return head + self._generate(prompts, params)


class PublishesBeforeTheJoin(Trainer):
    """The bug the vLLM test must catch: new weights reach the sampler while it still collects."""

    def _learn(self, trajs: list[Trajectory]) -> dict[str, float]:
        metrics = super()._learn(trajs)
        self.publish_weights()
        return metrics


VLLM_TOLERANCE = 1e-3
"""Max |vLLM - transformers| log-prob over a batch's policy tokens, float32 (as in test_train.py)."""


def _pipelined_vllm_run(cfg: Any, trainer_cls: type[Trainer]) -> dict[str, Any]:
    """3 gated pipelined steps; returns the logged rows, the batches, the weights after each
    update (v0 = warmed up) and the gate's counts."""
    trainer = trainer_cls(cfg)
    assert type(trainer.sampler).__name__ == "VLLMEngine"
    gate = UpdateGate(trainer)
    trainer.warmup()
    weights, rows = [copy.deepcopy(trainer.model)], []
    try:
        for _ in range(3):
            rows.append(trainer.rl_step())
            trainer.step += 1
            weights.append(copy.deepcopy(trainer.model))
    finally:
        trainer.prefetch.close()
    files = sorted((cfg.run_dir / "rollouts").glob("step_*.jsonl"))
    batches = [read_trajectories(f) for f in files]
    pad = trainer.tokenizer.pad_token_id
    gaps = [[_sampler_logprob_gap(w, b, pad) for w in weights[:3]] for b in batches]
    return {"rows": rows, "batches": batches, "gaps": gaps, "gate": gate, "trainer": trainer}


def _check_sampled_by_previous_weights(gaps: list[list[float]]) -> None:
    """Batch 2 was sampled by v0 (not v1), batch 3 by v1 (not v2): the learner had moved on."""
    for batch, sampler in ((1, 0), (2, 1)):
        assert gaps[batch][sampler] < VLLM_TOLERANCE, (batch, gaps[batch])
        assert gaps[batch][sampler + 1] > 10 * VLLM_TOLERANCE, (batch, gaps[batch])


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("trainer_cls", [Trainer, PublishesBeforeTheJoin], ids=["correct", "mutant"])
def test_pipelined_vllm_engine_samples_the_previous_weights_while_the_learner_updates(
    tiny_model_dir: Path, tmp_path: Path, trainer_cls: type[Trainer]
) -> None:
    """rollout.engine=vllm, 3 pipelined steps: vLLM (its own weights, its own thread) samples step
    t+1 while the main thread updates, with the weights published after step t-1. The sampler
    log-probs of batches 2 and 3 match a recompute under v0 and v1 and differ from v1 and v2.
    The mutant publishes right after the update, before the join: the same check must reject it."""
    if os.environ.get("CI") != "true":
        pytest.importorskip("vllm")
    extra = [*ASYNC, "rollout.engine=vllm", "train.steps=3", "train.lr=1e-2", "algo.entropy_coef=0.05"]
    got = _pipelined_vllm_run(_cfg(tiny_model_dir, tmp_path, "vllm", extra), trainer_cls)
    gate, rows = got["gate"], got["rows"]
    assert gate.overlapped == gate.after_update == 2  # both background collections were split
    if trainer_cls is PublishesBeforeTheJoin:
        with pytest.raises(AssertionError):
            _check_sampled_by_previous_weights(got["gaps"])
        return
    assert [{t.policy_version for t in b} for b in got["batches"]] == [{0}, {0}, {1}]
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["async/dropped_stale"] == 0.0 for r in rows)
    assert got["trainer"].policy_version == got["trainer"].sampler_version == 3
    assert got["gaps"][0][0] < VLLM_TOLERANCE  # the first batch: synchronous, fresh weights
    _check_sampled_by_previous_weights(got["gaps"])
    # token-mode correction: ratio ~1 on the fresh batch, visibly not 1 on the stale ones
    assert abs(rows[0]["offpolicy/ratio_max"] - 1) < VLLM_TOLERANCE
    for r in rows[1:]:
        assert max(abs(r["offpolicy/ratio_max"] - 1), abs(r["offpolicy/ratio_min"] - 1)) > 10 * VLLM_TOLERANCE
