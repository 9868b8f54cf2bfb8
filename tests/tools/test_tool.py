"""areal_agents.tools.tool: schemas from typed functions, argument validation, sync/async,
binding."""

from __future__ import annotations

import asyncio
import enum
import json
from typing import Literal

import pytest

from areal_agents.errors import ToolError, UserError
from areal_agents.tools import Tool, ToolResult, function_tool


class Unit(enum.Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


@function_tool
def forecast(
    city: str,
    days: int,
    unit: Unit = Unit.CELSIUS,
    detail: Literal["short", "long"] = "short",
    hours: list[int] | None = None,
    tags: dict[str, float] | None = None,
    precise: bool = False,
    scale: float = 1.0,
) -> dict:
    """Get the weather forecast.

    Args:
        city: Name of the city.
        days (int): Number of days,
            counted from today.
        unit: Temperature unit.
        detail: How much to say.
        hours: Hours of the day to report.
        tags: Extra weights.
        precise: Whether to use decimals.
        scale: A multiplier.

    Returns:
        The forecast.
    """
    return {"city": city, "days": days, "unit": unit.value, "hours": hours, "scale": scale}


def test_schema_from_google_docstring_and_type_hints_matches_hand_written_schema():
    expected = {
        "type": "function",
        "function": {
            "name": "forecast",
            "description": "Get the weather forecast.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "Name of the city."},
                    "days": {
                        "type": "integer",
                        "description": "Number of days, counted from today.",
                    },
                    "unit": {
                        "type": "string",
                        "enum": ["celsius", "fahrenheit"],
                        "description": "Temperature unit.",
                        "default": "celsius",
                    },
                    "detail": {
                        "type": "string",
                        "enum": ["short", "long"],
                        "description": "How much to say.",
                        "default": "short",
                    },
                    "hours": {
                        "type": ["array", "null"],
                        "items": {"type": "integer"},
                        "description": "Hours of the day to report.",
                        "default": None,
                    },
                    "tags": {
                        "type": ["object", "null"],
                        "additionalProperties": {"type": "number"},
                        "description": "Extra weights.",
                        "default": None,
                    },
                    "precise": {
                        "type": "boolean",
                        "description": "Whether to use decimals.",
                        "default": False,
                    },
                    "scale": {"type": "number", "description": "A multiplier.", "default": 1.0},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    }
    assert forecast.schema == expected


def test_rest_docstring_gives_argument_descriptions_and_options_override_name():
    @function_tool(name="lookup", description="Find a record.")
    def find(key: str, limit: int = 3) -> str:
        """Search something.

        :param key: The record key.
        :param int limit: At most this many
            records.
        """
        return key * limit

    params = find.schema["function"]["parameters"]
    assert find.name == "lookup" and find.description == "Find a record."
    assert params["properties"]["key"]["description"] == "The record key."
    assert params["properties"]["limit"]["description"] == "At most this many records."


def test_numpy_docstring_gives_argument_descriptions():
    @function_tool
    def scale(x: float, factor: float = 2.0) -> float:
        """Scale a number.

        Parameters
        ----------
        x : float
            The number.
        factor : float, optional
            The multiplier,
            2 by default.
        """
        return x * factor

    props = scale.parameters["properties"]
    assert scale.description == "Scale a number."
    assert props["x"]["description"] == "The number."
    assert props["factor"]["description"] == "The multiplier, 2 by default."


def test_call_validates_converts_and_serializes_the_result():
    result = forecast.call('{"city": "Oslo", "days": 2.0, "unit": "fahrenheit", "hours": [6]}')
    assert result == ToolResult(
        json.dumps({"city": "Oslo", "days": 2, "unit": "fahrenheit", "hours": [6], "scale": 1.0})
    )
    assert result.ok


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ('{"city": "Oslo", "days": ', "arguments are not valid JSON"),
        ('["Oslo", 2]', "arguments must be a JSON object, got an array"),
        ('{"days": 2}', "missing required argument 'city'"),
        ('{"city": "Oslo", "days": 2, "town": "x"}', "unknown argument 'town'"),
        ('{"city": "Oslo", "days": "two"}', "argument 'days' must be an integer, got a string"),
        ('{"city": "Oslo", "days": 2.5}', "argument 'days' must be an integer, got a number"),
        ('{"city": "Oslo", "days": true}', "argument 'days' must be an integer, got a boolean"),
        ('{"city": "Oslo", "days": 1, "unit": "kelvin"}', "argument 'unit' must be one of"),
        ('{"city": "Oslo", "days": 1, "hours": [1, "x"]}', "argument 'hours' item 1 must be"),
        ('{"city": "Oslo", "days": 1, "tags": {"a": "b"}}', "argument 'tags' key 'a' must be"),
    ],
)
def test_bad_arguments_become_an_error_result_naming_the_problem_and_expected_arguments(
    arguments, message
):
    result = forecast.call(arguments)
    assert result.error == "bad_arguments"
    assert result.content.startswith("Error: " + message), result.content
    assert "Expected arguments: city (string, required), days (integer, required)" in (
        result.content
    )


