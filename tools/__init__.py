"""Tools an agent can call: typed functions with JSON schemas, and built-in tools.

>>> from tools import calculator
>>> calculator.call({"expression": "6 * 7"}).content
'42'
"""

from tools.calculator import CalculationError, calculator, evaluate
from tools.tool import Tool, ToolResult, function_tool

__all__ = ["CalculationError", "Tool", "ToolResult", "calculator", "evaluate", "function_tool"]
