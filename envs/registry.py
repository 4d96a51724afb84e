"""Registering tool environments: our ids, one-call registration, and pip-installed plugins.

`register` is `gymnasium.register` with two differences: a duplicate id is an error (a silent
override would make two runs train on different environments under one name), and we remember
which ids came through it so `envs.checks` can check every one of them.

Plugins: a package declares an entry point in group `agent_rl.envs` pointing at a function (or a
module) that calls `envs.register(...)`; `import envs` loads them all. A broken plugin produces a
`PluginWarning` naming it and is skipped; it never breaks the import.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

import gymnasium as gym
from gymnasium.envs.registration import EnvSpec

NAMESPACE = "agent_rl"
PLUGIN_GROUP = "agent_rl.envs"

_ours: set[str] = set()
_loaded_plugins: set[str] = set()


class PluginWarning(UserWarning):
    """An `agent_rl.envs` plugin failed to load; its environments are missing."""


def register(
    id: str, entry_point: str | Callable[..., gym.Env], *, exist_ok: bool = False, **kwargs: Any
) -> EnvSpec:
    """Register an environment id with Gymnasium; `gymnasium.make(id, **kw)` then builds it.

    `entry_point` is a "module:Class" string (imported lazily on make) or a callable.
    `kwargs` are EnvSpec fields, e.g. `kwargs={...}` default constructor arguments.
    `exist_ok=True` accepts re-registering the same id with the same entry point (idempotent setup).
    """
    if id in gym.registry:
        existing = gym.registry[id]
        if exist_ok and existing.entry_point == entry_point:
            _ours.add(id)
            return existing
        raise ValueError(
            f"environment id {id!r} is already registered (entry point {existing.entry_point!r}); "
            "bump the version suffix (e.g. -v1) or call envs.unregister(id) first"
        )
    gym.register(id=id, entry_point=entry_point, **kwargs)
    _ours.add(id)
    return gym.registry[id]


def unregister(id: str) -> None:
    """Remove an id (tests and notebooks that re-run their registration cell)."""
    gym.registry.pop(id, None)
    _ours.discard(id)


def registered_ids() -> list[str]:
    """Every id registered through `envs.register` (built-ins and plugins) that still exists."""
    return sorted(i for i in _ours if i in gym.registry)


def load_plugins(group: str = PLUGIN_GROUP) -> list[str]:
    """Load each entry point of `group` once; returns the names that loaded without error."""
    loaded: list[str] = []
    for ep in entry_points(group=group):
        key = f"{ep.name}={ep.value}"
        if key in _loaded_plugins:
            continue
        _loaded_plugins.add(key)
        try:
            target = ep.load()
            if callable(target):
                target()
        except (Exception, SystemExit) as exc:
            warnings.warn(
                f"agent_rl env plugin {ep.name!r} ({ep.value}) failed and was skipped: "
                f"{type(exc).__name__}: {exc}",
                PluginWarning,
                stacklevel=2,
            )
            continue
        loaded.append(ep.name)
    return loaded


EASY_SYSTEM_PROMPT = "Use ```python, then answer in \\boxed{}."
"""~19 tokens with the tiny tokenizer: a whole difficulty-0 episode stays well under 200 tokens."""

BUILTIN_ENVS: dict[str, tuple[str, dict[str, Any]]] = {
    f"{NAMESPACE}/PythonMath-v0": ("envs.math_envs:PythonMathEnv", {}),
    f"{NAMESPACE}/PythonArithEasy-v0": (
        "envs.math_envs:PythonMathEnv",
        {
            "families": ("multiply",),
            "difficulty": 0,
            "max_turns": 3,
            "max_tool_calls": 2,
            "system_prompt": EASY_SYSTEM_PROMPT,
        },
    ),
    f"{NAMESPACE}/MathNoTool-v0": ("envs.math_envs:MathNoToolEnv", {}),
    f"{NAMESPACE}/CalculatorMath-v0": ("envs.math_envs:CalculatorMathEnv", {}),
    f"{NAMESPACE}/ChainLookup-v0": ("envs.tasks.chain:ChainEnv", {"min_depth": 1, "max_depth": 16}),
}
"""id -> (entry point, default kwargs). PythonArithEasy is the quickstart's difficulty-0 task.
ChainLookup is the long-horizon family (envs/tasks/chain.py): pass max_depth up to 32."""


def register_builtin_envs() -> None:
    """Register the built-in ids (idempotent)."""
    for env_id, (entry_point, kwargs) in BUILTIN_ENVS.items():
        register(env_id, entry_point, exist_ok=True, kwargs=kwargs)
