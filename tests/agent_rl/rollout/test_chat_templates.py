"""Conformance: one multi-turn tool episode through REAL chat templates and real BPE vocabularies,
with the tools described in the system prompt and passed natively (`tools=` JSON schemas).

Fixtures (chat_templates/, provenance in its README.md): the templates are the models' own, as
shipped in llama.cpp's models/templates (PyPI sdist llama-cpp-python 0.3.36); the tokenizers are
llama.cpp's vocab-only GGUF dumps of the real Qwen2 and Llama 3 tokenizers (same sdist), converted
with transformers' GGUF loader and checked token-for-token against the expected ids llama.cpp ships
beside them, and Mistral Nemo's Tekken vocabulary from the PyPI package mistral-common, converted
with transformers' Tekken converter and checked against tiktoken on the same ranks. The newer
models' added tokens (Qwen2.5/Qwen3 tool and think tokens, Llama 3.1's renamed reserved tokens) are
added here at their published ids.
"""

from __future__ import annotations

import functools
import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from agent_rl.rollout.chat_delta import (
    ChatDelta,
    ChatTemplateError,
    resolve_tool_schemas,
    template_renders_tools,
)
from agent_rl.rollout.collector import Collector, CollectorConfig
from agent_rl.rollout.decode import decode_turn, marker_ids
from agent_rl.tiny_model import CHAT_TEMPLATE as TINY_CHATML
from agent_rl.warmup import tokenize_conversation
from envs import CalculatorMathEnv, get_format
from envs.demos import demonstration
from envs.tools import CalculatorTool
from tests.agent_rl.rollout.helpers import ScriptedEngine, ScriptedToolEnv

DATA = Path(__file__).parent / "chat_templates"
QWEN25_ADDED = [
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
    "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
    "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]  # fmt: skip
QWEN3_ADDED = [*QWEN25_ADDED, "<tool_response>", "</tool_response>", "<think>", "</think>"]
QWEN_NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
                    "<think>", "</think>"}  # fmt: skip
"""Added tokens that Qwen's tokenizer.json marks "special": false, so decoding with
skip_special_tokens (as the collector does) keeps them: the env must see `<tool_call>`."""
LLAMA31_RENAMED = {128004: "<|finetune_right_pad_id|>", 128008: "<|eom_id|>", 128010: "<|python_tag|>"}


def _id_map_fix(tok: PreTrainedTokenizerFast, names: dict[int, str]) -> None:
    for tid, name in names.items():
        assert tok.convert_tokens_to_ids(name) == tid, (name, tid)


def qwen_tokenizer(template: str, added: list[str]) -> PreTrainedTokenizerFast:
    """The Qwen BPE with the model's added tokens at their published ids (151646 on)."""
    raw = json.loads(gzip.decompress((DATA / "qwen2-bpe.tokenizer.json.gz").read_bytes()))
    by_id = {t["id"]: t for t in raw["added_tokens"]}
    for offset, text in enumerate(added):
        entry = by_id[151646 + offset]
        raw["model"]["vocab"].pop(entry["content"], None)
        raw["model"]["vocab"][text] = entry["id"]
        entry.update(content=text, special=text not in QWEN_NOT_SPECIAL)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(raw)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    _id_map_fix(tok, {151646 + i: t for i, t in enumerate(added)})
    tok.chat_template = (DATA / template).read_text()
    return tok


def llama31_tokenizer() -> PreTrainedTokenizerFast:
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


MISTRAL_SPECIALS = {0: "<unk>", 1: "<s>", 2: "</s>", 3: "[INST]", 4: "[/INST]", 5: "[AVAILABLE_TOOLS]",
                    6: "[/AVAILABLE_TOOLS]", 7: "[TOOL_RESULTS]", 8: "[/TOOL_RESULTS]", 9: "[TOOL_CALLS]"}  # fmt: skip


