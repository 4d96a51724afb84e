"""`agent-rl train`: prompts -> rollouts -> rewards -> advantages -> update -> weight sync -> metrics.

Read top to bottom: `Trainer.__init__` builds every part from the config, `fit` runs the warm-up,
the RL steps and the final report, `rl_step` is one iteration of the loop. Nothing here branches on
the estimator's name: the learner looks it up in the registry.

Determinism: task order comes from a cursor (the data position), sampling seeds from (seed, step,
sequence), and every RNG is in the checkpoint, so a CPU run resumed after `kill -9` reproduces the
same losses bit for bit.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agent_rl import build
from agent_rl.batch import collate
from agent_rl.checkpoint import load_latest_checkpoint, save_checkpoint
from agent_rl.config import Config, ConfigError, dump_config, load_config
from agent_rl.dynamic_sampling import collect_informative
from agent_rl.evaluate import evaluate_greedy
from agent_rl.learner import Learner
from agent_rl.lora import sampler_weights
from agent_rl.metrics import MetricsLogger, WandbSink, write_plots
from agent_rl.pipeline import Collected, Prefetch, drop_stale, staleness_metrics
from agent_rl.progress import RunProgress
from agent_rl.rollout.trajectory import Trajectory, TrajectoryWriter

if TYPE_CHECKING:
    from agent_rl.distributed import RayCollector, RayRollout
    from agent_rl.distributed.learner import RayLearner
    from agent_rl.rollout import Collector, Engine

log = logging.getLogger(__name__)


class Trainer:
    """Everything the loop needs, built from one config by `agent_rl.build`."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        # The task splits first: a run that would ask for a split its tasks lack stops here, before
        # any model, actor or sandbox is started.
        self.tasks = build.task_splits(cfg)
        build.check_splits(cfg, self.tasks, warmup=True)
        self.run_dir = cfg.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        build.set_cpu_threads(cfg.model.cpu_threads)
        build.seed_everything(cfg.train.seed)
        torch.use_deterministic_algorithms(True, warn_only=True)
        self.model_path = build.resolve_model_path(cfg)
        self.model, self.tokenizer = build.load_policy(cfg, self.model_path)
        self.learner = self._make_learner()
        self.sandbox = build.make_sandbox(cfg.sandbox)
        self.make_env = build.env_factory(cfg, self.sandbox)
        self.sampler: Engine | RayRollout
        """Whatever samples the policy, and so receives its weights after each update: an engine in
        this process, or a fleet of Ray rollout workers (`scale.backend: ray`)."""
        self.collector: Collector | RayCollector
        self.eval_collector: Collector | RayCollector
        self._make_rollout()
        self.writer = TrajectoryWriter(self.run_dir, tokenizer_path=str(self.model_path))
        self.logger = MetricsLogger(self.run_dir, wandb=_wandb_sink(cfg))
        self.progress = RunProgress(cfg.run.progress)
        self.step = 0
        self.task_cursor = 0
        self.tokens_total = 0
        self.retry_backoff_s: tuple[float, ...] = (5.0, 20.0, 60.0)
        """Waits before collecting a step again when all its episodes failed (e.g. the sandbox is
        restarting); after the last one the step is skipped and training goes on."""
        self.policy_version = 0
        """RL updates applied to the learner's weights (skipped steps apply none); checkpointed."""
        self.sampler_version = 0
        """The policy version the sampler holds: set by publish_weights."""
        self.prefetch = Prefetch() if cfg.rollout.async_steps else None
        """The next step's collection in flight under pipelining (agent_rl.pipeline); None = synchronous."""

    def _make_learner(self) -> Learner | RayLearner:
        cfg = self.cfg
        if cfg.scale.learner_workers > 1:
            # Data-parallel ranks as Ray actors, replicas of this model; the driver keeps its copy
            # for the warm-up and the initial weights only (the policy then lives on the ranks).
            from agent_rl.distributed.learner import RayLearner

            return RayLearner.from_config(cfg, self.model_path, self.model.state_dict())
        ref = copy.deepcopy(self.model).eval().requires_grad_(False) if cfg.algo.kl_coef > 0 else None
        return Learner(self.model, cfg.algo, cfg.train, temperature=cfg.rollout.temperature, ref_model=ref)

    def _make_rollout(self) -> None:
        cfg = self.cfg
        configs = build.collector_configs(cfg)
        if cfg.scale.backend == "ray":
            # Rollout workers as Ray actors: the same collect/update_weights interface, other processes.
            from agent_rl.distributed import RayRollout

            fleet = RayRollout.from_config(cfg, self.model_path, self.model.state_dict())
            self.sampler = fleet
            self.collector, self.eval_collector = (
                fleet.collector(configs.train),
                fleet.collector(configs.eval),
            )
        else:
            from agent_rl.rollout import Collector

            policy = self.model
            if cfg.rollout.async_steps and cfg.rollout.engine == "hf":
                # Pipelined collection samples while the learner updates: it needs frozen weights of
                # its own, which publish_weights refreshes once the collection in flight has ended.
                policy = copy.deepcopy(self.model).eval().requires_grad_(False)
            engine = build.make_engine(cfg, self.model_path, model=policy, tokenizer=self.tokenizer)
            self.sampler = engine
            self.collector = Collector(engine, self.tokenizer, self.make_env, configs.train)
            self.eval_collector = Collector(engine, self.tokenizer, self.make_env, configs.eval)

    # -- state ---------------------------------------------------------------------------------
    def publish_weights(self) -> None:
        """Hand the policy's current weights to the rollout engine: this process's model, or learner
        rank 0's (an object-store reference, so they do not travel through the driver)."""
        if isinstance(self.learner, Learner):
            # The in-process HF engine samples with this very module (adapters and all); every other
            # sampler holds the plain architecture and gets merged weights under LoRA.
            shared = self.cfg.rollout.engine == "hf" and self.cfg.scale.backend == "local"
            self.sampler.update_weights(self.model.state_dict() if shared else sampler_weights(self.model))
        else:
            self.sampler.update_weights(self.learner.weights_ref())
        self.sampler_version = self.policy_version

    def save(self) -> Path:
        data: dict[str, Any] = {
            "task_cursor": self.task_cursor,
            "tokens_total": self.tokens_total,
            "policy_version": self.policy_version,
        }
        if self.prefetch is not None:
            # The batch collected ahead is part of the state: resume trains on it exactly as it was
            # sampled (from the previous weights) instead of re-sampling it from newer ones.
            self.prefetch.wait()
            pending = self.prefetch.peek()
            data["pending"] = None if pending is None else pending.state()
        return save_checkpoint(self.run_dir, self.step, learner=self.learner, data=data)

    def maybe_resume(self) -> bool:
        """Continue from the newest readable checkpoint, if resuming is on and there is one."""
        found = load_latest_checkpoint(self.run_dir, learner=self.learner) if self.cfg.run.resume else None
        if found is None:
            return False
        _, rest = found
        self.step = rest["step"]
        self.task_cursor = rest["data"]["task_cursor"]
        self.tokens_total = rest["data"]["tokens_total"]
        self.policy_version = rest["data"].get("policy_version", self.step)
        pending = rest["data"].get("pending")
        if self.prefetch is not None and pending is not None:
            self.prefetch.restore(Collected.from_state(pending))
        elif pending is not None:
            log.warning(
                "the checkpoint holds a batch collected ahead (pipelining); synchronous mode drops it"
            )
        self.publish_weights()
        self.logger.truncate_after(self.step)
        return True

    # -- phases --------------------------------------------------------------------------------
    def warmup(self) -> list[float]:
        """Supervised steps on scripted demonstrations from the task source's demo split."""
        from agent_rl.warmup import warm_up

        w = self.cfg.train.warmup
        demos = self.tasks.indices("demo", w.demos)
        with (
            self.progress.phase("warm-up demonstrations", len(demos)) as played,
            self.progress.phase("warm-up updates", w.steps) as updated,
        ):

            def on_step(step: int, loss: float) -> None:
                self.logger.log_warmup(step, loss)
                updated(note=f"loss {loss:.3f}")

            seed = self.cfg.train.seed
            losses = warm_up(
                self.model, self.tokenizer, self.make_env, demos, w, seed, on_demo=played, on_step=on_step
            )
        if not isinstance(self.learner, Learner):
            self.learner.load_weights(self.model.state_dict())  # the ranks start RL from the warm-up
        self.publish_weights()
        return losses

    def warmup_check(self) -> dict[str, float]:
        """Greedy final-turn and per-turn accuracy on held-out correct demonstrations
        (WarmupConfig.check_demos): whether the warmed-up model has the skill RL will build on,
        logged before RL starts."""
        from agent_rl.warmup import held_out_accuracy

        w = self.cfg.train.warmup
        if not w.check_demos:
            return {}
        held_out = self.tasks.indices("demo", w.check_demos, first=w.demos)
        with self.progress.phase("warm-up check", len(held_out)) as played:
            accuracy = held_out_accuracy(self.model, self.tokenizer, self.make_env, held_out, on_demo=played)
        row = {f"eval/{name}": value for name, value in accuracy.items()}
        self.logger.log(0, row)
        return row

    def evaluate(self, n: int, when: str = "") -> dict[str, float]:
        """Greedy success rate on the first `n` held-out tasks (temperature 0, one sample each)."""
        if n <= 0:
            return {}
        self.model.eval()
        with self.progress.phase(f"held-out eval {when}".rstrip(), n) as done:
            return evaluate_greedy(self.eval_collector, self.tasks, n, on_episode=done)

    def rl_step(self) -> dict[str, float]:
        """One step: collect, update, publish the new weights (pipelined with rollout.async_steps)."""
        if self.prefetch is not None:
            return self._pipelined_step(self.prefetch)
        got = self._collect_step(self.step, self.sampler_version)
        t1 = time.perf_counter()
        metrics = self._learn(got.trajectories)
        t2 = time.perf_counter()
        if self.sampler_version != self.policy_version:
            self.publish_weights()
        return self._finish_step(got, metrics, {"perf/rollout_s": got.rollout_s, "perf/update_s": t2 - t1})

    def _pipelined_step(self, prefetch: Prefetch) -> dict[str, float]:
        """Update on the batch collected during the previous step while the next one is collected
        from the sampler's frozen weights; publish only once that collection is joined."""
        cfg = self.cfg
        t0 = time.perf_counter()
        got = prefetch.take() or self._collect_step(self.step, self.sampler_version)  # None: first step
        trajs, dropped = drop_stale(got.trajectories, self.policy_version, cfg.rollout.max_staleness)
        if dropped:
            log.warning(
                "step %d: dropped %d samples more than %d policy versions old",
                self.step + 1,
                len(dropped),
                cfg.rollout.max_staleness,
            )
        stale = staleness_metrics(got, self.policy_version, len(dropped))
        upcoming, version = self.step + 1, self.sampler_version
        if upcoming < cfg.train.steps:
            prefetch.submit(lambda: self._collect_step(upcoming, version))
        t1 = time.perf_counter()
        metrics = self._learn(trajs)
        t2 = time.perf_counter()
        waited = (t1 - t0) + prefetch.wait()
        if self.sampler_version != self.policy_version:
            self.publish_weights()
        perf = {
            "perf/rollout_s": got.rollout_s,
            "perf/update_s": t2 - t1,
            "perf/rollout_wait_s": waited,
            "perf/step_s": time.perf_counter() - t0,
        }
        metrics.update(stale)
        return self._finish_step(got, metrics, perf)

    def _collect_step(self, step: int, version: int) -> Collected:
        """Step `step`'s batch from the task cursor, sampled by the weights the sampler holds (policy
        `version`). Under pipelining this runs in the background thread: nothing else touches the
        cursor or the sampler meanwhile."""
        cfg = self.cfg
        t0 = time.perf_counter()
        # The training split, read in order and cycled (a dataset's epochs); the cursor is checkpointed.
        tasks = self.tasks.reset_options(
            "train", cfg.rollout.prompts_per_step, first=self.task_cursor, wrap=True
        )
        seed = cfg.train.seed * 1_000_003 + step  # every sampling seed of this step derives from it
        trajs, retries = self._collect(tasks, seed=seed, step=step)
        self.task_cursor += cfg.rollout.prompts_per_step
        dynamic: dict[str, float] = {}
        if cfg.algo.dynamic_sampling:
            trajs, dynamic = self._informative(trajs, seed=seed)
        for t in trajs:
            t.policy_version = version
        stats = self.collector.last_stats.as_metrics()
        return Collected(trajs, version, retries, dynamic, stats, time.perf_counter() - t0)

    def _learn(self, trajs: list[Trajectory]) -> dict[str, float]:
        """The update, or a logged skip when no episode is usable; bumps the policy version."""
        if any(t.valid for t in trajs):
            metrics = self._update(trajs)
            self.policy_version += 1
            return metrics
        # Every episode failed, even after the retries (or all were too stale): the weights stay.
        log.warning("step %d: none of %d episodes is usable; skipping the update", self.step + 1, len(trajs))
        return {"train/skipped_step": 1.0}

    def _finish_step(
        self, got: Collected, metrics: dict[str, float], perf: dict[str, float]
    ) -> dict[str, float]:
        """Write the step's trajectories and add the rollout, timing and dynamic-sampling metrics."""
        self.writer.write(self.step, got.trajectories)
        metrics.update(self._rollout_metrics(got.trajectories, got.stats))
        metrics.update({"perf/rollout_retries": got.retries, **perf})
        metrics.update(got.dynamic)
        return metrics

    def _informative(self, trajs: list[Trajectory], seed: int) -> tuple[list[Trajectory], dict[str, float]]:
        """DAPO's dynamic sampling (agent_rl.dynamic_sampling): extra rounds read the next tasks from the
        cursor, with their own seed (round r: seed + r * 2^32) and group ids after the earlier rounds'."""
        cfg, n = self.cfg, self.cfg.rollout.prompts_per_step
        rounds = [0]

        def more(first_group: int) -> list[Trajectory]:
            rounds[0] += 1
            tasks = self.tasks.reset_options("train", n, first=self.task_cursor, wrap=True)
            self.task_cursor += n
            batch = self.collector.collect(tasks, cfg.rollout.group_size, seed=seed + rounds[0] * 2**32)
            for t in batch:
                t.group_id += first_group
            return batch

        result = collect_informative(trajs, more, n, cfg.algo.dynamic_sampling_max_rounds)
        spent = sum(t.num_policy_tokens + t.num_tool_tokens for t in result.dropped)
        # tokens/cumulative counts what was sampled, dropped or not. Under pipelining this runs in the
        # background thread, while the main thread leaves the counter alone (it reads it after the join).
        self.tokens_total += spent
        return result.trajectories, {**result.metrics(cfg.rollout.group_size), "tokens/dropped": spent}

    def _collect(self, tasks: list[dict[str, int]], seed: int, step: int) -> tuple[list[Trajectory], int]:
        """One step's trajectories; collected again after a wait when every episode failed (a sandbox
        outage fails them all at reset), up to len(retry_backoff_s) times. Returns them and the retries."""
        for retries, wait in enumerate((*self.retry_backoff_s, None)):
            trajs = self.collector.collect(tasks, self.cfg.rollout.group_size, seed=seed)
            if wait is None or any(t.valid for t in trajs):
                return trajs, retries
            log.warning(
                "step %d: all %d episodes failed (first: %s); collecting again in %gs",
                step + 1,
                len(trajs),
                trajs[0].infra_error,
                wait,
            )
            time.sleep(wait)
        raise AssertionError("unreachable: the last attempt returns")

    def _update(self, trajs: list[Trajectory]) -> dict[str, float]:
        """Score, advantages and the policy update on the collated batch (the caller publishes)."""
        every = self.cfg.train.grad_variance_every
        batch = collate(trajs, self.tokenizer.pad_token_id)
        scored, metrics = self.learner.step(batch, diagnose=bool(every) and self.step % every == 0)
        for traj, adv in zip(trajs, scored.advantages):
            traj.advantages = adv[: len(traj.response_ids)].tolist()  # for the trajectory log
        return metrics

    def _rollout_metrics(self, trajs: list[Trajectory], stats: dict[str, float]) -> dict[str, float]:
        valid = [t for t in trajs if t.valid]
        policy_tokens = sum(t.num_policy_tokens for t in trajs)
        tool_tokens = sum(t.num_tool_tokens for t in trajs)
        self.tokens_total += policy_tokens + tool_tokens
        return {
            "env/reward_mean": sum(t.reward for t in valid) / max(1, len(valid)),
            "env/success_rate": sum(t.reward > 0 for t in valid) / max(1, len(valid)),
            "env/turns_mean": sum(t.num_turns for t in trajs) / len(trajs),
            "env/truncated_frac": sum(t.truncated for t in trajs) / len(trajs),
            "env/infra_errors": len(trajs) - len(valid),
            "tokens/policy": policy_tokens,
            "tokens/tool": tool_tokens,
            "tokens/total": policy_tokens + tool_tokens,
            "tokens/cumulative": self.tokens_total,
            **stats,
        }

    def fit(self) -> dict[str, Any]:
        cfg = self.cfg
        dump_config(cfg, self.run_dir / "config.yaml")
        with self.progress:
            resumed = self.maybe_resume()
            summary: dict[str, Any] = {
                "run_dir": str(self.run_dir),
                "resumed_from_step": self.step if resumed else None,
            }
            if not resumed:
                if cfg.train.warmup.steps:
                    losses = self.warmup()
                    summary["warmup_loss_first_last"] = [losses[0], losses[-1]]
                    summary.update(self.warmup_check())
                summary["eval_before"] = self.evaluate(cfg.env.eval_tasks, "before RL")
                self.logger.log(0, summary["eval_before"])
            self._rl_steps()
            self.save()
            if self.prefetch is not None:
                self.prefetch.close()
            summary["eval_after"] = self.evaluate(cfg.env.eval_tasks, "after RL")
        self.logger.log(self.step, summary["eval_after"])
        summary["plots"] = [str(p) for p in write_plots(self.run_dir)]
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.logger.close()
        return summary

    def _rl_steps(self) -> None:
        """RL steps until `train.steps` (or the rollout-token budget), checkpointing as configured."""
        cfg = self.cfg
        budget = cfg.train.max_rollout_tokens
        with self.progress.phase("RL steps", cfg.train.steps, completed=self.step) as advance:
            while self.step < cfg.train.steps and not (budget and self.tokens_total >= budget):
                metrics = self.rl_step()
                self.step += 1
                self.logger.log(self.step, metrics)
                advance(note=f"{self.step}: success {metrics['env/success_rate']:.2f}")
                every = cfg.train.checkpoint_every
                if every and self.step % every == 0:
                    self.save()


def _wandb_sink(cfg: Config) -> WandbSink | None:
    if not cfg.run.wandb:
        return None
    config = cfg.model_dump(mode="json")
    return WandbSink(cfg.run_dir, cfg.run.name, cfg.run.wandb_project, cfg.run.wandb_mode, config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agent-rl train", description="Train a tool-using policy.")
    parser.add_argument("--config", help="YAML config (see configs/); defaults when omitted")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.steps=5 (repeatable)",
    )
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        trainer = Trainer(cfg)
    except ConfigError as err:
        parser.error(str(err))
    summary = trainer.fit()
    before = summary.get("eval_before", {}).get("eval/success_rate")
    after = summary.get("eval_after", {}).get("eval/success_rate")
    print(f"done: {cfg.run_dir}  eval success {before} -> {after}  plots: {len(summary['plots'])}")
    return 0
