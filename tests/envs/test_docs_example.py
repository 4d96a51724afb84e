"""The registration example in docs/envs.md, executed exactly as written."""

from __future__ import annotations

import re
from pathlib import Path

import gymnasium as gym

import envs
from envs.checks import check_env

DOC = Path(__file__).resolve().parents[2] / "docs" / "envs.md"


def registration_example() -> str:
    section = DOC.read_text().split("## Adding an environment", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_example_is_under_20_lines() -> None:
    lines = [line for line in registration_example().splitlines() if line.strip()]
    assert len(lines) < 20


def test_documented_registration_example_works() -> None:
    namespace: dict = {}
    try:
        exec(compile(registration_example(), str(DOC), "exec"), namespace)
        env = namespace["env"]
        assert isinstance(env.unwrapped, namespace["CollatzEnv"])
        assert "my_project/Collatz-v0" in envs.registered_ids()
        check_env(env)

        obs, _ = env.reset(options={"task_index": 0})
        assert obs[-1]["content"] == "How many Collatz steps take 27 to 1?"
        code = (
            "n, s = 27, 0\nwhile n != 1:\n    n, s = (n // 2 if n % 2 == 0 else 3 * n + 1), s + 1\nprint(s)"
        )
        obs, *_ = env.step(f"```python\n{code}\n```")
        assert obs[0]["content"] == "```output\n111\n```"
        _, reward, terminated, _, _ = env.step("\\boxed{111}")
        assert terminated and reward == 1.0
        env.close()
        again = gym.make("my_project/Collatz-v0")
        assert again.unwrapped.max_turns == 4
        again.close()
    finally:
        envs.unregister("my_project/Collatz-v0")
