"""MCP both ways with the OpenAI Agents SDK: ``areal-agent mcp-serve`` used by the SDK's own
MCP client (``agents.mcp.MCPServerStdio``), by an SDK agent through the recording proxy,
and by our client over streamable HTTP; an SDK agent and an env-driven episode calling a
real MCP server's tools (tests/core/mcp_test_server.py).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp.client.client", reason="needs the mcp package, 2.x")
from tests.integrations.test_openai_agents import _require

agents = _require("agents")
from agents.mcp import MCPServerStdio  # noqa: E402

from areal_agents import envs  # noqa: E402
from areal_agents.integrations.openai_agents import run_agent  # noqa: E402
from areal_agents.rollout.runner import Runner  # noqa: E402
from areal_agents.tools.mcp_client import MCPConnection, mcp_tools  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TEST_SERVER = [sys.executable, str(ROOT / "tests" / "core" / "mcp_test_server.py")]
SERVE = [sys.executable, "-m", "areal_agents.cli.main", "mcp-serve", "--env", "areal/Calculator-v0"]


def _stdio_params(*extra: str) -> dict[str, Any]:
    return {"command": SERVE[0], "args": [*SERVE[1:], *extra], "cwd": str(ROOT)}


async def test_mcp_serve_with_the_agents_sdk_mcp_client():
    env = envs.make("areal/Calculator-v0")
    env.reset(seed=0)
    (own,) = env.tools()
    async with MCPServerStdio(
        _stdio_params(), client_session_timeout_seconds=30, use_structured_content=False
    ) as server:
        listed = {t.name: t for t in await server.list_tools()}
        assert sorted(listed) == ["calculator", "reset_task", "submit_answer"]
        # the env's own schema and description
        assert listed["calculator"].input_schema == own.parameters
        assert listed["calculator"].description == own.description

        task = await server.call_tool("reset_task", {"seed": 3})
        assert not task.is_error
        assert "Compute (790 + 42) * 69." in task.content[0].text
        assert task.structured_content["messages"][-1]["role"] == "user"

        product = await server.call_tool("calculator", {"expression": "(790 + 42) * 69"})
        assert (product.is_error, product.content[0].text) == (False, "57408")
        bad = await server.call_tool("calculator", {"expression": "1 / 0"})
        assert bad.is_error and bad.content[0].text == "division by zero"

        scored = await server.call_tool("submit_answer", {"answer": "The answer is 57408."})
        assert scored.structured_content["reward"] == 1.0
        assert scored.structured_content["success"] is True
        assert scored.structured_content["info"]["tool_used"] is True
        late = await server.call_tool("calculator", {"expression": "1 + 1"})
        assert late.is_error and "call reset_task" in late.content[0].text


async def test_an_sdk_agent_uses_mcp_serve_through_the_recording_proxy(scripted):
    scripted.replies += [
        scripted.tool_call("calculator", {"expression": "37 * 12 + 5"}),
        "The answer is 449.",
    ]
    async with MCPServerStdio(_stdio_params(), client_session_timeout_seconds=30) as server:
        agent = agents.Agent(name="solver", instructions="Use the tools.", mcp_servers=[server])
        session = scripted.session()
        result = await run_agent(
            agent,
            "Compute 37 * 12 + 5.",
            base_url=scripted.server.base_url,
            api_key=session.api_key,
        )
    assert result.final_output == "The answer is 449."
    first, second = scripted.trajectory(session)["completions"]
    assert {t["function"]["name"] for t in first["tools"]} >= {"calculator", "submit_answer"}
    (fed,) = [m for m in second["messages"] if m["role"] == "tool"]
    assert "449" in fed["content"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_mcp_serve_over_streamable_http_with_our_client():
    port = _free_port()
    proc = subprocess.Popen(
        [*SERVE, "--transport", "http", "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
                assert time.monotonic() < deadline, "mcp-serve --transport http did not listen"
                time.sleep(0.2)
        conn = MCPConnection({"url": f"http://127.0.0.1:{port}/mcp", "timeout_s": 10}).open()
        try:
            by_name = {t.name: t for t in conn.tools()}
            assert sorted(by_name) == ["calculator", "reset_task", "submit_answer"]
            assert by_name["calculator"].call({"expression": "2 ** 10"}).content == "1024"
            wrong = by_name["submit_answer"].call({"answer": "The answer is 1."})
            assert wrong.ok and wrong.content.startswith("reward: 0")
        finally:
            conn.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_mcp_serve_reports_a_bad_env_before_serving():
    out = subprocess.run(
        [*SERVE[:-1], "areal/Calculater-v0"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert "Did you mean 'areal/Calculator-v0'" in out.stderr


async def test_an_sdk_agent_calls_a_real_mcp_servers_tools(scripted):
    tools = mcp_tools({"command": TEST_SERVER, "tools": ["add", "lookup"]})
    scripted.replies += [
        scripted.tool_call("add", {"a": 20, "b": 22}),
        scripted.tool_call("lookup", {"city": "Oslo"}),
        "42, and Oslo has 4000 people.",
    ]
    agent = agents.Agent(name="mcp-user", instructions="Use the tools.")
    session = scripted.session()
    result = await run_agent(
        agent,
        "Add 20 and 22.",
        base_url=scripted.server.base_url,
        api_key=session.api_key,
        tools=tools,
    )
    assert result.final_output == "42, and Oslo has 4000 people."
    completions = scripted.trajectory(session)["completions"]
    assert [t["function"]["name"] for t in completions[0]["tools"]] == ["add", "lookup"]
    fed = [m["content"] for c in completions[1:] for m in c["messages"] if m["role"] == "tool"]
    assert fed[0] == "42"
    assert json.loads(fed[-1]) == {"city": "Oslo", "population": 4000}


async def test_an_env_driven_episode_goes_on_after_the_mcp_server_crashes(scripted):
    mcp = {"command": TEST_SERVER, "tools": ["add", "crash"], "prefix": "m_", "scope": "env"}
    scripted.replies += [
        scripted.tool_call("m_add", {"a": 1, "b": 2}),
        scripted.tool_call("m_crash", {}),
        scripted.tool_call("m_add", {"a": 3}),
        "The answer is 3.",
    ]
    runner = Runner(scripted.server.proxy, max_turns=6, episode_timeout_s=120)
    result = await runner.run_episode(
        lambda: envs.make("areal/Calculator-v0", mcp=mcp, max_turns=6), seed=0
    )
    assert result.end_reason == "terminated", result.error
    last = result.episode.completions[-1]
    tool_messages = [m["content"] for m in last.messages if m["role"] == "tool"]
    assert tool_messages[0] == "3"
    assert tool_messages[1].startswith("Error: MCP tool 'crash' failed")
    assert tool_messages[2] == "4"  # reconnected: a new server process
