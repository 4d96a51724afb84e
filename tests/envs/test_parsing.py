from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from envs.answers import extract_final_answer, find_boxed
from envs.parsing import FORMATS, CodeBlockFormat, HermesFormat, Llama3JsonFormat, MistralFormat, get_format


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
    assert set(FORMATS) == {"code", "hermes", "llama3_json", "mistral", "mistral_v11"}
    for name in FORMATS:
        fmt = get_format(name)
        text = fmt.render_call("python", {"code": "print(6 * 7)"})
        turn = fmt.parse(text)
        assert turn.calls[0].arguments["code"].strip() == "print(6 * 7)" and not turn.errors, name
        assert turn.calls[0].name == "python" and turn.answer is None, name


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
        "<|python_tag|>",
        "[TOOL_CALLS]",
        "[ARGS]",
        '"parameters"',
        ";",
        "]",
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
    for fmt in (get_format(name) for name in FORMATS):
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


def _calls(turn) -> list[tuple[str, dict]]:
    return [(c.name, c.arguments) for c in turn.calls]


def test_llama3_json_single_and_multiple_calls() -> None:
    fmt = Llama3JsonFormat()
    one = fmt.parse('{"name": "calculator", "parameters": {"expression": "6 * 7"}}')
    assert _calls(one) == [("calculator", {"expression": "6 * 7"})] and one.answer is None
    # Llama 3.2: <|python_tag|>, "arguments" for "parameters", several calls separated by ";"
    many = fmt.parse('<|python_tag|>{"name": "a", "arguments": {"x": 1}}; {"name": "b", "parameters": {}}')
    assert _calls(many) == [("a", {"x": 1}), ("b", {})] and not many.errors
    # string-encoded arguments (OpenAI style) are accepted, as in the hermes format
    assert _calls(fmt.parse('{"name": "a", "parameters": "{\\"x\\": 2}"}')) == [("a", {"x": 2})]


def test_llama3_json_prose_and_answers() -> None:
    fmt = Llama3JsonFormat()
    assert fmt.parse("So the product is \\boxed{42}.").answer == "42"
    assert fmt.parse("So the product is \\boxed{42}.").items == []
    # a call after a sentence of prose is still a call; JSON that is not a call is prose
    mixed = fmt.parse('Let me compute. {"name": "calculator", "parameters": {"expression": "1+1"}} ok')
    assert _calls(mixed) == [("calculator", {"expression": "1+1"})]
    assert fmt.parse('The set {x | x > 0} and {"a": 1} give \\boxed{1}').items == []
    final = fmt.parse('{"name": "calculator", "parameters": {"expression": "2"}} so \\boxed{2}')
    assert final.answer == "2" and len(final.calls) == 1  # the env ends the episode, skipping the call


def test_llama3_json_malformed_calls_explain_the_fix() -> None:
    fmt = Llama3JsonFormat()
    cases = {
        '{"name": "calculator", "parameters": {"expression": "6 *': "cut off",  # truncated
        '{"name": "calculator", "parameters": {"expression": "6"}': "cut off",  # unclosed
        "{'name': 'calculator'}": "not valid JSON",
        '{"name": "calculator", "parameters": {oops}}': "not valid JSON",
        '{"nam": "calculator"}': '"name"',
        '{"name": 7, "parameters": {}}': '"name"',
        '{"name": "calculator", "parameters": [1]}': '"parameters" must be a JSON object',
        '{"name": "calculator", "parameters": "{no"}': "not JSON",
        "<|python_tag|>print(6 * 7)": "<|python_tag|>",
        '{"name": ' + "[" * 100_000: "nested too deeply",
    }
    for text, reason in cases.items():
        turn = fmt.parse(text)
        assert turn.calls == [] and len(turn.errors) == 1, text[:50]
        assert reason in turn.errors[0] and '"parameters"' in turn.errors[0], (text[:50], turn.errors)
    # a broken second call does not lose the first
    both = fmt.parse('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {')
    assert _calls(both) == [("a", {})] and "cut off" in both.errors[0]


def test_mistral_v3_and_v11_calls() -> None:
    fmt = MistralFormat()
    v3 = fmt.parse(
        '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "6"}, "id": "a1b2c3d4e"}]'
    )
    assert _calls(v3) == [("calculator", {"expression": "6"})] and v3.answer is None
    two = fmt.parse('[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"y": 2}}]')
    assert _calls(two) == [("a", {}), ("b", {"y": 2})]
    v11 = fmt.parse('[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[CALL_ID]abc123def[ARGS]{"y": [2]}')
    assert _calls(v11) == [("a", {"x": 1}), ("b", {"y": [2]})] and not v11.errors
    # a decoder that drops [ARGS] leaves name{...}
    assert _calls(fmt.parse('[TOOL_CALLS]calculator{"expression": "1"}')) == [
        ("calculator", {"expression": "1"})
    ]