def mistral_tokenizer() -> PreTrainedTokenizerFast:
    """Mistral Nemo's Tekken BPE (130,072 ranks after 1,000 control-token ids)."""
    raw = gzip.decompress((DATA / "mistral-tekken-240718.tokenizer.json.gz").read_bytes()).decode()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(raw),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    _id_map_fix(tok, MISTRAL_SPECIALS)
    tok.chat_template = (DATA / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()
    return tok


@dataclass(frozen=True)
class Case:
    factory: Any
    kwargs: dict[str, Any]
    turns: str
    """Which policy turns: "plain" or "think"."""
    tool_block: str
    """Text the template writes around natively passed tools (its own tool block)."""
    rerender_equal: bool = True
    """Whether a one-shot render of the whole conversation equals the trajectory's text: Qwen3 with
    thinking off drops the prompt's empty think block on re-render, Mistral writes the system
    message only into the LAST user turn."""


CASES: dict[str, Case] = {
    "qwen2.5": Case(
        lambda: qwen_tokenizer("Qwen-Qwen2.5-7B-Instruct.jinja", QWEN25_ADDED), {}, "plain", "<tools>"
    ),
    "qwen3-thinking": Case(
        lambda: qwen_tokenizer("Qwen-Qwen3-0.6B.jinja", QWEN3_ADDED), {}, "think", "<tools>"
    ),
    "qwen3-no-thinking": Case(
        lambda: qwen_tokenizer("Qwen-Qwen3-0.6B.jinja", QWEN3_ADDED),
        {"enable_thinking": False},
        "plain",
        "<tools>",
        rerender_equal=False,
    ),
    "llama3.1": Case(llama31_tokenizer, {}, "plain", "Given the following functions"),
    "mistral-nemo": Case(mistral_tokenizer, {}, "plain", "[AVAILABLE_TOOLS]", rerender_equal=False),
}


@functools.cache
def _tokenizer(name: str) -> PreTrainedTokenizerFast:
    """One tokenizer per case for the whole module (building a vocabulary takes seconds)."""
    return CASES[name].factory()


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
TOOL_REPLY = [{"role": "tool", "name": "calculator", "tool_call_id": "000100000", "content": "42"}]
SCHEMAS = [CalculatorTool().schema()]


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest) -> tuple[str, Any, Case]:
    return request.param, CASES[request.param].factory(), CASES[request.param]


