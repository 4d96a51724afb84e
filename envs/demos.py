"""Scripted demonstrations: the assistant turns of a correct tool-use episode.

Used for a short supervised warm-up before RL (a model trained from scratch has never seen the
tool-call pattern), and by tests as a policy that must score 1. Generated tasks carry the code
that prints their answer, so a demonstration is: run it, read the output, box the answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

from envs.parsing import get_format
from envs.spaces import Message
from envs.tasks.base import Task


def scripted_solution(task: Task, tool_format: str = "code", tool: str = "python") -> list[str]:
    """Assistant turns of a correct episode: one tool call, then the boxed answer.

    `tool="calculator"` works for tasks whose solution is a single `print(<expression>)`.
    """
    if task.solution_code is None:
        raise ValueError(
            f"task {task.id or task.problem[:40]!r} has no solution_code; only generated tasks do"
        )
    if tool == "python":
        arguments = {"code": task.solution_code}
    elif tool == "calculator":
        match = re.fullmatch(r"print\((.*)\)", task.solution_code.strip())
        if match is None:
            raise ValueError(f"task {task.id!r} needs a program, not one expression: use the python tool")
        arguments = {"expression": match.group(1)}
    else:
        raise ValueError(f"no scripted solution for tool {tool!r}; use 'python' or 'calculator'")
    call = get_format(tool_format).render_call(tool, arguments)
    return [call, f"\\boxed{{{task.answer}}}"]


def scripted_single_turn(task: Task) -> list[str]:
    """The single-turn (no tool) demonstration: just the boxed answer."""
    return [f"\\boxed{{{task.answer}}}"]


@dataclass
class Episode:
    """A played episode: the full conversation, per-step rewards and infos."""

    messages: list[Message] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    infos: list[dict[str, Any]] = field(default_factory=list)
    terminated: bool = False
    truncated: bool = False

    @property
    def total_reward(self) -> float:
        return sum(self.rewards)


def play(env: gym.Env, turns: list[str], *, seed: int | None = None, options: dict | None = None) -> Episode:
    """Feed fixed assistant turns to `env` until it ends (or the turns run out)."""
    obs, info = env.reset(seed=seed, options=options)
    episode = Episode(messages=list(obs), infos=[info])
    for turn in turns:
        obs, reward, terminated, truncated, info = env.step(turn)
        episode.messages.append({"role": "assistant", "content": turn})
        episode.messages.extend(obs)
        episode.rewards.append(float(reward))
        episode.infos.append(info)
        if terminated or truncated:
            episode.terminated, episode.truncated = terminated, truncated
            break
    return episode


def demonstration(env: gym.Env, task_index: int) -> Episode:
    """Play the scripted solution of task `task_index` in `env`, with real tool outputs.

    An env whose tasks have no `solution_code` (a chain of lookups, say) gives its own turns by
    defining `scripted_turns(task) -> list[str]` (and `flawed_turns(task)` for the warm-up's
    deliberately imperfect demonstrations)."""
    base = env.unwrapped
    task = base.tasks[task_index]
    if hasattr(base, "scripted_turns"):
        turns = base.scripted_turns(task)
    elif not base.tools:
        turns = scripted_single_turn(task)
    else:
        tool = "python" if "python" in base.tools else next(iter(base.tools))
        turns = scripted_solution(task, base.format.name, tool=tool)
    return play(env, turns, options={"task_index": task_index})


def confident_guess(answer: str) -> str:
    """A plausible but wrong answer: `answer` rounded to two significant digits (an integer
    answer; others get a marker appended). The demonstration of a model that estimates instead
    of computing."""
    try:
        value = int(answer)
    except ValueError:
        return answer + "?"
    digits = len(str(abs(value)))
    if digits <= 2:
        return str(value + 1)
    scale = 10 ** (digits - 2)
    guess = round(value / scale) * scale
    return str(guess if guess != value else value + scale)


def hallucinated_demonstration(env: gym.Env, task_index: int) -> Episode:
    """Task `task_index` with the tool's output made up, a real failure of tool-using models.

    The call is written, but instead of ending the turn to wait for the result, the turn goes on
    with a confident guess of the output (a round number) and its boxed copy. The answer ends the
    episode, so the call never runs and the reward is 0. The guess is round on purpose: a policy
    that made up full-length digits learned to make up digits after a real output too (measured:
    greedy success 0 -> 0 after RL), while a round guess keeps "copy the output" a distinct skill.
    An env with its own `flawed_turns(task)` (ChainEnv: answering before the chain's end) plays those.
    """
    base = env.unwrapped
    task = base.tasks[task_index]
    if hasattr(base, "flawed_turns"):
        return play(env, base.flawed_turns(task), options={"task_index": task_index})
    call = scripted_solution(task, base.format.name)[0]
    guess = confident_guess(task.answer)
    turn = f"{call}\n```output\n{guess}\n```\n\\boxed{{{guess}}}"
    return play(env, [turn], options={"task_index": task_index})
