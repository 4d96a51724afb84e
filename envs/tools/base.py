"""The Tool abstraction: a named function with a JSON-schema signature that the agent may call.

A tool never raises for a bad call: it returns a `ToolOutput` whose text explains the problem,
because the agent has to read that text and recover. Only a failure of the infrastructure behind
a tool (the sandbox is down) is raised, as `ToolInfraError`, so the environment can tell the
trainer that the episode says nothing about the policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


class ToolInfraError(RuntimeError):
    """The machinery behind a tool failed (not the agent's call); the episode is not evidence."""


@dataclass
class ToolCall:
    """One call the agent made: which tool, with which arguments, and where in its text."""

    name: str
    arguments: dict[str, Any]
    raw: str = ""
    """The exact text of the call, for logging."""


@dataclass
class ToolOutput:
    """What a call returned, as the agent will read it, plus metadata for `info`."""

    text: str
    ok: bool = True
    """False when the agent's call failed (exception, timeout, bad arguments)."""
    metadata: dict[str, Any] = field(default_factory=dict)


def truncate_output(text: str, max_chars: int) -> str:
    """Keep the head and tail of long output, with a marker that says how much was cut.

    Both ends matter: the head shows what the code printed first, the tail holds the traceback or
    the final result. The marker is visible so the agent learns its output was shortened.
    """
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    cut = len(text) - max_chars
    marker = f"\n...[output truncated: {cut} characters omitted]...\n"
    head = max(0, (max_chars * 2) // 3)
    tail = max(0, max_chars - head)
    return text[:head] + marker + (text[-tail:] if tail else "")


class Tool(ABC):
    """A callable tool with a name, a description and a JSON-schema for its arguments.

    Lifecycle hooks `open`/`close` let stateful tools (a Python session, a database connection)
    live exactly as long as one episode: the environment calls `open` on reset and `close` on the
    next reset or on `env.close()`.
    """

    name: str
    description: str
    parameters: dict[str, Any]

    @abstractmethod
    def call(self, arguments: dict[str, Any]) -> ToolOutput:
        """Run the call. Bad arguments give a ToolOutput with ok=False; infra failures raise."""

    def open(self) -> None:
        """Start per-episode state. Default: stateless."""
        return None

    def close(self) -> None:
        """Release per-episode state; must be safe to call twice."""
        return None

    def schema(self) -> dict[str, Any]:
        """The OpenAI/Hermes function schema, as chat templates take it in `tools=`."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def validate(self, arguments: Any) -> str | None:
        """Check arguments against the schema's required keys and simple types; None when fine.

        Deliberately small (no external jsonschema dependency): tool schemas here are flat objects.
        """
        if not isinstance(arguments, dict):
            return f"arguments must be a JSON object, got {type(arguments).__name__}"
        props: dict[str, Any] = self.parameters.get("properties", {})
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            return f"missing required argument(s): {', '.join(missing)}"
        unknown = [k for k in arguments if k not in props]
        if unknown and self.parameters.get("additionalProperties", True) is False:
            return f"unknown argument(s): {', '.join(unknown)}; expected: {', '.join(props)}"
        for key, value in arguments.items():
            expected = props.get(key, {}).get("type")
            types = JSON_TYPES.get(expected) if isinstance(expected, str) else None
            if types and (
                not isinstance(value, types) or (expected != "boolean" and isinstance(value, bool))
            ):
                return f"argument {key!r} must be of type {expected}, got {type(value).__name__}"
        return None
