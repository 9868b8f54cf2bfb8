"""MCP tools: a real MCP server (tests/core/mcp_test_server.py, written with the mcp package)
in a subprocess, its tools listed as OpenAI tool schemas, called with time limits, its
failures turned into tool messages; the same tools inside an env (``envs.make(id, mcp=...)``).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp.client.client", reason="needs the mcp package, 2.x")

from areal_agents import envs
from areal_agents.errors import ConfigError
from areal_agents.tools.mcp_client import MCPConnection, MCPServerConfig, connect
from areal_agents.tools.tool import Tool

SERVER = str(Path(__file__).with_name("mcp_test_server.py"))
COMMAND = [sys.executable, SERVER]


@pytest.fixture(scope="module")
def conn() -> Any:
    connection = MCPConnection({"command": COMMAND, "timeout_s": 1.0}).open()
    yield connection
    connection.close()


def _tool(conn: MCPConnection, name: str) -> Tool:
    return next(t for t in conn.tools() if t.name == name)


def test_tools_are_listed_as_openai_tool_schemas(conn):
    names = [t.name for t in conn.tools()]
    assert names == ["add", "lookup", "fail", "slow", "crash", "counter"]
    schema = _tool(conn, "add").schema
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "add"
    assert function["description"] == "Add two integers."
    params = function["parameters"]
    assert params["type"] == "object"
    assert params["required"] == ["a"]
    assert params["properties"]["a"]["type"] == "integer"
    assert params["properties"]["b"]["default"] == 1
    # a tool without arguments still has an object schema
    assert _tool(conn, "counter").schema["function"]["parameters"]["properties"] == {}


def test_calls_give_text_structured_and_error_results(conn):
    assert _tool(conn, "add").call('{"a": 2, "b": 3}').content == "5"
    looked = _tool(conn, "lookup").call({"city": "Paris"})
    assert looked.ok and '"population": 5000' in looked.content  # structured content as JSON
    failed = _tool(conn, "fail").call({"reason": "no"})
    assert failed.error == "tool_exception"
    assert failed.content.startswith("Error: ") and "refused: no" in failed.content


def test_model_mistakes_are_caught_before_the_server(conn):
    result = _tool(conn, "add").call('{"a": "two"}')
    assert result.error == "bad_arguments"
    assert "argument 'a' must be an integer" in result.content
    assert "a (integer, required), b (integer, default 1)" in result.content
    assert _tool(conn, "add").call("{not json").error == "bad_arguments"


def test_a_slow_call_times_out_with_a_tool_message(conn):
    start = time.perf_counter()
    result = _tool(conn, "slow").call({"seconds": 5})
    assert time.perf_counter() - start < 3.5
    assert result.error == "timeout"
    assert result.content == "Error: MCP tool 'slow' timed out after 1 s"
    assert _tool(conn, "add").call({"a": 1}).content == "2"  # the connection goes on


async def test_async_calls_from_another_event_loop_run_concurrently(conn):
    add = _tool(conn, "add")
    results = await asyncio.gather(*[add.acall({"a": i, "b": i}) for i in range(8)])
    assert [r.content for r in results] == [str(2 * i) for i in range(8)]
    slow = await _tool(conn, "slow").acall({"seconds": 5})
    assert slow.error == "timeout"


def test_a_crash_is_a_tool_error_and_the_next_call_reconnects():
    conn = MCPConnection({"command": COMMAND, "timeout_s": 5.0, "name": "crashy"}).open()
    try:
        counter = _tool(conn, "counter")
        first = counter.call({}).content.split()
        crashed = _tool(conn, "crash").call({})
        assert crashed.error == "mcp_error"
        assert "server 'crashy' is unreachable" in crashed.content
        again = counter.call({}).content.split()  # a new server process
        assert again[0] == "1" and again[1] != first[1]
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({}, "give exactly one of 'command'"),
        ({"command": ["x"], "url": "http://h/mcp"}, "give exactly one of 'command'"),
        ({"url": "localhost:8000"}, "expected an http:// or https:// URL"),
        ({"command": []}, "non-empty list of strings"),
        ({"command": ["x"], "timeout_s": 0}, "mcp.timeout_s: expected a positive number"),
        ({"command": ["x"], "scope": "episode"}, "mcp.scope: expected 'process'"),
        ({"command": ["x"], "tool": ["a"]}, "unknown key(s) ['tool']"),
        ({"command": ["x"], "prefix": "a.b"}, "mcp.prefix"),
        ("python server.py", "expected a mapping"),
    ],
)
def test_bad_configs_name_the_fix(config, message):
    with pytest.raises(ConfigError) as err:
        MCPServerConfig.parse(config)
    assert message in str(err.value)


def test_a_command_string_is_split_like_a_shell():
    cfg = MCPServerConfig.parse({"command": "python 'my server.py' --x"})
    assert cfg.command == ("python", "my server.py", "--x")


def test_a_server_that_does_not_start_is_a_config_error():
    with pytest.raises(ConfigError, match=r"did not start: .*check that the command runs"):
        MCPConnection({"command": ["/nonexistent/mcp-server"]}).open()
    with pytest.raises(ConfigError, match="did not start"):
        MCPConnection({"command": [sys.executable, "-c", "import sys; sys.exit(1)"]}).open()
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="raise connect_timeout_s"):
        MCPConnection(
            {
                "command": [sys.executable, "-c", "import time; time.sleep(30)"],
                "connect_timeout_s": 1,
            }
        ).open()
    assert time.perf_counter() - start < 10


def test_a_tools_list_naming_a_missing_tool_is_a_config_error():
    with pytest.raises(ConfigError, match=r"has no tool\(s\) \['nope'\]; it lists"):
        MCPConnection({"command": COMMAND, "tools": ["add", "nope"]}).open()


def test_env_gets_the_mcp_tools_and_runs_them_in_step():
    mcp = {"command": COMMAND, "tools": ["add", "fail"], "prefix": "m_", "timeout_s": 2}
    env = envs.make("areal/Calculator-v0", mcp=mcp)
    again = envs.make("areal/Calculator-v0", mcp=mcp)
    try:
        _, info = env.reset(seed=0)
        assert [t["function"]["name"] for t in info["tools"]] == ["calculator", "m_add", "m_fail"]
        # scope "process": both envs share one connection
        assert again.tools()[1].connection is env.tools()[1].connection
        calls = [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "m_add", "arguments": '{"a": 4}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "m_fail", "arguments": '{"reason": "x"}'},
            },
        ]
        obs, _, terminated, _, info = env.step({"role": "assistant", "tool_calls": calls})
        assert obs[0]["content"] == "5" and obs[1]["content"].endswith("refused: x")
        assert [r["error"] for r in info["tool_results"]] == [None, "tool_exception"]
        assert not terminated
    finally:
        env.close()
        again.close()
    assert connect(MCPServerConfig.parse(mcp)).tools()[0].call({"a": 1}).content == "2"


def test_env_scope_opens_one_server_per_env_and_closes_it():
    env = envs.make("areal/Calculator-v0", mcp={"command": COMMAND, "scope": "env"})
    conn = env.tools()[1].connection
    assert conn.tools()[0].call({"a": 1}).content == "2"
    env.close()
    assert conn.tools()[0].call({"a": 1}).error == "mcp_error"  # closed with the env


def test_a_clash_with_an_env_tool_fails_the_reset_naming_the_fix():
    env = envs.make("areal/Calculator-v0")
    env.add_tools([Tool("calculator", "another", {"type": "object"}, lambda: "1")])
    with pytest.raises(ConfigError, match="give the MCP server a 'prefix'"):
        env.reset(seed=0)


def test_bad_mcp_kwarg_fails_make():
    with pytest.raises(ConfigError, match="env areal/Calculator-v0: mcp: expected a server"):
        envs.make("areal/Calculator-v0", mcp="python server.py")
    with pytest.raises(ConfigError, match=r"mcp\[1\]: give exactly one"):
        envs.make("areal/Calculator-v0", mcp=[{"command": COMMAND}, {}])
