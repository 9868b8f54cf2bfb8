"""Tools an agent can call: typed functions with JSON schemas, and built-in tools.

>>> from areal_agents.tools import calculator
>>> calculator.call({"expression": "6 * 7"}).content
'42'
"""

from areal_agents.tools.calculator import CalculationError, calculator, evaluate
from areal_agents.tools.tool import Tool, ToolResult, function_tool

__all__ = ["CalculationError", "Tool", "ToolResult", "calculator", "evaluate", "function_tool"]
