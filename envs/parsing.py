"""Tool-call formats: how calls are written by the agent and how results are written back.

Two formats, both common in tool-integrated reasoning:

- `code` (ToRL / SimpleTIR style): the agent writes fenced ```python blocks; each block runs in the
  Python tool and its result comes back as a fenced ```output block. We return that block as a
  separate chat message (role `tool` by default, configurable) instead of splicing it into the
  assistant's text, so every turn is a clean message and the chat template stays append-only.
- `hermes` (Hermes / Qwen2.5 function calling): `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`; each call's result comes back as one `tool` message holding the plain output.

Parsing never raises: a malformed call becomes an error item whose text tells the agent how to
write it correctly, and the environment shows that text as the call's result.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from envs.answers import extract_final_answer
from envs.tools.base import ToolCall


@dataclass
class ParsedItem:
    """One attempted call, in order: either a well-formed call or the error explaining why not."""

    call: ToolCall | None = None
    error: str | None = None


@dataclass
class ParsedTurn:
    """Everything the environment needs from one assistant turn."""

    items: list[ParsedItem] = field(default_factory=list)
    answer: str | None = None
    """Final answer from the prose (outside calls), or None."""

    @property
    def calls(self) -> list[ToolCall]:
        return [i.call for i in self.items if i.call is not None]

    @property
    def errors(self) -> list[str]:
        return [i.error for i in self.items if i.error is not None]


class ToolFormat:
    """Base class: parse an assistant turn, render a result, render a call (for demonstrations)."""

    name: str = ""
    native_tools: bool = False
    """Whether calls are JSON function calls by tool name, the kind a chat template's own tool block
    (`apply_chat_template(tools=...)`) describes. Only such a format can hand its tool list to the
    template (`ToolEnv(tool_listing="native")`); the ```python format has no list to hand over."""

    def parse(self, text: str) -> ParsedTurn:
        raise NotImplementedError

    def render_result(self, text: str) -> str:
        """The content of the message that carries one call's result."""
        raise NotImplementedError

    def render_call(self, tool: str, arguments: dict) -> str:
        """The assistant text that makes this call (used by scripted demonstrations)."""
        raise NotImplementedError

    def instructions(self, tool_schemas: list[dict]) -> str:
        """One short system-prompt paragraph telling the agent how to call tools. `tool_schemas` is
        empty when the chat template lists the tools itself (native tool schemas)."""
        raise NotImplementedError


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n?(.*?)```", re.DOTALL)
_CODE_LANGS = {"python", "py", "python3"}


class CodeBlockFormat(ToolFormat):
    """```python blocks in, ```output blocks out; every block goes to the `python` tool."""

    name = "code"

    def __init__(self, tool_name: str = "python") -> None:
        self.tool_name = tool_name

    def parse(self, text: str) -> ParsedTurn:
        items: list[ParsedItem] = []
        prose_parts: list[str] = []
        pos = 0
        for match in _FENCE.finditer(text):
            prose_parts.append(text[pos : match.start()])
            pos = match.end()
            if match.group(1).lower() in _CODE_LANGS:
                code = match.group(2)
                if code.strip():
                    items.append(
                        ParsedItem(call=ToolCall(self.tool_name, {"code": code}, raw=match.group(0)))
                    )
                else:
                    items.append(ParsedItem(error="Error: the ```python block is empty."))
        rest = text[pos:]
        unclosed = re.search(r"```[ \t]*(python3?|py)\b", rest, re.IGNORECASE)
        if unclosed:
            prose_parts.append(rest[: unclosed.start()])
            items.append(
                ParsedItem(error="Error: unclosed ```python block; end the code with ``` on its own line.")
            )
        else:
            prose_parts.append(rest)
        return ParsedTurn(items=items, answer=extract_final_answer("".join(prose_parts)))

    def render_result(self, text: str) -> str:
        return f"```output\n{text}\n```"

    def render_call(self, tool: str, arguments: dict) -> str:
        return f"```python\n{arguments['code'].rstrip()}\n```"

    def instructions(self, tool_schemas: list[dict]) -> str:
        return "Run Python in ```python blocks; you will see the ```output."


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HERMES_HINT = 'write <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>'


class HermesFormat(ToolFormat):
    """`<tool_call>{json}</tool_call>` in, one `tool` message per call out."""

    name = "hermes"
    native_tools = True

    def parse(self, text: str) -> ParsedTurn:
        items: list[ParsedItem] = []
        prose_parts: list[str] = []
        pos = 0
        for match in _TOOL_CALL.finditer(text):
            prose_parts.append(text[pos : match.start()])
            pos = match.end()
            items.append(self._parse_one(match.group(1), match.group(0)))
        rest = text[pos:]
        if "<tool_call>" in rest:
            at = rest.index("<tool_call>")
            prose_parts.append(rest[:at])
            # The output ended inside the call (a stop string cut `</tool_call>` off, or the turn's
            # token budget): a complete JSON call is recovered, as vLLM's hermes parser does.
            last = self._parse_one(rest[at + len("<tool_call>") :], rest[at:])
            items.append(
                last if last.call else ParsedItem(error=f"Error: unclosed <tool_call>; {_HERMES_HINT}.")
            )
        else:
            prose_parts.append(rest)
        return ParsedTurn(items=items, answer=extract_final_answer("".join(prose_parts)))

    @staticmethod
    def _parse_one(body: str, raw: str) -> ParsedItem:
        try:
            payload = json.loads(body.strip())
        except (ValueError, RecursionError) as exc:
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
            return ParsedItem(error=f"Error: the tool call is not valid JSON ({reason}); {_HERMES_HINT}.")
        if not isinstance(payload, dict):
            return ParsedItem(error=f"Error: the tool call must be a JSON object; {_HERMES_HINT}.")
        name = payload.get("name")
        if not isinstance(name, str) or not name:
            return ParsedItem(error=f'Error: the tool call needs a string "name"; {_HERMES_HINT}.')
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):
            # Some models emit arguments as a JSON-encoded string (OpenAI style); accept both.
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                return ParsedItem(error=f'Error: "arguments" is a string that is not JSON; {_HERMES_HINT}.')
        if not isinstance(arguments, dict):
            return ParsedItem(error=f'Error: "arguments" must be a JSON object; {_HERMES_HINT}.')
        return ParsedItem(call=ToolCall(name=name, arguments=arguments, raw=raw))

    def render_result(self, text: str) -> str:
        return text

    def render_call(self, tool: str, arguments: dict) -> str:
        return f"<tool_call>{json.dumps({'name': tool, 'arguments': arguments})}</tool_call>"

    def instructions(self, tool_schemas: list[dict]) -> str:
        call = 'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
        if not tool_schemas:  # the chat template renders the tool list (native tool schemas)
            return call
        tools = "\n".join(json.dumps(s["function"], separators=(",", ":")) for s in tool_schemas)
        return f"Tools:\n{tools}\n{call}"


FORMATS: dict[str, type[ToolFormat]] = {"code": CodeBlockFormat, "hermes": HermesFormat}


def get_format(name: str | ToolFormat) -> ToolFormat:
    """A format instance by name; unknown names list the valid ones."""
    if isinstance(name, ToolFormat):
        return name
    if name not in FORMATS:
        raise ValueError(f"unknown tool_format {name!r}; choose one of: {', '.join(sorted(FORMATS))}")
    return FORMATS[name]()
