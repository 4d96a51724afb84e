"""Test doubles for the rollout: a scripted multi-turn env, an unreliable sandbox, a scripted engine."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import gymnasium

from agent_rl.rollout.engine import Completion, SamplingParams, per_prompt_params


class ScriptedToolEnv(gymnasium.Env):
    """Replies to every turn with a tool message; terminates after `episode_turns` turns.

    reward_per_step is given on every step; the final step adds `outcome_reward`. Failure knobs
    make the env raise or report an infrastructure error on a given turn.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(
        self,
        episode_turns: int = 3,
        tool_reply: str = "tool says {turn}",
        reward_per_step: float = 0.0,
        outcome_reward: float = 1.0,
        raise_on_turn: int | None = None,
        raise_on_reset: bool = False,
        infra_error_on_turn: int | None = None,
        truncate_on_turn: int | None = None,
    ) -> None:
        self.episode_turns = episode_turns
        self.tool_reply = tool_reply
        self.reward_per_step = reward_per_step
        self.outcome_reward = outcome_reward
        self.raise_on_turn = raise_on_turn
        self.raise_on_reset = raise_on_reset
        self.infra_error_on_turn = infra_error_on_turn
        self.truncate_on_turn = truncate_on_turn
        self.turn = 0
        self.received: list[str] = []
        self.closed = False

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        if self.raise_on_reset:
            raise RuntimeError("reset exploded")
        self.turn = 0
        self.received = []
        task = (options or {}).get("question", f"question {seed}")
        obs = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": task}]
        return obs, {"seed": seed}

    def step(self, action: str):
        self.turn += 1
        self.received.append(action)
        if self.raise_on_turn == self.turn:
            raise RuntimeError(f"verifier crashed on turn {self.turn}")
        if self.infra_error_on_turn == self.turn:
            return [], 0.0, False, False, {"infra_error": "sandbox unreachable"}
        done = self.turn >= self.episode_turns
        reward = self.reward_per_step + (self.outcome_reward if done else 0.0)
        truncated = self.truncate_on_turn == self.turn
        obs = [] if done else [{"role": "tool", "content": self.tool_reply.format(turn=self.turn)}]
        return obs, reward, done, truncated, {"turn": self.turn}

    def close(self) -> None:
        self.closed = True


class FlakySandbox:
    """A real local HTTP "sandbox" that the test can shut down mid-rollout."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                reply = b"ran " + body[:20]
                self.send_response(200)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/run"
        self.calls = 0
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class SandboxEnv(ScriptedToolEnv):
    """Sends every action to a FlakySandbox; an unreachable sandbox is reported as infra_error.

    `stop_after` shuts the sandbox down once that many calls were served (the sandbox 'goes away').
    """

    def __init__(self, sandbox: FlakySandbox, stop_after: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sandbox = sandbox
        self.stop_after = stop_after

    def step(self, action: str):
        try:
            data = action.encode("utf-8", "replace") or b"-"
            with urllib.request.urlopen(self.sandbox.url, data=data, timeout=2) as resp:
                output = resp.read().decode("utf-8", "replace")
        except OSError as exc:
            self.turn += 1
            return [], 0.0, False, False, {"infra_error": f"sandbox unreachable: {exc}"}
        with self.sandbox.lock:
            self.sandbox.calls += 1
            if self.sandbox.calls == self.stop_after:
                threading.Thread(target=self.sandbox.stop, daemon=True).start()
        obs, reward, terminated, truncated, info = super().step(action)
        if obs:
            obs = [{"role": "tool", "content": output}]
        return obs, reward, terminated, truncated, info


@dataclass
class ScriptedEngine:
    """Returns pre-written completions (as text) and records every prefix it was asked to extend.

    Log-probs are fake (-0.5 per token): this double tests bookkeeping, not sampling.
    """

    tokenizer: Any
    replies: Sequence[str]
    append_eos: bool = True
    max_model_len: int = 4096
    prefixes: list[list[int]] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]):
        plist = per_prompt_params(prompts, params, self.max_model_len)
        self.batch_sizes.append(len(prompts))
        out = []
        for prompt, p in zip(prompts, plist, strict=True):
            self.prefixes.append(list(prompt))
            text = self.replies[self._turn_of(prompt)]
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if self.append_eos:
                ids = [*ids, self.eos_token_id]
            finish = "stop" if self.append_eos else "length"
            if len(ids) > p.max_new_tokens:
                ids, finish = ids[: p.max_new_tokens], "length"
            out.append(Completion(token_ids=ids, log_probs=[-0.5] * len(ids), finish_reason=finish))
        return out

    def _turn_of(self, prompt: Sequence[int]) -> int:
        """Which assistant turn this prefix asks for: count generation prompts in it."""
        start = self.tokenizer.convert_tokens_to_ids("<|im_start|>")
        starts = [i for i, t in enumerate(prompt) if t == start]
        assistant = self.tokenizer.encode("assistant", add_special_tokens=False)
        n = sum(1 for i in starts if list(prompt[i + 1 : i + 1 + len(assistant)]) == assistant)
        return min(n - 1, len(self.replies) - 1)

    def update_weights(self, state_dict: Any) -> None:
        pass
