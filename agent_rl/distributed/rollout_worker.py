"""One rollout worker: a Ray actor that owns an engine, its collectors, envs and sandbox backend.

Weights are versioned: the driver puts each state dict into Ray's object store once and every
worker fetches it by reference. A collect call names the version it must run with and loads it
first; the actor runs one method at a time, so weights never change inside a collect and every
trajectory of a call comes from exactly that version.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent_rl import build
from agent_rl.config import Config
from agent_rl.rollout.collector import Collector, CollectorConfig, CollectStats, ResetArgs
from agent_rl.rollout.trajectory import Trajectory


@dataclass
class WorkerSpec:
    """Everything a worker needs to build itself on any node (plain data, pickled to the actor).

    The worker builds its engine, sandbox and envs from `config` through `agent_rl.build`, exactly
    as the in-process trainer does, so a setting cannot reach one path and miss the other.
    """

    config: Config
    model_path: str
    """Must exist on every node that runs a worker (a shared filesystem or the same path)."""
    sandbox_token: str | None = None
    """Bearer token for pooled sandbox services."""
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra VLLMEngine arguments the config has no key for, e.g. {"tensor_parallel_size": 2} with
    num_gpus=2 (untested here)."""

    @classmethod
    def from_config(cls, cfg: Config, model_path: Any) -> WorkerSpec:
        return cls(
            config=cfg,
            model_path=str(model_path),
            sandbox_token=os.environ.get(cfg.sandbox.token_env),
            num_gpus=1.0 if build.uses_gpu(cfg) else 0.0,
        )


@dataclass
class ShardResult:
    worker_id: str
    version: int
    trajectories: list[Trajectory]
    stats: CollectStats


class RolloutWorker:
    """The actor body (wrapped with `ray.remote` by the driver, so this module imports without Ray)."""

    def __init__(self, spec: WorkerSpec, worker_id: str, leaser: Any = None) -> None:
        cfg = spec.config
        self.spec = spec
        self.worker_id = worker_id
        # The configured thread count, else the actor's CPU share (an HF engine would take every core).
        hf = cfg.rollout.engine == "hf"
        build.set_cpu_threads(cfg.model.cpu_threads or (max(1, int(spec.num_cpus)) if hf else None))
        model = None
        if hf:
            model, self.tokenizer = build.load_model_and_tokenizer(
                spec.model_path, cfg.model.dtype, cfg.model.device
            )
            model.eval().requires_grad_(False)
        else:
            self.tokenizer = build.load_tokenizer(spec.model_path)
        self.engine = build.make_engine(
            cfg, spec.model_path, model=model, tokenizer=self.tokenizer, extra=spec.engine_kwargs
        )
        if leaser is not None:
            from agent_rl.distributed.sandbox_leases import PooledSandbox

            self.sandbox: Any = PooledSandbox(leaser, owner=worker_id, token=spec.sandbox_token)
        else:
            self.sandbox = build.make_sandbox(cfg.sandbox)
        self._make_env = build.env_factory(cfg, self.sandbox)
        self._collectors: dict[int, Collector] = {}
        self.version = -1
        self._stall_s = 0.0

    def ready(self) -> dict[str, Any]:
        """Answers once construction finished (the model is loaded)."""
        return {"worker_id": self.worker_id, "pid": os.getpid(), "version": self.version}

    def weights_version(self) -> int:
        return self.version

    def load_weights(self, version: int, box: list[Any]) -> int:
        """Load weights `version` from the object store (`box` = [ObjectRef]) unless already held.

        The ref travels inside a list so Ray does not fetch it for workers that already hold it.
        An older version than the one held is ignored: updates only move forward.
        """
        if version > self.version:
            import ray

            state: Mapping[str, Any] = ray.get(box[0])
            self.engine.update_weights(state)
            self.version = version
        return self.version

    def stall_next_collect(self, seconds: float) -> None:
        """Test hook: the next collect first sleeps `seconds`, like a worker stuck in a sandbox call."""
        self._stall_s = seconds

    def collect(
        self,
        key: int,
        config: CollectorConfig,
        tasks: Sequence[ResetArgs],
        group_ids: Sequence[int],
        group_size: int,
        seed: int,
        version: int,
        box: list[Any],
    ) -> ShardResult:
        if self._stall_s:
            seconds, self._stall_s = self._stall_s, 0.0
            time.sleep(seconds)
        self.load_weights(version, box)
        if self.version != version:
            raise RuntimeError(
                f"worker {self.worker_id} holds weights v{self.version}, the call pinned v{version}"
            )
        collector = self._collectors.get(key)
        if collector is None:
            collector = Collector(self.engine, self.tokenizer, self._make_env, config)
            self._collectors[key] = collector
        # Groups keep their numbers in the whole batch, not in this shard: seeds and trajectory ids
        # derive from them, so a group sampled here is the one the in-process collector would sample.
        trajectories = collector.collect(tasks, group_size, seed=seed, group_ids=group_ids)
        return ShardResult(self.worker_id, self.version, trajectories, collector.last_stats)
