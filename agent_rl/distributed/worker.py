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

from agent_rl.config import SandboxConfig
from agent_rl.rollout.collector import Collector, CollectorConfig, CollectStats, Task
from agent_rl.rollout.trajectory import Trajectory


@dataclass
class WorkerSpec:
    """Everything a worker needs to build itself on any node (plain data, pickled to the actor)."""

    model_path: str
    """Must exist on every node that runs a worker (a shared filesystem or the same path)."""
    env_id: str
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    engine: str = "hf"
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int = 576
    seed: int = 0
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """The worker's own sandbox backend, used when no shared pool is given."""
    sandbox_token: str | None = None
    """Bearer token for pooled sandbox services."""
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    torch_threads: int | None = None
    """Intra-op threads for the HF engine; None = the actor's CPU share (at least 1)."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra VLLMEngine arguments, e.g. {"tensor_parallel_size": 2} with num_gpus=2 (untested here)."""


@dataclass
class ShardResult:
    worker_id: str
    version: int
    trajectories: list[Trajectory]
    stats: CollectStats


class ShardCollector(Collector):
    """A Collector that numbers groups by their index in the whole batch, not in its shard.

    Why: the per-turn sampling seed and the trajectory id are derived from the group index, so a
    group sampled on any worker is the same group the in-process collector would sample.
    """

    _group_ids: Sequence[int] = ()

    def collect_groups(
        self, tasks: Sequence[Task], group_ids: Sequence[int], group_size: int, seed: int
    ) -> list[Trajectory]:
        if len(tasks) != len(group_ids):
            raise ValueError(f"{len(tasks)} tasks but {len(group_ids)} group ids")
        self._group_ids = list(group_ids)
        try:
            return self.collect(tasks, group_size, seed=seed)
        finally:
            self._group_ids = ()

    async def _episode(self, g: int, s: int, task: Task, call_seed: int, *rest: Any) -> Trajectory:
        return await super()._episode(self._group_ids[g], s, task, call_seed, *rest)


class RolloutWorker:
    """The actor body (wrapped with `ray.remote` by the driver, so this module imports without Ray)."""

    def __init__(self, spec: WorkerSpec, worker_id: str, leaser: Any = None) -> None:
        import gymnasium
        import torch

        import envs  # noqa: F401  (registers the agent_rl/ environments)
        from agent_rl.tiny_model import load_model_and_tokenizer

        self.spec = spec
        self.worker_id = worker_id
        if spec.engine == "hf":
            torch.set_num_threads(spec.torch_threads or max(1, int(spec.num_cpus)))
        self.tokenizer: Any
        if spec.engine == "hf":
            from agent_rl.rollout.hf_engine import HFEngine

            model, self.tokenizer = load_model_and_tokenizer(spec.model_path, spec.dtype, spec.device)
            model.eval().requires_grad_(False)
            self.engine: Any = HFEngine(
                model, self.tokenizer, max_model_len=spec.max_model_len, seed=spec.seed
            )
        else:
            from transformers import AutoTokenizer

            from agent_rl.rollout.vllm_engine import VLLMEngine

            self.tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
            self.engine = VLLMEngine(
                spec.model_path,
                max_model_len=spec.max_model_len,
                seed=spec.seed,
                dtype=spec.dtype,
                **spec.engine_kwargs,
            )
        if leaser is not None:
            from agent_rl.distributed.sandbox_pool import PooledSandbox

            self.sandbox: Any = PooledSandbox(leaser, owner=worker_id, token=spec.sandbox_token)
        else:
            from agent_rl.train import make_sandbox

            self.sandbox = make_sandbox(spec.sandbox)
        sandbox, env_id, env_kwargs = self.sandbox, spec.env_id, dict(spec.env_kwargs)
        self._make_env = lambda: gymnasium.make(env_id, sandbox=sandbox, **env_kwargs)
        self._collectors: dict[int, ShardCollector] = {}
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
        tasks: Sequence[Task],
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
            collector = ShardCollector(self.engine, self.tokenizer, self._make_env, config)
            self._collectors[key] = collector
        trajectories = collector.collect_groups(tasks, group_ids, group_size, seed)
        return ShardResult(self.worker_id, self.version, trajectories, collector.last_stats)
