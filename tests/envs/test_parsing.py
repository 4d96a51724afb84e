from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from envs.answers import extract_final_answer, find_boxed
from envs.parsing import CodeBlockFormat, HermesFormat, get_format


def test_code_blocks_become_python_calls_in_order() -> None:
    turn = CodeBlockFormat().parse("Let me.\n```python\nx = 2\n```\ntext\n```py\nprint(x)\n```")
    assert [c.arguments["code"] for c in turn.calls] == ["x = 2\n", "print(x)\n"]
    assert turn.answer is None and turn.errors == []


def test_non_python_fences_are_not_run() -> None:
    turn = CodeBlockFormat().parse("```output\n42\n```\n```bash\nls\n```")
    assert turn.calls == [] and turn.items == []


def test_unclosed_python_block_is_an_error_item() -> None:
    turn = CodeBlockFormat().parse("```python\nprint(1)")
    assert turn.calls == []
    assert "unclosed" in turn.errors[0]


def test_boxed_inside_code_is_not_an_answer() -> None:
    turn = CodeBlockFormat().parse('```python\nprint("\\\\boxed{1}")\n```')
    assert turn.answer is None and len(turn.calls) == 1
    assert CodeBlockFormat().parse("so \\boxed{12}").answer == "12"


def test_hermes_call_with_object_or_string_arguments() -> None:
    fmt = HermesFormat()
    a = fmt.parse('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>')
    b = fmt.parse('<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    assert a.calls[0].arguments == b.calls[0].arguments == {"code": "print(1)"}


def test_hermes_malformed_calls_explain_the_fix() -> None:
    fmt = HermesFormat()
    for text in [
        "<tool_call>{oops</tool_call>",
        "<tool_call>[1, 2]</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "python", "arguments": 3}</tool_call>',
        '<tool_call>{"name": "python"',
        "<tool_call>" + "[" * 100_000 + "</tool_call>",
    ]:
        turn = fmt.parse(text)
        assert turn.calls == [], text[:40]
        assert turn.errors and "<tool_call>" in turn.errors[0], text[:40]


def test_render_call_round_trips_through_parse() -> None:
    for name in ("code", "hermes"):
        fmt = get_format(name)
        text = fmt.render_call("python", {"code": "print(6 * 7)"})
        assert fmt.parse(text).calls[0].arguments["code"].strip() == "print(6 * 7)"


def test_answers_last_wins_and_nested_braces() -> None:
    assert extract_final_answer("\\boxed{1} then <answer>2</answer>") == "2"
    assert extract_final_answer("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_final_answer("\\boxed{3} and \\boxed{4") == "3"
    assert find_boxed("\\boxed{a}\\boxed{b{c}}") == ["a", "b{c}"]


ADVERSARIAL = st.sampled_from(
    [
        "```",
        "```python\n",
        "```py",
        "\n```",
        "<tool_call>",
        "</tool_call>",
        "{",
        "}",
        '"name"',
        ":",
        "\\boxed{",
        "<answer>",
        "</answer>",
        "[",
        '"arguments"',
        "\x00",
        "\u202e",
        "💥",
        "\\",
        "\n",
    ]
)
TEXT = st.lists(st.one_of(ADVERSARIAL, st.text(max_size=20)), max_size=60).map("".join)


@settings(max_examples=400, deadline=None)
@given(TEXT)
def test_parsers_never_raise_on_any_text(text: str) -> None:
    for fmt in (CodeBlockFormat(), HermesFormat()):
        turn = fmt.parse(text)
        for item in turn.items:
            assert (item.call is None) != (item.error is None)
        assert turn.answer is None or isinstance(turn.answer, str)


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
    )
)
def test_hermes_any_json_payload_is_call_or_error(payload: object) -> None:
    turn = HermesFormat().parse(f"<tool_call>{json.dumps(payload)}</tool_call>")
    assert len(turn.items) == 1
    ok = isinstance(payload, dict) and isinstance(payload.get("name"), str) and payload["name"] != ""
    ok = ok and isinstance(payload.get("arguments", {}), (dict, str))
    if ok and isinstance(payload.get("arguments", {}), dict):
        assert turn.calls and turn.calls[0].name == payload["name"]
    if not ok:
        assert turn.errors


def test_an_answer_inside_reasoning_is_not_the_answer() -> None:
    """A reasoning model tries `\\boxed{}` candidates in <think> before it checks them with a tool:
    they must neither end the episode nor be graded (issue 16)."""
    assert extract_final_answer("<think>maybe \\boxed{12}?</think>Let me check with the tool.") is None
    assert extract_final_answer("<think>try \\boxed{1}</think>So \\boxed{2}.") == "2"
    assert extract_final_answer("<think>still going, \\boxed{3} perhaps") is None  # unclosed: thinking
    # the template opened the block in the generation prompt: only text after </think> counts
    assert extract_final_answer("guess \\boxed{4}</think>checked: <answer>5</answer>") == "5"
    assert extract_final_answer("no reasoning at all: \\boxed{6}") == "6"
    turn = HermesFormat().parse(
        '<think>\\boxed{7}?</think><tool_call>{"name": "python", "arguments": {"code": "print(7)"}}</tool_call>'
    )
    assert turn.answer is None and len(turn.items) == 1  # the call runs; the episode goes on


def test_a_hermes_call_cut_before_its_closing_tag_is_recovered() -> None:
    """A stop string or the token budget can cut `</tool_call>` off a complete call."""
    turn = HermesFormat().parse('Let me run it. <tool_call>{"name": "python", "arguments": {"code": "1"}}')
    assert [i.call.name for i in turn.items if i.call] == ["python"] and not turn.errors
    cut = HermesFormat().parse('<tool_call>{"name": "python", "argu')  # cut mid-JSON: still an error
    assert cut.items[0].call is None and "unclosed <tool_call>" in cut.errors[0]
