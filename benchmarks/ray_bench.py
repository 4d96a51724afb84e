"""Benchmark: rollout throughput on Ray with 1 vs 2 worker actors, and the cost of one weight sync.

What it measures (CPU, tiny model, the easy arithmetic env with the local sandbox):
1. Rollout throughput: wall time of one collect(B tasks x N samples) and policy tokens/s, for the
   in-process collector (the baseline, with torch's default threads and with 1 thread) and for
   Ray with 1 and 2 rollout workers (1 logical CPU and 1 torch thread each). Medians and p99 over repeated collects with
   fresh seeds, after one warm-up collect per setup.
2. Weight sync: `RayRollout.update_weights(state_dict, wait=True)` = one `ray.put` of the state
   dict plus every worker fetching it from the object store and copying it into its model;
   against the in-process baseline, a plain `load_state_dict`-style copy into a second model.
3. One learner step (score + advantages + PPO update) on a collected B x N batch: the in-process
   Learner (1 torch thread) against `RayLearner` with 1 and 2 ranks (gloo, 1 CPU and 1 thread
   each). The ranks' time includes shipping the shards and the scored batch through Ray and the
   gradient all-reduce. Median and p99 over repeated steps, after one warm-up step each.

On a 2-core machine the two workers' engines run in parallel (one core each), but the env steps
(sandbox interpreter processes), the Ray raylet and the driver share the same two cores, so the
speed-up is below 2x; on more cores it approaches the number of workers until the sandbox or the
driver saturates.

Run:  python benchmarks/ray_bench.py [--prompts 8 --group 4 --repeats 3 --workers 1,2 --ranks 1,2]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from pathlib import Path
from typing import Any


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _tasks(n: int, offset: int) -> list[dict[str, int]]:
    return [{"task_index": i, "seed": i} for i in range(offset, offset + n)]


def _time_collects(collector: Any, args: argparse.Namespace) -> dict[str, float]:
    collector.collect(_tasks(args.prompts, 10_000), args.group, seed=999)  # warm-up
    walls, tps, idle = [], [], []
    for r in range(args.repeats):
        t0 = time.perf_counter()
        trajs = collector.collect(_tasks(args.prompts, r * args.prompts), args.group, seed=r)
        wall = time.perf_counter() - t0
        walls.append(wall)
        tps.append(sum(t.num_policy_tokens for t in trajs) / wall)
        idle.append(collector.last_stats.as_metrics()["perf/engine_idle_frac"])
    return {
        "wall_med": statistics.median(walls),
        "wall_p99": _quantile(walls, 0.99),
        "tok_s_med": statistics.median(tps),
        "engine_idle": statistics.median(idle),
    }


def _time_learner_steps(
    model_path: Path, collector: Any, tokenizer: Any, args: argparse.Namespace
) -> tuple[str, list[tuple[str, dict[str, float]]]]:
    """Median/p99 wall time of Learner.step in process and of RayLearner.step with 1..N ranks."""
    import torch

    from agent_rl.batch import collate
    from agent_rl.build import load_model_and_tokenizer
    from agent_rl.config import AlgoConfig, TrainConfig
    from agent_rl.distributed.learner import LearnerSpec, RayLearner
    from agent_rl.learner import Learner

    trajs = collector.collect(_tasks(args.prompts, 20_000), args.group, seed=4321)
    trajs = [  # k copies as distinct groups: a bigger batch without sampling it
        dataclasses.replace(t, group_id=t.group_id + c * args.prompts)
        for c in range(args.learner_copies)
        for t in trajs
    ]
    batch = collate(trajs, tokenizer.pad_token_id)
    desc = f"{len(trajs)} rows x {batch.input_ids.shape[1]} tokens ({int(batch.policy_mask.sum())} policy tokens)"
    algo, train = AlgoConfig(), TrainConfig(lr=1e-5)

    def timed(step: Any) -> dict[str, float]:
        step()  # warm-up
        walls = []
        for _ in range(args.learner_repeats):
            t0 = time.perf_counter()
            step()
            walls.append(time.perf_counter() - t0)
        return {"med": statistics.median(walls), "p99": _quantile(walls, 0.99)}

    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, _ = load_model_and_tokenizer(model_path)
    local = Learner(model, algo, train)
    rows.append(("in-process, 1 thr", timed(lambda: local.step(batch))))
    torch.set_num_threads(threads)
    for n in [int(x) for x in args.ranks.split(",")]:
        spec = LearnerSpec(model_path=str(model_path), algo=algo, train=train)
        ranks = RayLearner(spec, n, model.state_dict())
        try:
            rows.append((f"ray, {n} rank{'s' if n > 1 else ''}", timed(functools.partial(ranks.step, batch))))
        finally:
            ranks.shutdown()
    return desc, rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=8, help="B tasks per collect")
    parser.add_argument("--group", type=int, default=4, help="N samples per task")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sync-repeats", type=int, default=10)
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts ('' = none)")
    parser.add_argument("--ranks", default="1,2", help="comma-separated learner rank counts")
    parser.add_argument("--learner-repeats", type=int, default=5)
    parser.add_argument(
        "--learner-copies", type=int, default=1, help="tile the collected batch k times for the learner step"
    )
    parser.add_argument("--model", default=None, help="model dir (default: the offline tiny model)")
    args = parser.parse_args()

    import gymnasium
    import ray
    import torch

    import envs  # noqa: F401
    from agent_rl.build import load_model_and_tokenizer, resolve_model_path
    from agent_rl.config import build_config
    from agent_rl.distributed import RayRollout
    from agent_rl.rollout import Collector, CollectorConfig, SamplingParams
    from agent_rl.rollout.hf_engine import HFEngine
    from sandbox import LocalSandbox

    base = ["env.id=agent_rl/PythonArithEasy-v0", "rollout.max_new_tokens=24", "rollout.max_turns=2"]
    if args.model:
        base.append(f"model.path={args.model}")
    model_path = Path(args.model) if args.model else resolve_model_path(build_config({}, base))
    model, tokenizer = load_model_and_tokenizer(model_path)
    cc = CollectorConfig(
        sampling=SamplingParams(max_new_tokens=24), max_turns=2, max_total_tokens=512, max_tool_tokens=64
    )
    episodes = args.prompts * args.group
    print(
        f"workload: {args.prompts} tasks x {args.group} samples = {episodes} episodes per collect, "
        f"{args.repeats} timed collects; torch threads in-process: {torch.get_num_threads()}"
    )

    rows: list[tuple[str, dict[str, float]]] = []
    sandbox = LocalSandbox()
    local = Collector(
        HFEngine(model, tokenizer, max_model_len=536, seed=0),
        tokenizer,
        lambda: gymnasium.make("agent_rl/PythonArithEasy-v0", sandbox=sandbox, max_turns=2),
        cc,
    )
    threads = torch.get_num_threads()
    rows.append((f"in-process, {threads} thr", _time_collects(local, args)))
    torch.set_num_threads(1)  # what each Ray worker gets (1 logical CPU): separates threads from Ray
    rows.append(("in-process, 1 thr", _time_collects(local, args)))
    torch.set_num_threads(threads)

    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024 * 1024, log_to_driver=False)
    ray_start = time.perf_counter() - t0
    sync: dict[str, float] = {}
    spawn: dict[int, float] = {}
    worker_counts = [int(x) for x in args.workers.split(",") if x]
    for w in worker_counts:
        cfg = build_config({}, [*base, "scale.backend=ray", f"scale.rollout_workers={w}"])
        t0 = time.perf_counter()
        rollout = RayRollout.from_config(cfg, model_path, model.state_dict())
        spawn[w] = time.perf_counter() - t0
        try:
            rows.append(
                (f"ray, {w} worker{'s' if w > 1 else ''}", _time_collects(rollout.collector(cc), args))
            )
            if w == max(worker_counts):
                state = model.state_dict()
                puts, fulls = [], []
                for _ in range(args.sync_repeats):
                    t0 = time.perf_counter()
                    ref = ray.put({k: v.detach().cpu() for k, v in state.items()})
                    puts.append(time.perf_counter() - t0)
                    del ref
                    t0 = time.perf_counter()
                    rollout.update_weights(state, wait=True)
                    fulls.append(time.perf_counter() - t0)
                sync = {
                    "workers": w,
                    "put_med": statistics.median(puts),
                    "sync_med": statistics.median(fulls),
                    "sync_p99": _quantile(fulls, 0.99),
                }
        finally:
            rollout.shutdown()

    learner_rows = _time_learner_steps(model_path, local, tokenizer, args)

    copy_model, _ = load_model_and_tokenizer(model_path)
    copy_engine = HFEngine(copy_model, tokenizer, max_model_len=536)
    local_sync = []
    for _ in range(args.sync_repeats):
        t0 = time.perf_counter()
        copy_engine.update_weights(model.state_dict())
        local_sync.append(time.perf_counter() - t0)
    mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20

    base_wall = rows[0][1]["wall_med"]
    one = next((r for n, r in rows if n.startswith("ray, 1 ")), None)
    print()
    print(
        f"{'setup':<24}{'wall med s':>12}{'wall p99 s':>12}{'tok/s med':>12}{'engine idle':>13}"
        f"{'vs in-proc':>12}{'vs 1 worker':>13}"
    )
    for name, r in rows:
        vs1 = f"{one['wall_med'] / r['wall_med']:.2f}x" if one and name.startswith("ray") else "-"
        print(
            f"{name:<24}{r['wall_med']:>12.2f}{r['wall_p99']:>12.2f}{r['tok_s_med']:>12.1f}"
            f"{r['engine_idle']:>13.2f}{base_wall / r['wall_med']:>11.2f}x{vs1:>13}"
        )
    print()
    print(f"weight sync, tiny model ({mb:.2f} MiB of fp32 tensors), median of {args.sync_repeats}:")
    print(f"  in-process copy into a 2nd model (baseline): {1e3 * statistics.median(local_sync):8.2f} ms")
    if sync:
        print(f"  ray.put of the state dict alone:             {1e3 * sync['put_med']:8.2f} ms")
        print(
            f"  update_weights(wait=True), {sync['workers']} workers:        "
            f"{1e3 * sync['sync_med']:8.2f} ms (p99 {1e3 * sync['sync_p99']:.2f} ms)"
        )
    print()
    batch_desc, learner_rows = learner_rows
    print(f"one learner step on {batch_desc}, median of {args.learner_repeats}:")
    print(f"{'setup':<24}{'step med s':>12}{'step p99 s':>12}{'vs in-proc':>12}{'vs 1 rank':>11}")
    one_rank = next((r for n, r in learner_rows if n.startswith("ray, 1 ")), None)
    for name, r in learner_rows:
        vs1 = f"{one_rank['med'] / r['med']:.2f}x" if one_rank and name.startswith("ray") else "-"
        print(
            f"{name:<24}{r['med']:>12.3f}{r['p99']:>12.3f}"
            f"{learner_rows[0][1]['med'] / r['med']:>11.2f}x{vs1:>11}"
        )
    print()
    print(
        f"one-off costs: ray.init {ray_start:.1f} s; worker start (model load) "
        + ", ".join(f"{w} worker(s) {s:.1f} s" for w, s in spawn.items())
    )
    ray.shutdown()


if __name__ == "__main__":
    main()
