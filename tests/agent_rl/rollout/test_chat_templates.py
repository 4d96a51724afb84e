"""Conformance: one multi-turn tool episode through REAL chat templates and real BPE vocabularies.

Fixtures (chat_templates/, provenance in its README.md): the templates are the models' own, as
shipped in llama.cpp's models/templates (PyPI sdist llama-cpp-python 0.3.36); the tokenizers are
llama.cpp's vocab-only GGUF dumps of the real Qwen2 and Llama 3 tokenizers (same sdist), converted
with transformers' GGUF loader and checked token-for-token against the expected ids llama.cpp ships
beside them. The newer models' added tokens (Qwen2.5/Qwen3 tool and think tokens, Llama 3.1's
renamed reserved tokens) are added here at their published ids.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from agent_rl.rollout.chat_delta import ChatDelta, ChatTemplateError
from agent_rl.rollout.collector import Collector, CollectorConfig
from tests.agent_rl.rollout.helpers import ScriptedEngine, ScriptedToolEnv

DATA = Path(__file__).parent / "chat_templates"
QWEN25_ADDED = [
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
    "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
    "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]  # fmt: skip
QWEN3_ADDED = [*QWEN25_ADDED, "<tool_response>", "</tool_response>", "<think>", "</think>"]
LLAMA31_RENAMED = {128004: "<|finetune_right_pad_id|>", 128008: "<|eom_id|>", 128010: "<|python_tag|>"}


def _id_map_fix(tok: PreTrainedTokenizerFast, names: dict[int, str]) -> None:
    for tid, name in names.items():
        assert tok.convert_tokens_to_ids(name) == tid, (name, tid)


def qwen_tokenizer(template: str, added: list[str]) -> PreTrainedTokenizerFast:
    """The Qwen BPE with the model's added tokens at their published ids (151646 on)."""
    import json

    raw = json.loads(gzip.decompress((DATA / "qwen2-bpe.tokenizer.json.gz").read_bytes()))
    by_id = {t["id"]: t for t in raw["added_tokens"]}
    for offset, text in enumerate(added):
        entry = by_id[151646 + offset]
        raw["model"]["vocab"].pop(entry["content"], None)
        raw["model"]["vocab"][text] = entry["id"]
        entry.update(content=text, special=True)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(raw)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    _id_map_fix(tok, {151646 + i: t for i, t in enumerate(added)})
    tok.chat_template = (DATA / template).read_text()
    return tok


def llama31_tokenizer() -> PreTrainedTokenizerFast:
    import json

    raw = json.loads(gzip.decompress((DATA / "llama3-bpe.tokenizer.json.gz").read_bytes()))
    by_id = {t["id"]: t for t in raw["added_tokens"]}
    for tid, name in LLAMA31_RENAMED.items():
        raw["model"]["vocab"].pop(by_id[tid]["content"], None)
        raw["model"]["vocab"][name] = tid
        by_id[tid]["content"] = name
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(raw)),
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
    )
    _id_map_fix(tok, {**LLAMA31_RENAMED, 128009: "<|eot_id|>", 128006: "<|start_header_id|>"})
    tok.chat_template = (DATA / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()
    return tok


CASES: dict[str, tuple[Any, dict[str, Any], str]] = {
    # name: (tokenizer factory, template kwargs, first policy turn)
    "qwen2.5": (lambda: qwen_tokenizer("Qwen-Qwen2.5-7B-Instruct.jinja", QWEN25_ADDED), {}, "plain"),
    "qwen3-thinking": (lambda: qwen_tokenizer("Qwen-Qwen3-0.6B.jinja", QWEN3_ADDED), {}, "think"),
    "qwen3-no-thinking": (
        lambda: qwen_tokenizer("Qwen-Qwen3-0.6B.jinja", QWEN3_ADDED),
        {"enable_thinking": False},
        "plain",
    ),
    "llama3.1": (llama31_tokenizer, {}, "plain"),
}
OPENING = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is 6 * 7? Use the calculator."},
]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
TURNS = {
    "plain": [CALL, "The product is \\boxed{42}."],
    "think": [
        f"<think>\nI should call the tool.\n</think>\n\n{CALL}",
        "<think>\n42\n</think>\n\n\\boxed{42}",
    ],
}
TOOL_REPLY = [{"role": "tool", "name": "calculator", "content": "42"}]


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest) -> tuple[str, Any, dict[str, Any], list[str]]:
    factory, kwargs, turns = CASES[request.param]
    return request.param, factory(), kwargs, TURNS[turns]


