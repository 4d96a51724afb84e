"""FSDP2 learner ranks (`scale.learner_sharding: fsdp`) on CPU: 2 gloo ranks in spawned processes.

The ranks are the real `LearnerRank` (the body of the Ray actor) driven directly, without Ray, so
that a deadlock shows as a process that does not finish within its timeout rather than a hung
test. Rank 0 holds 5 rows and rank 1 3 rows of each batch (whole groups), with 1-row
micro-batches: rank 1 runs fewer micro-batches per minibatch, and holds no row at all of some
minibatches, so every step exercises the lock-step padding.

Tolerance (relative L2 of the parameter vectors, ||theta_fsdp - theta_1proc|| / ||theta_1proc||).
The two learners see the same batch and the same minibatches; they differ only in float32
rounding: the ranks score differently shaped batches (old log-probs within ~1e-6 of each other,
see test_ray_learner.py) and sum each minibatch's gradient in another order (a reduce-scatter of
two partial sums per micro-batch pass). As derived in test_ray_learner.py, each optimiser step's
gradient then agrees to a relative ~1e-5. AdamW turns that into parameter differences: an element
whose gradient is well above the rounding noise takes the step lr * m/sqrt(v), whose relative
error is that of g, <= 1e-5 lr; an element whose gradient is at the noise level can step the other
way, a difference of at most 2 lr (|m|/sqrt(v) <= 1 in these first steps). With a fraction f of
such elements among N, after k optimiser steps ||d theta|| <= k lr sqrt(N) (2 sqrt(f) + 1e-5), so

    relative L2 <= k * lr * (2 sqrt(f) + 1e-5) * sqrt(N) / ||theta||,

k = ppo_epochs x minibatches = 8 optimiser steps per RL step, lr = 1e-3 (the peak; the warm-up
ramp only lowers it), f = 1e-4 (assumed: at most 1 element in 10^4 whose gradient is within the
rounding noise of zero; the measured gap shows whether that holds), N and ||theta|| from the
model (`_bound`). For the tiny model (sqrt(N)/||theta|| ~ 17) that is ~3e-3 after 1 RL step and
~8e-3 after 3. A wrong step (a rank's gradient missing, averaged instead of summed, or a padding
pass adding a non-zero gradient) moves most elements by O(lr) per optimiser step: the test also
checks that one RL step moves theta by more than 10x the 1-step bound, so the bound can fail.
Measured: printed by `test_two_fsdp_ranks_take_the_single_process_steps`, on the default and the
AVX2 kernels (ATEN_CPU_CAPABILITY=avx2): see docs/ray.md.
"""

from __future__ import annotations

import copy
import io
import multiprocessing as mp
import os
import queue
import socket
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from agent_rl.build import load_model_and_tokenizer  # noqa: E402
from agent_rl.config import AlgoConfig, ConfigError, TrainConfig, build_config  # noqa: E402
from agent_rl.learner import Learner  # noqa: E402
from tests.agent_rl.test_learner import make_batch  # noqa: E402

pytestmark = pytest.mark.slow

ALGO = AlgoConfig(
    micro_batch_size=1,
    minibatches=4,
    ppo_epochs=2,
    loss_agg="seq-mean-token-mean",
    kl_coef=0.05,
    entropy_coef=0.01,
)
TRAIN = TrainConfig(lr=1e-3, seed=0, warmup_lr_steps=3)
GROUPS = [0, 0, 1, 1, 1, 2, 2, 2]  # rank 0 gets rows 0-4 (2 groups), rank 1 rows 5-7
BATCHES = [
    make_batch([1, 0, 0, 1, 1, 0, 0, 1], GROUPS, seed=0),
    make_batch([0, 1, 1, 1, 0, 1, 0, 0], GROUPS, seed=1),
    make_batch([1, 1, 0, 0, 1, 0, 1, 0], GROUPS, seed=2),
]
NOISY_FRACTION = 1e-4
"""f in the module docstring: elements whose gradient is within rounding noise of zero."""


