"""Tool-call formats: how calls are written by the agent and how results are written back.

Two formats, both common in tool-integrated reasoning:

- `code` (ToRL / SimpleTIR style): the agent writes fenced ```python blocks; each block runs in the
  Python tool and its result comes back as a fenced ```output block. We return that block as a
  separate chat message (role `tool` by default, configurable) instead of splicing it into the
  assistant's text, so every turn is a clean message and the chat template stays append-only.
- `hermes` (Hermes / Qwen2.5 function calling): `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`; each call's result comes back as one `tool` message holding the plain output.
- `llama3_json` (Llama 3.1/3.2): the turn is `{"name": ..., "parameters": {...}}`, maybe after
  `<|python_tag|>`, several separated by `;`.
- `mistral` / `mistral_v11` (Mistral): `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` (v3) or
  `[TOOL_CALLS]name[ARGS]{...}` (v11+); both parse either syntax and differ only in what they write.

The JSON formats return each call's result as one `tool` message holding the plain output.

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
    malformed_example: str = ""
    """A turn that attempts a call and gets it wrong, for `envs.check_env`'s malformed-call check."""

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
    malformed_example = "```python\nprint(1)"

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


def call_from_payload(
    payload: object, raw: str, hint: str, argument_keys: tuple[str, ...] = ("arguments",)
) -> ParsedItem:
    """A decoded JSON call object as a call, or the error that says what is wrong with it. Shared by
    every JSON format so that the same mistake gets the same explanation; `hint` shows the format's
    own syntax and `argument_keys` are the names it accepts for the arguments, first one preferred."""
    key = argument_keys[0]
    if not isinstance(payload, dict):
        return ParsedItem(error=f"Error: the tool call must be a JSON object; {hint}.")
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return ParsedItem(error=f'Error: the tool call needs a string "name"; {hint}.')
    present = [k for k in argument_keys if k in payload]
    arguments = payload[present[0]] if present else {}
    if isinstance(arguments, str):
        # Some models emit arguments as a JSON-encoded string (OpenAI style); accept both.
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return ParsedItem(error=f'Error: "{key}" is a string that is not JSON; {hint}.')
    if not isinstance(arguments, dict):
        return ParsedItem(error=f'Error: "{key}" must be a JSON object; {hint}.')
    return ParsedItem(call=ToolCall(name=name, arguments=arguments, raw=raw))


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HERMES_HINT = 'write <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>'


class HermesFormat(ToolFormat):
    """`<tool_call>{json}</tool_call>` in, one `tool` message per call out."""

    name = "hermes"
    native_tools = True
    malformed_example = "<tool_call>{not json</tool_call>"

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
        return call_from_payload(payload, raw, _HERMES_HINT)

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


def _decode_json(text: str, start: int) -> tuple[object, int] | str:
    """The JSON value that starts at `start` and where it ends, or why there is none, worded to follow
    "is"/"are". A value cut off by the end of the text (a stop string, the token budget) is named as
    such, since the fix (finish the call) differs from fixing a typo."""
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except RecursionError:
        return "nested too deeply"
    except json.JSONDecodeError as exc:
        if exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated string"):
            return "cut off before its JSON is complete"
        return f"not valid JSON ({exc.msg})"


PYTHON_TAG = "<|python_tag|>"
_LLAMA_HINT = 'reply with only {"name": "<tool>", "parameters": {...}} (several calls: separate them with ;)'
_LLAMA_NEXT = re.compile(r'<\|python_tag\|>|\{\s*"name"\s*:')
_JSON_OBJECT_START = re.compile(r'\s*\{\s*["\'}]')