def _runs_of_mask_one(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs, cur = [], []
    for t, m in zip(ids, mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    runs.append(cur)
    return runs


@pytest.mark.parametrize("tools", [None, SCHEMAS], ids=["system-prompt-tools", "native-tools"])
def test_episode_is_token_exact_masked_and_prefix_stable(case: Any, tools: Any) -> None:
    name, tok, c = case
    kwargs, turns = c.kwargs, TURNS[c.turns]
    delta = ChatDelta(tok, template_kwargs=kwargs, tools=tools)
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
    assert _runs_of_mask_one(ids, mask) == sampled
    # Token-exact against the template itself. The prompt is the template's own render; the env's
    # part is what the template writes after the first assistant turn in a one-shot render of the
    # same conversation (less the eos the policy sampled).
    extra = {**kwargs, "tools": tools} if tools else kwargs
    render = lambda msgs: tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **extra)  # noqa: E731
    assert prefixes[0] == tok.encode(render(OPENING), add_special_tokens=False)
    prompt = tok.decode(prefixes[0])
    assert (c.tool_block in prompt and '"calculator"' in prompt) == bool(tools), name
    one_shot = render([*OPENING, {"role": "assistant", "content": turns[0]}, *TOOL_REPLY])
    after = one_shot[one_shot.index(turns[0]) + len(turns[0]) :]
    assert after.startswith(tok.eos_token)
    reply_ids = prefixes[1][len(prefixes[0]) + len(sampled[0]) :]
    assert reply_ids == tok.encode(after[len(tok.eos_token) :], add_special_tokens=False), name
    if c.rerender_equal:
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


@dataclass
class InOrderEngine(ScriptedEngine):
    """Replies in call order (one episode at a time), whatever the template's turn markers are."""

    def _turn_of(self, prompt: Any) -> int:
        return min(len(self.prefixes) - 1, len(self.replies) - 1)


def test_every_real_template_renders_tools_and_chatml_does_not(case: Any) -> None:
    name, tok, _ = case
    assert template_renders_tools(tok, None), name
    assert not template_renders_tools(tok, TINY_CHATML)
    assert (
        resolve_tool_schemas("auto", True) == "native"
        and resolve_tool_schemas("auto", False) == "system_prompt"
    )
    assert resolve_tool_schemas("system_prompt", True) == "system_prompt"
    with pytest.raises(ChatTemplateError, match="does not render tools"):
        resolve_tool_schemas("native", False)


def test_collector_passes_the_envs_native_tools_to_the_template(case: Any) -> None:
    """The real env (calculator, hermes calls) with `tool_listing="native"`: the prompt holds the
    template's own tool block and no "Tools:" line, and the episode stays token-exact."""
    name, tok, c = case
    turns = TURNS[c.turns]
    engine = InOrderEngine(tok, turns)
    config = CollectorConfig(chat_template_kwargs=c.kwargs, max_total_tokens=2048)
    make_env = lambda: CalculatorMathEnv(difficulty=0, tool_listing="native")  # noqa: E731
    traj = Collector(engine, tok, make_env, config).collect([{"task_index": 0, "seed": 0}], 1)[0]
    assert traj.stop_reason == "terminated", (name, traj.infra_error)
    assert traj.reset_info["tools"] == SCHEMAS
    prompt = tok.decode(traj.prompt_ids)
    assert c.tool_block in prompt and '"calculator"' in prompt and "Tools:" not in prompt, name
    full = traj.prompt_ids + traj.response_ids
    assert all(full[: len(p)] == p for p in engine.prefixes)
    sampled = [[*tok.encode(t, add_special_tokens=False), tok.eos_token_id] for t in turns]
    assert _runs_of_mask_one(traj.response_ids, traj.response_mask) == sampled
    # The env's reply is the template's rendering of the real tool message (name, id, result 42):
    # what a one-shot render of the same conversation writes after the first assistant turn.
    env = make_env()
    opening, _ = env.reset(seed=0, options={"task_index": 0})
    reply, *_ = env.step(turns[0])
    assert reply == [{"role": "tool", "name": "calculator", "tool_call_id": "000100000", "content": "42"}]
    if c.turns == "plain":  # a think turn is rewritten in a re-render, so it has no verbatim anchor
        conversation = [*opening, {"role": "assistant", "content": turns[0]}, *reply]
        one_shot = tok.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True, tools=SCHEMAS, **c.kwargs
        )
        after = one_shot[one_shot.index(turns[0]) + len(turns[0]) + len(tok.eos_token) :]
        tool_ids = traj.response_ids[len(sampled[0]) : len(sampled[0]) + traj.num_tool_tokens]
        assert tool_ids == tok.encode(after, add_special_tokens=False), name


@pytest.mark.parametrize(
    ("name", "tool_format"), [("qwen2.5", "hermes"), ("llama3.1", "hermes"), ("llama3.1", "llama3_json")]
)
def test_warmup_examples_equal_rollouts_with_native_tools(name: str, tool_format: str) -> None:
    """A warm-up demonstration tokenised with the env's native tools is the very token sequence
    the collector builds when the policy writes the same turns (append-only templates), also when
    the demonstration writes Llama's own call syntax."""
    tok = _tokenizer(name)
    env = CalculatorMathEnv(difficulty=0, tool_listing="native", tool_format=tool_format)
    episode = demonstration(env, 0)
    assert episode.total_reward == 1.0
    example = tokenize_conversation(tok, episode.messages, tools=episode.infos[0]["tools"])
    turns = [m["content"] for m in episode.messages if m["role"] == "assistant"]
    engine = InOrderEngine(tok, turns)
    make_env = lambda: CalculatorMathEnv(difficulty=0, tool_listing="native", tool_format=tool_format)  # noqa: E731
    traj = Collector(engine, tok, make_env, CollectorConfig(max_total_tokens=2048)).collect(
        [{"task_index": 0, "seed": 0}], 1
    )[0]
    full, mask = traj.prompt_ids + traj.response_ids, [0] * len(traj.prompt_ids) + traj.response_mask
    # The warm-up also keeps what the template writes after the last turn's eos (Qwen's "\n"), mask 0.
    assert example.ids[: len(full)] == full and example.mask[: len(full)] == mask
    assert not any(example.mask[len(full) :]) and len(example.ids) - len(full) <= 1


