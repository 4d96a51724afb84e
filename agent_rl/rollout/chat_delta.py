"""Token ids for the env's new messages, computed without ever re-tokenising the history.

The problem: after the policy's turn we must append the env's reply (a tool message, the next
generation prompt) in the exact form the chat template would render it. Re-rendering and
re-tokenising the whole conversation each turn is what peers do, and it breaks in three ways:
BPE merges across the old/new boundary change earlier tokens; templates that are not
append-only (e.g. Qwen3 strips <think> blocks from past assistant turns) rewrite the history;
and the sampled ids are replaced by a re-encoding of their decoded text.

The method: render a fixed reference conversation that ends with an assistant turn, once
without and once with the new messages (plus the generation prompt). The difference is exactly
the text the template inserts after an assistant turn; only that difference is tokenised. The
reference contains no reasoning block, so templates that rewrite past reasoning render it the
same both times. The assistant turn's closing text (e.g. "<|im_end|>\n") belongs to the delta
too, minus the eos when the policy already sampled it.

Templates that are not append-only (Qwen3 renders an empty ``<think>\n\n</think>\n\n`` into the
LAST assistant turn only) render the reference differently once messages follow it, so the
"difference of two renders" is ill-defined. Mode ``anchor`` handles them: it renders the reference
plus the new messages once, finds the reference assistant's content (a unique marker) in that
render, and takes everything after it: the closing, the new messages and the generation prompt,
exactly as the template writes them after an assistant turn that is not last. Whatever the
template rewrites BEFORE the marker is never used, and the policy's sampled ids are never touched.
Modes (``model.chat_delta`` in the config): ``append`` (strict: refuses non-append-only
templates), ``anchor``, and ``auto`` (default: ``append`` when the template is prefix-stable on
the reference, else ``anchor``; for an append-only template both give the same ids).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

REFERENCE_ASSISTANT = "REFERENCE-ASSISTANT-TURN"
DEFAULT_REFERENCE: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "reference system"},
    {"role": "user", "content": "reference user"},
    {"role": "assistant", "content": REFERENCE_ASSISTANT},
)


CHAT_DELTA_MODES = ("auto", "append", "anchor")
TOOL_SCHEMA_MODES = ("auto", "native", "system_prompt")
"""`model.tool_schemas`: where the env's tool schemas go. native: `apply_chat_template(tools=...)`
(the env leaves its "Tools:" line out); system_prompt: the env's system prompt lists them; auto:
native when the chat template renders tools, else system_prompt."""
_PROBE_TOOL = "agent_rl_probe_tool"
_PROBE_MESSAGES = (
    {"role": "system", "content": "probe"},
    {"role": "user", "content": "probe"},
)


class ChatTemplateError(ValueError):
    """The chat template cannot be split into per-turn deltas; the message says why."""


def template_renders_tools(tokenizer: Any, chat_template: str | None = None) -> bool:
    """Whether the chat template writes `tools=` schemas into the prompt (Qwen2.5/Qwen3's `<tools>`
    block, Llama 3.1's JSON list, Mistral's [AVAILABLE_TOOLS]).

    Tested by rendering: a probe tool passed as `tools=` must appear in the text, so a template that
    only mentions `tools` without writing them out counts as not rendering. A template that cannot
    render the probe conversation at all is judged by its source: it renders tools when its Jinja
    refers to `tools`.
    """
    schema = {"name": _PROBE_TOOL, "description": "probe", "parameters": {"type": "object", "properties": {}}}
    try:
        text = tokenizer.apply_chat_template(
            list(_PROBE_MESSAGES),
            tools=[{"type": "function", "function": schema}],
            tokenize=False,
            add_generation_prompt=True,
            chat_template=chat_template,
        )
    except Exception:
        source = chat_template or getattr(tokenizer, "chat_template", None) or ""
        return bool(re.search(r"\btools\b", str(source)))
    return _PROBE_TOOL in text


def resolve_tool_schemas(mode: str, renders_tools: bool) -> str:
    """`model.tool_schemas` for one chat template: 'native' or 'system_prompt' (see TOOL_SCHEMA_MODES)."""
    if mode not in TOOL_SCHEMA_MODES:
        raise ValueError(f"tool_schemas must be one of {TOOL_SCHEMA_MODES}, got {mode!r}")
    if mode == "native" and not renders_tools:
        raise ChatTemplateError(
            "model.tool_schemas is 'native' but the chat template does not render tools= (it never writes "
            "the schemas into the prompt, so the model would not see its tools); set model.tool_schemas "
            "to 'system_prompt' or 'auto'"
        )
    if mode == "auto":
        return "native" if renders_tools else "system_prompt"
    return mode


@dataclass
class ToolTruncation:
    """Result of cutting the env's reply to the tool-token budget."""

    messages: list[dict[str, Any]]
    cut_tokens: int
    """Content tokens removed (0 = nothing cut)."""


