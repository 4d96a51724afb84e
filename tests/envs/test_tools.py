from __future__ import annotations

import pytest

from envs.tools import CalculatorTool, PythonTool, ToolInfraError, truncate_output
from tests.envs.conftest import FaultyBackend


def test_truncate_keeps_head_and_tail_with_marker() -> None:
    text = "HEAD" + "x" * 1000 + "TAIL"
    out = truncate_output(text, 100)
    assert out.startswith("HEAD") and out.endswith("TAIL")
    assert "[output truncated: 908 characters omitted]" in out
    assert truncate_output("short", 100) == "short"


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("2**100 % 7", str(2**100 % 7)),
        ("factorial(20)", "2432902008176640000"),
        ("pow(3, 10**9, 1000)", str(pow(3, 10**9, 1000))),
        ("(1+2)*3 - 4//3", "8"),
    ],
)
def test_calculator_computes_exactly(expression: str, expected: str) -> None:
    out = CalculatorTool().call({"expression": expression})
    assert out.ok and out.text == expected


@pytest.mark.parametrize(
    "expression",
    ["10**10**10", "__import__('os')", "factorial(10**6)", "1/0", "x + 1", "-" * 3000 + "1", "(" * 300 + "1"],
)
def test_calculator_refuses_without_raising(expression: str) -> None:
    out = CalculatorTool().call({"expression": expression})
    assert not out.ok and out.text


def test_tool_validates_arguments() -> None:
    assert "missing" in CalculatorTool().call({}).text
    assert "type string" in CalculatorTool().call({"expression": 3}).text
    assert "unknown argument" in CalculatorTool().call({"expression": "1", "x": 1}).text


def test_python_tool_keeps_state_within_a_session_and_resets_between(sandbox) -> None:
    tool = PythonTool(sandbox)
    tool.open()
    assert tool.call({"code": "x = 41"}).ok
    assert tool.call({"code": "print(x + 1)"}).text == "42"
    tool.open()  # a new episode: fresh interpreter
    out = tool.call({"code": "print(x)"})
    assert not out.ok and "NameError" in out.text
    tool.close()
    tool.close()


def test_python_tool_reports_errors_timeouts_and_values(sandbox) -> None:
    tool = PythonTool(sandbox, timeout_s=1.0)
    tool.open()
    try:
        err = tool.call({"code": "1/0"})
        assert (
            not err.ok
            and "ZeroDivisionError" in err.text
            and err.metadata["error_type"] == "ZeroDivisionError"
        )
        slow = tool.call({"code": "while True: pass"})
        assert not slow.ok and slow.metadata["timed_out"] and "TimeoutError" in slow.text
        assert tool.call({"code": "6 * 7"}).text == "42"  # trailing expression value, notebook style
    finally:
        tool.close()


def test_python_tool_closes_session_after_infra_failure() -> None:
    backend = FaultyBackend()
    tool = PythonTool(backend)
    tool.open()
    backend.fail_run = True
    with pytest.raises(ToolInfraError, match="connection reset"):
        tool.call({"code": "print(1)"})
    assert backend.closed == 1 and not tool.is_open
    backend.fail_open = True
    with pytest.raises(ToolInfraError, match="could not open"):
        tool.open()
