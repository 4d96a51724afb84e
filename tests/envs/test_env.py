"""ToolEnv driven by scripted policies against the real LocalSandbox."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import envs
from envs import GeneratedTasks, PythonMathEnv, RewardConfig, Task, ToolEnv
from envs.checks import check_env
from envs.tools import CalculatorTool, PythonTool
from tests.envs.conftest import FaultyBackend

TASK = Task(
    problem="Compute 123456789 * 987654321.",
    answer="121932631112635269",
    solution_code="print(123456789 * 987654321)",
)


@pytest.fixture
def env(sandbox):
    e = ToolEnv([TASK], sandbox=sandbox, max_turns=3)
    yield e
    e.close()


def test_reset_returns_system_and_user_prompt(env) -> None:
    obs, info = env.reset(seed=0)
    assert [m["role"] for m in obs] == ["system", "user"]
    assert obs[1]["content"] == TASK.problem and env.task == TASK and info["task_index"] == 0
    assert "\\boxed{}" in obs[0]["content"]


def test_correct_answer_via_tool_gives_reward_one(env) -> None:
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("```python\nprint(123456789 * 987654321)\n```")
    assert obs == [
        {
            "role": "tool",
            "name": "python",
            "tool_call_id": "000100000",
            "content": "```output\n121932631112635269\n```",
        }
    ]
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info["tool_calls"][0]["ok"] and info["tool_calls"][0]["duration_s"] > 0
    obs, reward, terminated, truncated, info = env.step("The product is \\boxed{121932631112635269}.")
    assert (obs, reward, terminated, truncated) == ([], 1.0, True, False)
    assert info["verification"]["correct"] and "infra_error" not in info


def test_wrong_answer_gives_zero(env) -> None:
    env.reset(seed=0)
    env.step("```python\nprint(123456789 * 987654321)\n```")
    _, reward, terminated, _, info = env.step("\\boxed{121932631112635268}")
    assert reward == 0.0 and terminated and info["verification"]["correct"] is False


def test_tool_error_becomes_an_observation(env) -> None:
    env.reset(seed=0)
    obs, _, terminated, truncated, info = env.step("```python\nprint(undefined_name)\n```")
    assert not terminated and not truncated
    assert "NameError" in obs[0]["content"] and info["tool_calls"][0]["ok"] is False


def test_variables_persist_across_turns(env) -> None:
    env.reset(seed=0)
    env.step("```python\nx = 123456789 * 987654321\n```")
    obs, *_ = env.step("```python\nprint(x)\n```")
    assert "121932631112635269" in obs[0]["content"]


def test_turn_limit_truncates(env) -> None:
    env.reset(seed=0)
    for turn in range(1, 4):
        obs, reward, terminated, truncated, info = env.step("```python\nprint(1)\n```")
        assert not terminated
        assert truncated == (turn == 3)
    assert info["truncated_reason"] == "max_turns" and obs == [] and reward == 0.0
    with pytest.raises(envs.ResetNeeded):
        env.step("more")


def test_tool_budget_and_per_turn_limit(sandbox) -> None:
    env = ToolEnv([TASK], sandbox=sandbox, max_turns=5, max_tool_calls=2, max_calls_per_turn=1)
    env.reset(seed=0)
    obs, *_, info = env.step("```python\nprint(1)\n```\n```python\nprint(2)\n```")
    assert obs[0]["content"] == "```output\n1\n```" and "at most 1 tool calls per turn" in obs[1]["content"]
    env.step("```python\nprint(3)\n```")
    _, _, terminated, truncated, info = env.step("```python\nprint(4)\n```")
    assert truncated and not terminated and info["truncated_reason"] == "tool_budget"
    env.close()


def test_answer_and_call_in_one_turn_ends_without_running(env) -> None:
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step("```python\nprint(1)\n```\n\\boxed{121932631112635269}")
    assert terminated and reward == 1.0 and info["skipped_calls"] == 1 and info["tool_calls"] == []


def test_long_output_is_truncated_with_marker(sandbox) -> None:
    env = ToolEnv([TASK], sandbox=sandbox, max_output_chars=100)
    env.reset(seed=0)
    obs, *_, info = env.step("```python\nprint('a' * 5000)\n```")
    assert "[output truncated:" in obs[0]["content"] and len(obs[0]["content"]) < 200
    assert info["tool_calls"][0]["output_truncated"] and info["tool_calls"][0]["output_chars"] == 5000
    env.close()


def test_format_penalties_are_per_step(sandbox) -> None:
    cfg = RewardConfig(malformed_call_penalty=0.1, no_answer_penalty=0.5)
    env = ToolEnv([TASK], sandbox=sandbox, reward=cfg)
    env.reset(seed=0)
    _, r1, *_ = env.step("```python\nprint(1)")
    _, r2, terminated, *_ = env.step("I give up.")
    assert (r1, r2, terminated) == (-0.1, -0.5, True)
    env.close()


def test_hermes_format_with_python_and_unknown_tool(sandbox) -> None:
    env = ToolEnv([TASK], sandbox=sandbox, tool_format="hermes")
    obs, _ = env.reset(seed=0)
    assert '"name":"python"' in obs[0]["content"]
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>'
    obs, *_ = env.step(call + '<tool_call>{"name": "shell", "arguments": {}}</tool_call>')
    assert obs[0] == {"role": "tool", "name": "python", "tool_call_id": "000100000", "content": "42"}
    assert obs[1]["tool_call_id"] == "000100001"
    assert "unknown tool 'shell'" in obs[1]["content"] and obs[1]["name"] == "shell"
    env.close()


def test_sandbox_outage_sets_infra_error_without_raising() -> None:
    backend = FaultyBackend()
    env = ToolEnv([TASK], sandbox=backend)
    env.reset(seed=0)
    backend.fail_run = True
    obs, reward, terminated, truncated, info = env.step("```python\nprint(1)\n```")
    assert truncated and not terminated and reward == 0.0 and obs == []
    assert "connection reset" in info["infra_error"]
    assert backend.closed == backend.opened == 1


def test_outage_at_reset_is_reported_and_retried() -> None:
    backend = FaultyBackend(fail_open=True)
    env = ToolEnv([TASK], sandbox=backend)
    _, info = env.reset(seed=0)
    assert "worker pool exhausted" in info["infra_error"]
    backend.fail_open = False
    obs, *_, info = env.step("```python\nprint(1)\n```")
    assert obs[0]["content"] == "```output\nran\n```" and "infra_error" not in info


def test_one_session_per_episode_closed_on_reset_end_and_close() -> None:
    backend = FaultyBackend()
    env = ToolEnv([TASK], sandbox=backend)
    env.reset(seed=0)
    env.reset(seed=1)
    assert (backend.opened, backend.closed) == (2, 1)
    env.step("\\boxed{1}")
    assert backend.closed == 2
    env.reset(seed=2)
    env.close()
    env.close()
    assert (backend.opened, backend.closed) == (3, 3)


def test_verifier_crash_is_flagged_not_silent() -> None:
    def broken(predicted, gold):
        raise RuntimeError("sympy blew up")

    env = ToolEnv([TASK], tools=[], verifier=broken)
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step("\\boxed{5}")
    assert terminated and reward == 0.0 and "sympy blew up" in info["verifier_error"]
    assert info["infra_error"].startswith("verifier:")


def test_single_turn_variant_ends_after_one_turn() -> None:
    env = envs.MathNoToolEnv(families=("multiply",), difficulty=0)
    obs, _ = env.reset(seed=3)
    assert [m["role"] for m in obs] == ["system", "user"]
    _, reward, terminated, *_ = env.step(f"```python\nprint(1)\n```\n\\boxed{{{env.task.answer}}}")
    assert terminated and reward == 1.0


def test_task_selection_by_index_and_seed(sandbox) -> None:
    env = PythonMathEnv(sandbox=sandbox, seed=5)
    _, info = env.reset(options={"task_index": 17})
    assert env.task == GeneratedTasks(seed=5)[17] and info["task_index"] == 17
    assert env.reset(seed=3)[0] == env.reset(seed=3)[0]
    with pytest.raises(ValueError, match="task_index"):
        env.reset(options={"task_index": -1})
    env.close()


def test_calculator_env_is_a_different_tool() -> None:
    env = envs.CalculatorMathEnv(difficulty=0)
    env.reset(seed=0)
    obs, *_ = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "2**10"}}</tool_call>')
    assert obs == [{"role": "tool", "name": "calculator", "tool_call_id": "000100000", "content": "1024"}]
    assert [s["function"]["name"] for s in env.tool_schemas] == ["calculator"]
    assert isinstance(next(iter(env.tools.values())), CalculatorTool)


def test_native_tool_listing_moves_the_schemas_from_the_prompt_to_info() -> None:
    listed = envs.CalculatorMathEnv(difficulty=0)
    native = envs.CalculatorMathEnv(difficulty=0, tool_listing="native")
    (system, _), info = listed.reset(seed=0)
    assert "Tools:" in system["content"] and '"name":"calculator"' in system["content"]
    assert "tools" not in info
    (system, _), info = native.reset(seed=0)
    assert "Tools:" not in system["content"] and "calculator" not in system["content"]
    assert "<tool_call>" in system["content"] and "\\boxed{}" in system["content"]
    assert info["tools"] == native.tool_schemas == listed.tool_schemas
    fn = info["tools"][0]["function"]
    assert info["tools"][0]["type"] == "function" and fn["name"] == "calculator"
    assert fn["parameters"]["required"] == ["expression"] and fn["description"]
    assert check_env(native)  # still a valid env: info may carry extra keys, obs stays messages


def test_native_listing_leaves_the_code_format_unchanged(sandbox) -> None:
    code = ToolEnv([TASK], sandbox=sandbox)
    native = ToolEnv([TASK], sandbox=sandbox, tool_listing="native")
    assert native.native_tools is None and native.system_prompt == code.system_prompt
    assert "tools" not in native.reset(seed=0)[1]
    with pytest.raises(ValueError, match="tool_listing"):
        ToolEnv([TASK], sandbox=sandbox, tool_listing="user_prompt")


def test_a_result_names_its_tool_even_for_a_malformed_call(sandbox) -> None:
    one = envs.CalculatorMathEnv(difficulty=0)
    one.reset(seed=0)
    obs, *_ = one.step("<tool_call>not json</tool_call>")
    assert obs[0]["name"] == "calculator" and "not valid JSON" in obs[0]["content"]
    two = ToolEnv([TASK], tools=[CalculatorTool(), PythonTool(sandbox)], tool_format="hermes")
    two.reset(seed=0)
    obs, *_ = two.step("<tool_call>not json</tool_call>")
    assert obs[0]["name"] == "invalid_tool_call"
    two.close()


MODEL_CALLS = {
    "llama3_json": '{"name": "calculator", "parameters": {"expression": "2**10"}}',
    "mistral": '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "2**10"}}]',
    "mistral_v11": '[TOOL_CALLS]calculator[ARGS]{"expression": "2**10"}',
}


@pytest.mark.parametrize("tool_format", list(MODEL_CALLS))
def test_llama_and_mistral_formats_through_the_env_and_the_registry(tool_format: str) -> None:
    """`tool_format=` picks the model's own call syntax; the env id made by gymnasium passes the checks."""
    env = envs.CalculatorMathEnv(difficulty=0, tool_format=tool_format)
    (system, _), _ = env.reset(seed=0)
    assert env.format.name == tool_format and "Tools:" in system["content"]
    obs, reward, terminated, _, info = env.step(MODEL_CALLS[tool_format])
    assert obs == [{"role": "tool", "name": "calculator", "tool_call_id": "000100000", "content": "1024"}]
    assert not terminated and reward == 0.0 and info["parse_errors"] == []
    obs, reward, *_, info = env.step(f"\\boxed{{{env.task.answer}}}")
    assert reward == 1.0 and info["verification"]["correct"]
    env.reset(seed=0)
    bad, _, terminated, _, info = env.step(env.format.malformed_example)
    assert not terminated and "Error" in bad[0]["content"] and info["parse_errors"]
    made = gymnasium.make("agent_rl/CalculatorMath-v0", tool_format=tool_format, tool_listing="native")
    assert check_env(made) and made.unwrapped.format.name == tool_format
    assert made.unwrapped.native_tools and "Tools:" not in made.unwrapped.system_prompt
    made.close()


