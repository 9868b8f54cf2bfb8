"""OpenAI Agents SDK agents, unchanged, through the recording proxy.

The proxy's record of an episode must match the SDK's own record of the run: the same tool
calls with the same arguments, the tool outputs the SDK produced in the next prompt, the
same final output, and output token ids that decode to exactly what the SDK received.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
from typing import Any

import pytest

from areal_agents.tools import calculator
from areal_agents.tools.tool import function_tool


def _require(module: str) -> Any:
    if os.environ.get("AREAL_REQUIRE_INTEGRATIONS") == "1":
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            pytest.fail(
                f"AREAL_REQUIRE_INTEGRATIONS=1 but {module!r} cannot be imported ({exc}); "
                "build the venv with requirements/make_venv.sh openai-agents DIR",
                pytrace=False,
            )
    return pytest.importorskip(module)


agents = _require("agents")

from areal_agents.integrations.openai_agents import (  # noqa: E402
    as_function_tools,
    run_agent,
    session_model,
)


@agents.function_tool
def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: The city's name.
    """
    return f"Sunny and 21 degrees in {city}."


def _calls_in(text: str) -> list[tuple[str, dict[str, Any]]]:
    """The (name, arguments) of each ``<tool_call>`` block in a decoded output."""
    blocks = text.split("<tool_call>")[1:]
    out = []
    for block in blocks:
        call = json.loads(block.split("</tool_call>")[0])
        out.append((call["name"], call["arguments"]))
    return out


def _sdk_calls(result: Any, kind: str) -> list[Any]:
    return [item for item in result.new_items if item.type == kind]


async def test_agent_with_two_tools_matches_the_recorded_episode(scripted):
    scripted.replies += [
        scripted.tool_call("get_weather", {"city": "Paris"})
        + "\n"
        + scripted.tool_call("calculator", {"expression": "21 * 9 / 5 + 32"}),
        scripted.tool_call("calculator", {"expression": "69.8 - 32"}),
        "It is sunny in Paris: 21 °C, which is 69.8 °F.",
    ]
    scripted_texts = list(scripted.replies)
    agent = agents.Agent(
        name="forecaster",
        instructions="Answer weather questions; convert units with the calculator.",
        tools=[get_weather],
    )
    session = scripted.session(task_id="weather-1")
    result = await run_agent(
        agent,
        "What is the weather in Paris, in Fahrenheit?",
        base_url=scripted.server.base_url,
        api_key=session.api_key,
        tools=[calculator],
    )
    # the user's agent object is untouched
    assert agent.tools == [get_weather] and agent.model is None

    traj = scripted.trajectory(session)
    completions = traj["completions"]
    assert len(completions) == len(result.raw_responses) == 3
    assert [c["id"] for c in completions] == [c.id for c in session.episode.completions]

    # the same tool calls, with the same arguments and ids
    sdk_calls = [item.raw_item for item in _sdk_calls(result, "tool_call_item")]
    recorded = [tc for c in completions for tc in c["message"].get("tool_calls") or []]
    assert [(c.call_id, c.name, json.loads(c.arguments)) for c in sdk_calls] == [
        (tc["id"], tc["function"]["name"], json.loads(tc["function"]["arguments"]))
        for tc in recorded
    ]
    assert [c.name for c in sdk_calls] == ["get_weather", "calculator", "calculator"]

    # the tool outputs the SDK produced are in the next completion's prompt
    outputs = {
        item.raw_item["call_id"]: item.output
        for item in _sdk_calls(result, "tool_call_output_item")
    }
    assert outputs[sdk_calls[0].call_id] == "Sunny and 21 degrees in Paris."
    assert outputs[sdk_calls[1].call_id] == "69.8"
    assert outputs[sdk_calls[2].call_id] == "37.8"
    for k, completion in enumerate(completions[:-1]):
        made = [tc["id"] for tc in completion["message"]["tool_calls"]]
        fed = {
            m["tool_call_id"]: m["content"]
            for m in completions[k + 1]["messages"]
            if m["role"] == "tool"
        }
        assert {cid: fed[cid] for cid in made} == {cid: outputs[cid] for cid in made}

    # the same final output
    assert completions[-1]["message"]["content"] == result.final_output
    assert result.final_output == "It is sunny in Paris: 21 °C, which is 69.8 °F."

    # the engine got the recorded prompt ids; every output decodes to what the SDK received
    assert [c["prompt_ids"] for c in completions] == scripted.prompts
    for completion, response, scripted_text in zip(
        completions, result.raw_responses, scripted_texts, strict=True
    ):
        text = scripted.output_text(completion)
        assert text == scripted_text
        calls = [o for o in response.output if o.type == "function_call"]
        if calls:
            assert _calls_in(text) == [(c.name, json.loads(c.arguments)) for c in calls]
        else:
            (message,) = response.output
            assert text == message.content[0].text

    # one line of turns: each call continues the previous one, merged into one sample
    assert [c["parent_id"] for c in completions] == [
        None,
        completions[0]["id"],
        completions[1]["id"],
    ]
    assert len(traj["samples"]) == 1
    assert traj["task_id"] == "weather-1"


