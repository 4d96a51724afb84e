"""A small local Ray cluster on loopback, shared by the tests of this folder."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest


def import_ray_or_skip() -> Any:
    """Ray, or a skip on a dev machine without it; under CI=true a missing Ray is a failure."""
    try:
        import ray
    except ImportError:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("ray is not installed; CI must run the Ray tests (pip install 'agent-rl[ray]')")
        pytest.skip("ray is not installed (pip install ray)")
    return ray


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """4 logical CPUs (2 rollout workers + 2 learner ranks reserve one each; the machine may have
    fewer cores), no dashboard, a 200 MB object store: the machine is small and shared."""
    ray = import_ray_or_skip()
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=200 * 1024 * 1024,
        log_to_driver=False,
    )
    yield ray
    ray.shutdown()
