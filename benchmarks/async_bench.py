"""Benchmark: synchronous vs one-step-off-policy pipelined RL steps (rollout.async_steps 0 vs 1).

What it measures, in one run (the machine is shared: read the ratios, and the load printed with them):
for each scenario, two trainers with the same config but rollout.async_steps, each warmed up as
configured and then run for --steps RL steps. Per step: the collection time (perf/rollout_s), the
update time (perf/update_s) and the step's wall time. Medians over the steps after the first (a
pipelined run's first step has nothing collected ahead, so it is synchronous).

Printed per scenario and mode: rollout, update, step (seconds), step / max(rollout, update) and
step / (rollout + update). Synchronous steps cost about rollout + update (ratio ~1 to the sum);
the target for pipelined steps is step <= max(rollout, update) + 10% (ratio <= 1.10 to the max).
The last column is the pipelined speed-up over the synchronous step of the same scenario.

Scenarios:
  quickstart  configs/quickstart.yaml with a short warm-up (--warmup-steps, 64 demos), no evals.
  long        ChainLookup-v0 (many tool turns), more tokens per turn and per episode, no warm-up
              (the tiny model then samples until its token budgets: long turns).

Run:  nice -n 19 python benchmarks/async_bench.py [--scenarios quickstart long] [--steps 6]
      [--warmup-steps 60] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from agent_rl.config import Config, load_config
from agent_rl.train import Trainer

ROOT = Path(__file__).resolve().parent.parent

SCENARIOS: dict[str, list[str]] = {
    "quickstart": ["train.warmup.demos=64"],
    "long": [
        "env.id=agent_rl/ChainLookup-v0",
        "train.warmup.steps=0",
        "rollout.max_turns=4",
        "rollout.max_new_tokens=160",
        "rollout.max_total_tokens=1024",
        "rollout.max_tool_tokens=128",
    ],
}


@dataclass(frozen=True)
class Timing:
    rollout_s: float
    update_s: float
    step_s: float

    @property
    def vs_max(self) -> float:
        return self.step_s / max(self.rollout_s, self.update_s)

    @property
    def vs_sum(self) -> float:
        return self.step_s / (self.rollout_s + self.update_s)


def scenario_config(name: str, mode: int, args: argparse.Namespace, out: Path) -> Config:
    sets = [
        f"train.warmup.steps={args.warmup_steps}",
        *SCENARIOS[name],
        f"train.steps={args.steps}",
        "env.eval_tasks=0",
        "run.progress=false",
        "run.resume=false",
        f"model.cpu_threads={args.threads}",
        f"rollout.async_steps={mode}",
        f"run.out_dir={out}",
        f"run.name={name}_{mode}",
    ]
    return load_config(ROOT / "configs" / "quickstart.yaml", sets)


def run_mode(cfg: Config) -> Timing:
    """Warm up as configured, then time every RL step; medians over all steps but the first."""
    trainer = Trainer(cfg)
    if cfg.train.warmup.steps:
        trainer.warmup()
    rows: list[tuple[float, float, float]] = []
    try:
        while trainer.step < cfg.train.steps:
            t0 = time.perf_counter()
            metrics = trainer.rl_step()
            wall = time.perf_counter() - t0
            trainer.step += 1
            rows.append((metrics["perf/rollout_s"], metrics["perf/update_s"], wall))
    finally:
        if trainer.prefetch is not None:
            trainer.prefetch.close()
    rows = rows[1:] or rows
    return Timing(*(statistics.median(r[i] for r in rows) for i in range(3)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--steps", type=int, default=6, help="RL steps per run (the first is not timed)")
    parser.add_argument("--warmup-steps", type=int, default=60, help="supervised warm-up (quickstart)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (model.cpu_threads)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is not timed)")
    load_before = os.getloadavg()
    results: dict[tuple[str, int], Timing] = {}
    with tempfile.TemporaryDirectory(prefix="async_bench_") as tmp:
        for name in args.scenarios:
            for mode in (0, 1):
                results[name, mode] = run_mode(scenario_config(name, mode, args, Path(tmp)))
    load_after = os.getloadavg()
    print(f"cores: {os.cpu_count()}  load average (1/5/15 min) before: {load_before}  after: {load_after}")
    print(f"steps timed per run: {args.steps - 1} (medians)  torch threads: {args.threads}")
    header = f"{'scenario':<11} {'mode':<10} {'rollout_s':>9} {'update_s':>9} {'step_s':>8} "
    print(header + f"{'step/max':>9} {'step/sum':>9} {'speed-up':>9}")
    for name in args.scenarios:
        sync = results[name, 0]
        for mode in (0, 1):
            t = results[name, mode]
            label = "pipelined" if mode else "sync"
            speed = f"{sync.step_s / t.step_s:9.2f}" if mode else f"{'':>9}"
            print(
                f"{name:<11} {label:<10} {t.rollout_s:9.3f} {t.update_s:9.3f} {t.step_s:8.3f} "
                f"{t.vs_max:9.2f} {t.vs_sum:9.2f} {speed}"
            )
    met = all(results[n, 1].vs_max <= 1.10 for n in args.scenarios)
    print(f"target pipelined step <= 1.10 x max(rollout, update): {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
