"""Named splits of a task source: which task indices train the policy, which are held out for
evaluation, which feed the scripted warm-up.

Why the source owns them: only the source knows how many tasks it has and where they came from. A
trainer that hard-codes "held-out tasks start at index 500,000" works for a generated stream of a
million tasks and fails on a 2-row dataset. Splits are ranges of the source's own indices, so
`env.reset(options={"task_index": i})` and every logged task index keep meaning the same task.
A source that declares no splits is all training data.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from envs.tasks.base import Task, TaskSource

TRAIN, EVAL, DEMO = "train", "eval", "demo"
"""The names the trainer asks for: RL prompts, held-out greedy evaluation, warm-up demonstrations."""


class SplitTasks:
    """A task source with named, disjoint index ranges over it (`splits`)."""

    def __init__(self, source: TaskSource, splits: Mapping[str, range]) -> None:
        taken: list[tuple[int, int, str]] = []
        for name, span in splits.items():
            if span.step != 1 or not 0 <= span.start <= span.stop <= len(source):
                raise ValueError(
                    f"split {name!r} = {span} is not a contiguous range within [0, {len(source)})"
                )
            taken.append((span.start, span.stop, name))
        taken.sort()
        for (_, stop, first), (start, _, second) in itertools.pairwise(taken):
            if start < stop:
                raise ValueError(f"splits {first!r} and {second!r} overlap")
        self.source = source
        self.splits: dict[str, range] = dict(splits)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> Task:
        return self.source[index]


class ConcatTasks:
    """Several sources end to end, e.g. a dataset's training rows followed by its held-out rows."""

    def __init__(self, sources: Sequence[TaskSource]) -> None:
        if not sources:
            raise ValueError("ConcatTasks needs at least one source")
        self.sources = list(sources)
        self.starts: list[int] = []
        total = 0
        for source in self.sources:
            self.starts.append(total)
            total += len(source)
        self._len = total

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> Task:
        if not 0 <= index < self._len:
            raise IndexError(f"task index {index} out of range [0, {self._len})")
        for start, source in zip(reversed(self.starts), reversed(self.sources)):
            if index >= start:
                return source[index - start]
        raise AssertionError("unreachable: index checked above")


def task_splits(source: TaskSource) -> dict[str, range]:
    """The source's named splits; one that declares none is all training data."""
    declared = getattr(source, "splits", None)
    if declared is None:
        return {TRAIN: range(len(source))}
    return dict(declared)


def generated_splits(size: int) -> dict[str, range]:
    """Half of a generated stream trains, the next 30% is held out, the last 20% plays demonstrations.

    The boundaries of a 1,000,000-task stream (500,000 and 800,000) are the ones earlier runs used,
    so their logged task indices and held-out scores stay comparable.
    """
    eval_from, demo_from = size // 2, size * 4 // 5
    return {TRAIN: range(0, eval_from), EVAL: range(eval_from, demo_from), DEMO: range(demo_from, size)}