class Llama3JsonFormat(ToolFormat):
    """Llama 3.1/3.2 JSON tool calls: `{"name": ..., "parameters": {...}}`, one `tool` message per call.

    What the model writes, per its chat template and vLLM's `llama3_json` parser: the whole turn is
    the call object (`"arguments"` is accepted for `"parameters"`), optionally after the
    `<|python_tag|>` token (Llama 3.2 often writes it), several objects separated by `;`. Models
    also put a call after a sentence of prose, so a call is found (a) at the start of the turn,
    after `<|python_tag|>` or after a `;` that follows a call, where any JSON object is read as an
    attempted call, and (b) anywhere a `{"name":` object starts. Everything else is prose, where
    the final answer is looked for.
    """

    name = "llama3_json"
    native_tools = True
    malformed_example = '{"name": "calculator", "parameters": {"expression": '

    def parse(self, text: str) -> ParsedTurn:
        items: list[ParsedItem] = []
        prose: list[str] = []
        pos = 0
        expect_call = _JSON_OBJECT_START.match(text) is not None
        while pos < len(text):
            if expect_call:
                start = text.index("{", pos)
            else:
                match = _LLAMA_NEXT.search(text, pos)
                if match is None:
                    break
                if match.group(0) == PYTHON_TAG:
                    prose.append(text[pos : match.start()])
                    pos, expect_call = match.end(), True
                    if _JSON_OBJECT_START.match(text, pos) is None:  # code or prose after the tag
                        items.append(
                            ParsedItem(error=f"Error: <|python_tag|> must open a JSON call; {_LLAMA_HINT}.")
                        )
                        return ParsedTurn(items=items, answer=extract_final_answer("".join(prose)))
                    continue
                start = match.start()
            prose.append(text[pos:start])
            decoded = _decode_json(text, start)
            if isinstance(decoded, str):  # the rest of the turn is the broken call
                items.append(ParsedItem(error=f"Error: the tool call is {decoded}; {_LLAMA_HINT}."))
                return ParsedTurn(items=items, answer=extract_final_answer("".join(prose)))
            payload, pos = decoded
            items.append(
                call_from_payload(payload, text[start:pos], _LLAMA_HINT, ("parameters", "arguments"))
            )
            separator = re.match(r"\s*;", text[pos:])
            expect_call = (
                separator is not None and _JSON_OBJECT_START.match(text, pos + separator.end()) is not None
            )
            if expect_call:
                pos += separator.end()
        prose.append(text[pos:])
        return ParsedTurn(items=items, answer=extract_final_answer("".join(prose)))

    def render_result(self, text: str) -> str:
        return text

    def render_call(self, tool: str, arguments: dict) -> str:
        """Character for character what Llama 3.1's template writes for an assistant `tool_calls`
        message: `{"name": "` + name + `", "parameters": ` + arguments|tojson + `}` (transformers'
        tojson is json.dumps with ensure_ascii=False and default separators)."""
        return f'{{"name": "{tool}", "parameters": {json.dumps(arguments, ensure_ascii=False)}}}'

    def instructions(self, tool_schemas: list[dict]) -> str:
        call = 'Call one by replying with only {"name": <tool>, "parameters": {...}}.'
        if not tool_schemas:
            return call
        tools = "\n".join(json.dumps(s["function"], separators=(",", ":")) for s in tool_schemas)
        return f"Tools:\n{tools}\n{call}"


TOOL_CALLS = "[TOOL_CALLS]"
_MISTRAL_HINTS = {
    "v3": 'write [TOOL_CALLS][{"name": "<tool>", "arguments": {...}}] (one list for several calls)',
    "v11": "write [TOOL_CALLS]<tool>[ARGS]{...} (repeat it for several calls)",
}
_MISTRAL_NAMED = re.compile(
    r"\s*([A-Za-z_][\w.\-]*)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9]*\s*)?(?:\[ARGS\])?\s*(?=\{)"
)


