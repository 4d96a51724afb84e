"""The driver side: shard a collect call over rollout-worker actors, sync weights, survive faults.

`RayRollout` plays the engine for the trainer (`update_weights`) and hands out `RayCollector`s
that play the collector (`collect`, `last_stats`). Groups are split into contiguous shards, one
per worker, and results are put back in batch order, so the trainer sees exactly the list the
in-process collector would return.

Faults: a worker whose actor dies (killed, OOM, node lost) is replaced by a fresh actor that
loads the current weights; the shard it was running is re-run on the least busy live worker.
A shard that fails `max_attempts` times comes back as infrastructure-failure trajectories
(`infra_error` set, excluded by the learner), so the step always completes with B x N entries.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent_rl.distributed.cluster import ensure_ray, import_ray
from agent_rl.distributed.worker import RolloutWorker, ShardResult, WorkerSpec
from agent_rl.rollout.collector import CollectorConfig, CollectStats, Task
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

    def as_metrics(self) -> dict[str, float]:
        return {
            **super().as_metrics(),
            "perf/rollout_workers": self.workers,
            "perf/worker_restarts": self.worker_restarts,
            "perf/rerun_episodes": self.rerun_episodes,
            "perf/lost_episodes": self.lost_episodes,
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
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.ray = import_ray()
        if not self.ray.is_initialized():
            raise RuntimeError("RayRollout needs a Ray connection; call ensure_ray() or ray.init() first")
        self.spec = spec
        self.max_attempts = max_attempts
        self.max_model_len = spec.max_model_len
        self.leaser: Any = None
        if sandbox_urls:
            from agent_rl.distributed.sandbox_pool import start_leaser

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
        if scale.learner_workers > 1:
            raise NotImplementedError(
                "scale.learner_workers > 1 (DDP learner ranks on Ray) is not implemented yet; "
                "use scale.learner_workers=1 (the learner runs in the driver)"
            )
        ensure_ray(scale.address, min_cpus=scale.rollout_workers)
        env_kwargs = dict(cfg.env.kwargs)
        env_kwargs.setdefault("max_turns", cfg.rollout.max_turns)
        on_gpu = cfg.rollout.engine == "vllm" or cfg.model.device.startswith("cuda")
        spec = WorkerSpec(
            model_path=str(model_path),
            env_id=cfg.env.id,
            env_kwargs=env_kwargs,
            engine=cfg.rollout.engine,
            dtype=cfg.model.dtype,
            device=cfg.model.device if cfg.rollout.engine == "hf" else "cuda",
            max_model_len=cfg.rollout.max_total_tokens + cfg.rollout.max_new_tokens,
            seed=cfg.train.seed,
            sandbox=cfg.sandbox,
            sandbox_token=os.environ.get(cfg.sandbox.token_env),
            num_gpus=1.0 if on_gpu else 0.0,
        )
        return cls(spec, scale.rollout_workers, weights, sandbox_urls=scale.sandbox_urls)

    # ------------------------------------------------------------------ workers
    def _spawn(self) -> tuple[Any, str]:
        wid = f"rollout-{self._spawned}"
        self._spawned += 1
        return self._actor_cls.remote(self.spec, wid, self.leaser), wid

    def _replace(self, index: int, dead: Any) -> None:
        """Swap a dead worker for a fresh one holding the current weights (once per death)."""
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
        self.restarts += 1
        if self._box[0] is not None:
            handle.load_weights.remote(self.version, self._box)
        log.warning("rollout worker %s died; replaced by %s (weights v%d)", old_id, wid, self.version)

    def worker_versions(self) -> list[int]:
        """The weights version each current worker holds (waits for pending loads)."""
        return self.ray.get([w.weights_version.remote() for w in self.workers])

    # ------------------------------------------------------------------ engine interface
    def update_weights(self, state_dict: Mapping[str, Any], *, wait: bool = False) -> int:
        """Publish a new weights version: one object-store put, fetched by every worker.

        Workers start loading at once (in the background unless `wait`); a collect call pins
        the version, so a worker that missed this message still loads it before sampling.
        """
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
        tasks: Sequence[Task],
        group_size: int,
        seed: int,
        *,
        on_submitted: Any = None,
    ) -> tuple[list[Trajectory], ClusterCollectStats]:
        from ray.exceptions import RayActorError

        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        started = time.perf_counter()
        restarts_before = self.restarts
        shards = split_groups(len(tasks), len(self.workers))
        results: list[ShardResult | None] = [None] * len(shards)
        lost: dict[int, list[Trajectory]] = {}
        attempts = [0] * len(shards)
        pending: dict[Any, tuple[int, int, Any]] = {}
        rerun = 0
        version, box = self.version, self._box

        def submit(shard: int, index: int) -> None:
            ids = shards[shard]
            worker = self.workers[index]
            ref = worker.collect.remote(
                key, config, [tasks[g] for g in ids], ids, group_size, seed, version, box
            )
            pending[ref] = (shard, index, worker)

        for shard in range(len(shards)):
            submit(shard, shard)
        if on_submitted is not None:
            on_submitted()
        while pending:
            ready, _ = self.ray.wait(list(pending), num_returns=1)
            shard, index, worker = pending.pop(ready[0])
            try:
                results[shard] = self.ray.get(ready[0])
                continue
            except RayActorError as err:
                failure = err
            self._replace(index, worker)
            attempts[shard] += 1
            episodes = len(shards[shard]) * group_size
            if attempts[shard] < self.max_attempts:
                rerun += episodes
                busy = [sum(1 for _, i, _ in pending.values() if i == j) for j in range(len(self.workers))]
                submit(shard, min(range(len(self.workers)), key=lambda j: busy[j]))
            else:
                reason = f"rollout worker lost {attempts[shard]} times: {type(failure).__name__}"
                lost[shard] = [
                    _infra_failure(seed, g, s, tasks[g], reason)
                    for g in shards[shard]
                    for s in range(group_size)
                ]
        trajectories: list[Trajectory] = []
        for shard, result in enumerate(results):
            trajectories.extend(result.trajectories if result is not None else lost[shard])
        stats = _merge_stats([r.stats for r in results if r is not None], len(self.workers))
        stats.wall_s = time.perf_counter() - started
        stats.worker_restarts = self.restarts - restarts_before
        stats.rerun_episodes = rerun
        stats.lost_episodes = sum(len(v) for v in lost.values())
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
        self, tasks: Sequence[Task], group_size: int, *, seed: int | None = None, on_submitted: Any = None
    ) -> list[Trajectory]:
        """B tasks x `group_size` samples, in the in-process collector's order and with its seeds.

        `on_submitted` (tests, tooling) is called once every shard is on its way to a worker.
        """
        call_seed = self.config.seed + self._calls if seed is None else seed
        self._calls += 1
        trajectories, self.last_stats = self.rollout.collect(
            self.key, self.config, list(tasks), group_size, call_seed, on_submitted=on_submitted
        )
        return trajectories


def _infra_failure(seed: int, g: int, s: int, task: Task, reason: str) -> Trajectory:
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