def test_exception_inside_the_tool_is_returned_not_raised():
    @function_tool
    def divide(a: float, b: float) -> float:
        """Divide a by b."""
        return a / b

    @function_tool
    def fail(reason: str) -> str:
        """Always fails with a message meant for the model."""
        raise ToolError(reason)

    assert divide.call({"a": 1, "b": 0}) == ToolResult(
        "Error: ZeroDivisionError: float division by zero", error="tool_exception"
    )
    assert fail.call({"reason": "the database is read-only"}) == ToolResult(
        "Error: the database is read-only", error="tool_exception"
    )


async def test_async_functions_work_through_call_and_acall_with_timeouts():
    @function_tool(timeout_s=0.05)
    async def wait(seconds: float) -> str:
        """Sleep a while."""
        await asyncio.sleep(seconds)
        return "done"

    assert (await wait.acall({"seconds": 0})).content == "done"
    assert wait.call({"seconds": 0}).content == "done"  # sync call inside a running loop
    slow = await wait.acall({"seconds": 1})
    assert slow.error == "timeout" and "timed out after 0.05 s" in slow.content


def test_sync_function_in_acall_and_sync_call_outside_a_loop():
    @function_tool
    async def echo(text: str) -> str:
        """Echo the text."""
        return text

    assert echo.call({"text": "hi"}).content == "hi"
    assert asyncio.run(forecast.acall({"city": "Rome", "days": 1})).ok


def test_bind_hides_parameters_from_the_schema_and_fills_them_on_every_call():
    class Counter:
        def __init__(self) -> None:
            self.total = 0

    @function_tool(state_params=["state"])
    def add(amount: int, state: Counter) -> int:
        """Add to the episode counter.

        Args:
            amount: How much to add.
        """
        state.total += amount
        return state.total

    assert list(add.parameters["properties"]) == ["amount"]
    with pytest.raises(UserError, match=r"needs bind\(state=...\)"):
        add.call({"amount": 1})
    counter = Counter()
    bound = add.bind(state=counter)
    assert bound.call({"amount": 2}).content == "2"
    assert bound.call({"amount": 3}).content == "5" and counter.total == 5
    rebound = forecast.bind(city="Paris")
    assert "city" not in rebound.parameters["properties"]
    assert rebound.parameters["required"] == ["days"]
    assert json.loads(rebound.call({"days": 1}).content)["city"] == "Paris"
    assert rebound.call({"days": 1, "city": "Rome"}).error == "bad_arguments"
    with pytest.raises(TypeError, match="cannot bind"):
        forecast.bind(country="France")


def test_unsupported_annotations_and_bad_names_are_rejected_at_definition():
    with pytest.raises(TypeError, match="unsupported type"):

        @function_tool
        def f(x: complex) -> str:
            return ""

    with pytest.raises(TypeError, match="needs a type annotation"):

        @function_tool
        def g(x) -> str:  # type: ignore[no-untyped-def]
            return ""

    with pytest.raises(ValueError, match="tool name must match"):
        Tool("bad name!", "", {"type": "object"}, lambda: None)


def test_hand_written_tool_validates_against_its_schema():
    tool = Tool(
        "greet",
        "Greet someone.",
        {
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "required": ["name"],
        },
        lambda name: f"Hello, {name}!",
    )
    assert tool.call({"name": "Ada"}) == ToolResult("Hello, Ada!")
    assert tool.call({}).content.startswith("Error: missing required argument 'name'")
    assert tool.call({"name": "Ada", "age": 3}).content.startswith("Error: unknown argument 'age'")
    assert tool("Bob") == "Hello, Bob!"


def test_hand_written_schema_keywords_beyond_types_are_checked_and_named():
    tool = Tool(
        "pick",
        "Pick items.",
        {
            "type": "object",
            "properties": {
                "count": {"type": "integer", "minimum": 1},
                "where": {
                    "type": "object",
                    "properties": {"shelf": {"type": "string"}},
                    "required": ["shelf"],
                    "additionalProperties": False,
                },
            },
        },
        lambda **kwargs: json.dumps(kwargs),
    )
    assert tool.call({"count": 2, "where": {"shelf": "a"}}).ok
    assert tool.call({"count": 0}).content.startswith(
        "Error: argument 'count' is invalid: 0 is less than the minimum of 1"
    )
    assert tool.call({"where": {}}).content.startswith("Error: argument 'where' is missing key")
    assert tool.call({"where": {"shelf": "a", "row": 1}}).content.startswith(
        "Error: argument 'where' has unknown key 'row'"
    )
    # a schema that is not one is refused where the tool is made, never mid-episode
    with pytest.raises(ValueError, match="tool 'odd': tool parameters are not a valid JSON schema"):
        Tool("odd", "", {"type": "object", "properties": {"a": {"type": "any"}}}, print)