class ChatDelta:
    """Renders prompts and per-turn deltas for one tokenizer and chat template."""

    def __init__(
        self,
        tokenizer: Any,
        reference: Sequence[Mapping[str, str]] = DEFAULT_REFERENCE,
        chat_template: str | None = None,
        mode: str = "auto",
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if mode not in CHAT_DELTA_MODES:
            raise ValueError(f"chat_delta mode must be one of {CHAT_DELTA_MODES}, got {mode!r}")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.mode = mode
        self.tools = [dict(t) for t in tools] if tools else None
        """JSON function schemas passed as `tools=` to every render (prompt and deltas alike)."""
        self.template_kwargs = dict(template_kwargs or {})
        """Extra template variables, e.g. {"enable_thinking": False} for Qwen3."""
        self.reference = [dict(m) for m in reference]
        if not self.reference or self.reference[-1]["role"] != "assistant":
            raise ChatTemplateError("the reference conversation must end with an assistant message")
        marker = self.reference[-1]["content"]
        self._base = self._render(self.reference, add_generation_prompt=False)
        at = self._base.rfind(marker)
        if at < 0:
            raise ChatTemplateError(
                "the chat template does not render the reference assistant message verbatim; pass a "
                "reference conversation whose last assistant content the template keeps unchanged"
            )
        self._closing = self._base[at + len(marker) :]
        eos = tokenizer.eos_token or ""
        self._closing_after_eos = (
            self._closing[len(eos) :] if eos and self._closing.startswith(eos) else self._closing
        )

    def _render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        kwargs = dict(self.template_kwargs)
        if self.tools:
            kwargs["tools"] = self.tools
        return self.tokenizer.apply_chat_template(
            list(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=self.chat_template,
            **kwargs,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The first prompt: the env's opening messages plus the generation prompt."""
        return self.encode(self._render(messages, add_generation_prompt=True))

    def delta_ids(self, new_messages: Sequence[Mapping[str, Any]], policy_ended_with_eos: bool) -> list[int]:
        """Ids to append after a policy turn: its closing, the new messages, the generation prompt."""
        if not new_messages:
            raise ValueError("the env returned no new messages; a multi-turn env must reply to each turn")
        full = self._render([*self.reference, *new_messages], add_generation_prompt=True)
        if full.startswith(self._base) and self.mode != "anchor":
            closing = self._closing_after_eos if policy_ended_with_eos else self._closing
            return self.encode(closing + full[len(self._base) :])
        if self.mode == "append":
            raise ChatTemplateError(
                "the chat template renders the reference conversation differently once new messages follow "
                "it (not append-only, e.g. Qwen3's think block); set model.chat_delta to 'anchor' or 'auto'"
            )
        return self.encode(self._after_anchor(full, policy_ended_with_eos))

    def _after_anchor(self, full: str, policy_ended_with_eos: bool) -> str:
        """The text after the reference assistant's content in `full`, less an eos already sampled."""
        marker = self.reference[-1]["content"]
        at = full.find(marker)
        if at < 0 or full.find(marker, at + 1) >= 0:
            raise ChatTemplateError(
                "the chat template does not render the reference assistant message exactly once when "
                "messages follow it, so the delta cannot be anchored; pass another reference"
            )
        tail = full[at + len(marker) :]
        eos = self.tokenizer.eos_token or ""
        if policy_ended_with_eos and eos:
            if not tail.startswith(eos):
                raise ChatTemplateError(
                    f"the template does not close an assistant turn with the eos token {eos!r}; the "
                    "policy's sampled eos would be duplicated or misplaced"
                )
            tail = tail[len(eos) :]
        return tail

    def truncate_tool_messages(
        self, messages: Sequence[Mapping[str, Any]], max_tokens: int
    ) -> ToolTruncation:
        """Cut the reply's message contents to `max_tokens` content tokens in total, with a marker.

        Content is cut (not delta ids) so the template's own structure stays intact; the marker
        tells the policy (and a human reading the trajectory) that output was dropped.
        """
        out: list[dict[str, Any]] = []
        left, cut = max_tokens, 0
        for message in messages:
            msg = dict(message)
            content = msg.get("content")
            if isinstance(content, str):
                ids = self.encode(content)
                if len(ids) > left:
                    removed = len(ids) - left
                    msg["content"] = self.tokenizer.decode(ids[:left]) + f"\n[... {removed} tokens truncated]"
                    cut += removed
                    left = 0
                else:
                    left -= len(ids)
            out.append(msg)
        return ToolTruncation(messages=out, cut_tokens=cut)
