"""Gymnasium spaces for text actions and chat-message observations.

`gymnasium.spaces.Text` restricts characters to a fixed charset, but an assistant turn is any
Unicode string, so actions use `TextSpace` (any `str` up to a length). Observations are lists of
`{"role", "content"}` dicts: `MessagesSpace`. Neither flattens to arrays; vectorised wrappers
that need numeric spaces do not apply to text environments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gymnasium.spaces import Space

Message = dict[str, str]
ROLES = ("system", "user", "assistant", "tool")
OPTIONAL_KEYS = ("name", "tool_call_id")
"""Message keys besides role and content: a tool result's tool and call id (chat templates read them)."""
_SAMPLE_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,!?\n"


class TextSpace(Space[str]):
    """Any string of at most `max_length` characters. Samples avoid tool-call syntax."""

    def __init__(self, max_length: int = 16_384, seed: int | None = None) -> None:
        if max_length <= 0:
            raise ValueError(f"max_length must be positive, got {max_length}")
        self.max_length = max_length
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        n = int(self.np_random.integers(1, min(self.max_length, 64) + 1))
        idx = self.np_random.integers(0, len(_SAMPLE_CHARS), size=n)
        return "".join(_SAMPLE_CHARS[i] for i in idx)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"TextSpace(max_length={self.max_length})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TextSpace) and other.max_length == self.max_length


class MessagesSpace(Space[list]):
    """A list of chat messages, each a dict with a known `role`, a string `content` and, for a tool
    result, optionally the tool's `name` and a `tool_call_id` (strings)."""

    def __init__(self, roles: Sequence[str] = ROLES, seed: int | None = None) -> None:
        self.roles = tuple(roles)
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def sample(self, mask: Any = None, probability: Any = None) -> list[Message]:
        n = int(self.np_random.integers(0, 3))
        return [
            {"role": self.roles[int(self.np_random.integers(len(self.roles)))], "content": f"sample {i}"}
            for i in range(n)
        ]

    def contains(self, x: Any) -> bool:
        return isinstance(x, list) and all(
            isinstance(m, dict)
            and {"role", "content"} <= set(m) <= {"role", "content", *OPTIONAL_KEYS}
            and m["role"] in self.roles
            and all(isinstance(v, str) for v in m.values())
            for m in x
        )

    def __repr__(self) -> str:
        return f"MessagesSpace(roles={self.roles})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MessagesSpace) and other.roles == self.roles
