"""Gymnasium multi-turn tool environments for training LLM agents.

An action is the assistant's text for one turn; an observation is the list of new chat messages
the agent sees next. Importing `envs` registers the built-in ids under `agent_rl/` and loads
pip-installed plugins (entry point group `agent_rl.envs`). See docs/envs.md.
"""

from __future__ import annotations

from envs.demos import Episode, demonstration, play, scripted_single_turn, scripted_solution
from envs.env import ResetNeeded, ToolEnv
from envs.math_envs import CalculatorMathEnv, MathNoToolEnv, PythonMathEnv
from envs.parsing import (
    CodeBlockFormat,
    HermesFormat,
    Llama3JsonFormat,
    MistralFormat,
    ParsedTurn,
    ToolFormat,
    get_format,
)
from envs.registry import (
    NAMESPACE,
    PLUGIN_GROUP,
    PluginWarning,
    load_plugins,
    register,
    register_builtin_envs,
    registered_ids,
    unregister,
)
from envs.rewards import RewardConfig
from envs.tasks import FAMILIES, FunctionTasks, GeneratedTasks, ListTasks, Task, TaskSource, load_tasks
from envs.tools import CalculatorTool, PythonTool, Shared, Tool, ToolCall, ToolInfraError, ToolOutput
from envs.verify import MathVerifier, Verification

__all__ = [
    "FAMILIES",
    "NAMESPACE",
    "PLUGIN_GROUP",
    "CalculatorMathEnv",
    "CalculatorTool",
    "CodeBlockFormat",
    "Episode",
    "FunctionTasks",
    "GeneratedTasks",
    "HermesFormat",
    "ListTasks",
    "Llama3JsonFormat",
    "MathNoToolEnv",
    "MathVerifier",
    "MistralFormat",
    "ParsedTurn",
    "PluginWarning",
    "PythonMathEnv",
    "PythonTool",
    "ResetNeeded",
    "RewardConfig",
    "Shared",
    "Task",
    "TaskSource",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "ToolFormat",
    "ToolInfraError",
    "ToolOutput",
    "Verification",
    "demonstration",
    "get_format",
    "load_plugins",
    "load_tasks",
    "play",
    "register",
    "register_builtin_envs",
    "registered_ids",
    "scripted_single_turn",
    "scripted_solution",
    "unregister",
]

register_builtin_envs()
load_plugins()
