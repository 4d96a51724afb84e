"""Connecting to Ray: one place that knows how this project starts or joins a cluster."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent_rl.config import ScaleConfig


class RayUnavailable(ImportError):
    """`scale.backend: ray` was chosen but the `ray` package is not installed."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError as err:
        raise RayUnavailable(
            "scale.backend=ray needs the ray package: pip install 'agent-rl[ray]' (or pip install ray); "
            "or use scale.backend=local to run everything in this process"
        ) from err
    return ray


def ensure_ray(address: str | None, *, min_cpus: int = 1) -> Any:
    """Join the cluster at `address`, or start a small local one; a running connection is reused.

    Why reuse: tests and notebooks call `ray.init` with their own limits first, and a second
    `ray.init` would fail. A local start asks for at least `min_cpus` logical CPUs so the
    configured rollout workers can all be placed even on a 2-core machine.
    """
    ray = import_ray()
    if ray.is_initialized():
        return ray
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    else:
        ray.init(
            num_cpus=max(os.cpu_count() or 1, min_cpus),
            include_dashboard=False,
            log_to_driver=True,
        )
    return ray


def ray_cpus_wanted(scale: ScaleConfig) -> int:
    """Logical CPUs the configured actors reserve: one per rollout worker and per learner rank
    (learner_workers=1 keeps the learner in the driver, which reserves none)."""
    return scale.rollout_workers + (scale.learner_workers if scale.learner_workers > 1 else 0)
