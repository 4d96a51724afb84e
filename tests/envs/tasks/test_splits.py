"""Task splits belong to the task source: generated streams carry train/eval/demo ranges, datasets
carry train (and eval when held-out rows are given), and the env resets into any of them."""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium
import pytest

import envs  # noqa: F401  (registers the agent_rl/ environments)
from envs.math_envs import math_tasks
from envs.tasks import (
    DEMO,
    EVAL,
    TRAIN,
    ConcatTasks,
    GeneratedTasks,
    ListTasks,
    SplitTasks,
    Task,
    generated_splits,
    task_splits,
)


def _dataset(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a in rows))
    return path


def test_generated_tasks_split_at_the_indices_earlier_runs_used() -> None:
    source = math_tasks(families=("multiply",), difficulty=0)
    splits = task_splits(source)
    assert splits == {
        TRAIN: range(0, 500_000),
        EVAL: range(500_000, 800_000),
        DEMO: range(800_000, 1_000_000),
    }
    plain = GeneratedTasks(families=("multiply",), difficulty=0)
    assert source[splits[EVAL][3]] == plain[500_003]  # held-out task 3 is the task it always was
    assert generated_splits(10) == {TRAIN: range(0, 5), EVAL: range(5, 8), DEMO: range(8, 10)}


def test_a_dataset_is_training_data_unless_held_out_rows_are_given(tmp_path: Path) -> None:
    train = _dataset(tmp_path / "train.jsonl", [("1+1?", "2"), ("2+2?", "4")])
    assert task_splits(math_tasks(train)) == {TRAIN: range(0, 2)}
    held_out = _dataset(tmp_path / "test.jsonl", [("3+3?", "6"), ("4+4?", "8"), ("5+5?", "10")])
    source = math_tasks(train, eval_dataset=held_out)
    splits = task_splits(source)
    assert splits == {TRAIN: range(0, 2), EVAL: range(2, 5)}
    assert [source[i].problem for i in splits[EVAL]] == ["3+3?", "4+4?", "5+5?"]
    with pytest.raises(ValueError, match="eval_dataset needs a training dataset"):
        math_tasks(eval_dataset=held_out)


def test_the_env_resets_into_a_held_out_row_by_its_task_index(tmp_path: Path) -> None:
    train = _dataset(tmp_path / "train.jsonl", [("1+1?", "2")])
    held_out = _dataset(tmp_path / "test.jsonl", [("3+3?", "6")])
    env = gymnasium.make("agent_rl/MathNoTool-v0", dataset=str(train), eval_dataset=str(held_out))
    try:
        index = task_splits(env.unwrapped.tasks)[EVAL][0]
        obs, info = env.reset(options={"task_index": index})
        assert obs[-1]["content"] == "3+3?" and info["task_index"] == 1
        _, reward, terminated, _, _ = env.step("\\boxed{6}")
        assert terminated and reward == 1.0
    finally:
        env.close()


def test_splits_must_be_disjoint_ranges_inside_the_source() -> None:
    source = ListTasks([Task(problem=str(i), answer=str(i)) for i in range(4)])
    assert task_splits(source) == {TRAIN: range(0, 4)}
    with pytest.raises(ValueError, match="overlap"):
        SplitTasks(source, {TRAIN: range(0, 3), EVAL: range(2, 4)})
    with pytest.raises(ValueError, match="within"):
        SplitTasks(source, {EVAL: range(2, 5)})
    joined = ConcatTasks([source, ListTasks([Task(problem="x", answer="1")])])
    assert len(joined) == 5 and joined[4].problem == "x" and joined[3].problem == "3"
    with pytest.raises(IndexError):
        joined[5]
