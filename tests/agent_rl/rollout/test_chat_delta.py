"""Chat-template deltas: exact for append-only templates, stable for templates that rewrite history."""

from __future__ import annotations

from typing import Any

import pytest

from agent_rl.rollout.chat_delta import ChatDelta, ChatTemplateError

# ChatML that, like Qwen3, drops <think>...</think> from assistant turns that are not the last
# message: re-rendering a conversation therefore changes tokens of earlier turns.
STRIP_THINK_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "compute 2 + 3"},
]
TOOL = [{"role": "tool", "content": "5"}]


def test_append_only_template_delta_equals_full_render(tokenizer: Any) -> None:
    delta = ChatDelta(tokenizer)
    assistant = "print(2 + 3)"
    ids = delta.prompt_ids(CONVERSATION)
    ids += [*tokenizer.encode(assistant, add_special_tokens=False), tokenizer.eos_token_id]
    ids += delta.delta_ids(TOOL, policy_ended_with_eos=True)
    full = [*CONVERSATION, {"role": "assistant", "content": assistant}, *TOOL]
    rendered = tokenizer.apply_chat_template(full, tokenize=False, add_generation_prompt=True)
    assert ids == tokenizer.encode(rendered, add_special_tokens=False)


def test_delta_after_eos_starts_with_the_templates_closing_newline(tokenizer: Any) -> None:
    delta = ChatDelta(tokenizer).delta_ids(TOOL, policy_ended_with_eos=True)
    assert tokenizer.decode(delta, skip_special_tokens=False).startswith("\n<|im_start|>tool\n5<|im_end|>")
    assert delta[0] != tokenizer.eos_token_id


def test_delta_without_eos_closes_the_assistant_turn(tokenizer: Any) -> None:
    delta = ChatDelta(tokenizer).delta_ids(TOOL, policy_ended_with_eos=False)
    assert delta[0] == tokenizer.eos_token_id
    assert tokenizer.decode(delta, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_non_append_only_template_gives_a_stable_delta(tokenizer: Any) -> None:
    stripping = ChatDelta(tokenizer, chat_template=STRIP_THINK_TEMPLATE)
    plain = ChatDelta(tokenizer)
    # The delta is the template's reply text only, whatever the policy wrote before it.
    assert stripping.delta_ids(TOOL, True) == plain.delta_ids(TOOL, True)
    # ...while re-rendering the conversation would rewrite the policy's earlier tokens.
    assistant = {"role": "assistant", "content": "<think>2+3 is 5</think>answer 5"}

    def render(messages: list[dict[str, str]]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, chat_template=STRIP_THINK_TEMPLATE)

    assert not render([*CONVERSATION, assistant, *TOOL]).startswith(render([*CONVERSATION, assistant]))


def test_template_that_rewrites_the_reference_is_refused_in_append_mode(tokenizer: Any) -> None:
    counting = "{{ messages|length }}" + tokenizer.chat_template
    strict = ChatDelta(tokenizer, chat_template=counting, mode="append")
    with pytest.raises(ChatTemplateError, match="renders the reference conversation differently"):
        strict.delta_ids(TOOL, True)
    # 'auto' (the default) anchors on the reference assistant's content: what follows it is the same.
    assert ChatDelta(tokenizer, chat_template=counting).delta_ids(TOOL, True) == ChatDelta(
        tokenizer
    ).delta_ids(TOOL, True)


def test_anchor_mode_refuses_a_template_that_drops_the_marker(tokenizer: Any) -> None:
    dropping = tokenizer.chat_template.replace("message['content']", "message['content'][:3]")
    with pytest.raises(ChatTemplateError):
        ChatDelta(tokenizer, chat_template=dropping, mode="anchor")


def test_unknown_mode_is_refused(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="chat_delta mode"):
        ChatDelta(tokenizer, mode="rerender")


def test_reference_must_end_with_an_assistant_turn(tokenizer: Any) -> None:
    with pytest.raises(ChatTemplateError, match="end with an assistant"):
        ChatDelta(tokenizer, reference=CONVERSATION)


def test_tool_truncation_cuts_content_and_says_so(tokenizer: Any) -> None:
    delta = ChatDelta(tokenizer)
    long = "1234567890 " * 40
    result = delta.truncate_tool_messages([{"role": "tool", "content": long}], max_tokens=10)
    assert result.cut_tokens == len(tokenizer.encode(long, add_special_tokens=False)) - 10
    assert result.messages[0]["content"].endswith(f"[... {result.cut_tokens} tokens truncated]")
    short = delta.truncate_tool_messages([{"role": "tool", "content": "42"}], max_tokens=10)
    assert short.cut_tokens == 0
    assert short.messages[0]["content"] == "42"
