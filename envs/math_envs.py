"""The built-in environments: math with the Python tool, without tools, and with a calculator.

Each is ToolEnv plus a choice of tasks: a user dataset when `dataset=` is given, otherwise the
generated families. They are classes (not factories) so `gymnasium.make` can import them lazily
from "envs.math_envs:<Class>" and so a user can subclass them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from envs.env import ToolEnv
from envs.tasks.base import TaskSource
from envs.tasks.datasets import load_tasks
from envs.tasks.generated import FAMILIES, GeneratedTasks
from envs.tools.calculator import CalculatorTool

ARITHMETIC_FAMILIES = ("multiply", "add", "power", "modpow")
"""Families a calculator can solve in one expression."""


def math_tasks(
    dataset: str | Path | TaskSource | None = None,
    *,
    problem_field: str = "problem",
    answer_field: str = "answer",
    split: str | None = None,
    limit: int | None = None,
    families: Sequence[str] = tuple(FAMILIES),
    difficulty: int = 1,
    seed: int = 0,
) -> TaskSource:
    """A dataset's tasks when `dataset` is a path (or a source), else generated tasks."""
    if dataset is None:
        return GeneratedTasks(families=families, difficulty=difficulty, seed=seed)
    if isinstance(dataset, (str, Path)):
        return load_tasks(
            dataset, problem_field=problem_field, answer_field=answer_field, split=split, limit=limit
        )
    return dataset


class PythonMathEnv(ToolEnv):
    """Math with a persistent Python sandbox (```python blocks by default, or tool_format="hermes")."""

    def __init__(
        self,
        dataset: str | Path | TaskSource | None = None,
        *,
        problem_field: str = "problem",
        answer_field: str = "answer",
        split: str | None = None,
        limit: int | None = None,
        families: Sequence[str] = tuple(FAMILIES),
        difficulty: int = 1,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        tasks = math_tasks(
            dataset,
            problem_field=problem_field,
            answer_field=answer_field,
            split=split,
            limit=limit,
            families=families,
            difficulty=difficulty,
            seed=seed,
        )
        super().__init__(tasks, **kwargs)


class MathNoToolEnv(PythonMathEnv):
    """The same tasks answered in a single turn without tools, for comparisons."""

    def __init__(self, dataset: str | Path | TaskSource | None = None, **kwargs: Any) -> None:
        if kwargs.get("tools"):
            raise ValueError("MathNoToolEnv has no tools; use PythonMathEnv to give the agent tools")
        kwargs["tools"] = []
        super().__init__(dataset, **kwargs)


class CalculatorMathEnv(PythonMathEnv):
    """Arithmetic tasks with a calculator tool called in the Hermes format (no sandbox needed)."""

    def __init__(self, dataset: str | Path | TaskSource | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("families", ARITHMETIC_FAMILIES)
        kwargs.setdefault("tools", [CalculatorTool()])
        kwargs.setdefault("tool_format", "hermes")
        super().__init__(dataset, **kwargs)