def _bound(rl_steps: int, initial: dict[str, Any]) -> float:
    """Relative L2 bound on the parameters after `rl_steps` steps (derived in the module docstring)."""
    theta = torch.cat([v.double().flatten() for v in initial.values()])
    k = rl_steps * ALGO.ppo_epochs * ALGO.minibatches
    return k * TRAIN.lr * (2 * NOISY_FRACTION**0.5 + 1e-5) * theta.numel() ** 0.5 / theta.norm().item()


TIMEOUT_S = float(os.environ.get("AGENT_RL_FSDP_TIMEOUT_S", "300"))
"""A deadlocked collective never returns: the ranks are killed and the test fails after this (a
normal run takes well under a minute of CPU; raise it on a heavily loaded machine)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, job: dict[str, Any], out: Any) -> None:
    """One FSDP rank: optionally load a checkpoint, run the batches, report weights and states."""
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(TIMEOUT_S - 5, file=sys.stderr)  # where a stuck rank waits
    torch.set_num_threads(1)
    from agent_rl.distributed.learner import LearnerRank, LearnerSpec, shard_rows

    spec = LearnerSpec(
        model_path=job["model_dir"],
        algo=job["algo"],
        train=job["train"],
        timeout_s=TIMEOUT_S,
        sharding="fsdp",
    )
    learner = LearnerRank(spec, rank, world, job["weights"])
    learner.init_process_group("127.0.0.1", port)
    if job.get("resume") is not None:
        learner.load_state_dict(job["resume"])
    report: dict[str, Any] = {"weights": [], "states": [], "memory": None}
    for batch in job["batches"]:
        rows = shard_rows(batch.group_index, world)[rank]
        learner.prepare(batch.rows(rows), rows, len(batch))
        learner.update()
        print(f"rank {rank}: step done", flush=True)
        report["weights"].append(learner.weights())  # gathered: every rank calls it
        report["states"].append(learner.state_dict())
    report["memory"] = learner.memory()
    report["digest"] = learner.digest()
    # As bytes: a queued tensor is shared by file descriptor, which the parent can no longer open
    # once this process has exited (FileNotFoundError on the resource sharer's socket).
    buf = io.BytesIO()
    torch.save(report, buf)
    out.put((rank, buf.getvalue()))
    import torch.distributed as dist

    dist.destroy_process_group()


def run_fsdp_ranks(job: dict[str, Any], world: int = 2) -> list[dict[str, Any]]:
    """Run `job` on `world` spawned FSDP ranks; each rank's report, by rank. Fails (and kills the
    ranks) if any has not finished within TIMEOUT_S: a deadlock in a collective."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, job, out), daemon=True) for r in range(world)
    ]
    for p in procs:
        p.start()
    reports: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while len(reports) < world:
            try:
                rank, data = out.get(timeout=1.0)
                reports[rank] = torch.load(io.BytesIO(data), weights_only=False)
            except queue.Empty:
                died = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not died, f"an FSDP rank died (exit codes {died}); its traceback is on stderr"
                assert time.monotonic() < deadline, (
                    f"FSDP ranks did not finish within {TIMEOUT_S:g}s (deadlock)"
                )
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [reports[r] for r in range(world)]


def _relative_l2(got: dict[str, Any], want: dict[str, Any]) -> float:
    assert set(got) == set(want)
    diff = torch.cat([(got[k].double() - want[k].double()).flatten() for k in want])
    ref = torch.cat([want[k].double().flatten() for k in want])
    return (diff.norm() / ref.norm()).item()


def _adam_steps(state: dict[str, Any]) -> list[float]:
    """AdamW's per-parameter step counters in a learner state (they set its bias correction)."""
    return [float(moments["step"]) for moments in state["optimizer"]["state"].values()]


