"""CAMEL-AI agents, unchanged, through the recording proxy.

The proxy's record of an episode must match CAMEL's own record of the step: the same tool
calls with the same arguments, the tool results CAMEL produced in the next prompt, the same
final message, and output token ids that decode to exactly what CAMEL received.
"""

from __future__ import annotations

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
                "build the venv with requirements/make_venv.sh camel DIR",
                pytrace=False,
            )
    return pytest.importorskip(module)


_require("camel")

from camel.agents import ChatAgent  # noqa: E402
from camel.toolkits import FunctionTool  # noqa: E402
from camel.utils import BaseTokenCounter  # noqa: E402

from areal_agents.integrations.camel import (  # noqa: E402
    OfflineTokenCounter,
    as_function_tools,
    session_model,
)


def lookup_stock(item: str) -> int:
    """Units of an item in the warehouse.

    Args:
        item: The item's name.
    """
    return {"widget": 12, "gadget": 30}.get(item, 0)


def _calls_in(text: str) -> list[tuple[str, dict[str, Any]]]:
    """The (name, arguments) of each ``<tool_call>`` block in a decoded output."""
    blocks = text.split("<tool_call>")[1:]
    return [
        (call["name"], call["arguments"])
        for call in (json.loads(b.split("</tool_call>")[0]) for b in blocks)
    ]


def test_chat_agent_with_two_tools_matches_the_recorded_episode(scripted):
    scripted.replies += [
        scripted.tool_call("lookup_stock", {"item": "widget"}),
        scripted.tool_call("calculator", {"expression": "12 * 4"}),
        "There are 12 widgets: 48 with four per box.",
    ]
    scripted_texts = list(scripted.replies)
    session = scripted.session(task_id="stock-1")
    agent = ChatAgent(
        "You manage a warehouse.",
        model=session_model(
            scripted.server.base_url,
            session.api_key,
            token_counter=OfflineTokenCounter(scripted.tokenizer),
        ),
        tools=[FunctionTool(lookup_stock), *as_function_tools([calculator])],
    )
    response = agent.step("How many widgets are in stock, times four?")

    traj = scripted.trajectory(session)
    completions = traj["completions"]
    assert len(completions) == 3
    records = response.info["tool_calls"]

    # the same tool calls, with the same arguments and ids
    recorded = [tc for c in completions for tc in c["message"].get("tool_calls") or []]
    assert [(r.tool_call_id, r.tool_name, r.args) for r in records] == [
        (tc["id"], tc["function"]["name"], json.loads(tc["function"]["arguments"]))
        for tc in recorded
    ]
    assert [r.tool_name for r in records] == ["lookup_stock", "calculator"]
    assert [r.result for r in records] == [12, "48"]

    # the tool results CAMEL produced are in the next completion's prompt
    for k, record in enumerate(records):
        fed = {
            m["tool_call_id"]: m["content"]
            for m in completions[k + 1]["messages"]
            if m["role"] == "tool"
        }
        assert fed[record.tool_call_id] == str(record.result)

    # the engine got the recorded prompt ids; every output decodes to what CAMEL received
    assert [c["prompt_ids"] for c in completions] == scripted.prompts
    assert [scripted.output_text(c) for c in completions] == scripted_texts
    assert response.msgs[0].content == "There are 12 widgets: 48 with four per box."
    assert scripted.output_text(completions[-1]) == response.msgs[0].content
    for completion, record in zip(completions, records, strict=False):
        assert _calls_in(scripted.output_text(completion)) == [(record.tool_name, record.args)]

    # one line of turns, each continuing the previous one
    assert [c["parent_id"] for c in completions] == [
        None,
        completions[0]["id"],
        completions[1]["id"],
    ]
    assert completions[0]["messages"][0] == {"role": "system", "content": "You manage a warehouse."}
    assert {t["function"]["name"] for t in completions[0]["tools"]} == {
        "lookup_stock",
        "calculator",
    }


async def test_async_step_goes_through_the_session(scripted):
    scripted.replies += [
        scripted.tool_call("calculator", {"expression": "2 ** 10"}),
        "1024",
    ]
    session = scripted.session()
    agent = ChatAgent(
        "Compute.",
        model=session_model(scripted.server.base_url, session.api_key),
        tools=as_function_tools([calculator]),
    )
    response = await agent.astep("2 to the 10th?")
    assert response.msgs[0].content == "1024"
    (record,) = response.info["tool_calls"]
    assert record.result == "1024"
    assert len(session.episode.completions) == 2


def test_function_tools_keep_our_schema_and_report_bad_arguments_as_data():
    (calc,) = as_function_tools([calculator])
    assert calc.get_openai_tool_schema() == calculator.schema
    assert calc.get_function_name() == "calculator"
    assert calc(expression="6*7") == "42"
    assert calc(expr="1").startswith("Error: unknown argument 'expr'")

    def broken(x: int) -> int:
        raise RuntimeError("disk full")

    (tool,) = as_function_tools([function_tool(broken)])
    assert tool(x=1) == "Error: RuntimeError: disk full"
    with pytest.raises(
        TypeError, match=r"expected a list of areal_agents\.tools\.tool\.Tool, got Tool"
    ):
        as_function_tools(calculator)


def test_offline_token_counter(qwen_tokenizer):
    messages = [{"role": "user", "content": "Héllo"}]
    exact = OfflineTokenCounter(qwen_tokenizer)
    rough = OfflineTokenCounter()
    assert isinstance(exact, BaseTokenCounter)
    assert exact.count_tokens_from_messages(messages) == len(qwen_tokenizer.encode_chat(messages))
    assert rough.count_tokens_from_messages(messages) >= exact.count_tokens_from_messages(messages)
    for counter in (exact, rough):
        assert counter.decode(counter.encode("Héllo wörld")) == "Héllo wörld"
    # content CAMEL may send that the template cannot render still gets a count
    odd = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert exact.count_tokens_from_messages(odd) > 0
