"""Task sources: generated tasks that need code, user math datasets, and their named splits."""

from __future__ import annotations

from envs.tasks.base import FunctionTasks, ListTasks, Task, TaskSource
from envs.tasks.datasets import load_tasks
from envs.tasks.generated import EASY_FAMILIES, FAMILIES, GeneratedTasks
from envs.tasks.splits import DEMO, EVAL, TRAIN, ConcatTasks, SplitTasks, generated_splits, task_splits

__all__ = [
    "DEMO",
    "EASY_FAMILIES",
    "EVAL",
    "FAMILIES",
    "TRAIN",
    "ConcatTasks",
    "FunctionTasks",
    "GeneratedTasks",
    "ListTasks",
    "SplitTasks",
    "Task",
    "TaskSource",
    "generated_splits",
    "load_tasks",
    "task_splits",
]
