"""A task is a problem with a reference answer; a task source is an indexable collection of them.

Sources are indexable (not iterators) so that `reset(options={"task_index": i})` and seeded
resets select the same task every time, which makes episodes reproducible and lets a trainer
sample the same prompt for a whole GRPO group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Task:
    """One problem. `answer` is compared by the verifier; `solution_code` feeds scripted demos."""

    problem: str
    answer: str
    id: str = ""
    family: str = ""
    """Which generator or dataset it came from, for per-family metrics."""
    solution_code: str | None = None
    """Python that prints the answer, when known (generated tasks): used by `envs.demos`."""
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)


@runtime_checkable
class TaskSource(Protocol):
    """Anything with a length and integer indexing that returns Tasks."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Task: ...


class ListTasks:
    """A fixed list of tasks (tests, small evaluation sets)."""

    def __init__(self, tasks: Sequence[Task]) -> None:
        if not tasks:
            raise ValueError("ListTasks needs at least one task")
        self._tasks = list(tasks)

    def __len__(self) -> int:
        return len(self._tasks)

    def __getitem__(self, index: int) -> Task:
        return self._tasks[index]


class FunctionTasks:
    """Tasks made on demand by `make(index) -> Task`: the shortest way to define a new task family."""

    def __init__(self, make: Callable[[int], Task], size: int = 10_000) -> None:
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        self._make = make
        self._size = size

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: int) -> Task:
        if not 0 <= index < self._size:
            raise IndexError(f"task index {index} out of range [0, {self._size})")
        return self._make(index)
