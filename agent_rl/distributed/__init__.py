"""Scale-out on Ray: rollout workers and learner ranks as actors, sandbox leases, weight sync.

The trainer selects this with `scale.backend: ray`; nothing here is imported otherwise, so the
in-process default needs no Ray. `RayRollout` is the trainer's sampler (`update_weights`)
and, through `RayRollout.collector(config)`, the collector (`collect`, `last_stats`);
`RayLearner` stands in for the Learner when `scale.learner_workers > 1`.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ClusterCollectStats",
    "LearnerRankError",
    "LearnerSpec",
    "LeaseTable",
    "PooledSandbox",
    "RayCollector",
    "RayLearner",
    "RayRollout",
    "WorkerSpec",
    "parse_sandbox_url",
]


def __getattr__(name: str) -> Any:
    # Lazy: `import agent_rl.distributed` must not import ray or torch.
    if name in ("RayRollout", "RayCollector", "ClusterCollectStats"):
        from agent_rl.distributed import rollout

        return getattr(rollout, name)
    if name in ("RayLearner", "LearnerSpec", "LearnerRankError"):
        from agent_rl.distributed import learner

        return getattr(learner, name)
    if name == "WorkerSpec":
        from agent_rl.distributed.rollout_worker import WorkerSpec

        return WorkerSpec
    if name in ("LeaseTable", "PooledSandbox", "parse_sandbox_url"):
        from agent_rl.distributed import sandbox_leases

        return getattr(sandbox_leases, name)
    raise AttributeError(f"module 'agent_rl.distributed' has no attribute {name!r}")
