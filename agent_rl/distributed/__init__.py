"""Scale-out on Ray: rollout workers as actors, a shared sandbox pool, versioned weight sync.

The trainer selects this with `scale.backend: ray`; nothing here is imported otherwise, so the
in-process default needs no Ray. `RayRollout` stands in for both the engine (`update_weights`)
and, through `RayRollout.collector(config)`, the collector (`collect`, `last_stats`).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ClusterCollectStats",
    "LeaseTable",
    "PooledSandbox",
    "RayCollector",
    "RayRollout",
    "WorkerSpec",
    "parse_sandbox_url",
]


def __getattr__(name: str) -> Any:
    # Lazy: `import agent_rl.distributed` must not import ray or torch.
    if name in ("RayRollout", "RayCollector", "ClusterCollectStats"):
        from agent_rl.distributed import rollout

        return getattr(rollout, name)
    if name == "WorkerSpec":
        from agent_rl.distributed.worker import WorkerSpec

        return WorkerSpec
    if name in ("LeaseTable", "PooledSandbox", "parse_sandbox_url"):
        from agent_rl.distributed import sandbox_pool

        return getattr(sandbox_pool, name)
    raise AttributeError(f"module 'agent_rl.distributed' has no attribute {name!r}")
