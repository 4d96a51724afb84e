"""One progress display for a whole run: a bar with an ETA for every phase that takes a while.

Why: the warm-up and the evaluations used to run in silence (about 75 s of nothing in a 300-step
warm-up), so a user could not tell a slow phase from a hung one. Each phase gets a bar with done /
total, elapsed time and the time remaining; a disabled display (`run.progress: false`, the
experiment's cells, tests) costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

Advance = Callable[..., None]
"""`advance(n=1, note="")`: n more units done; `note` replaces the text after the phase's name."""


class RunProgress:
    """A live display whose phases (warm-up, evaluation, RL steps) are bars, one after another."""

    def __init__(self, enabled: bool) -> None:
        self._bars = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            disable=not enabled,
        )

    def __enter__(self) -> RunProgress:
        self._bars.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._bars.stop()

    @contextmanager
    def phase(self, name: str, total: int, completed: int = 0) -> Iterator[Advance]:
        """A bar for `total` units of one phase; yields the function that moves it."""
        task = self._bars.add_task(name, total=total, completed=completed)

        def advance(n: int = 1, note: str = "") -> None:
            self._bars.update(task, advance=n, description=f"{name} {note}".rstrip())

        yield advance