FUZZ_PIECES = st.sampled_from(
    [
        "```python\n",
        "```",
        "\n",
        "print(1)",
        "1/0",
        "<tool_call>",
        "</tool_call>",
        '{"name": "python", ',
        '"arguments": {"code": "print(2)"}}',
        '{"name": "calculator", "arguments": {"expression": "2**99"}}',
        '{"name": "calculator", "parameters": {"expression": "3"}}; ',
        "<|python_tag|>",
        "[TOOL_CALLS]",
        '[{"name": "calculator", "arguments": {"expression": "2"}}]',
        'calculator[ARGS]{"expression": "4"}',
        "\\boxed{",
        "}",
        "<answer>",
        "</answer>",
        "{",
        "\x00",
        "💥",
    ]
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    turns=st.lists(
        st.lists(st.one_of(FUZZ_PIECES, st.text(max_size=10)), max_size=12).map("".join), max_size=5
    )
)
def test_env_steps_never_raise_on_arbitrary_turns(turns: list[str]) -> None:
    backend = FaultyBackend()
    for env in (
        ToolEnv([TASK], sandbox=backend, max_turns=3),
        *(
            ToolEnv([TASK], tools=[CalculatorTool()], tool_format=f, max_turns=3)
            for f in ("hermes", *MODEL_CALLS)
        ),
    ):
        obs, _ = env.reset(seed=0)
        for turn in turns:
            obs, reward, terminated, truncated, _ = env.step(turn)
            assert obs in env.observation_space and isinstance(reward, float)
            if terminated or truncated:
                break
        env.close()
    assert backend.opened == backend.closed


def test_gymnasium_make_deep_copies_tool_kwargs_without_sharing_sessions() -> None:
    import copy

    backend = FaultyBackend()
    tool = envs.PythonTool(envs.Shared(backend))
    tool.open()
    clone = copy.deepcopy(tool)
    assert clone.backend.backend is backend and not clone.is_open and tool.is_open
    tool.close()
    verifier = envs.MathVerifier()
    assert copy.deepcopy(verifier) is verifier


def test_sandbox_limits_reach_the_session(sandbox) -> None:
    env = ToolEnv([TASK], sandbox=sandbox, sandbox_limits={"memory_mb": 200})
    env.reset(options={"task_index": np.int64(0)})  # numpy indices from samplers are accepted
    obs, *_, info = env.step("```python\nblob = bytearray(600 * 2**20)\nprint(len(blob))\n```")
    call = info["tool_calls"][0]
    assert not call["ok"] and (call["memory_exceeded"] or call["error_type"] == "MemoryError"), call
    assert "MemoryError" in obs[0]["content"]
    env.close()
