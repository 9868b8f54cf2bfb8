"""areal_agents.tools.calculator: correct arithmetic, and specific errors instead of unsafe
evaluation."""

from __future__ import annotations

import time

import pytest

from areal_agents.tools.calculator import CalculationError, calculator, evaluate


@pytest.mark.parametrize(
    ("expression", "result"),
    [
        ("37 * 12 + 5", "449"),
        ("(2 + 3) / 4", "1.25"),
        ("7 / 7", "1"),
        ("17 // 5", "3"),
        ("17 % 5", "2"),
        ("2 ** 10", "1024"),
        ("-(3 - 10)", "7"),
        ("2^3", "8"),
        ("6 × 7", "42"),
        ("84 ÷ 2 =", "42"),
        ("sqrt(16) + abs(-2)", "6"),
        ("round(2.456, 2)", "2.46"),
        ("max(1, 5, 3) - min(4, 2)", "3"),
        ("1 / 3", "0.333333333333"),
        ("1_000 * 3", "3000"),
    ],
)
def test_evaluates_arithmetic_and_formats_the_number(expression, result):
    assert calculator.call({"expression": expression}).content == result


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('echo hi')", "unsupported syntax 'attribute access'"),
        ("__import__('os')", "unsupported syntax '__import__' (unknown function)"),
        ("(1).real", "unsupported syntax 'attribute access'"),
        ("open('/etc/passwd')", "unsupported syntax 'open' (unknown function)"),
        ("x + 1", "unsupported syntax 'x' (a name)"),
        ("'a' * 3", "unsupported syntax 'a' (not a number)"),
        ("[1, 2][0]", "unsupported syntax 'subscript'"),
        ("lambda: 1", "unsupported syntax 'lambda'"),
        ("1 < 2", "unsupported syntax 'comparison'"),
        ("1,000 + 1", "unsupported syntax 'tuple'"),
        ("5 & 3", "unsupported syntax '&'"),
        ("2 +", "invalid expression"),
        ("", "empty expression"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("sqrt(-4)", "math domain error"),
        ("(-8) ** 0.5", "result is not a real number"),
        ("1e308 * 10", "result is not a finite number"),
        ("round(1.5, 99)", "round(x, n) needs an integer n"),
        ("1" + " + 1" * 300, "expression too long"),
    ],
)
def test_unsafe_or_invalid_expressions_give_a_specific_error(expression, message):
    result = calculator.call({"expression": expression})
    assert result.error == "tool_exception"
    assert result.content.startswith("Error: " + message), result.content


@pytest.mark.parametrize("expression", ["2**10**10", "9**9**9", "10**400 / 3", "(10**300)**5"])
def test_huge_powers_are_refused_before_they_are_computed(expression):
    start = time.perf_counter()
    result = calculator.call({"expression": expression})
    assert time.perf_counter() - start < 0.5
    assert result.content.startswith("Error: result too large"), result.content


def test_huge_products_are_refused():
    expression = " * ".join(["10**300"] * 5)
    assert calculator.call({"expression": expression}).content.startswith("Error: result too large")


def test_evaluate_raises_calculation_error_and_never_runs_code(tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(CalculationError):
        evaluate(f"__import__('pathlib').Path('{marker}').touch()")
    assert not marker.exists()
    assert evaluate("2 * (3 + 4)") == 14


def test_non_string_expression_is_a_bad_argument():
    result = calculator.call({"expression": 5})
    assert result.error == "bad_arguments"
    assert "argument 'expression' must be a string, got an integer" in result.content
