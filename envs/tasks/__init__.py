"""Task sources: generated tasks that need code, and user math datasets."""

from __future__ import annotations

from envs.tasks.base import FunctionTasks, ListTasks, Task, TaskSource
from envs.tasks.datasets import load_tasks
from envs.tasks.generated import EASY_FAMILIES, FAMILIES, GeneratedTasks

__all__ = [
    "EASY_FAMILIES",
    "FAMILIES",
    "FunctionTasks",
    "GeneratedTasks",
    "ListTasks",
    "Task",
    "TaskSource",
    "load_tasks",
]
