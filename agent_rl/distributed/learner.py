"""Data-parallel learner ranks on Ray: N replicas of the Learner that take one optimiser step together.

`RayLearner` stands in for `Learner` in the trainer (`step`, `state_dict`, `load_state_dict`); each
rank is a `LearnerRank` actor holding a model replica, its optimiser and scheduler, all initialised
from the driver's weights, and joined to the others by torch.distributed (gloo on CPU, NCCL when
the model is on CUDA). One step:

1. The driver splits the collated batch into shards of WHOLE groups (group baselines need every
   sample of a group) and sends one to each rank.
2. Each rank scores its shard and computes its advantages (`Learner.prepare`); the driver puts the
   scored shards back together in batch order, for the trajectory log and for the adv/ and policy/
   metrics, which it computes once over the whole batch exactly as in one process.
3. Every rank runs `Learner.update(shard=...)`: the same global permutation and minibatches as one
   process, its loss divided by the global token (or sequence) count, gradients summed over the
   ranks before clipping. Every rank therefore takes the single-process optimiser step on the
   whole batch (up to float rounding) and the replicas stay identical.

Why an explicit all-reduce in `Learner.update` rather than torch's DDP wrapper: the loss is already
normalised by the global count, so gradients must be SUMMED (DDP averages); a rank may hold no row
of some minibatch (groups are whole, the permutation is global) and DDP needs every rank to run a
backward each step; and scoring, diagnostics and checkpoints keep using the plain module. DDP's
overlap of communication with the backward pass buys nothing at this scale; one flat all-reduce
per optimiser step is what it would do anyway.

Faults: a learner rank cannot be replaced mid-update (it holds its shard and the others wait for
it in all-reduce), so a rank that dies or does not answer within `timeout_s` fails the step with
`LearnerRankError`; the ranks are shut down and the run resumes from its last checkpoint.
"""

from __future__ import annotations

import copy
import logging
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from agent_rl import build
from agent_rl.batch import RolloutBatch, ScoredBatch, gather_rows
from agent_rl.config import AlgoConfig, TrainConfig
from agent_rl.distributed.cluster import ensure_ray, import_ray, ray_cpus_wanted
from agent_rl.distributed.rollout import split_groups
from agent_rl.learner import Learner, step_metrics
from agent_rl.parallel import Shard, combine_micro_metrics

if TYPE_CHECKING:
    from agent_rl.config import Config

log = logging.getLogger(__name__)


class LearnerRankError(RuntimeError):
    """A learner rank died, raised, or did not answer in time; the step cannot complete."""


@dataclass
class LearnerSpec:
    """What a rank needs to build its replica on any node (plain data, pickled to the actor)."""

    model_path: str
    """Must exist on every node that runs a rank (the weights themselves come from the driver)."""
    algo: AlgoConfig
    train: TrainConfig
    temperature: float = 1.0
    dtype: str = "float32"
    device: str = "cpu"
    """'cpu', or 'cuda' = the GPU Ray assigned to the rank (then the backend is NCCL)."""
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    torch_threads: int | None = None
    """Intra-op threads; None = the actor's CPU share (at least 1)."""
    timeout_s: float = 600.0
    """Deadline for one call (and the torch.distributed collective timeout)."""
    sharding: str = "none"
    """'none': a full replica per rank; 'fsdp': FSDP2 shards of parameters, gradients and AdamW
    state (agent_rl/sharding.py), so every method that touches weights is a collective."""
    param_dtype: str | None = None
    """FSDP compute dtype ('bfloat16' = bf16 mixed precision); None = the model's dtype."""