def test_episode_is_token_exact_masked_and_prefix_stable(case: Any) -> None:
    name, tok, kwargs, turns = case
    delta = ChatDelta(tok, template_kwargs=kwargs)
    ids = delta.prompt_ids(OPENING)
    mask = [0] * len(ids)
    prefixes = [list(ids)]
    sampled = []
    for n, text in enumerate(turns):
        turn = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
        sampled.append(turn)
        ids += turn
        mask += [1] * len(turn)
        if n + 1 < len(turns):
            reply = delta.delta_ids(TOOL_REPLY, policy_ended_with_eos=True)
            ids += reply
            mask += [0] * len(reply)
            prefixes.append(list(ids))
    # Prefix stability: every prompt the engine saw is a prefix of the final sequence.
    assert all(ids[: len(p)] == p for p in prefixes)
    # Sampled ids are kept verbatim, and they are exactly the mask-1 tokens.
    runs, cur = [], []
    for t, m in zip(ids, mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    runs.append(cur)
    assert runs == sampled
    # Token-exact against the template itself. The prompt is the template's own render; the env's
    # part is what the template writes after the first assistant turn in a one-shot render of the
    # same conversation (less the eos the policy sampled).
    render = lambda msgs: tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)  # noqa: E731
    assert prefixes[0] == tok.encode(render(OPENING), add_special_tokens=False)
    one_shot = render([*OPENING, {"role": "assistant", "content": turns[0]}, *TOOL_REPLY])
    after = one_shot[one_shot.index(turns[0]) + len(turns[0]) :]
    assert after.startswith(tok.eos_token)
    reply_ids = prefixes[1][len(prefixes[0]) + len(sampled[0]) :]
    assert reply_ids == tok.encode(after[len(tok.eos_token) :], add_special_tokens=False), name
    if not kwargs:  # with thinking off, Qwen3's prompt holds an empty think block that re-renders drop
        assert prefixes[1] == tok.encode(one_shot, add_special_tokens=False), name


def test_qwen3_is_not_append_only_and_strict_mode_says_so() -> None:
    """The bug of issue 16: Qwen3 adds an empty think block to the LAST assistant turn only."""
    tok = qwen_tokenizer("Qwen-Qwen3-0.6B.jinja", QWEN3_ADDED)
    with pytest.raises(ChatTemplateError, match="not append-only"):
        ChatDelta(tok, mode="append").delta_ids(TOOL_REPLY, True)
    anchored = ChatDelta(tok, mode="anchor").delta_ids(TOOL_REPLY, True)
    assert ChatDelta(tok).delta_ids(TOOL_REPLY, True) == anchored
    text = tok.decode(anchored, skip_special_tokens=False)
    assert (
        text == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_anchor_equals_append_on_an_append_only_template() -> None:
    tok = qwen_tokenizer("Qwen-Qwen2.5-7B-Instruct.jinja", QWEN25_ADDED)
    for eos in (True, False):
        assert ChatDelta(tok, mode="anchor").delta_ids(TOOL_REPLY, eos) == ChatDelta(
            tok, mode="append"
        ).delta_ids(TOOL_REPLY, eos)


def test_collector_runs_a_qwen3_episode_with_its_own_template() -> None:
    tok = qwen_tokenizer("Qwen-Qwen3-0.6B.jinja", QWEN3_ADDED)
    engine = ScriptedEngine(tok, TURNS["think"])
    traj = Collector(engine, tok, lambda: ScriptedToolEnv(episode_turns=2), CollectorConfig()).collect(
        [1], 1
    )[0]
    assert traj.stop_reason == "terminated"
    full = traj.prompt_ids + traj.response_ids
    assert all(full[: len(p)] == p for p in engine.prefixes)
    assert "<think>\nI should call the tool.\n</think>" in tok.decode(traj.response_ids)
