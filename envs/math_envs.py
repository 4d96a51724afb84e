"""The built-in environments: math with the Python tool, without tools, and with a calculator.

Each is ToolEnv plus a choice of tasks: a user dataset when `dataset=` is given, otherwise the
generated families. They are classes (not factories) so `gymnasium.make` can import them lazily
from "envs.math_envs:<Class>" and so a user can subclass them.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from envs.env import ToolEnv
from envs.tasks.base import TaskSource
from envs.tasks.datasets import load_tasks
from envs.tasks.generated import FAMILIES, GeneratedTasks
from envs.tasks.splits import EVAL, TRAIN, ConcatTasks, SplitTasks, generated_splits
from envs.tools.calculator import CalculatorTool

ARITHMETIC_FAMILIES = ("multiply", "add", "power", "modpow")
"""Families a calculator can solve in one expression."""


def math_tasks(
    dataset: str | Path | TaskSource | None = None,
    *,
    eval_dataset: str | Path | TaskSource | None = None,
    problem_field: str = "problem",
    answer_field: str = "answer",
    split: str | None = None,
    eval_split: str | None = None,
    limit: int | None = None,
    families: Sequence[str] = tuple(FAMILIES),
    difficulty: int = 1,
    seed: int = 0,
) -> TaskSource:
    """A dataset's tasks when `dataset` is a path (or a source), else generated tasks; with splits.

    Generated tasks come with train, eval and demo splits (`generated_splits`). A dataset is all
    training data unless `eval_dataset` names held-out rows (another file, or the same folder with
    `eval_split=`); it has no demo split, since its rows carry no solution program to demonstrate.
    """
    if dataset is None:
        if eval_dataset is not None:
            raise ValueError(
                "eval_dataset needs a training dataset too (generated tasks have their own eval split)"
            )
        generated = GeneratedTasks(families=families, difficulty=difficulty, seed=seed)
        return SplitTasks(generated, generated_splits(len(generated)))
    fields = {"problem_field": problem_field, "answer_field": answer_field, "limit": limit}
    train = _as_source(dataset, split=split, **fields)
    if eval_dataset is None:
        return train
    held_out = _as_source(eval_dataset, split=eval_split, **fields)
    return SplitTasks(
        ConcatTasks([train, held_out]),
        {TRAIN: range(len(train)), EVAL: range(len(train), len(train) + len(held_out))},
    )


def _as_source(dataset: str | Path | TaskSource, **options: Any) -> TaskSource:
    return load_tasks(dataset, **options) if isinstance(dataset, (str, Path)) else dataset


_TASK_OPTIONS = frozenset(p for p in inspect.signature(math_tasks).parameters if p != "dataset")


class PythonMathEnv(ToolEnv):
    """Math with a persistent Python sandbox (```python blocks by default, or tool_format="hermes").

    Keyword arguments named like `math_tasks`' options choose the tasks (dataset fields, splits,
    generated families, difficulty, seed); every other one goes to `ToolEnv`.
    """

    def __init__(self, dataset: str | Path | TaskSource | None = None, **kwargs: Any) -> None:
        options = {k: kwargs.pop(k) for k in _TASK_OPTIONS & kwargs.keys()}
        super().__init__(math_tasks(dataset, **options), **kwargs)


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
