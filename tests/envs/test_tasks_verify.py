from __future__ import annotations

import contextlib
import io
import json
import time

import pytest

from envs.tasks import FAMILIES, GeneratedTasks, load_tasks
from envs.verify import MathVerifier, as_number


@pytest.mark.parametrize("difficulty", [0, 2, 5])
def test_every_family_solution_code_prints_its_answer(difficulty: int) -> None:
    tasks = GeneratedTasks(difficulty=difficulty, seed=7)
    for i in range(2 * len(FAMILIES)):
        task = tasks[i]
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(task.solution_code, {})
        assert buf.getvalue().strip() == task.answer, task


def test_generated_tasks_are_reproducible_and_seed_dependent() -> None:
    a, b = GeneratedTasks(seed=1), GeneratedTasks(seed=1)
    assert [a[i] for i in range(20)] == [b[i] for i in range(20)]
    c = GeneratedTasks(seed=2)
    assert [a[i].problem for i in range(20)] != [c[i].problem for i in range(20)]
    assert a[5] == GeneratedTasks(seed=1)[5]  # random access does not depend on order


def test_difficulty_zero_prompts_are_short() -> None:
    tasks = GeneratedTasks(families=("multiply",), difficulty=0)
    assert all(len(tasks[i].problem) <= 32 for i in range(100))
    assert GeneratedTasks(families=("multiply",), difficulty=3)[0].problem != tasks[0].problem


@pytest.mark.parametrize("difficulty", [0, 1, 2])
def test_products_have_a_fixed_number_of_digits(difficulty: int) -> None:
    """n-digit factors, always a 2n-digit product: the answer's length never varies within a level."""
    n = 3 + 3 * difficulty
    tasks = GeneratedTasks(families=("multiply",), difficulty=difficulty, seed=3)
    for i in range(500):
        a, b = map(int, tasks[i].problem.removeprefix("Compute ").removesuffix(".").split(" * "))
        assert len(str(a)) == len(str(b)) == n
        assert len(tasks[i].answer) == 2 * n and int(tasks[i].answer) == a * b


def test_bad_generator_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="choose from"):
        GeneratedTasks(families=("nope",))
    with pytest.raises(ValueError, match="difficulty"):
        GeneratedTasks(difficulty=9)


ROWS = [{"question": "1+1?", "solution": "It is \\boxed{2}."}, {"question": "Half of 1?", "solution": "1/2"}]


def test_load_jsonl_parquet_and_hf_folder_with_custom_fields(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset, DatasetDict

    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    DatasetDict({"test": Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "hf"))
    for path, kw in [("d.jsonl", {}), ("d.parquet", {}), ("hf", {"split": "test"})]:
        tasks = load_tasks(tmp_path / path, problem_field="question", answer_field="solution", **kw)
        assert [(t.problem, t.answer) for t in (tasks[0], tasks[1])] == [("1+1?", "2"), ("Half of 1?", "1/2")]


def test_load_errors_name_the_problem(tmp_path) -> None:
    (tmp_path / "d.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    with pytest.raises(ValueError, match="problem_field="):
        load_tasks(tmp_path / "d.jsonl")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        load_tasks(tmp_path / "bad.jsonl")
    with pytest.raises(FileNotFoundError):
        load_tasks(tmp_path / "missing.jsonl")


def test_numbers_compare_exactly() -> None:
    v = MathVerifier(symbolic=False)
    assert v("121,932,631,112,635,269", "121932631112635269").correct
    assert v("\\frac{1}{2}", "0.5").correct
    assert not v("121932631112635268", "121932631112635269").correct
    assert as_number("1e5") is None


def test_symbolic_equivalence() -> None:
    v = MathVerifier(timeout_s=20)
    try:
        assert v("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}").correct
        assert v("x + 1", "1 + x").method == "symbolic"
        assert not v("x + 2", "1 + x").correct
    finally:
        v.close()


def sleepy_compare(predicted: str, gold: str) -> bool:
    if predicted == "slow":
        time.sleep(60)
    if predicted == "crash":
        raise RuntimeError("parser exploded")
    return predicted == gold


def test_verifier_timeout_and_crash_are_errors_not_wrong_answers() -> None:
    v = MathVerifier(timeout_s=1.0, compare=sleepy_compare)
    try:
        start = time.monotonic()
        slow = v("slow", "x")
        assert slow.error and "timed out" in slow.error and time.monotonic() - start < 10
        crash = v("crash", "x")
        assert crash.error and "parser exploded" in crash.error
        again = v("a", "b")  # goes to the worker, which must have been restarted after the kill
        assert again.error is None and not again.correct and again.method == "symbolic"
    finally:
        v.close()