def test_native_tools_with_a_template_that_ignores_them_is_an_error() -> None:
    tok = qwen_tokenizer("Qwen-Qwen2.5-7B-Instruct.jinja", QWEN25_ADDED)
    engine = InOrderEngine(tok, [CALL])
    config = CollectorConfig(chat_template=TINY_CHATML)
    collector = Collector(engine, tok, lambda: CalculatorMathEnv(difficulty=0, tool_listing="native"), config)
    with pytest.raises(ChatTemplateError, match="does not render tools"):
        collector.collect([{"task_index": 0}], 1)


def test_model_tool_schemas_config_resolves_against_the_models_template(tmp_path: Path) -> None:
    from agent_rl import build
    from agent_rl.config import ConfigError, load_config

    tiny = load_config(None, ["env.id=agent_rl/CalculatorMath-v0"])
    assert build.tool_schemas(tiny) == "system_prompt" and "tool_listing" not in build.env_kwargs(tiny)
    with pytest.raises(ConfigError, match="does not render tools"):
        build.tool_schemas(load_config(None, ["model.tool_schemas=native"]))
    qwen_tokenizer("Qwen-Qwen2.5-7B-Instruct.jinja", QWEN25_ADDED).save_pretrained(tmp_path)
    qwen = load_config(None, [f"model.path={tmp_path}", "env.id=agent_rl/CalculatorMath-v0"])
    assert build.tool_schemas(qwen) == "native" and build.env_kwargs(qwen)["tool_listing"] == "native"
    env = build.env_factory(qwen, None)()
    assert "Tools:" not in env.reset(seed=0)[0][0]["content"]
    forced = load_config(None, [f"model.path={tmp_path}", "model.tool_schemas=system_prompt"])
    assert "tool_listing" not in build.env_kwargs(forced)


# ----- the models' own call syntaxes (envs.parsing: llama3_json, mistral) -------------------------
NATIVE_SYNTAX = {"llama3.1": "llama3_json", "mistral-nemo": "mistral"}
"""Each model with the tool format it was trained on."""
PARTS = ("954", "914")


def _native_turns(tool_format: str) -> list[str]:
    """Three turns in the model's own syntax: two calls in one turn (Llama 3.2's `<|python_tag|>`
    and `;`, Mistral v3's list), the call exactly as `render_call` writes it, then the answer."""
    fmt = get_format(tool_format)
    key = "parameters" if tool_format == "llama3_json" else "arguments"
    calc = lambda e: {"name": "calculator", key: {"expression": e}}  # noqa: E731
    if tool_format == "llama3_json":
        two = "<|python_tag|>" + "; ".join(json.dumps(calc(e)) for e in PARTS)
    else:
        two = "[TOOL_CALLS]" + json.dumps([calc(e) for e in PARTS])
    return [
        two,
        fmt.render_call("calculator", {"expression": "954 * 914"}),
        "The product is \\boxed{871956}.",
    ]


def _played(tool_format: str, listing: str, turns: list[str]) -> tuple[list[Any], Any, list[list[Any]]]:
    """The same episode stepped directly: the opening messages, the reset info and each turn's reply."""
    env = CalculatorMathEnv(difficulty=0, tool_format=tool_format, tool_listing=listing)
    opening, info = env.reset(seed=0, options={"task_index": 0})
    return opening, info, [env.step(text)[0] for text in turns]