def _to(obj: Any, device: torch.device | str) -> Any:
    """`obj` with every tensor inside (dicts, lists, tuples) moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return obj


class LearnerRank:
    """One data-parallel rank (the actor body; wrapped with `ray.remote` by the driver)."""

    def __init__(self, spec: LearnerSpec, rank: int, world_size: int, weights: Mapping[str, Any]) -> None:
        torch.set_num_threads(spec.torch_threads or max(1, int(spec.num_cpus)))
        torch.use_deterministic_algorithms(True, warn_only=True)
        self.spec, self.rank, self.world_size = spec, rank, world_size
        model, _ = build.load_model_and_tokenizer(spec.model_path, spec.dtype, spec.device)
        model.load_state_dict(weights)  # identical replicas: every rank starts from the driver's weights
        # As in the trainer: the reference policy is the initial one, never the warmed-up or resumed one.
        # Under FSDP it stays a full replica (no-grad forwards only; sharding it is not built).
        self.ref = copy.deepcopy(model).eval().requires_grad_(False) if spec.algo.kl_coef > 0 else None
        self.fsdp = spec.sharding == "fsdp"
        self.device = next(model.parameters()).device
        # FSDP replaces the parameters when it shards (after the process group exists), so the
        # optimiser is built then; a replica gets its Learner now.
        self.learner = self._learner(model)
        self._model = model
        self._scored: ScoredBatch | None = None
        self._shard: Shard | None = None
        self._stall_s = 0.0

    # -- process group ---------------------------------------------------------------------------
    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port, for the others to meet rank 0 (called on rank 0)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_process_group(self, host: str, port: int) -> int:
        import torch.distributed as dist

        dist.init_process_group(
            "nccl" if self.device.type == "cuda" else "gloo",
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=self.spec.timeout_s),
        )
        if self.fsdp:
            from agent_rl.sharding import ShardingSpec, shard_model

            # The Learner trains the FSDP root around the LM; self._model stays the LM (its
            # parameters are now the shards), for names and state dicts.
            self.learner = self._learner(
                shard_model(self._model, ShardingSpec(param_dtype=self.spec.param_dtype))
            )
        return self.rank

    def _learner(self, model: torch.nn.Module) -> Learner:
        spec = self.spec
        return Learner(model, spec.algo, spec.train, temperature=spec.temperature, ref_model=self.ref)

    def _gathered(self) -> Any:
        """Under FSDP, every parameter gathered for a stretch of no-grad forwards (a collective)."""
        from contextlib import nullcontext

        from agent_rl.sharding import gathered

        return gathered(self.learner.model) if self.fsdp else nullcontext()

    # -- one step ----------------------------------------------------------------------------------
    def prepare(self, batch: RolloutBatch, rows: torch.Tensor, total: int) -> ScoredBatch:
        """Score this rank's shard and add advantages; kept for `update`, returned on the CPU."""
        self._stall()
        self._shard = Shard(rows, total, lockstep=self.fsdp)
        with self._gathered():  # FSDP: ranks score shards of different sizes, so no per-forward collectives
            self._scored = self.learner.prepare(batch.to(self.device))
        return self._scored.to("cpu")

    def diagnose(self, scored: ScoredBatch) -> dict[str, float]:
        """Exact gradient diagnostics over the WHOLE scored batch (rank 0 only, before the update)."""
        return self.learner.gradient_diagnostics(scored.to(self.device))

    def update(self) -> tuple[dict[str, float], list[tuple[int, dict[str, float]]]]:
        """The synchronised update on the prepared shard: (this rank's metrics, its micro-batch records)."""
        self._stall()
        if self._scored is None or self._shard is None:
            raise RuntimeError("update() before prepare(): nothing to train on")
        metrics = self.learner.update(self._scored, self._shard)
        self._scored = self._shard = None
        return metrics, self.learner.micro_metrics

    # -- state -------------------------------------------------------------------------------------
    def weights(self) -> dict[str, torch.Tensor]:
        """The full weights on the CPU. Under FSDP a collective (call on every rank); ranks other
        than 0 then return {} so only rank 0's copy lands in the object store."""
        if not self.fsdp:
            return _to(self.learner.model.state_dict(), "cpu")
        from agent_rl.sharding import full_model_state

        full = full_model_state(self._model)
        return full if self.rank == 0 else {}

    def load_weights(self, weights: Mapping[str, Any]) -> None:
        if not self.fsdp:
            self.learner.model.load_state_dict(weights)
            return
        from agent_rl.sharding import load_full_model_state

        load_full_model_state(self._model, weights)

    def state_dict(self) -> dict[str, Any]:
        """The in-process Learner's format. Under FSDP gathered from the shards (a collective: every
        rank calls it; ranks other than 0 return {}), so a checkpoint loads into any layout."""
        if not self.fsdp:
            return _to(self.learner.state_dict(), "cpu")
        from agent_rl.sharding import full_model_state, full_optimizer_state

        model, optimizer = full_model_state(self._model), full_optimizer_state(self.learner.optimizer)
        if self.rank != 0:
            return {}
        return {
            "model": model,
            "optimizer": optimizer,
            "scheduler": self.learner.scheduler.state_dict(),
            "generator": self.learner.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state in the in-process format, whatever layout wrote it. Under FSDP every rank
        gets the same full state and cuts its own shards out of it (no collective); the model,
        AdamW (moments and per-parameter step counters), scheduler and generator are all restored,
        which makes a resumed run bit-identical to an uninterrupted one (test_fsdp.py)."""
        if not self.fsdp:
            self.learner.load_state_dict(state)
            return
        from agent_rl.sharding import load_full_model_state, load_full_optimizer_state

        load_full_model_state(self._model, state["model"])
        load_full_optimizer_state(self.learner.optimizer, state["optimizer"])
        self.learner.scheduler.load_state_dict(state["scheduler"])
        self.learner.generator.set_state(state["generator"])

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and AdamW state, and its peak RSS."""
        import resource

        from agent_rl.sharding import local_bytes

        out = local_bytes(self.learner.model, self.learner.optimizer)
        out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        return out

    def digest(self) -> str:
        """A hash of every parameter's bytes: equal on all ranks iff the replicas are identical."""
        import hashlib

        from agent_rl.sharding import full_value

        h = hashlib.sha256()
        for p in self.learner.model.parameters():  # under FSDP: the gathered parameter (a collective)
            h.update(full_value(p.detach()).cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def gradients(self) -> dict[str, torch.Tensor]:
        """The last optimiser step's gradient (summed over the ranks, clipped), by parameter name.

        For parity checks: AdamW divides each element by its own running scale, which turns float
        rounding in a tiny gradient into a visible parameter difference, so two learners are
        compared on what goes into the optimiser, not on what comes out of it.
        """
        from agent_rl.sharding import full_value

        return {  # under FSDP: gathered (a collective; every rank calls it)
            name: full_value(p.grad.detach()).to("cpu").clone()
            for name, p in self._model.named_parameters()
            if p.grad is not None
        }

    # -- tests -------------------------------------------------------------------------------------
    def stall_next_call(self, seconds: float) -> None:
        """Test hook: the next prepare/update first sleeps `seconds` (a hung rank)."""
        self._stall_s = seconds

    def _stall(self) -> None:
        if self._stall_s:
            seconds, self._stall_s = self._stall_s, 0.0
            time.sleep(seconds)


def check_sharding(spec: LearnerSpec) -> None:
    """Refuse FSDP with what needs per-sample backward passes on a full model (a rank-local
    backward would be a collective the other ranks never join)."""
    if spec.sharding not in ("none", "fsdp"):
        raise ValueError(f"unknown learner sharding {spec.sharding!r}: 'none' or 'fsdp'")
    from agent_rl.advantages.registry import required_inputs

    if spec.sharding == "fsdp" and "grad_sq_norms" in required_inputs(spec.algo.estimator):
        raise ValueError(
            f"algo.estimator={spec.algo.estimator!r} needs exact per-sequence gradient norms (one backward "
            "per sample on one rank), which FSDP cannot run; use scale.learner_sharding=none"
        )


def shard_rows(group_index: torch.Tensor, num_ranks: int) -> list[torch.Tensor]:
    """Row indices for each rank: whole groups (consecutive in first-seen order), near-equal in number."""
    groups = list(dict.fromkeys(group_index.tolist()))  # first-seen order
    if len(groups) < num_ranks:
        raise ValueError(
            f"the batch has {len(groups)} groups but there are {num_ranks} learner ranks; "
            "each rank needs at least one whole group (raise rollout.prompts_per_step)"
        )
    out = []
    for ids in split_groups(len(groups), num_ranks):
        members = torch.tensor([groups[i] for i in ids])
        out.append(torch.isin(group_index, members).nonzero().squeeze(1))
    return out


def reduce_update_metrics(
    results: Sequence[tuple[dict[str, float], list[tuple[int, dict[str, float]]]]],
) -> dict[str, float]:
    """One set of update metrics from every rank's: the ranks' micro-batch records combined per
    optimiser step exactly as one process combines its own (`combine_micro_metrics`); grad/ and
    perf/ metrics are identical on every rank (gradients were summed before clipping): rank 0's."""
    metrics = combine_micro_metrics([record for _, records in results for record in records])
    metrics.update({k: v for k, v in results[0][0].items() if not k.startswith("losses/")})
    return metrics


class RayLearner:
    """The driver's handle on N learner ranks, with the Learner interface the trainer uses."""

    def __init__(self, spec: LearnerSpec, num_ranks: int, weights: Mapping[str, Any]) -> None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        check_sharding(spec)
        self.ray = import_ray()
        if not self.ray.is_initialized():
            raise RuntimeError("RayLearner needs a Ray connection; call ensure_ray() or ray.init() first")
        self.spec = spec
        self.timeout_s = spec.timeout_s
        actor = self.ray.remote(num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, max_restarts=0)(LearnerRank)
        ref = self.ray.put(_to(dict(weights), "cpu"))
        self.ranks: list[Any] = [actor.remote(spec, r, num_ranks, ref) for r in range(num_ranks)]
        # Rank 0 picks the rendezvous port on its own node; every rank then joins (blocks until all have).
        (host, port) = self._gather([self.ranks[0].rendezvous_address.remote()], [0], "start")[0]
        self._gather([r.init_process_group.remote(host, port) for r in self.ranks], None, "join the group")
        log.info("%d learner ranks joined at %s:%d", num_ranks, host, port)

    @classmethod
    def from_config(cls, cfg: Config, model_path: Any, weights: Mapping[str, Any]) -> RayLearner:
        """`cfg.scale.learner_workers` ranks (connecting to `cfg.scale.address` or starting a local Ray)."""
        scale = cfg.scale
        ensure_ray(scale.address, min_cpus=ray_cpus_wanted(scale))
        on_gpu = build.uses_gpu(cfg)
        spec = LearnerSpec(
            model_path=str(model_path),
            algo=cfg.algo,
            train=cfg.train,
            temperature=cfg.rollout.temperature,
            dtype=cfg.model.dtype,
            device="cuda" if on_gpu else "cpu",
            num_gpus=1.0 if on_gpu else 0.0,
            torch_threads=cfg.model.cpu_threads,
            timeout_s=scale.learner_timeout_s,
            sharding=scale.learner_sharding,
            param_dtype=None if scale.fsdp_param_dtype == "model" else scale.fsdp_param_dtype,
        )
        return cls(spec, scale.learner_workers, weights)

    # -- calls with a deadline ---------------------------------------------------------------------
    def _wait(self, refs: list[Any], ranks: list[int] | None, what: str) -> None:
        """Wait for every call up to the deadline, without fetching results; a late rank shuts the
        ranks down and raises LearnerRankError."""
        _, pending = self.ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s, fetch_local=False)
        if pending:
            late = [rank for rank, ref in zip(ranks or range(len(refs)), refs) if ref in pending]
            self.shutdown()
            raise LearnerRankError(
                f"learner rank(s) {late} did not answer within {self.timeout_s:g}s ({what}). A rank cannot "
                "be replaced mid-update (it holds its shard and the others wait for it in all-reduce), so "
                "the step fails and the ranks were shut down; resume from the last checkpoint. The "
                "deadline is scale.learner_timeout_s."
            )

    def _gather(self, refs: list[Any], ranks: list[int] | None, what: str) -> list[Any]:
        """The calls' results, within the deadline; a rank that died or raised shuts the ranks down."""
        from ray.exceptions import RayActorError, RayTaskError

        self._wait(refs, ranks, what)
        try:
            return self.ray.get(refs)
        except (RayActorError, RayTaskError) as err:
            self.shutdown()
            raise LearnerRankError(
                f"a learner rank failed ({what}); the ranks were shut down: {err}"
            ) from err

    # -- the Learner interface ---------------------------------------------------------------------
    def step(self, batch: RolloutBatch, *, diagnose: bool = False) -> tuple[ScoredBatch, dict[str, float]]:
        """Score, estimate advantages and update on the ranks; the scored batch and one set of metrics."""
        if not self.ranks:
            raise LearnerRankError("the learner ranks were shut down (an earlier failure); resume the run")
        total = len(batch)
        rows = shard_rows(batch.group_index, len(self.ranks))
        refs = [r.prepare.remote(batch.rows(idx), idx, total) for r, idx in zip(self.ranks, rows)]
        scored = gather_rows(self._gather(refs, None, "score"), rows)
        metrics = step_metrics(scored)
        if diagnose and self.spec.sharding == "fsdp":
            raise ValueError(
                "gradient diagnostics need a full model on rank 0: not with scale.learner_sharding=fsdp"
            )
        if diagnose:
            metrics.update(self._gather([self.ranks[0].diagnose.remote(scored)], [0], "diagnose")[0])
        results = self._gather([r.update.remote() for r in self.ranks], None, "update")
        metrics.update(reduce_update_metrics(results))
        return scored, metrics

    def weights_ref(self) -> Any:
        """Rank 0's current weights as an object-store reference (for RayRollout.update_weights):
        the rollout workers fetch them from rank 0's node without a round trip through the driver."""
        if self.spec.sharding != "fsdp":
            ref = self.ranks[0].weights.remote()
            self._wait([ref], [0], "weights")
            return ref
        refs = [r.weights.remote() for r in self.ranks]  # gathering the shards: every rank takes part
        self._wait(refs, None, "weights")
        return refs[0]

    def load_weights(self, weights: Mapping[str, Any]) -> None:
        """Set the policy weights on every rank, optimiser untouched (after the driver's warm-up)."""
        ref = self.ray.put(_to(dict(weights), "cpu"))
        self._gather([r.load_weights.remote(ref) for r in self.ranks], None, "load weights")

    def state_dict(self) -> dict[str, Any]:
        """Rank 0's learner state, in the in-process Learner's format (so checkpoints stay the same)."""
        if self.spec.sharding != "fsdp":
            return self._gather([self.ranks[0].state_dict.remote()], [0], "state_dict")[0]
        return self._gather([r.state_dict.remote() for r in self.ranks], None, "state_dict")[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load one learner state (any learner_workers wrote it) into every rank."""
        ref = self.ray.put(state)
        self._gather([r.load_state_dict.remote(ref) for r in self.ranks], None, "load_state_dict")

    def digests(self) -> list[str]:
        """Per-rank parameter hashes (all equal while the replicas are in sync)."""
        return self._gather([r.digest.remote() for r in self.ranks], None, "digest")

    def gradients(self) -> list[dict[str, torch.Tensor]]:
        """Each rank's last optimiser-step gradient (`LearnerRank.gradients`); equal on all ranks."""
        return self._gather([r.gradients.remote() for r in self.ranks], None, "gradients")

    def shutdown(self) -> None:
        for r in self.ranks:
            try:
                self.ray.kill(r, no_restart=True)
            except Exception:  # already gone
                pass
        self.ranks = []
