"""DAPO's dynamic sampling (Yu et al. 2025): train only on groups that carry a learning signal.

Why: under a group baseline (GRPO, RLOO, OTB) a group whose valid members all got the same reward
has advantage ~0 everywhere; it costs a forward and backward pass, dilutes the token-mean loss,
and shrinks the effective batch as the policy gets good (or stays bad) at a task. Dynamic
sampling drops such groups and collects more prompts until the batch holds `prompts` informative
groups or `max_rounds` collections were made.

Determinism: each extra round reads the next tasks from the data cursor and numbers its groups
after the previous rounds' (`first_group`), so engine seeds and trajectory ids never repeat within
a step and a resumed run collects the same rounds again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agent_rl.rollout.trajectory import Trajectory

__all__ = ["DynamicSamplingResult", "collect_informative", "split_groups"]


def split_groups(trajs: list[Trajectory]) -> tuple[list[list[Trajectory]], list[list[Trajectory]]]:
    """(informative, uninformative) groups, each in first-seen order of group_id.

    A group is informative when at least two of its members are valid and their rewards differ.
    Groups with one or no valid member are uninformative (nothing to compare against).
    """
    groups: dict[int, list[Trajectory]] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t)
    informative, dropped = [], []
    for members in groups.values():
        rewards = {t.reward for t in members if t.valid}
        valid = sum(t.valid for t in members)
        (informative if valid >= 2 and len(rewards) > 1 else dropped).append(members)
    return informative, dropped


@dataclass(frozen=True)
class DynamicSamplingResult:
    trajectories: list[Trajectory]
    """The kept groups' trajectories (at most `prompts` groups), in collection order."""
    dropped: list[Trajectory]
    """Trajectories of dropped groups (and of informative groups beyond `prompts`): tokens spent."""
    rounds: int
    """Collections made, the first included."""

    def metrics(self, group_size: int) -> dict[str, float]:
        kept_groups = len({t.group_id for t in self.trajectories})
        return {
            "train/dynamic_dropped_groups": float(len(self.dropped) // max(1, group_size)),
            "train/dynamic_kept_groups": float(kept_groups),
            "train/dynamic_rounds": float(self.rounds),
        }


def collect_informative(
    first: list[Trajectory],
    collect_round: Callable[[int], list[Trajectory]],
    prompts: int,
    max_rounds: int,
) -> DynamicSamplingResult:
    """Keep the informative groups of `first`, collecting more rounds while fewer than `prompts`.

    first:         the step's first collection.
    collect_round: collect_round(first_group) -> one more collection whose group ids start at
                   first_group (the caller advances its data cursor).
    When no round yields an informative group, the first collection is returned unchanged (the
    step then trains on it as it would without dynamic sampling, with ~0 advantages).
    """
    if prompts < 1 or max_rounds < 1:
        raise ValueError(f"prompts and max_rounds must be >= 1; got {prompts}, {max_rounds}")
    kept: list[list[Trajectory]] = []
    dropped: list[Trajectory] = []
    batch, rounds = first, 1
    next_group = max((t.group_id for t in first), default=-1) + 1
    while True:
        informative, uninformative = split_groups(batch)
        kept.extend(informative)
        dropped.extend(t for g in uninformative for t in g)
        if len(kept) >= prompts or rounds >= max_rounds:
            break
        batch = collect_round(next_group)
        next_group = max((t.group_id for t in batch), default=next_group - 1) + 1
        rounds += 1
    if not kept:
        in_first = {id(t) for t in first}
        return DynamicSamplingResult(list(first), [t for t in dropped if id(t) not in in_first], rounds)
    dropped.extend(t for g in kept[prompts:] for t in g)
    return DynamicSamplingResult([t for g in kept[:prompts] for t in g], dropped, rounds)