async def test_handoff_goes_through_the_same_session_as_a_second_branch(scripted):
    scripted.replies += [
        scripted.tool_call("transfer_to_billing", {}),
        scripted.tool_call("refund", {"order_id": "A17"}),
        "Order A17 is refunded.",
    ]

    def refund(order_id: str) -> str:
        return f"refund issued for {order_id}"

    billing = agents.Agent(
        name="billing",
        instructions="Handle refunds.",
        tools=[as_function_tools([function_tool(refund)])[0]],
    )
    triage = agents.Agent(name="triage", instructions="Route the user.", handoffs=[billing])
    session = scripted.session()
    result = await run_agent(
        triage, "Refund order A17.", base_url=scripted.server.base_url, api_key=session.api_key
    )
    assert result.final_output == "Order A17 is refunded."
    assert result.last_agent.name == "billing"
    # the handoff target kept no model of its own: the run config sent it through the session
    assert billing.model is None

    completions = scripted.trajectory(session)["completions"]
    assert len(completions) == 3
    first, second, third = completions
    assert first["message"]["tool_calls"][0]["function"]["name"] == "transfer_to_billing"
    assert first["messages"][0] == {"role": "system", "content": "Route the user."}
    assert second["messages"][0] == {"role": "system", "content": "Handle refunds."}
    # the billing agent's history carries the handoff, but under its own system prompt:
    # a new branch of the episode's tree, which the refund turn then continues
    assert [m.get("tool_call_id") for m in second["messages"] if m["role"] == "tool"] == [
        first["message"]["tool_calls"][0]["id"]
    ]
    assert first["parent_id"] is None and second["parent_id"] is None
    assert third["parent_id"] == second["id"]
    assert [t["function"]["name"] for t in first["tools"]] == ["transfer_to_billing"]
    assert [t["function"]["name"] for t in second["tools"]] == ["refund"]
    # each call names the agent whose turn it was (agent.train picks among them)
    assert [c["agent"] for c in completions] == ["triage", "billing", "billing"]
    refund_id = second["message"]["tool_calls"][0]["id"]
    fed = {m["tool_call_id"]: m["content"] for m in third["messages"] if m["role"] == "tool"}
    assert fed[refund_id] == "refund issued for A17"
    assert scripted.output_text(third) == result.final_output


def test_function_tools_keep_our_schema_and_report_bad_arguments_as_data():
    (calc,) = as_function_tools([calculator])
    assert calc.name == "calculator"
    assert calc.description == calculator.description
    assert calc.params_json_schema == calculator.parameters
    assert calc.strict_json_schema  # closed object, every property required

    def scale(x: float, factor: float = 2.0) -> float:
        return x * factor

    (optional,) = as_function_tools([function_tool(scale)])
    assert not optional.strict_json_schema  # strict mode would make `factor` required
    assert optional.params_json_schema["required"] == ["x"]

    bad = asyncio.run(calc.on_invoke_tool(None, '{"expr": "1+1"}'))
    assert bad.startswith("Error: unknown argument 'expr'")
    assert asyncio.run(calc.on_invoke_tool(None, '{"expression": "6*7"}')) == "42"

    with pytest.raises(TypeError, match=r"expected a areal_agents\.tools\.tool\.Tool, got dict"):
        as_function_tools([{"name": "x"}])


def test_session_model_points_at_the_session():
    model = session_model("http://127.0.0.1:9/v1", "sk-areal-abc", model="qwen")
    assert model.model == "qwen"
    assert str(model._client.base_url).rstrip("/") == "http://127.0.0.1:9/v1"
    assert model._client.api_key == "sk-areal-abc"


async def test_extra_tool_with_a_taken_name_is_refused(scripted):
    agent = agents.Agent(name="a", tools=as_function_tools([calculator]))
    session = scripted.session()
    with pytest.raises(ValueError, match="already has tools named"):
        await run_agent(
            agent,
            "x",
            base_url=scripted.server.base_url,
            api_key=session.api_key,
            tools=[calculator],
        )
