"""areal_agents.envs.base and areal_agents.envs.spaces: the episode contract every env inherits."""

from __future__ import annotations

import gymnasium
import pytest

from areal_agents.envs import AgentEnv, AssistantMessage, ChatMessages, EpisodeEnded
from areal_agents.tools import calculator


class EchoEnv(AgentEnv):
    """Say "done" to finish; anything else gets a reply."""

    def _start(self, options):
        self._tools = [calculator]
        return [{"role": "user", "content": "Say done."}], {"task_id": "echo"}

    def _respond(self, message):
        if message["content"] == "done":
            return [], 1.0, True, {"success": True}
        return [{"role": "user", "content": "Again."}], 0.0, False, {}


def call(name, arguments, call_id="c1"):
    function = {"name": name, "arguments": arguments}
    return {"id": call_id, "type": "function", "function": function}


def test_reset_gives_messages_tools_and_task_id():
    env = EchoEnv()
    obs, info = env.reset(seed=0)
    assert obs == [{"role": "user", "content": "Say done."}]
    assert info == {"task_id": "echo", "tools": [calculator.schema]}
    assert env.observation_space.contains(obs)


def test_tool_calls_each_get_one_tool_message_with_errors_recorded():
    env = EchoEnv()
    env.reset(seed=0)
    action = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            call("calculator", '{"expression": "6 * 7"}', "a"),
            call("search", "{}", "b"),
            call("calculator", '{"expression": ', "c"),
            {"id": "d", "type": "function"},
        ],
    }
    obs, reward, terminated, truncated, info = env.step(action)
    assert [m["tool_call_id"] for m in obs] == ["a", "b", "c", "d"]
    assert obs[0]["content"] == "42"
    assert obs[1]["content"] == "Error: unknown tool 'search'; available tools: calculator"
    assert obs[2]["content"].startswith("Error: arguments are not valid JSON")
    assert obs[3]["content"].startswith("Error: malformed tool call")
    errors = [r["error"] for r in info["tool_results"]]
    assert errors == [None, "unknown_tool", "bad_arguments", "bad_tool_call"]
    assert (reward, terminated, truncated) == (0.0, False, False)


def test_a_bare_string_is_an_assistant_message_and_the_transcript_is_kept():
    env = EchoEnv()
    env.reset(seed=0)
    assert env.step("hello")[0] == [{"role": "user", "content": "Again."}]
    _obs, reward, terminated, truncated, info = env.step("done")
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)
    assert [m["role"] for m in env.messages] == ["user", "assistant", "user", "assistant"]


def test_running_out_of_turns_truncates_without_success():
    env = EchoEnv(max_turns=2)
    env.reset(seed=0)
    assert env.step("no")[3] is False
    _obs, _reward, terminated, truncated, info = env.step("no")
    assert (terminated, truncated, info["success"]) == (False, True, False)


def test_step_before_reset_or_after_the_end_raises_reset_needed():
    env = EchoEnv()
    with pytest.raises(EpisodeEnded, match="call reset"):
        env.step("done")
    env.reset(seed=0)
    env.step("done")
    with pytest.raises(gymnasium.error.ResetNeeded):
        env.step("done")


def test_invalid_actions_and_budgets_are_type_and_value_errors():
    env = EchoEnv()
    env.reset(seed=0)
    with pytest.raises(TypeError, match="expected an assistant message"):
        env.step({"role": "user", "content": "hi"})
    with pytest.raises(TypeError, match="got int"):
        env.step(3)
    with pytest.raises(ValueError, match="max_turns must be a positive int"):
        EchoEnv(max_turns=0)


def test_spaces_accept_messages_and_reject_malformed_ones():
    space, actions = ChatMessages(), AssistantMessage()
    assert space.contains([{"role": "system", "content": "x"}, {"role": "user", "content": "y"}])
    assert not space.contains([{"role": "robot", "content": "x"}])
    assert not space.contains([{"role": "tool", "content": "x"}])  # no tool_call_id
    assert actions.contains("plain text")
    assert actions.contains({"role": "assistant", "content": None, "tool_calls": []})
    assert not actions.contains({"role": "user", "content": "x"})
    assert space.contains(space.sample()) and actions.contains(actions.sample())
