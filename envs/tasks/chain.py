"""Long-horizon chain tasks: follow a hidden chain of keys for `depth` tool calls, then answer.

The task: "Start at key 482913; look it up, then look up the key it returns, ... (depth lookups);
answer the key the last lookup returns." The chain is a keyed hash, `next = H(secret, key)`, whose
secret lives only in the `lookup` tool. So:

- every step needs a tool result: the model cannot compute H without the secret, and with 900,000
  keys cannot memorise it;
- no step can be skipped or batched: the key for call k+1 is the result of call k, so a turn may
  hold at most one useful call, and an episode of depth d takes d tool turns plus an answer turn;
- the reward is sparse and terminal: 1 for the right final key, 0 otherwise (ToolEnv's outcome),
  given by a `declare(key)` call (or a boxed key in prose);
- depth is drawn per task from [min_depth, max_depth] (1 to 32), so episode lengths in one batch
  differ by up to 32x, the heterogeneity OTB is about. Within a GRPO group (one task) lengths still
  differ through the policy: a sample that answers early or loses the chain ends sooner.

Each lookup also prints `noise_lines` distractor records ("cache 113847 -> 920014") before the
answer line, as real tool output carries text the agent must read past. They make a 16-call episode
thousands of tokens long, and they exercise the output truncation marker of ToolEnv
(`max_output_chars`) and the collector (`max_tool_tokens`).

Splits: tasks come with train / eval / demo index ranges (`generated_splits`). Held-out tasks start
from other keys; the secret (the environment itself) is shared, as a held-out problem of a math
family shares the rules of arithmetic.

Warm-up: `ChainEnv.scripted_turns` is a correct episode (one lookup per hop, then the last key
declared) and `ChainEnv.flawed_turns` one that loses count: it declares the key of an earlier hop.
Both play through `envs.demos` with real tool output.

What is not covered: a Python-tool variant (a program could loop the whole chain in one call, so
turns could be skipped).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from envs.env import ToolEnv
from envs.parsing import get_format
from envs.tasks.base import Task
from envs.tasks.splits import SplitTasks, generated_splits
from envs.tools.base import Tool, ToolOutput

KEY_MIN, KEY_MAX = 100_000, 999_999
"""Keys are 6-digit integers: short in any tokenizer, far too many to memorise."""
MAX_DEPTH = 32


def chain_secret(seed: int) -> str:
    """The lookup secret of a chain family: a function of its seed only."""
    return hashlib.sha256(f"agent-rl-chain:{seed}".encode()).hexdigest()[:16]


def next_key(secret: str, key: int) -> int:
    """One hop of the hidden chain."""
    digest = hashlib.sha256(f"{secret}:{key}".encode()).digest()
    return KEY_MIN + int.from_bytes(digest[:8], "big") % (KEY_MAX - KEY_MIN + 1)


def walk(secret: str, start: int, depth: int) -> list[int]:
    """The keys the depth lookups return, in order (the last one is the answer)."""
    keys, key = [], start
    for _ in range(depth):
        key = next_key(secret, key)
        keys.append(key)
    return keys


@dataclass
class ChainTasks:
    """An indexable, reproducible stream of chain tasks; task i depends only on (seed, i, depths)."""

    min_depth: int = 1
    max_depth: int = 16
    seed: int = 0
    size: int = 1_000_000
    splits: dict[str, range] = field(init=False)
    """train / eval / demo index ranges (envs.tasks.splits.generated_splits)."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_depth <= self.max_depth <= MAX_DEPTH:
            raise ValueError(
                f"need 1 <= min_depth <= max_depth <= {MAX_DEPTH}, got {self.min_depth}..{self.max_depth}"
            )
        if self.size <= 0:
            raise ValueError(f"size must be positive, got {self.size}")
        self.splits = generated_splits(self.size)

    @property
    def secret(self) -> str:
        return chain_secret(self.seed)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Task:
        if not 0 <= index < self.size:
            raise IndexError(f"task index {index} out of range [0, {self.size})")
        rng = random.Random(f"chain:{self.seed}:{index}:{self.min_depth}:{self.max_depth}")
        depth = rng.randint(self.min_depth, self.max_depth)
        start = rng.randint(KEY_MIN, KEY_MAX)
        keys = walk(self.secret, start, depth)
        lookups = "1 lookup" if depth == 1 else f"{depth} lookups in all, one per turn"
        problem = (
            f"Start at key {start}. Call lookup on it, then on the key it returns, and so on ({lookups}). "
            "Then call declare with the key the last lookup returned."
        )
        return Task(
            problem=problem,
            answer=str(keys[-1]),
            id=f"chain-s{self.seed}-d{self.min_depth}-{self.max_depth}-{index}",
            family="chain",
            metadata={"depth": depth, "start": start, "keys": keys},
        )


