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
from agent_rl.tiny_model import CHAT_TEMPLATE as TINY_CHATML
from agent_rl.warmup import tokenize_conversation
from envs import CalculatorMathEnv
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


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.1"])
def test_warmup_examples_equal_rollouts_with_native_tools(name: str) -> None:
    """A warm-up demonstration tokenised with the env's native tools is the very token sequence
    the collector builds when the policy writes the same turns (append-only templates)."""
    tok = CASES[name].factory()
    env = CalculatorMathEnv(difficulty=0, tool_listing="native")
    episode = demonstration(env, 0)
    assert episode.total_reward == 1.0
    example = tokenize_conversation(tok, episode.messages, tools=episode.infos[0]["tools"])
    turns = [m["content"] for m in episode.messages if m["role"] == "assistant"]
    engine = InOrderEngine(tok, turns)
    make_env = lambda: CalculatorMathEnv(difficulty=0, tool_listing="native")  # noqa: E731
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