@pytest.mark.parametrize("listing", ["system_prompt", "native"])
@pytest.mark.parametrize("name", list(NATIVE_SYNTAX))
def test_episode_in_the_models_own_call_syntax_is_token_exact(name: str, listing: str) -> None:
    """Llama 3.1 and Mistral Nemo write their calls in their own syntax: the env parses them
    (`<|python_tag|>` and `[TOOL_CALLS]` are special tokens the collector must keep when it decodes),
    and the trajectory is token-exact, masked and prefix-stable through the real template."""
    tok, tool_format = _tokenizer(name), NATIVE_SYNTAX[name]
    turns = _native_turns(tool_format)
    engine = InOrderEngine(tok, turns)
    make_env = lambda: CalculatorMathEnv(difficulty=0, tool_format=tool_format, tool_listing=listing)  # noqa: E731
    traj = Collector(engine, tok, make_env, CollectorConfig(max_total_tokens=4096)).collect(
        [{"task_index": 0, "seed": 0}], 1
    )[0]
    assert traj.stop_reason == "terminated" and traj.reward == 1.0, (name, traj.stop_reason)
    calls = [[c["arguments"]["expression"] for c in t.info["tool_calls"]] for t in traj.turns]
    assert calls == [list(PARTS), ["954 * 914"], []], name
    assert all(not t.info["parse_errors"] for t in traj.turns)
    full = traj.prompt_ids + traj.response_ids
    assert all(full[: len(p)] == p for p in engine.prefixes)
    sampled = [[*tok.encode(t, add_special_tokens=False), tok.eos_token_id] for t in turns]
    assert _runs_of_mask_one(traj.response_ids, traj.response_mask) == sampled
    # The prompt is the template's; each env reply (two tool messages, then one) is what the template
    # writes after that assistant turn. (Mistral's template cannot render two assistant turns with
    # plain content around tool messages in one go, so each turn is rendered on its own.)
    opening, info, replies = _played(tool_format, listing, turns)
    assert [len(r) for r in replies] == [2, 1, 0]
    render = lambda msgs, gen: tok.apply_chat_template(  # noqa: E731
        msgs, tokenize=False, add_generation_prompt=gen, tools=info.get("tools")
    )
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    assert traj.prompt_ids == encode(render(opening, True))
    pos = 0
    for text, ids, reply in zip(turns, sampled, replies):
        pos += len(ids)
        if reply:
            one_shot = render([*opening, {"role": "assistant", "content": text}, *reply], True)
            expected = encode(one_shot[one_shot.index(text) + len(text) + len(tok.eos_token) :])
            assert traj.response_ids[pos : pos + len(expected)] == expected, name
            assert not any(traj.response_mask[pos : pos + len(expected)])
            pos += len(expected)
    assert pos == len(traj.response_ids)
    if CASES[name].rerender_equal:  # Llama 3.1: the whole trajectory is the template's render
        conversation = [*opening]
        for text, reply in zip(turns, replies):
            conversation += [{"role": "assistant", "content": text}, *reply]
        assert full == encode(render(conversation, False))


@pytest.mark.parametrize("name", list(NATIVE_SYNTAX))
def test_render_call_is_what_the_template_writes_for_a_tool_call(name: str) -> None:
    """A demonstration's call is the model's own rendering of a structured `tool_calls` message:
    Llama 3.1's character for character; Mistral Nemo's less the `"id"` its template adds (the env
    pairs results with calls by position and gives them its own ids)."""
    tok, fmt = _tokenizer(name), get_format(NATIVE_SYNTAX[name])
    arguments = {"expression": "6 * 7", "note": "π ≈ 3.14"}
    call = {"id": "000100000", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
    text = tok.apply_chat_template([*OPENING, {"role": "assistant", "tool_calls": [call]}], tokenize=False)
    opener = "[/INST]" if name == "mistral-nemo" else "<|start_header_id|>assistant<|end_header_id|>\n\n"
    written = text[text.rindex(opener) + len(opener) :].removesuffix(tok.eos_token)
    expected = fmt.render_call("calculator", arguments)
    if name == "mistral-nemo":
        expected = expected[: -len("}]")] + ', "id": "000100000"}]'
    assert written == expected
    parsed = fmt.parse(written)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calculator", arguments)] and not parsed.errors


@pytest.mark.parametrize("name", list(CASES))
def test_decoding_a_turn_keeps_only_the_tool_call_markers(name: str) -> None:
    """The collector drops special tokens (eos) from the text it hands the env, but keeps the
    special tokens that open a call: Llama's `<|python_tag|>`, Mistral's `[TOOL_CALLS]`."""
    tok = _tokenizer(name)
    markers = marker_ids(tok)
    marker = {"llama3.1": "<|python_tag|>", "mistral-nemo": "[TOOL_CALLS]"}.get(name)
    assert list(markers.values()) == ([marker] if marker else []), name
    plain = [*tok.encode("So \\boxed{42}.", add_special_tokens=False), tok.eos_token_id]
    assert (
        decode_turn(tok, plain, markers) == tok.decode(plain, skip_special_tokens=True) == "So \\boxed{42}."
    )
    if marker:
        text = f'Let me: {marker}[{{"name": "calculator"}}] é'
        ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
        assert markers[ids[ids.index(next(iter(markers)))]] == marker  # one special token
        assert decode_turn(tok, ids, markers) == text
        assert marker not in tok.decode(ids, skip_special_tokens=True)