@pytest.fixture(scope="module")
def single_process(tiny_model_dir: Path) -> dict[str, Any]:
    """The in-process Learner on the whole batches: weights and learner state after each step."""
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    initial = copy.deepcopy(model.state_dict())
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    local = Learner(model, ALGO, TRAIN, ref_model=ref)
    weights, states = [], []
    for batch in BATCHES:
        local.step(batch)
        weights.append(copy.deepcopy(model.state_dict()))
        states.append(copy.deepcopy(local.state_dict()))
    return {"initial": initial, "weights": weights, "states": states}


@pytest.fixture(scope="module")
def fsdp_run(tiny_model_dir: Path, single_process: dict[str, Any]) -> list[dict[str, Any]]:
    job = {
        "model_dir": str(tiny_model_dir),
        "algo": ALGO,
        "train": TRAIN,
        "weights": single_process["initial"],
        "batches": BATCHES,
    }
    return run_fsdp_ranks(job)


def test_two_fsdp_ranks_take_the_single_process_steps(
    fsdp_run: list[dict[str, Any]], single_process: dict[str, Any]
) -> None:
    rank0, rank1 = fsdp_run
    assert rank1["weights"] == [{}, {}, {}] and rank1["states"] == [{}, {}, {}]  # only rank 0 ships them
    assert rank0["digest"] == rank1["digest"]  # the gathered parameters are the same on both ranks
    initial = single_process["initial"]
    moved = _relative_l2(initial, single_process["weights"][0])
    for steps in (1, 3):
        bound = _bound(steps, initial)
        gap = _relative_l2(rank0["weights"][steps - 1], single_process["weights"][steps - 1])
        print(
            f"fsdp vs single process after {steps} step(s): relative L2 {gap:.3e} (bound {bound:.2e}; "
            f"one step moves {moved:.3e}; ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', 'default')})"
        )
        assert gap <= bound, (steps, gap)
    assert moved > 10 * _bound(1, initial)  # the bound is meaningful: a skipped step would exceed it


def test_fsdp_checkpoint_is_the_in_process_format(
    tiny_model_dir: Path, fsdp_run: list[dict[str, Any]], single_process: dict[str, Any]
) -> None:
    """Gathered, not sharded: the same keys, shapes and optimiser layout as one process writes, so
    an fsdp checkpoint resumes in process, on replicated ranks, or on any number of fsdp ranks."""
    got, want = fsdp_run[0]["states"][0], single_process["states"][0]
    assert set(got) == set(want)
    assert {k: v.shape for k, v in got["model"].items()} == {k: v.shape for k, v in want["model"].items()}
    assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
    for i, moments in want["optimizer"]["state"].items():
        for key, value in moments.items():
            assert got["optimizer"]["state"][i][key].shape == value.shape, (i, key)
    assert _adam_steps(got) == _adam_steps(want)  # the counters as they were, not as they are now
    assert got["scheduler"] == want["scheduler"]
    assert torch.equal(got["generator"], want["generator"])
    # ...and loads into a plain Learner.
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    Learner(model, ALGO, TRAIN).load_state_dict(got)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in got["model"].items())


