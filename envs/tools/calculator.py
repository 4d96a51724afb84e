"""CalculatorTool: exact arithmetic on one expression, without running arbitrary code.

The example of a second, different tool: stateless, no sandbox, safe by construction (it walks
the expression's syntax tree and allows only numbers, arithmetic operators and a few integer
functions), with size guards so `10**10**10` is refused instead of hanging the process.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from envs.tools.base import Tool, ToolOutput

MAX_EXPRESSION_CHARS = 2000
MAX_RESULT_BITS = 200_000
"""Refuse results larger than ~60,000 decimal digits: enough for any task here, cheap to compute."""

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, tuple[Callable[..., Any], int]] = {
    # name: (function, largest allowed integer argument, 0 = unbounded)
    "abs": (abs, 0),
    "gcd": (math.gcd, 0),
    "lcm": (math.lcm, 0),
    "isqrt": (math.isqrt, 0),
    "sqrt": (math.sqrt, 0),
    "factorial": (math.factorial, 5000),
    "comb": (math.comb, 100_000),
    "pow": (pow, 0),
}


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be evaluated; the message is shown to the agent."""


def _bits(x: Any) -> int:
    return x.bit_length() if isinstance(x, int) else 64


def _power(base: Any, exp: Any, mod: Any = None) -> Any:
    if mod is not None:
        return pow(base, exp, mod)
    if isinstance(base, int) and isinstance(exp, int) and exp > 0 and _bits(base) * exp > MAX_RESULT_BITS:
        raise CalculatorError("result too large; use pow(a, b, m) for modular powers")
    return pow(base, exp)


def evaluate(expression: str) -> Any:
    """Evaluate an arithmetic expression exactly (integers stay integers)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not a valid expression: {exc.msg}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return _power(_eval(node.left), _eval(node.right))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Mult) and _bits(left) + _bits(right) > MAX_RESULT_BITS:
            raise CalculatorError("result too large")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
        if node.keywords:
            raise CalculatorError("keyword arguments are not supported")
        fn, limit = _FUNCTIONS[node.func.id]
        args = [_eval(a) for a in node.args]
        if limit and any(isinstance(a, int) and a > limit for a in args):
            raise CalculatorError(f"{node.func.id}() argument larger than {limit}")
        if fn is pow:
            return _power(*args)
        return fn(*args)
    allowed = ", ".join(sorted(_FUNCTIONS))
    raise CalculatorError(
        f"unsupported syntax {type(node).__name__!s}; use numbers, + - * / // % ** and {allowed}"
    )


class CalculatorTool(Tool):
    """Evaluate one arithmetic expression exactly."""

    name = "calculator"
    description = "Evaluate an arithmetic expression exactly, e.g. 2**100 % 7 or factorial(30)."
    parameters: dict[str, Any] = {  # noqa: RUF012 - class-level schema, never mutated
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "The expression to evaluate."}},
        "required": ["expression"],
        "additionalProperties": False,
    }

    def call(self, arguments: dict[str, Any]) -> ToolOutput:
        problem = self.validate(arguments)
        if problem:
            return ToolOutput(text=f"Error: {problem}", ok=False, metadata={"error_type": "BadArguments"})
        try:
            value = evaluate(arguments["expression"])
        except CalculatorError as exc:
            return ToolOutput(text=f"Error: {exc}", ok=False, metadata={"error_type": "CalculatorError"})
        except (ArithmeticError, ValueError, TypeError, RecursionError, MemoryError) as exc:
            return ToolOutput(
                text=f"{type(exc).__name__}: {exc}", ok=False, metadata={"error_type": type(exc).__name__}
            )
        return ToolOutput(text=str(value), ok=True, metadata={"error_type": None})
