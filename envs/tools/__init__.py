"""Tools an agent can call: the abstraction, the sandboxed Python tool and a calculator."""

from __future__ import annotations

from envs.tools.base import Tool, ToolCall, ToolInfraError, ToolOutput, truncate_output
from envs.tools.calculator import CalculatorTool
from envs.tools.python import PythonTool, Shared, shared_backend

__all__ = [
    "CalculatorTool",
    "PythonTool",
    "Shared",
    "Tool",
    "ToolCall",
    "ToolInfraError",
    "ToolOutput",
    "shared_backend",
    "truncate_output",
]