def test_mistral_prose_and_answers() -> None:
    fmt = MistralFormat()
    before = fmt.parse('I will compute it.[TOOL_CALLS][{"name": "c", "arguments": {}}]')
    assert _calls(before) == [("c", {})] and before.answer is None
    assert fmt.parse("The answer is \\boxed{7}.").answer == "7"
    assert fmt.parse("The answer is \\boxed{7}.").items == []
    assert fmt.parse('[{"name": "c", "arguments": {}}] is a list').items == []  # no [TOOL_CALLS]: prose
    after = fmt.parse('[TOOL_CALLS]c[ARGS]{"e": 1} so \\boxed{3}')
    assert after.answer == "3" and len(after.calls) == 1


def test_mistral_malformed_calls_explain_the_fix() -> None:
    fmt = MistralFormat()
    cases = {
        '[TOOL_CALLS][{"name": "c", "arguments": {"e": "1': "cut off",
        '[TOOL_CALLS][{"name": "c", "arguments": {"e": "1"}}': "cut off",
        "[TOOL_CALLS][{name: c}]": "not valid JSON",
        "[TOOL_CALLS][]": "empty",
        "[TOOL_CALLS][1]": "JSON object",
        '[TOOL_CALLS][{"arguments": {}}]': '"name"',
        '[TOOL_CALLS][{"name": "c", "arguments": 3}]': '"arguments" must be a JSON object',
        "[TOOL_CALLS]": "must be followed",
        "[TOOL_CALLS]calculator": "must be followed",
        "[TOOL_CALLS]c[ARGS][1]": "must be followed",
        '[TOOL_CALLS]c[ARGS]{"e": ': "cut off",
    }
    for text, reason in cases.items():
        turn = fmt.parse(text)
        assert turn.calls == [] and len(turn.errors) == 1, text
        assert reason in turn.errors[0] and "[TOOL_CALLS]" in turn.errors[0], (text, turn.errors)
    v11 = get_format("mistral_v11").parse("[TOOL_CALLS]")
    assert "[TOOL_CALLS]<tool>[ARGS]{...}" in v11.errors[0]  # the error shows the style's own syntax


def test_mistral_render_call_styles() -> None:
    args = {"expression": "6 * 7", "note": "π"}
    assert get_format("mistral").render_call("c", args) == (
        '[TOOL_CALLS][{"name": "c", "arguments": {"expression": "6 * 7", "note": "π"}}]'
    )
    assert (
        get_format("mistral_v11").render_call("c", args)
        == '[TOOL_CALLS]c[ARGS]{"expression": "6 * 7", "note": "π"}'
    )
    assert (
        Llama3JsonFormat().render_call("c", args)
        == '{"name": "c", "parameters": {"expression": "6 * 7", "note": "π"}}'
    )


def test_json_formats_instructions_and_flags() -> None:
    schema = [{"type": "function", "function": {"name": "c", "description": "d", "parameters": {}}}]
    for name in ("hermes", "llama3_json", "mistral", "mistral_v11"):
        fmt = get_format(name)
        assert fmt.native_tools and fmt.malformed_example
        assert fmt.parse(fmt.malformed_example).errors, name
        short, listed = fmt.instructions([]), fmt.instructions(schema)
        assert "Tools:" not in short and listed.startswith('Tools:\n{"name":"c"') and listed.endswith(short)
    assert '"parameters"' in get_format("llama3_json").instructions([])
    assert "[TOOL_CALLS]" in get_format("mistral").instructions([])
    assert "[ARGS]" in get_format("mistral_v11").instructions([])


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
    )
)
def test_llama_and_mistral_any_json_payload_is_call_or_error(payload: object) -> None:
    body = json.dumps(payload)
    for turn in (Llama3JsonFormat().parse(body), MistralFormat().parse(f"[TOOL_CALLS][{body}]")):
        for item in turn.items:
            assert (item.call is None) != (item.error is None)
    llama = Llama3JsonFormat().parse(body)
    if isinstance(payload, dict):  # an object at the start of the turn is always an attempted call
        assert len(llama.items) == 1
        key = next((k for k in ("parameters", "arguments") if k in payload), None)
        ok = isinstance(payload.get("name"), str) and payload["name"] != ""
        ok = ok and (key is None or isinstance(payload[key], dict))
        assert bool(llama.calls) == ok or (key and isinstance(payload[key], str)), payload
