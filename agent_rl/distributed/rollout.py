"""The driver side: shard a collect call over rollout-worker actors, sync weights, survive faults.

`RayRollout` plays the engine for the trainer (`update_weights`) and hands out `RayCollector`s
that play the collector (`collect`, `last_stats`). Groups are split into contiguous shards, one
per worker, and results are put back in batch order, so the trainer sees exactly the list the
in-process collector would return.

Faults: a worker whose actor dies (killed, OOM, node lost) is replaced by a fresh actor that
loads the current weights; the shard it was running is re-run on the least busy live worker.
A worker that hangs (alive, but stuck in a sandbox call or a deadlock) is treated the same way
once its shard misses the deadline `worker_timeout_s`: the driver kills the actor and proceeds as
if it had died. A shard that fails `max_attempts` times comes back as infrastructure-failure
trajectories (`infra_error` set, excluded by the learner), so the step always completes with
B x N entries.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from agent_rl.distributed.cluster import ensure_ray, import_ray, ray_cpus_wanted
from agent_rl.distributed.rollout_worker import RolloutWorker, ShardResult, WorkerSpec
from agent_rl.rollout.collector import CollectorConfig, CollectStats, ResetArgs
from agent_rl.rollout.trajectory import Trajectory, json_safe

if TYPE_CHECKING:
    from agent_rl.config import Config

log = logging.getLogger(__name__)


@dataclass
class ClusterCollectStats(CollectStats):
    """CollectStats summed over workers; busy times are per engine (mean over the shards run)."""

    workers: int = 0
    worker_restarts: int = 0
    """Workers replaced during this collect."""
    rerun_episodes: int = 0
    """Episodes re-run because their worker died."""
    lost_episodes: int = 0
    """Episodes returned as infrastructure failures after every attempt failed."""
    worker_timeouts: int = 0
    """Workers killed because a shard missed its deadline (also counted in worker_restarts)."""

    def as_metrics(self) -> dict[str, float]:
        return {
            **super().as_metrics(),
            "perf/rollout_workers": self.workers,
            "perf/worker_restarts": self.worker_restarts,
            "perf/rerun_episodes": self.rerun_episodes,
            "perf/lost_episodes": self.lost_episodes,
            "perf/worker_timeouts": self.worker_timeouts,
        }


def split_groups(num_groups: int, num_shards: int) -> list[list[int]]:
    """Contiguous, near-equal, non-empty shards of range(num_groups)."""
    shards = min(num_groups, num_shards)
    base, extra = divmod(num_groups, shards) if shards else (0, 0)
    out, start = [], 0
    for i in range(shards):
        size = base + (1 if i < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def _as_cpu_state(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}


class _Call(NamedTuple):
    """A shard on its way: which shard, on which worker (slot and handle), answer due by when."""

    shard: int
    index: int
    worker: Any
    deadline: float


class RayRollout:
    """N rollout-worker actors behind the engine interface the trainer uses."""

    def __init__(
        self,
        spec: WorkerSpec,
        num_workers: int,
        weights: Mapping[str, Any] | None = None,
        *,
        sandbox_urls: Sequence[str] = (),
        max_attempts: int = 2,
        worker_timeout_s: float = 600.0,
        worker_start_timeout_s: float = 300.0,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if worker_timeout_s <= 0 or worker_start_timeout_s < 0:
            raise ValueError(
                f"worker_timeout_s must be > 0 and worker_start_timeout_s >= 0, got "
                f"{worker_timeout_s} and {worker_start_timeout_s}"
            )
        self.ray = import_ray()
        if not self.ray.is_initialized():
            raise RuntimeError("RayRollout needs a Ray connection; call ensure_ray() or ray.init() first")
        self.spec = spec
        self.max_attempts = max_attempts
        self.worker_timeout_s = worker_timeout_s
        self.worker_start_timeout_s = worker_start_timeout_s
        self.leaser: Any = None
        if sandbox_urls:
            from agent_rl.distributed.sandbox_leases import start_leaser

            self.leaser = start_leaser(list(sandbox_urls))
        self._actor_cls = self.ray.remote(num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, max_restarts=0)(
            RolloutWorker
        )
        self._spawned = 0
        self.restarts = 0
        self.version = 0
        self._box: list[Any] = [None]
        self.workers: list[Any] = []
        self.worker_ids: list[str] = []
        self._starting: set[str] = set()
        """Replacement workers that have not answered yet (maybe still loading the model)."""
        for _ in range(num_workers):
            handle, wid = self._spawn()
            self.workers.append(handle)
            self.worker_ids.append(wid)
        self.ray.get([w.ready.remote() for w in self.workers])
        if weights is not None:
            self.update_weights(weights, wait=True)
        self._configs: list[CollectorConfig] = []

    @classmethod
    def from_config(
        cls, cfg: Config, model_path: Any, weights: Mapping[str, Any] | None = None
    ) -> RayRollout:
        """Workers for `cfg` (connecting to `cfg.scale.address` or starting a local Ray)."""
        scale = cfg.scale
        ensure_ray(scale.address, min_cpus=ray_cpus_wanted(scale))
        spec = WorkerSpec.from_config(cfg, model_path)
        return cls(
            spec,
            scale.rollout_workers,
            weights,
            sandbox_urls=scale.sandbox_urls,
            worker_timeout_s=scale.worker_timeout_s,
            worker_start_timeout_s=scale.worker_start_timeout_s,
        )

    # ------------------------------------------------------------------ workers
    def _spawn(self) -> tuple[Any, str]:
        wid = f"rollout-{self._spawned}"
        self._spawned += 1
        return self._actor_cls.remote(self.spec, wid, self.leaser), wid

    def _replace(self, index: int, dead: Any) -> None:
        """Swap a dead (or hung) worker for a fresh one holding the current weights (once per death)."""
        if self.workers[index] is not dead:
            return  # already replaced by an earlier failure report
        old_id = self.worker_ids[index]
        try:
            self.ray.kill(dead, no_restart=True)
        except Exception:  # already gone
            pass
        if self.leaser is not None:
            self.leaser.release_owner.remote(old_id)
        handle, wid = self._spawn()
        self.workers[index], self.worker_ids[index] = handle, wid
        self._starting.add(wid)
        self.restarts += 1
        if self._box[0] is not None:
            handle.load_weights.remote(self.version, self._box)
        log.warning("rollout worker %s lost; replaced by %s (weights v%d)", old_id, wid, self.version)

    def worker_versions(self) -> list[int]:
        """The weights version each current worker holds (waits for pending loads)."""
        return self.ray.get([w.weights_version.remote() for w in self.workers])

    # ------------------------------------------------------------------ engine interface
    def update_weights(self, state_dict: Mapping[str, Any] | Any, *, wait: bool = False) -> int:
        """Publish a new weights version: one object-store put, fetched by every worker.

        `state_dict` may also be an ObjectRef to one already in the object store (learner rank 0's
        weights: the workers then fetch them from that rank's node, not through the driver).
        Workers start loading at once (in the background unless `wait`); a collect call pins
        the version, so a worker that missed this message still loads it before sampling.
        """
        if isinstance(state_dict, self.ray.ObjectRef):
            ref = state_dict
        else:
            ref = self.ray.put(_as_cpu_state(state_dict))
        self.version += 1
        self._box = [ref]
        loads = [w.load_weights.remote(self.version, self._box) for w in self.workers]
        if wait:
            self.ray.get(loads)
        return self.version

    def collector(self, config: CollectorConfig) -> RayCollector:
        self._configs.append(config)
        return RayCollector(self, len(self._configs) - 1, config)

    def shutdown(self) -> None:
        for w in self.workers:
            try:
                self.ray.kill(w, no_restart=True)
            except Exception:
                pass
        if self.leaser is not None:
            self.ray.kill(self.leaser, no_restart=True)
        self.workers, self.worker_ids = [], []

    # ------------------------------------------------------------------ sharded collect
    def collect(
        self,
        key: int,
        config: CollectorConfig,
        tasks: Sequence[ResetArgs],
        group_size: int,
        seed: int,
        *,
        on_submitted: Any = None,
    ) -> tuple[list[Trajectory], ClusterCollectStats]:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        started = time.perf_counter()
        restarts_before = self.restarts
        run = _ShardedCollect(self, key, config, list(tasks), group_size, seed)
        for shard in range(len(run.shards)):
            run.submit(shard, shard)
        if on_submitted is not None:
            on_submitted()
        while run.pending:
            failed = run.wait_for_one()
            if failed is not None:
                run.retry_or_give_up(*failed)
        trajectories, stats = run.outcome()
        stats.wall_s = time.perf_counter() - started
        stats.worker_restarts = self.restarts - restarts_before
        return trajectories, stats


class _ShardedCollect:
    """One collect call in flight: its shards, their calls and deadlines, and what came back.

    Why an object: submitting, waiting and retrying share the pending calls (a worker's queue sets
    its next deadline) and the per-shard attempts; the loop in `RayRollout.collect` reads as
    submit all -> wait for one -> retry or give up -> outcome.
    """

    def __init__(
        self,
        fleet: RayRollout,
        key: int,
        config: CollectorConfig,
        tasks: list[ResetArgs],
        group_size: int,
        seed: int,
    ) -> None:
        self.fleet, self.key, self.config = fleet, key, config
        self.tasks, self.group_size, self.seed = tasks, group_size, seed
        self.version, self.box = fleet.version, fleet._box  # pinned: a retry runs the same weights
        self.shards = split_groups(len(tasks), len(fleet.workers))
        self.results: list[ShardResult | None] = [None] * len(self.shards)
        self.lost: dict[int, list[Trajectory]] = {}
        self.attempts = [0] * len(self.shards)
        self.pending: dict[Any, _Call] = {}
        self.rerun = self.timeouts = 0

    def busy(self, index: int) -> int:
        return sum(1 for c in self.pending.values() if c.index == index)

    def submit(self, shard: int, index: int) -> None:
        fleet, ids = self.fleet, self.shards[shard]
        worker = fleet.workers[index]
        # One deadline per shard queued ahead (an actor runs one call at a time), and the start-up
        # budget on a replacement that may still be importing torch and loading its model: that
        # takes as long as it takes on a loaded machine, whatever a shard's deadline is tuned to.
        starting = fleet.worker_ids[index] in fleet._starting
        deadline = (
            time.monotonic()
            + fleet.worker_timeout_s * (self.busy(index) + 1)
            + fleet.worker_start_timeout_s * starting
        )
        ref = worker.collect.remote(
            self.key,
            self.config,
            [self.tasks[g] for g in ids],
            ids,
            self.group_size,
            self.seed,
            self.version,
            self.box,
        )
        self.pending[ref] = _Call(shard, index, worker, deadline)

    def wait_for_one(self) -> tuple[_Call, str] | None:
        """Wait for the next answer or the next deadline; the failed call and why, or None on success."""
        from ray.exceptions import RayActorError

        fleet = self.fleet
        due = min(c.deadline for c in self.pending.values())
        ready, _ = fleet.ray.wait(list(self.pending), num_returns=1, timeout=max(0.0, due - time.monotonic()))
        if not ready:  # the most overdue shard's worker is hung: kill it and carry on as after a death
            call = self.pending.pop(min(self.pending, key=lambda r: self.pending[r].deadline))
            self.timeouts += 1
            reason = f"no answer within {fleet.worker_timeout_s:g}s"
            log.warning(
                "rollout worker %s: shard %d %s; killing it", fleet.worker_ids[call.index], call.shard, reason
            )
            return call, reason
        call = self.pending.pop(ready[0])
        try:
            result: ShardResult = fleet.ray.get(ready[0])
        except RayActorError as err:
            return call, type(err).__name__
        self.results[call.shard] = result
        fleet._starting.discard(result.worker_id)
        return None

    def retry_or_give_up(self, call: _Call, reason: str) -> None:
        """Replace the call's worker; re-run its shard elsewhere, or after max_attempts return the
        shard's episodes as infrastructure failures."""
        fleet, shard = self.fleet, call.shard
        fleet._replace(call.index, call.worker)
        self.attempts[shard] += 1
        if self.attempts[shard] < fleet.max_attempts:
            self.rerun += len(self.shards[shard]) * self.group_size
            # Least busy first; on a tie, a worker that has answered before over a replacement
            # that may still be loading its model.
            self.submit(
                shard,
                min(
                    range(len(fleet.workers)),
                    key=lambda j: (self.busy(j), fleet.worker_ids[j] in fleet._starting),
                ),
            )
            return
        why = f"rollout worker lost {self.attempts[shard]} times: {reason}"
        self.lost[shard] = [
            _infra_failure(self.seed, g, s, self.tasks[g], why)
            for g in self.shards[shard]
            for s in range(self.group_size)
        ]

    def outcome(self) -> tuple[list[Trajectory], ClusterCollectStats]:
        """The trajectories in batch order, and the stats summed over the shards that answered."""
        trajectories: list[Trajectory] = []
        for shard, result in enumerate(self.results):
            trajectories.extend(result.trajectories if result is not None else self.lost[shard])
        stats = _merge_stats([r.stats for r in self.results if r is not None], len(self.fleet.workers))
        stats.rerun_episodes = self.rerun
        stats.lost_episodes = sum(len(v) for v in self.lost.values())
        stats.worker_timeouts = self.timeouts
        return trajectories, stats


class RayCollector:
    """The collector interface over a RayRollout, for one CollectorConfig (sampling + budgets)."""

    def __init__(self, rollout: RayRollout, key: int, config: CollectorConfig) -> None:
        self.rollout = rollout
        self.key = key
        self.config = config
        self.last_stats: ClusterCollectStats = ClusterCollectStats()
        self._calls = 0

    def collect(
        self,
        tasks: Sequence[ResetArgs],
        group_size: int,
        *,
        seed: int | None = None,
        on_submitted: Any = None,
        on_episode: Callable[[], None] | None = None,
    ) -> list[Trajectory]:
        """B tasks x `group_size` samples, in the in-process collector's order and with its seeds.

        `on_submitted` (tests, tooling) is called once every shard is on its way to a worker;
        `on_episode` once per episode when the shards are back (progress bars).
        """
        call_seed = self.config.seed + self._calls if seed is None else seed
        self._calls += 1
        trajectories, self.last_stats = self.rollout.collect(
            self.key, self.config, list(tasks), group_size, call_seed, on_submitted=on_submitted
        )
        if on_episode is not None:
            for _ in trajectories:
                on_episode()
        return trajectories


def _infra_failure(seed: int, g: int, s: int, task: ResetArgs, reason: str) -> Trajectory:
    return Trajectory(
        traj_id=f"{seed}-{g}-{s}",
        group_id=g,
        sample_index=s,
        task=json_safe(task),
        stop_reason="infra_error",
        infra_error=reason,
    )


def _merge_stats(parts: list[CollectStats], workers: int) -> ClusterCollectStats:
    out = ClusterCollectStats(workers=workers)
    n = max(1, len(parts))
    for p in parts:
        out.engine_busy_s += p.engine_busy_s / n
        out.env_busy_s += p.env_busy_s / n
        out.engine_calls += p.engine_calls
        out.sequences_generated += p.sequences_generated
        out.policy_tokens += p.policy_tokens
        out.env_s += p.env_s
    return out