class LookupTool(Tool):
    """One hop of the hidden chain: `lookup(key)` prints distractor records, then `next: <key>`."""

    name = "lookup"
    description = "Look up a key in the chain; prints the key that follows it as 'next: <key>'."
    parameters: dict[str, Any] = {  # noqa: RUF012 - class-level schema, never mutated
        "type": "object",
        "properties": {"key": {"type": "integer", "description": "A 6-digit key."}},
        "required": ["key"],
        "additionalProperties": False,
    }

    def __init__(self, secret: str, noise_lines: int = 0) -> None:
        if noise_lines < 0:
            raise ValueError(f"noise_lines must be >= 0, got {noise_lines}")
        self.secret = secret
        self.noise_lines = noise_lines

    def call(self, arguments: dict[str, Any]) -> ToolOutput:
        problem = self.validate(arguments)
        key = arguments.get("key")
        if not problem and not KEY_MIN <= key <= KEY_MAX:  # validate() has checked it is an int
            problem = f"key must be a 6-digit integer ({KEY_MIN}..{KEY_MAX}), got {key!r}"
        if problem:
            return ToolOutput(text=f"Error: {problem}", ok=False, metadata={"error_type": "BadArguments"})
        rng = random.Random(f"{self.secret}:noise:{key}")
        noise = [
            f"cache {rng.randint(KEY_MIN, KEY_MAX)} -> {rng.randint(KEY_MIN, KEY_MAX)}"
            for _ in range(self.noise_lines)
        ]
        return ToolOutput(
            text="\n".join([*noise, f"next: {next_key(self.secret, key)}"]), metadata={"error_type": None}
        )


class DeclareTool(Tool):
    """`declare(key)`: the final answer (ChainEnv's `answer_tool`; ToolEnv ends the episode on it
    and verifies the key, so `call` never runs there).

    Why a call and not only a boxed answer (which ChainEnv also accepts): the answer is then
    written exactly like the lookup calls, and "copy the key the last tool output printed" is one
    skill for every turn. Measured on the tiny model: after a 1600-step warm-up it copied keys into
    lookup calls without error (0.00 nats per digit) but into \\boxed{} at chance (2.3 nats per
    digit, i.e. uniform): it had learned to copy from a fixed distance back, which the boxed
    answer does not share. `declare` tokenises like `lookup` in the tiny model's byte-level
    vocabulary (40 tokens up to the key, the same as a lookup call), so that distance holds.
    """

    name = "declare"
    description = "Give the final answer: the key the last lookup returned. Ends the task."
    parameters: dict[str, Any] = LookupTool.parameters

    def call(self, arguments: dict[str, Any]) -> ToolOutput:
        return ToolOutput(text="Error: declare is the final answer; the episode has ended.", ok=False)


class ChainEnv(ToolEnv):
    """Chain tasks with the lookup tool, Hermes-format calls, budgets sized for the deepest task.

    Keyword arguments: min_depth, max_depth, seed, size (ChainTasks), noise_lines (LookupTool); the
    rest go to ToolEnv. Defaults: max_turns = max_depth + 1 (every lookup plus the answer turn),
    max_tool_calls = max_depth, max_calls_per_turn = 1 (a second call in a turn could not know its
    key yet), max_output_chars = 2048 (longer tool output is cut with a visible marker),
    tools = lookup and declare, answer_tool = "declare".
    """

    def __init__(
        self,
        *,
        min_depth: int = 1,
        max_depth: int = 16,
        seed: int = 0,
        size: int = 1_000_000,
        noise_lines: int = 8,
        **kwargs: Any,
    ) -> None:
        source = ChainTasks(min_depth=min_depth, max_depth=max_depth, seed=seed, size=size)
        kwargs.setdefault("tools", [LookupTool(source.secret, noise_lines), DeclareTool()])
        kwargs.setdefault("answer_tool", "declare")
        kwargs.setdefault("tool_format", "hermes")
        kwargs.setdefault("max_turns", max_depth + 1)
        kwargs.setdefault("max_tool_calls", max_depth)
        kwargs.setdefault("max_calls_per_turn", 1)
        kwargs.setdefault("max_output_chars", 2048)
        super().__init__(SplitTasks(source, source.splits), **kwargs)

    def scripted_turns(self, task: Task) -> list[str]:
        """The correct episode of `task` (the warm-up's demonstration)."""
        return scripted_turns(task, self.format.name)

    def flawed_turns(self, task: Task) -> list[str]:
        """`task` answered too early: stop after k < depth lookups and declare the key the k-th
        returned (the start key when k = 0). A real long-horizon failure, losing count of the
        hops, that leaves the copy skill intact; k is uniform over 0..depth-1, fixed per task."""
        depth = task.metadata["depth"]
        k = random.Random(f"flawed:{task.id}").randrange(depth)
        seen = [task.metadata["start"], *task.metadata["keys"]]
        calls = scripted_turns(task, self.format.name)[:k]
        return [*calls, self.format.render_call("declare", {"key": seen[k]})]


def scripted_turns(task: Task, tool_format: str = "hermes") -> list[str]:
    """The assistant turns of a correct episode: one lookup per hop, then the declared answer."""
    keys: Sequence[int] = [task.metadata["start"], *task.metadata["keys"]]
    fmt = get_format(tool_format)
    return [
        *(fmt.render_call("lookup", {"key": k}) for k in keys[:-1]),
        fmt.render_call("declare", {"key": keys[-1]}),
    ]
