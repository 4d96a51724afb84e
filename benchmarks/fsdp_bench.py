"""Memory per learner rank: FSDP2 shards (scale.learner_sharding=fsdp) vs full replicas (none).

Two gloo ranks on this machine's CPU (spawned processes, the real `LearnerRank`), one update step
on an 8-row batch, then per rank: the bytes of parameters, gradients and AdamW state it holds
(local shards summed: `agent_rl.sharding.local_bytes`), their total, and the process's peak RSS.
The ratio column is fsdp / none in the same run. Models: the default tiny model, and a bigger
one built with TinyModelSpec (hidden 512, 8 layers).

Why peak RSS falls less than the state: each rank still loads the full model from disk before
sharding it (the same as the replicated path), and the interpreter + torch + transformers take a
few hundred MB that no sharding touches. The state bytes are what grows with the model.

    nice -n 19 .venv/bin/python benchmarks/fsdp_bench.py [--world 2] [--skip-big]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import tempfile
from pathlib import Path
from typing import Any

BIG = {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 1376}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, job: dict[str, Any], out: Any) -> None:
    import torch

    torch.set_num_threads(1)
    from agent_rl.build import load_model_and_tokenizer
    from agent_rl.config import AlgoConfig, TrainConfig
    from agent_rl.distributed.learner import LearnerRank, LearnerSpec, shard_rows

    model_dir, sharding = job["model_dir"], job["sharding"]
    model, _ = load_model_and_tokenizer(model_dir)
    weights = model.state_dict()
    del model
    algo = AlgoConfig(micro_batch_size=2, minibatches=1, ppo_epochs=1, kl_coef=0.0)
    spec = LearnerSpec(
        model_path=model_dir,
        algo=algo,
        train=TrainConfig(lr=1e-4),
        sharding=sharding,
        device=job["device"],
        param_dtype=job["param_dtype"],
    )
    learner = LearnerRank(spec, rank, world, weights)
    del weights
    learner.init_process_group("127.0.0.1", port)
    batch = _batch(8)
    rows = shard_rows(batch.group_index, world)[rank]
    learner.prepare(batch.rows(rows), rows, len(batch))
    learner.update()
    report: dict[str, Any] = dict(learner.memory())
    if job["device"] == "cuda":
        report["cuda_peak"] = torch.cuda.max_memory_allocated()
    weights = learner.weights()  # gathered on every rank; rank 0 keeps them
    if rank == 0:  # numpy copies: a queued tensor travels as a shared fd, gone once this rank exits
        report["weights"] = {k: v.detach().numpy().copy() for k, v in weights.items()}
    out.put((rank, report))
    import torch.distributed as dist

    dist.destroy_process_group()


def _batch(b: int) -> Any:
    import torch

    from agent_rl.batch import batch_from_tensors

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 300, (b, 32), generator=g)
    rewards = torch.zeros(b, 16)
    rewards[:, -1] = torch.randint(0, 2, (b,), generator=g).float()
    return batch_from_tensors(
        ids,
        torch.ones(b, 16),
        sampler_log_probs=torch.zeros(b, 16),
        token_rewards=rewards,
        group_index=torch.arange(b) // 2,
    )


def measure(job: dict[str, Any], world: int) -> dict[str, Any]:
    """Rank 0's report (the ranks hold equal shares up to one row of padding)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, job, out)) for r in range(world)]
    for p in procs:
        p.start()
    reports = dict(out.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return reports[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--skip-big", action="store_true")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: NCCL ranks, one GPU each (world 1 on a one-GPU machine)",
    )
    parser.add_argument(
        "--param-dtype",
        choices=("model", "bfloat16"),
        default="model",
        help="fsdp compute dtype (bfloat16 = MixedPrecisionPolicy, float32 reduce)",
    )
    args = parser.parse_args()
    from agent_rl.tiny_model import TinyModelSpec, ensure_tiny_model

    cache = Path(tempfile.gettempdir()) / "agent_rl_fsdp_bench"
    models = {"tiny (h64, 2 layers)": ensure_tiny_model(cache / "tiny")}
    if not args.skip_big:
        models["h512, 8 layers"] = ensure_tiny_model(cache / "big", TinyModelSpec(**BIG))
    mib = 1024 * 1024
    backend = "nccl" if args.device == "cuda" else "gloo"
    dtype = None if args.param_dtype == "model" else args.param_dtype
    print(
        f"world={args.world} {backend} ranks on {args.device}; fsdp param dtype {args.param_dtype}; "
        "per-rank bytes (rank 0) after one update step; MiB"
    )
    print("| model | quantity | none (replica) | fsdp (shards) | fsdp / none |")
    print("|---|---|---:|---:|---:|")
    gaps = {}
    for name, path in models.items():
        got = {
            mode: measure(
                {
                    "model_dir": str(path),
                    "sharding": mode,
                    "device": args.device,
                    "param_dtype": dtype if mode == "fsdp" else None,
                },
                args.world,
            )
            for mode in ("none", "fsdp")
        }
        for mode in got.values():
            mode["state"] = mode["params"] + mode["grads"] + mode["optimizer"]
        keys = ["params", "grads", "optimizer", "state", "peak_rss"] + (
            ["cuda_peak"] if args.device == "cuda" else []
        )
        for key in keys:
            a, b = got["none"][key], got["fsdp"][key]
            print(f"| {name} | {key} | {a / mib:.2f} | {b / mib:.2f} | {b / a:.3f} |")
        gaps[name] = relative_l2(got["fsdp"]["weights"], got["none"]["weights"])
    for name, gap in gaps.items():
        print(f"parameters after the step, fsdp vs none ({name}): relative L2 {gap:.3e}")


def relative_l2(got: dict[str, Any], want: dict[str, Any]) -> float:
    import torch

    got, want = ({k: torch.from_numpy(v).double() for k, v in d.items()} for d in (got, want))
    diff = torch.cat([(got[k] - want[k]).flatten() for k in want])
    return (diff.norm() / torch.cat([want[k].flatten() for k in want]).norm()).item()


if __name__ == "__main__":
    main()
