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
import os
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from agent_rl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from agent_rl.config import Config, ConfigError, SandboxConfig, dump_config, load_config
from agent_rl.learner import Learner
from agent_rl.metrics import MetricsLogger, write_plots
from agent_rl.tiny_model import TinyModelSpec, ensure_tiny_model, load_model_and_tokenizer

if TYPE_CHECKING:
    from agent_rl.distributed.learner import RayLearner

EVAL_TASK_OFFSET = 500_000
"""Held-out tasks start at this task index; training tasks come from below it."""
DEMO_TASK_OFFSET = 800_000
"""Warm-up demonstrations start here: disjoint from training and evaluation tasks."""


def cache_dir() -> Path:
    return Path(os.environ.get("AGENT_RL_CACHE", Path.home() / ".cache" / "agent-rl"))


def resolve_model_path(cfg: Config) -> Path:
    """The configured model folder, or the offline tiny model built once into the cache."""
    if cfg.model.path:
        return Path(cfg.model.path)
    spec = TinyModelSpec(
        hidden_size=cfg.model.tiny_hidden_size,
        num_layers=cfg.model.tiny_layers,
        num_heads=cfg.model.tiny_heads,
        intermediate_size=2 * cfg.model.tiny_hidden_size,
    )
    name = f"tiny-h{spec.hidden_size}-l{spec.num_layers}-a{spec.num_heads}-v{spec.tokenizer_version}"
    return ensure_tiny_model(cache_dir() / "models" / name, spec)


def make_sandbox(cfg: SandboxConfig) -> Any:
    """The sandbox backend named in the config; all three share one session interface."""
    if cfg.backend == "local":
        from sandbox import LocalSandbox

        return LocalSandbox()
    if cfg.backend == "http":
        from sandbox import Client

        return Client(cfg.url, token=os.environ.get(cfg.token_env))
    from sandbox.docker_backend import DockerSandbox

    return DockerSandbox()


