"""The tools both tau² domains share: ``calculate`` and ``transfer_to_human_agents``.

Also the small helpers the domain modules use to fail a tool call the way the benchmark
does: a :class:`~areal_agents.errors.ToolError` whose message the agent reads as
``"Error: <message>"``.
"""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Callable
from typing import Any

from areal_agents.errors import ToolError
from areal_agents.tools.tool import Tool, function_tool

TRANSFER_TOOL = "transfer_to_human_agents"
"""The tool whose call hands the conversation to a human: it ends the episode."""

_ALLOWED_CHARS = set("0123456789+-*/(). ")
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def fail(message: str) -> ToolError:
    """The error a tool raises to tell the agent ``Error: <message>``."""
    return ToolError(message)


def dump(value: Any) -> str:
    """A tool's JSON answer (records are serialized at once, never shared)."""
    return json.dumps(value)


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise fail("Invalid expression: only numbers, +, -, *, / and parentheses are allowed")


def calculate(expression: str) -> str:
    """Calculate the result of an arithmetic expression, rounded to two decimals.

    Args:
        expression: The expression, such as '2 + 2' or '(100 - 7.5) * 3'. It may contain
            numbers, the operators +, -, *, /, parentheses and spaces.
    """
    if not set(expression) <= _ALLOWED_CHARS:
        raise fail("Invalid characters in expression")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise fail(f"Invalid expression: {exc.msg}") from None
    try:
        value = _evaluate(tree)
    except ZeroDivisionError:
        raise fail("Division by zero") from None
    return str(round(float(value), 2))


def transfer_to_human_agents(summary: str) -> str:
    """Transfer the user to a human agent, with a summary of the user's issue.

    Transfer only if the user explicitly asks for a human agent, or if the user's issue
    cannot be solved with the policy and the available tools. This ends the conversation.

    Args:
        summary: A summary of the user's issue for the human agent.
    """
    return "Transfer successful"


GENERIC_TOOLS: tuple[Tool, ...] = (
    function_tool(calculate),
    function_tool(transfer_to_human_agents),
)
"""The shared tools (they hold no episode state)."""
