"""Our own environment checker: small named checks for the contract the trainer relies on.

Gymnasium's `check_env` covers the generic API (seeding, spaces, signatures). These checks cover
what a text tool environment must also do: open with a prompt, end on a plain answer, turn a
malformed call into an observation, truncate at the turn limit, score a scripted solution 1.
Each failure names the check and says how to fix it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import gymnasium as gym

from envs.demos import demonstration
from envs.tasks.base import Task

Check = Callable[[gym.Env], None]
CHECKS: dict[str, Check] = {}


class EnvCheckError(AssertionError):
    """A named check failed; the message says what to change."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"[{check}] {message}")
        self.check = check


def check(name: str) -> Callable[[Check], Check]:
    def decorator(fn: Check) -> Check:
        if name in CHECKS:
            raise ValueError(f"duplicate check name {name!r}")
        CHECKS[name] = fn
        return fn

    return decorator


def _require(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise EnvCheckError(name, message)


def _is_messages(obs: Any) -> bool:
    return isinstance(obs, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in obs
    )


@check("reset_returns_prompt")
def check_reset_returns_prompt(env: gym.Env) -> None:
    name = "reset_returns_prompt"
    obs, info = env.reset(seed=0)
    _require(_is_messages(obs), name, "reset() must return a list of {'role','content'} dicts")
    _require(
        bool(obs) and obs[-1]["role"] == "user", name, "the last opening message must be the user prompt"
    )
    _require(obs in env.observation_space, name, "the reset observation is not in observation_space")
    _require(isinstance(info, dict), name, "reset() must return an info dict")
    _require(isinstance(env.unwrapped.task, Task), name, "set self.task to the episode's Task in reset()")


@check("reset_is_reproducible")
def check_reset_is_reproducible(env: gym.Env) -> None:
    name = "reset_is_reproducible"
    a, _ = env.reset(seed=11)
    b, _ = env.reset(seed=11)
    _require(a == b, name, "reset(seed=s) twice gave different prompts: draw tasks from self.np_random")
    c, _ = env.reset(options={"task_index": 0})
    d, _ = env.reset(seed=99, options={"task_index": 0})
    _require(c == d, name, 'options={"task_index": i} must select task i regardless of the seed')


@check("plain_text_ends_episode")
def check_plain_text_ends_episode(env: gym.Env) -> None:
    name = "plain_text_ends_episode"
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("I do not know.")
    _require(terminated and not truncated, name, "a turn without tool call or answer must terminate")
    _require(isinstance(reward, float) and math.isfinite(reward), name, "the reward must be a finite float")
    _require(_is_messages(obs), name, "step() must return a list of messages")
    _require(
        info.get("verification", {}).get("correct") is False, name, "info['verification'] must mark it wrong"
    )


@check("step_after_end_raises")
def check_step_after_end_raises(env: gym.Env) -> None:
    name = "step_after_end_raises"
    env.reset(seed=0)
    env.step("I do not know.")
    try:
        env.step("again")
    except (RuntimeError, gym.error.ResetNeeded):
        return
    raise EnvCheckError(name, "step() after the episode ended must raise and ask for reset()")


def _has_tools(env: gym.Env) -> bool:
    return bool(getattr(env.unwrapped, "tools", None))


def _malformed_call(env: gym.Env) -> str:
    return env.unwrapped.format.malformed_example or "```python\nprint(1)"


@check("malformed_call_is_observation")
def check_malformed_call_is_observation(env: gym.Env) -> None:
    name = "malformed_call_is_observation"
    if not _has_tools(env):
        return
    env.reset(seed=0)
    obs, _, terminated, truncated, info = env.step(_malformed_call(env))
    _require(not terminated and not truncated, name, "a malformed call must not end the episode")
    _require(bool(obs) and "Error" in obs[0]["content"], name, "the agent must see an error message")
    _require(bool(info.get("parse_errors")), name, "info['parse_errors'] must list the problem")


@check("turn_limit_truncates")
def check_turn_limit_truncates(env: gym.Env) -> None:
    name = "turn_limit_truncates"
    if not _has_tools(env):
        return
    env.reset(seed=0)
    limit = env.unwrapped.max_turns
    for turn in range(1, limit + 1):
        _, _, terminated, truncated, _ = env.step(_malformed_call(env))
        _require(not terminated, name, "a tool-call turn must not terminate")
        if truncated:
            _require(turn == limit, name, f"truncated at turn {turn}, expected the limit {limit}")
            return
    raise EnvCheckError(name, f"no truncation after max_turns={limit} tool-call turns")


@check("scripted_solution_scores")
def check_scripted_solution_scores(env: gym.Env) -> None:
    name = "scripted_solution_scores"
    base = env.unwrapped
    if base.tasks[0].solution_code is None:
        return
    episode = demonstration(env, 0)
    last = episode.infos[-1]
    _require("infra_error" not in last, name, f"infrastructure failed: {last.get('infra_error')}")
    _require(episode.terminated, name, "the scripted solution must terminate with an answer")
    _require(
        episode.total_reward == base.reward_config.correct,
        name,
        f"scripted solution scored {episode.total_reward}, expected {base.reward_config.correct}: {last}",
    )


@check("close_is_idempotent")
def check_close_is_idempotent(env: gym.Env) -> None:
    env.close()
    env.close()


def check_env(env: gym.Env, skip: tuple[str, ...] = ()) -> list[str]:
    """Run every check (in order) except `skip`; returns the names that ran. Raises EnvCheckError."""
    ran = []
    for name, fn in CHECKS.items():
        if name in skip:
            continue
        fn(env)
        ran.append(name)
    return ran
