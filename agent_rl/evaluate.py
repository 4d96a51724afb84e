"""`agent-rl eval`: greedy success rate of a model or a run's checkpoint on held-out tasks.

Why no Trainer here: evaluating needs a policy, an engine, a sandbox and the env's held-out split,
all from `agent_rl.build`; an optimiser, a reference model or a metrics logger would only cost
memory and start-up time. The trainer scores its held-out tasks with the same `evaluate_greedy`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent_rl.checkpoint import latest_checkpoint, read_policy_weights
from agent_rl.config import Config, ConfigError, load_config
from agent_rl.lora import load_policy_state, sampler_weights

if TYPE_CHECKING:
    from agent_rl.build import TaskSplits
    from agent_rl.rollout.trajectory import Trajectory


def heldout_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Success and tool use over the valid episodes; infrastructure failures counted apart."""
    valid = [t for t in trajectories if t.valid]
    n = max(1, len(valid))
    return {
        "eval/success_rate": sum(t.reward > 0 for t in valid) / n,
        "eval/tool_use_rate": sum(any(tr.tool_tokens > 0 for tr in t.turns) for t in valid) / n,
        "eval/infra_errors": len(trajectories) - len(valid),
    }


def evaluate_greedy(
    collector: Any, splits: TaskSplits, n: int, on_episode: Callable[[], None] | None = None
) -> dict[str, float]:
    """The first `n` tasks of the eval split, one sample each with the collector's (greedy) sampling."""
    tasks = splits.reset_options("eval", n)
    return heldout_metrics(collector.collect(tasks, group_size=1, seed=0, on_episode=on_episode))


def evaluate_policy(cfg: Config, n: int, checkpoint: Path | None = None) -> dict[str, float]:
    """Greedy held-out success of cfg's model, with a checkpoint's policy weights when one is given.

    Runs in this process whatever `scale.backend` says: one greedy sample per task needs no fleet.
    """
    from agent_rl import build
    from agent_rl.rollout import Collector

    splits = build.task_splits(cfg)
    splits.require("eval", n)  # a clear error before any model is loaded
    build.set_cpu_threads(cfg.model.cpu_threads)
    build.seed_everything(cfg.train.seed)
    model_path = build.resolve_model_path(cfg)
    model, tokenizer = build.load_policy(cfg, model_path)
    if checkpoint is not None:
        load_policy_state(model, read_policy_weights(checkpoint))
    model.eval().requires_grad_(False)
    engine = build.make_engine(cfg, model_path, model=model, tokenizer=tokenizer)
    if checkpoint is not None and cfg.rollout.engine != "hf":
        engine.update_weights(sampler_weights(model))  # vLLM loaded the base weights from model_path
    sandbox = build.make_sandbox(cfg.sandbox)
    try:
        collector = Collector(
            engine, tokenizer, build.env_factory(cfg, sandbox), build.collector_configs(cfg).eval
        )
        return evaluate_greedy(collector, splits, n)
    finally:
        sandbox.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agent-rl eval", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="the run's YAML config (e.g. runs/<name>/config.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--checkpoint", help="a checkpoint folder; default: the newest in the run dir, else the base model"
    )
    parser.add_argument(
        "--tasks", type=int, default=None, help="number of held-out tasks (default: env.eval_tasks)"
    )
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        parser.error(str(err))
    ckpt = Path(args.checkpoint) if args.checkpoint else latest_checkpoint(cfg.run_dir)
    if args.checkpoint and not (ckpt / "state.pt").exists():
        parser.error(f"--checkpoint {ckpt} has no state.pt")
    n = cfg.env.eval_tasks if args.tasks is None else args.tasks
    try:
        metrics = evaluate_policy(cfg, n, ckpt)
    except ConfigError as err:
        parser.error(str(err))
    print(json.dumps({"checkpoint": str(ckpt) if ckpt else None, "tasks": n, **metrics}, indent=2))
    return 0