class MistralFormat(ToolFormat):
    """Mistral's `[TOOL_CALLS]` calls, one `tool` message per call.

    Both generations are parsed whatever `style` is: tokenizer v3 (Mistral 7B v0.3, Nemo, Mixtral
    8x22B) writes `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (an `"id"` key in an object
    is ignored), tokenizer v11+ (Mistral Small 3.1 on) writes `[TOOL_CALLS]name[ARGS]{...}` per
    call, with `[CALL_ID]id` between name and `[ARGS]` when it gives an id (a decoder that drops
    `[ARGS]` leaves `name{...}`, also accepted). Text before the first `[TOOL_CALLS]` and after a
    complete call is prose, where the final answer is looked for. `style` only picks what
    `render_call` writes and the syntax the instructions and error messages show.

    `[TOOL_CALLS]` is a control token: text handed to `parse` must be decoded keeping it (the
    collector does, see agent_rl.rollout.decode). Results go back as `tool` messages whose
    `tool_call_id` (nine digits from ToolEnv) satisfies Mistral's nine-alphanumeric rule.
    """

    name = "mistral"
    native_tools = True
    style = "v3"
    malformed_example = '[TOOL_CALLS][{"name": "calculator", "arguments": {not json}}]'

    @property
    def hint(self) -> str:
        return _MISTRAL_HINTS[self.style]

    def parse(self, text: str) -> ParsedTurn:
        head, *blocks = text.split(TOOL_CALLS)
        items: list[ParsedItem] = []
        prose = [head]
        for block in blocks:
            prose.append(self._parse_block(block, items))
        return ParsedTurn(items=items, answer=extract_final_answer("".join(prose)))

    def _parse_block(self, block: str, items: list[ParsedItem]) -> str:
        """Append the calls written after one `[TOOL_CALLS]` to `items`; returns the prose after them
        (none when the calls are broken: where they end is unknown)."""
        start = len(block) - len(block.lstrip())
        if block.startswith(("[", "{"), start):  # v3: a JSON list of call objects (or one object)
            decoded = _decode_json(block, start)
            if isinstance(decoded, str):
                items.append(ParsedItem(error=f"Error: the [TOOL_CALLS] list is {decoded}; {self.hint}."))
                return ""
            payload, end = decoded
            calls = payload if isinstance(payload, list) else [payload]
            if not calls:
                items.append(ParsedItem(error=f"Error: the [TOOL_CALLS] list is empty; {self.hint}."))
            raw = TOOL_CALLS + block[:end]
            items.extend(call_from_payload(call, raw, self.hint) for call in calls)
            return block[end:]
        named = _MISTRAL_NAMED.match(block)  # v11: name [CALL_ID]id [ARGS] {arguments}
        if named is None:
            items.append(ParsedItem(error=f"Error: [TOOL_CALLS] must be followed by the call; {self.hint}."))
            return ""
        decoded = _decode_json(block, named.end())
        if isinstance(decoded, str):
            items.append(ParsedItem(error=f"Error: the call's arguments are {decoded}; {self.hint}."))
            return ""
        arguments, end = decoded
        payload = {"name": named.group(1), "arguments": arguments}
        items.append(call_from_payload(payload, TOOL_CALLS + block[:end], self.hint))
        return block[end:]

    def render_result(self, text: str) -> str:
        return text

    def render_call(self, tool: str, arguments: dict) -> str:
        """The call as mistral-common encodes an assistant tool call without an id (json.dumps with
        ensure_ascii=False): the v3 list, or v11's name and `[ARGS]`."""
        if self.style == "v11":
            return f"{TOOL_CALLS}{tool}[ARGS]{json.dumps(arguments, ensure_ascii=False)}"
        return TOOL_CALLS + json.dumps([{"name": tool, "arguments": arguments}], ensure_ascii=False)

    def instructions(self, tool_schemas: list[dict]) -> str:
        example = {
            "v3": '[TOOL_CALLS][{"name": ..., "arguments": {...}}]',
            "v11": "[TOOL_CALLS]<tool>[ARGS]{...}",
        }
        call = f"Call tools as {example[self.style]}."
        if not tool_schemas:
            return call
        tools = "\n".join(json.dumps(s["function"], separators=(",", ":")) for s in tool_schemas)
        return f"Tools:\n{tools}\n{call}"


class MistralV11Format(MistralFormat):
    """The `mistral` parser; demonstrations and instructions in the v11+ syntax (Mistral Small 3.1 on)."""

    name = "mistral_v11"
    style = "v11"


FORMATS: dict[str, type[ToolFormat]] = {
    "code": CodeBlockFormat,
    "hermes": HermesFormat,
    "llama3_json": Llama3JsonFormat,
    "mistral": MistralFormat,
    "mistral_v11": MistralV11Format,
}


def get_format(name: str | ToolFormat) -> ToolFormat:
    """A format instance by name; unknown names list the valid ones."""
    if isinstance(name, ToolFormat):
        return name
    if name not in FORMATS:
        raise ValueError(f"unknown tool_format {name!r}; choose one of: {', '.join(sorted(FORMATS))}")
    return FORMATS[name]()
