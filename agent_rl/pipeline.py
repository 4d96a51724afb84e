"""One-step-off-policy pipelining: step t+1's rollouts are collected while step t updates.

Why: a synchronous step costs rollout + update, and each side idles while the other runs. With
`rollout.async_steps: 1` the trainer hands the next step's collection to one background thread
(`Prefetch`) before it updates on the current batch, so a step costs about max(rollout, update).
torch ops, sandbox calls and Ray waits release the GIL, so the two threads really overlap.

What makes it correct:
- The sampler never sees weights mid-update: it samples from its own frozen copy (a second model
  for the in-process hf engine; vLLM and Ray workers hold their own anyway), and new weights are
  published only after the collection in flight has been joined.
- Every trajectory records the policy version it was sampled with (`Trajectory.policy_version`);
  the learner's version minus it is the staleness, logged each step, and samples older than
  `rollout.max_staleness` are dropped (`drop_stale`).
- The sampler's log-probs on the trajectory are those of the older policy, so the importance
  correction of agent_rl.offpolicy (`algo.is_correction`, 'token' by default under pipelining)
  reweights stale samples by p_current / p_sampler.

Cost: the two threads share the GIL and the cores. With cores free, a pipelined step costs about
max(rollout, update) (1.4-1.8x faster than synchronous, hf/vllm/ray); on an oversubscribed CPU each
side slows down and the gain can vanish (benchmarks/async_bench.py, docs/async.md); Ray rollout
workers run in their own processes.

Not covered: more than one batch in flight (async_steps > 1), and partial rollouts that switch
weights mid-episode (AReaL-style); the whole batch is sampled with one version.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from agent_rl.rollout.trajectory import Trajectory

__all__ = ["Collected", "Prefetch", "drop_stale", "staleness_metrics"]


@dataclass
class Collected:
    """One step's rollouts and what the trainer logs about their collection."""

    trajectories: list[Trajectory]
    version: int
    """The policy version that sampled them (updates the sampler's weights had seen)."""
    retries: int = 0
    """Collections repeated because every episode failed (agent_rl.train.Trainer._collect)."""
    dynamic: dict[str, float] = field(default_factory=dict)
    """Dynamic-sampling metrics (agent_rl.train.Trainer._informative)."""
    stats: dict[str, float] = field(default_factory=dict)
    """The collector's own metrics (CollectStats.as_metrics) for this collection."""
    rollout_s: float = 0.0
    """Seconds the collection took (in the background thread when prefetched)."""

    def state(self) -> dict[str, Any]:
        """Plain data for the checkpoint: the in-flight batch resumes as it was collected."""
        return {
            "records": [t.to_record() for t in self.trajectories],
            "version": self.version,
            "retries": self.retries,
            "dynamic": dict(self.dynamic),
            "stats": dict(self.stats),
            "rollout_s": self.rollout_s,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Collected:
        return cls(
            trajectories=[Trajectory.from_record(r) for r in state["records"]],
            version=state["version"],
            retries=state["retries"],
            dynamic=state["dynamic"],
            stats=state["stats"],
            rollout_s=state["rollout_s"],
        )


class Prefetch:
    """At most one collection in flight, in one background thread; its result waits to be taken.

    While a job runs, only it may touch the trainer's data position (task cursor) and the sampler:
    the caller joins it (`wait`) before publishing weights or checkpointing.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")
        self._future: Future[Collected] | None = None
        self._ready: Collected | None = None

    def submit(self, job: Callable[[], Collected]) -> None:
        if self._future is not None or self._ready is not None:
            raise RuntimeError("a prefetched batch is still in flight or untaken; take() it first")
        self._future = self._pool.submit(job)

    def wait(self) -> float:
        """Join the job in flight (re-raising its error); returns the seconds spent waiting."""
        if self._future is None:
            return 0.0
        t0 = time.perf_counter()
        future, self._future = self._future, None
        self._ready = future.result()
        return time.perf_counter() - t0

    def take(self) -> Collected | None:
        """The prefetched batch (joining it first), or None when nothing was prefetched."""
        self.wait()
        ready, self._ready = self._ready, None
        return ready

    def peek(self) -> Collected | None:
        """The joined, not yet taken batch (for the checkpoint); call `wait` first."""
        if self._future is not None:
            raise RuntimeError("a collection is still in flight; wait() before reading it")
        return self._ready

    def restore(self, collected: Collected | None) -> None:
        """Put back a batch saved in a checkpoint (resume)."""
        self.wait()
        self._ready = collected

    def close(self) -> None:
        """Join whatever runs (its result is dropped) and stop the thread."""
        try:
            self.wait()
        finally:
            self._ready = None
            self._pool.shutdown(wait=True)


def drop_stale(
    trajectories: list[Trajectory], learner_version: int, max_staleness: int
) -> tuple[list[Trajectory], list[Trajectory]]:
    """(kept, dropped): samples more than `max_staleness` versions behind the learner are dropped.

    A trajectory without a version (sampled outside the trainer) is refused: its staleness is unknown.
    """
    kept, dropped = [], []
    for t in trajectories:
        if t.policy_version is None:
            raise ValueError(
                f"trajectory {t.traj_id} has no policy_version; the trainer sets it on collection"
            )
        (kept if learner_version - t.policy_version <= max_staleness else dropped).append(t)
    return kept, dropped


def staleness_metrics(collected: Collected, learner_version: int, dropped: int) -> dict[str, float]:
    """async/: how many versions the batch lags the learner, and how many samples were too old."""
    lags = [learner_version - (t.policy_version or 0) for t in collected.trajectories]
    return {
        "async/staleness_max": float(max(lags, default=0)),
        "async/staleness_mean": sum(lags) / max(1, len(lags)),
        "async/dropped_stale": float(dropped),
    }
