"""`agent-rl eval`: greedy success rate of a model or a run's checkpoint on held-out tasks."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from agent_rl.checkpoint import latest_checkpoint, load_checkpoint
from agent_rl.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agent-rl eval", description=__doc__)
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
    from agent_rl.train import Trainer

    trainer = Trainer(cfg)
    ckpt = Path(args.checkpoint) if args.checkpoint else latest_checkpoint(cfg.run_dir)
    if args.checkpoint and not (ckpt / "state.pt").exists():
        parser.error(f"--checkpoint {ckpt} has no state.pt")
    if ckpt is not None:
        load_checkpoint(ckpt, learner=trainer.learner)
        trainer.publish_weights()  # the loaded weights (learner rank 0's with learner ranks)
    n = cfg.env.eval_tasks if args.tasks is None else args.tasks
    metrics = trainer.evaluate(n)
    print(json.dumps({"checkpoint": str(ckpt) if ckpt else None, "tasks": n, **metrics}, indent=2))
    return 0