def make_engine(cfg: Config, model: torch.nn.Module, tokenizer: Any, model_path: Path) -> Any:
    if cfg.rollout.engine == "hf":
        from agent_rl.rollout.hf_engine import HFEngine

        # The engine shares the policy module: weight sync is free and sampling is exactly on-policy.
        return HFEngine(
            model,
            tokenizer,
            max_model_len=cfg.rollout.max_total_tokens + cfg.rollout.max_new_tokens,
            seed=cfg.train.seed,
        )
    from agent_rl.rollout.vllm_engine import VLLMEngine

    on_gpu = cfg.model.device.startswith("cuda")
    return VLLMEngine(
        str(model_path),
        max_model_len=cfg.rollout.max_total_tokens + cfg.rollout.max_new_tokens,
        seed=cfg.train.seed,
        dtype=cfg.model.dtype,
        gpu_memory_utilization=cfg.rollout.vllm_gpu_memory_utilization if on_gpu else None,
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """Everything the loop needs, built from one config."""

    def __init__(self, cfg: Config) -> None:
        import gymnasium

        import envs  # noqa: F401  (registers the agent_rl/ environments)
        from agent_rl.rollout import Collector, CollectorConfig, SamplingParams, TrajectoryWriter

        self.cfg = cfg
        self.run_dir = cfg.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.model.cpu_threads:
            torch.set_num_threads(cfg.model.cpu_threads)
        seed_everything(cfg.train.seed)
        torch.use_deterministic_algorithms(True, warn_only=True)
        self.model_path = resolve_model_path(cfg)
        self.model, self.tokenizer = load_model_and_tokenizer(
            self.model_path, cfg.model.dtype, cfg.model.device
        )
        self.learner: Learner | RayLearner
        if cfg.scale.learner_workers > 1:
            # Data-parallel ranks as Ray actors, replicas of this model; the driver keeps its copy
            # for the warm-up and the initial weights only (the policy then lives on the ranks).
            from agent_rl.distributed.learner import RayLearner

            self.learner = RayLearner.from_config(cfg, self.model_path, self.model.state_dict())
        else:
            ref = None
            if cfg.algo.kl_coef > 0:
                ref = copy.deepcopy(self.model).eval().requires_grad_(False)
            self.learner = Learner(
                self.model, cfg.algo, cfg.train, temperature=cfg.rollout.temperature, ref_model=ref
            )
        self.sandbox = make_sandbox(cfg.sandbox)
        env_kwargs = dict(cfg.env.kwargs)
        env_kwargs.setdefault("max_turns", cfg.rollout.max_turns)

        def make_env() -> Any:
            return gymnasium.make(cfg.env.id, sandbox=self.sandbox, **env_kwargs)

        self.make_env = make_env
        rollout = cfg.rollout
        sampling = SamplingParams(
            temperature=rollout.temperature, top_p=rollout.top_p, max_new_tokens=rollout.max_new_tokens
        )
        budgets = dict(
            max_turns=rollout.max_turns,
            max_total_tokens=rollout.max_total_tokens,
            max_tool_tokens=rollout.max_tool_tokens,
        )
        train_cc = CollectorConfig(sampling=sampling, **budgets)
        eval_cc = CollectorConfig(sampling=sampling.with_(temperature=0.0, top_p=1.0), **budgets)
        if cfg.scale.backend == "ray":
            # Rollout workers as Ray actors: the same collect/update_weights interface, other processes.
            from agent_rl.distributed import RayRollout

            self.engine = RayRollout.from_config(cfg, self.model_path, self.model.state_dict())
            self.collector = self.engine.collector(train_cc)
            self.eval_collector = self.engine.collector(eval_cc)
        else:
            self.engine = make_engine(cfg, self.model, self.tokenizer, self.model_path)
            self.collector = Collector(self.engine, self.tokenizer, make_env, train_cc)
            self.eval_collector = Collector(self.engine, self.tokenizer, make_env, eval_cc)
        self.writer = TrajectoryWriter(self.run_dir, tokenizer_path=str(self.model_path))
        self.logger = MetricsLogger(self.run_dir)
        self.step = 0
        self.task_cursor = 0
        self.tokens_total = 0

    # -- state ---------------------------------------------------------------------------------
    def publish_weights(self) -> None:
        """Hand the policy's current weights to the rollout engine: this process's model, or learner
        rank 0's (an object-store reference, so they do not travel through the driver)."""
        if isinstance(self.learner, Learner):
            self.engine.update_weights(self.model.state_dict())
        else:
            self.engine.update_weights(self.learner.weights_ref())

    def save(self) -> Path:
        return save_checkpoint(
            self.run_dir,
            self.step,
            learner=self.learner,
            data={"task_cursor": self.task_cursor, "tokens_total": self.tokens_total},
        )

    def maybe_resume(self) -> bool:
        ckpt = latest_checkpoint(self.run_dir) if self.cfg.run.resume else None
        if ckpt is None:
            return False
        rest = load_checkpoint(ckpt, learner=self.learner)
        self.step = rest["step"]
        self.task_cursor = rest["data"]["task_cursor"]
        self.tokens_total = rest["data"]["tokens_total"]
        self.publish_weights()
        self.logger.truncate_after(self.step)
        return True

    # -- phases --------------------------------------------------------------------------------
    def warmup(self) -> list[float]:
        """Supervised steps on scripted demonstrations played through the real environment."""
        from agent_rl.warmup import run_warmup, tokenize_conversation
        from envs import demonstration

        w = self.cfg.train.warmup
        env = self.make_env()
        try:
            # Demonstrations come from their own task range, disjoint from training and eval tasks.
            first = DEMO_TASK_OFFSET
            examples = [
                tokenize_conversation(self.tokenizer, demonstration(env, first + i).messages)
                for i in range(w.demos)
            ]
        finally:
            env.close()
        losses = run_warmup(
            self.model,
            examples,
            steps=w.steps,
            batch_size=w.batch_size,
            lr=w.lr,
            pad_id=self.tokenizer.pad_token_id,
            seed=self.cfg.train.seed,
        )
        if not isinstance(self.learner, Learner):
            self.learner.load_weights(self.model.state_dict())  # the ranks start RL from the warm-up
        self.publish_weights()
        return losses

    def evaluate(self, n: int) -> dict[str, float]:
        """Greedy success rate on held-out tasks (temperature 0, one sample each)."""
        if n <= 0:
            return {}
        self.model.eval()
        trajs = self.eval_collector.collect(_tasks(EVAL_TASK_OFFSET, n), group_size=1, seed=0)
        valid = [t for t in trajs if t.valid]
        return {
            "eval/success_rate": sum(t.reward > 0 for t in valid) / max(1, len(valid)),
            "eval/tool_use_rate": sum(any(tr.tool_tokens > 0 for tr in t.turns) for t in valid)
            / max(1, len(valid)),
            "eval/infra_errors": len(trajs) - len(valid),
        }

    def rl_step(self) -> dict[str, float]:
        from agent_rl.rollout import collate

        cfg = self.cfg
        t0 = time.perf_counter()
        tasks = _tasks(self.task_cursor, cfg.rollout.prompts_per_step)  # training tasks: indices below eval's
        trajs = self.collector.collect(
            tasks, cfg.rollout.group_size, seed=cfg.train.seed * 1_000_003 + self.step
        )
        self.task_cursor += cfg.rollout.prompts_per_step
        t1 = time.perf_counter()
        batch = collate(trajs, self.tokenizer.pad_token_id)
        every = cfg.train.grad_variance_every
        scored, metrics = self.learner.step(batch, diagnose=bool(every) and self.step % every == 0)
        self.publish_weights()
        t2 = time.perf_counter()
        for traj, adv in zip(trajs, scored["advantages"]):
            traj.advantages = adv[: len(traj.response_ids)].tolist()
        self.writer.write(self.step, trajs)
        valid = [t for t in trajs if t.valid]
        policy_tokens = sum(t.num_policy_tokens for t in trajs)
        tool_tokens = sum(t.num_tool_tokens for t in trajs)
        self.tokens_total += policy_tokens + tool_tokens
        metrics.update(
            {
                "env/reward_mean": sum(t.reward for t in valid) / max(1, len(valid)),
                "env/success_rate": sum(t.reward > 0 for t in valid) / max(1, len(valid)),
                "env/turns_mean": sum(t.num_turns for t in trajs) / len(trajs),
                "env/truncated_frac": sum(t.truncated for t in trajs) / len(trajs),
                "env/infra_errors": len(trajs) - len(valid),
                "tokens/policy": policy_tokens,
                "tokens/tool": tool_tokens,
                "tokens/total": policy_tokens + tool_tokens,
                "tokens/cumulative": self.tokens_total,
                **self.collector.last_stats.as_metrics(),
                "perf/rollout_s": t1 - t0,
                "perf/update_s": t2 - t1,
            }
        )
        return metrics

    def fit(self) -> dict[str, Any]:
        cfg = self.cfg
        dump_config(cfg, self.run_dir / "config.yaml")
        resumed = self.maybe_resume()
        summary: dict[str, Any] = {
            "run_dir": str(self.run_dir),
            "resumed_from_step": self.step if resumed else None,
        }
        if not resumed:
            if cfg.train.warmup.steps:
                losses = self.warmup()
                summary["warmup_loss_first_last"] = [losses[0], losses[-1]]
            summary["eval_before"] = self.evaluate(cfg.env.eval_tasks)
            self.logger.log(0, summary["eval_before"])
        progress = _progress(cfg.run.progress)
        with progress:
            task = progress.add_task("RL steps", total=cfg.train.steps, completed=self.step)
            budget = cfg.train.max_rollout_tokens
            while self.step < cfg.train.steps and not (budget and self.tokens_total >= budget):
                metrics = self.rl_step()
                self.step += 1
                self.logger.log(self.step, metrics)
                progress.update(
                    task,
                    advance=1,
                    description=f"RL step {self.step} success {metrics['env/success_rate']:.2f}",
                )
                every = cfg.train.checkpoint_every
                if every and self.step % every == 0:
                    self.save()
        self.save()
        summary["eval_after"] = self.evaluate(cfg.env.eval_tasks)
        self.logger.log(self.step, summary["eval_after"])
        summary["plots"] = [str(p) for p in write_plots(self.run_dir)]
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.logger.close()
        return summary


def _tasks(first: int, n: int) -> list[dict[str, int]]:
    """Reset options for tasks first..first+n-1 (the env's task index doubles as its reset seed)."""
    return [{"task_index": i, "seed": i} for i in range(first, first + n)]


def _progress(enabled: bool) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        disable=not enabled,
    )


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
    except ConfigError as err:
        parser.error(str(err))
    summary = Trainer(cfg).fit()
    before = summary.get("eval_before", {}).get("eval/success_rate")
    after = summary.get("eval_after", {}).get("eval/success_rate")
    print(f"done: {cfg.run_dir}  eval success {before} -> {after}  plots: {len(summary['plots'])}")
    return 0