def test_fsdp_ranks_resume_where_the_checkpoint_stopped(
    tiny_model_dir: Path, fsdp_run: list[dict[str, Any]], single_process: dict[str, Any]
) -> None:
    """1 step, checkpoint, fresh ranks load it and take 2 more: the weights of 3 uninterrupted steps.

    The fresh ranks start from the initial weights, as the trainer builds them (so the KL reference
    stays the initial policy), then load the checkpoint rank 0 gathered after the first step. They
    then hold bitwise the state the uninterrupted ranks held and run the same operations on the same
    shards, so only float rounding could separate the two, which is what `_bound` bounds: after r
    resumed steps the gap must stay within `_bound(r)` (the fsdp vs single-process tolerance).
    Measured: 0.0, bit-identical. What it guards against: AdamW's per-parameter `step` counters
    shared with the checkpoint (taken live, so they read 24 instead of 8; loaded without a copy, so
    two ranks sharing the checkpoint's memory added 2 per optimiser step) ended 2.4e-2 apart, 4x the
    bound. The counters, scheduler and generator are also compared exactly after the 2 steps.
    """
    checkpoint = fsdp_run[0]["states"][0]
    assert _adam_steps(checkpoint) == _adam_steps(single_process["states"][0])  # a snapshot, not live
    job = {
        "model_dir": str(tiny_model_dir),
        "algo": ALGO,
        "train": TRAIN,
        "weights": single_process["initial"],
        "batches": BATCHES[1:],
        "resume": checkpoint,  # spawned ranks get it through shared memory: both see one copy
    }
    rank0, rank1 = run_fsdp_ranks(job)
    assert rank0["digest"] == rank1["digest"]
    uninterrupted = fsdp_run[0]
    for resumed in (1, 2):
        gap = _relative_l2(rank0["weights"][resumed - 1], uninterrupted["weights"][resumed])
        bound = _bound(resumed, single_process["initial"])
        print(
            f"fsdp resume after 1 step, {resumed} more vs uninterrupted: relative L2 {gap:.3e} (bound {bound:.2e})"
        )
        assert gap <= bound, (resumed, gap)
    got, want = rank0["states"][-1], uninterrupted["states"][-1]
    optimiser_steps = len(BATCHES) * ALGO.ppo_epochs * ALGO.minibatches
    assert _adam_steps(got) == _adam_steps(want) == [optimiser_steps] * len(_adam_steps(want))
    assert got["scheduler"] == want["scheduler"]
    assert torch.equal(got["generator"], want["generator"])


def test_a_rank_with_fewer_micro_batches_does_not_deadlock(tiny_model_dir: Path) -> None:
    """6 rows on rank 0, 2 on rank 1, one minibatch of 1-row micro-batches: rank 1 runs 4 padding
    passes. Without them it would wait in an all-gather forever (the run would hit TIMEOUT_S)."""
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    algo = AlgoConfig(micro_batch_size=1, minibatches=1, ppo_epochs=1)
    batch = make_batch([1, 0, 1, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0, 1, 1], seed=3)
    job = {
        "model_dir": str(tiny_model_dir),
        "algo": algo,
        "train": TRAIN,
        "weights": model.state_dict(),
        "batches": [batch],
    }
    rank0, rank1 = run_fsdp_ranks(job)
    assert rank0["digest"] == rank1["digest"]
    initial = copy.deepcopy(model.state_dict())
    local = Learner(model, algo, TRAIN)
    local.step(batch)
    # one optimiser step here (1 epoch x 1 minibatch): the 1-step bound with k = 1 is 8x tighter
    assert _relative_l2(rank0["weights"][0], model.state_dict()) <= _bound(1, initial) / 8


def test_fsdp_config_is_refused_where_it_cannot_work() -> None:
    with pytest.raises(ConfigError, match="learner_workers >= 2"):
        build_config({}, ["scale.backend=ray", "scale.learner_sharding=fsdp"])
    ok = ["scale.backend=ray", "scale.learner_workers=2", "scale.learner_sharding=fsdp"]
    cfg = build_config({}, ok)
    assert cfg.scale.learner_sharding == "fsdp" and cfg.scale.fsdp_param_dtype == "model"
    with pytest.raises(ConfigError, match="grad_variance_every"):
        build_config({}, [*ok, "train.grad_variance_every=5"])
    with pytest.raises(ConfigError, match="lora"):
        build_config({}, [*ok, "model.lora.rank=8"])
    assert build_config({}, []).scale.learner_sharding == "none"


def test_fsdp_refuses_an_estimator_needing_per_sample_gradients(tiny_model_dir: Path) -> None:
    from agent_rl.distributed.learner import LearnerSpec, check_sharding

    spec = LearnerSpec(str(tiny_model_dir), AlgoConfig(estimator="exact_optimal"), TRAIN, sharding="fsdp")
    with pytest.raises(ValueError, match="exact per-sequence gradient norms"):
        check_sharding(spec)
    check_sharding(LearnerSpec(str(tiny_model_dir), AlgoConfig(), TRAIN, sharding="fsdp"))
