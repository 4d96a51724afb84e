"""Math tasks from user datasets: JSONL, Parquet, or a Hugging Face `datasets` saved folder.

Field names are configurable because every dataset names them differently (problem/question,
answer/solution/final_answer). An answer field holding a whole worked solution is reduced to its
last `\\boxed{}`. Rows with a missing or empty field are an error naming the row, not a silent skip:
a dataset that loses rows changes the training distribution without anyone noticing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from envs.answers import answer_from_solution
from envs.tasks.base import ListTasks, Task


def _rows(path: Path, split: str | None) -> Iterable[Mapping[str, Any]]:
    if path.is_dir():
        from datasets import DatasetDict, load_from_disk

        data = load_from_disk(str(path))
        if isinstance(data, DatasetDict):
            name = split or ("train" if "train" in data else None)
            if name is None or name not in data:
                raise ValueError(f"{path} has splits {list(data)}; pass split=<one of them>")
            data = data[name]
        return iter(data)
    suffix = path.suffix.lower()
    if suffix in {".jsonl", ".json"}:
        return _jsonl(path)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return iter(pq.read_table(path).to_pylist())
    raise ValueError(
        f"cannot read {path}: use a .jsonl/.parquet file or a folder saved with datasets' save_to_disk"
    )


def _jsonl(path: Path) -> Iterable[Mapping[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: each line must be a JSON object")
            yield row


def load_tasks(
    path: str | Path,
    *,
    problem_field: str = "problem",
    answer_field: str = "answer",
    id_field: str | None = None,
    split: str | None = None,
    limit: int | None = None,
) -> ListTasks:
    """Read a dataset into tasks. `limit` keeps the first N rows (quick evaluations)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset not found: {path}")
    tasks: list[Task] = []
    for i, row in enumerate(_rows(path, split)):
        if limit is not None and i >= limit:
            break
        for name in (problem_field, answer_field):
            if name not in row or row[name] is None or str(row[name]).strip() == "":
                raise ValueError(
                    f"{path}: row {i} has no {name!r} field (fields: {sorted(row)}); "
                    f"set problem_field=/answer_field= to the dataset's names"
                )
        tasks.append(
            Task(
                problem=str(row[problem_field]).strip(),
                answer=answer_from_solution(str(row[answer_field])),
                id=str(row[id_field]) if id_field and id_field in row else f"{path.stem}-{i}",
                family=path.stem,
            )
        )
    if not tasks:
        raise ValueError(f"{path}: no rows")
    return ListTasks(tasks)
