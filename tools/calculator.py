"""A safe arithmetic calculator tool.

The expression is parsed with :mod:`ast` and evaluated by walking a whitelist of nodes;
nothing is ever passed to ``eval``. Allowed:

- numbers (int and float literals; ``1_000`` too), and the constants ``pi`` and ``e``;
- ``+ - * / // % **``, unary ``+``/``-``, parentheses;
- the functions ``abs``, ``round`` (``round(x)`` or ``round(x, ndigits)``), ``min``,
  ``max`` and ``sqrt``.

Common notations models write are normalized first: ``×`` and ``·`` mean ``*``, ``÷`` means
``/``, ``^`` means ``**``, and a trailing ``=`` is dropped.

Guards: expressions longer than :data:`MAX_EXPRESSION_CHARS`; exponents whose result would
exceed :data:`MAX_RESULT_BITS` bits (``2**10**10`` is refused before it is computed); any
intermediate result whose magnitude exceeds ``2**MAX_RESULT_BITS``; non-finite or complex
results. Each refusal is a :class:`CalculationError` whose message names the problem, e.g.
``division by zero`` or ``unsupported syntax 'attribute access' (...)``.

The result is formatted for a model to copy: integers exactly (``"444"``), floats with up to
12 significant digits, and integral floats without ``.0`` (``7 / 7`` gives ``"1"``).

    >>> evaluate("37 * 12 + 5")
    449
    >>> calculator.call('{"expression": "(2 + 3) / 4"}').content
    '1.25'
    >>> calculator.call('{"expression": "1 / 0"}').content
    'Error: division by zero'
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from areal_agents.errors import ToolError
from areal_agents.tools.tool import function_tool

__all__ = ["CalculationError", "calculator", "evaluate", "format_number"]

MAX_EXPRESSION_CHARS = 500
"""Longest expression accepted."""
MAX_RESULT_BITS = 1024
"""Largest magnitude of any intermediate or final result: ``2**1024`` (about ``1.8e308``)."""

Number = int | float

_ALLOWED_SUMMARY = (
    "the calculator accepts numbers, + - * / // % **, parentheses and the functions "
    "abs, max, min, round, sqrt"
)
_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}
_SYNTAX_NAMES: dict[type[ast.AST], str] = {
    ast.Attribute: "attribute access",
    ast.Subscript: "subscript",
    ast.Compare: "comparison",
    ast.BoolOp: "boolean operator",
    ast.Lambda: "lambda",
    ast.List: "list",
    ast.Dict: "dict",
    ast.Set: "set",
    ast.IfExp: "conditional expression",
    ast.JoinedStr: "f-string",
    ast.ListComp: "comprehension",
    ast.GeneratorExp: "comprehension",
    ast.NamedExpr: "assignment",
    ast.Starred: "starred expression",
}


class CalculationError(ToolError):
    """The expression cannot be evaluated; the message says why."""


def evaluate(expression: str) -> Number:
    """Evaluate an arithmetic expression safely.

    Raises:
        CalculationError: the expression is invalid, unsupported, too large or undefined.
    """
    if not isinstance(expression, str):
        raise CalculationError(f"expected an expression string, got {type(expression).__name__}")
    text = _normalize(expression)
    if not text:
        raise CalculationError("empty expression; write an arithmetic expression like 2 * (3 + 4)")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculationError(f"expression too long ({len(text)} > {MAX_EXPRESSION_CHARS} chars)")
    try:
        tree = ast.parse(text, mode="eval")
        return _check_size(_eval(tree.body))
    except SyntaxError as exc:
        raise CalculationError(f"invalid expression ({exc.msg}); {_ALLOWED_SUMMARY}") from None
    except (RecursionError, MemoryError):
        raise CalculationError("expression too deeply nested") from None


def format_number(value: Number) -> str:
    """Format a result for the model: exact ints, up to 12 significant digits for floats."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return format(value, ".12g")


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the number.

    Args:
        expression: An arithmetic expression with numbers, + - * / // % ** and parentheses,
            e.g. "37 * 12 + 5". Functions: abs, max, min, round, sqrt.
    """
    return format_number(evaluate(expression))


def _normalize(expression: str) -> str:
    text = expression.strip().replace("×", "*").replace("·", "*").replace("÷", "/")
    text = text.replace("^", "**").replace("−", "-")
    return text.removesuffix("=").strip()


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant):
        return _constant(node.value)
    if isinstance(node, ast.BinOp):
        return _binary(node)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else +value
    if isinstance(node, ast.Name):
        if node.id in _CONSTANTS:
            return _CONSTANTS[node.id]
        raise CalculationError(f"unsupported syntax {node.id!r} (a name); {_ALLOWED_SUMMARY}")
    if isinstance(node, ast.Call):
        return _call(node)
    if isinstance(node, ast.Tuple):
        raise CalculationError(
            "unsupported syntax 'tuple' (a comma outside a function call); "
            "write numbers without thousands separators: 1000, not 1,000"
        )
    what = _SYNTAX_NAMES.get(type(node), type(node).__name__)
    raise CalculationError(f"unsupported syntax {what!r}; {_ALLOWED_SUMMARY}")


def _constant(value: Any) -> Number:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculationError(f"unsupported syntax {value!r} (not a number); {_ALLOWED_SUMMARY}")
    return value


def _binary(node: ast.BinOp) -> Number:
    left, right = _eval(node.left), _eval(node.right)
    if isinstance(node.op, ast.Pow):
        return _check_size(_power(left, right))
    op = _BINARY.get(type(node.op))
    if op is None:
        symbol = {ast.BitXor: "^", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<"}.get(
            type(node.op), type(node.op).__name__
        )
        raise CalculationError(f"unsupported syntax {symbol!r}; {_ALLOWED_SUMMARY}")
    try:
        return _check_size(op(left, right))
    except ZeroDivisionError:
        raise CalculationError("division by zero") from None
    except OverflowError:
        raise CalculationError("result too large") from None


def _power(base: Number, exponent: Number) -> Number:
    """``base ** exponent``, refused up front when the result would be too large."""
    if abs(base) > 1 and abs(exponent) > 0:
        bits = abs(exponent) * math.log2(abs(base))
        if exponent > 0 and bits > MAX_RESULT_BITS:
            raise CalculationError(
                f"result too large: {format_number(base)} ** {format_number(exponent)} has "
                f"about {bits:.3g} bits (limit {MAX_RESULT_BITS})"
            )
    try:
        result = base**exponent
    except ZeroDivisionError:
        raise CalculationError("division by zero (zero to a negative power)") from None
    except OverflowError:
        raise CalculationError("result too large") from None
    if isinstance(result, complex):
        raise CalculationError("result is not a real number (negative base, fractional power)")
    return result


def _call(node: ast.Call) -> Number:
    if not isinstance(node.func, ast.Name):
        return _eval(node.func)  # raises: attribute access, subscript, ...
    name = node.func.id
    if node.keywords:
        raise CalculationError(f"unsupported syntax 'keyword argument' in {name}()")
    if name not in ("sqrt", "abs", "min", "max", "round"):
        raise CalculationError(
            f"unsupported syntax {name!r} (unknown function); allowed functions: "
            "abs, max, min, round, sqrt"
        )
    args = [_eval(arg) for arg in node.args]
    if name == "sqrt" and len(args) == 1:
        if args[0] < 0:
            raise CalculationError("math domain error: sqrt of a negative number")
        return math.sqrt(args[0])
    if name == "abs" and len(args) == 1:
        return abs(args[0])
    if name in ("min", "max") and args:
        return min(args) if name == "min" else max(args)
    if name == "round" and len(args) in (1, 2):
        return _round(*args)
    raise CalculationError(f"wrong number of arguments for {name}(): got {len(args)}")


def _round(value: Number, ndigits: Number | None = None) -> Number:
    if ndigits is None:
        return round(value)
    if not isinstance(ndigits, int) or not 0 <= ndigits <= 15:
        raise CalculationError("round(x, n) needs an integer n between 0 and 15")
    return round(value, ndigits)


def _check_size(value: Number) -> Number:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculationError("result is not a finite number")
    if isinstance(value, int) and value.bit_length() > MAX_RESULT_BITS:
        raise CalculationError(f"result too large (more than {MAX_RESULT_BITS} bits)")
    return value
