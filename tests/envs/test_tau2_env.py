"""``Tau2Env`` behaviour: a scripted conversation, episode endings, tool errors, private
databases for concurrent episodes, dense shaping, agent-driven scoring and ``check_env``."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from areal_agents import envs
from areal_agents.envs.base import EpisodeEnded
from areal_agents.envs.checker import check_env
from areal_agents.envs.tau2 import ScriptedUserSimulator, Tau2Env, get_domain
from areal_agents.envs.tau2.user import UserSimulator
from areal_agents.errors import ConfigError, UserError

RETAIL_TASK = "0"  # exchange of two items of delivered order #W2378156 (Yusuf Rossi)
ORDER = "#W2378156"


def call(name: str, call_id: str = "call_1", **arguments: Any) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        ],
    }


def make_env(turns: list[str] | None = None, **kwargs: Any) -> Tau2Env:
    user = ScriptedUserSimulator(turns or ["I want to exchange two items.", "###STOP###"])
    return Tau2Env(kwargs.pop("domain", "retail"), user_simulator=user, **kwargs)


def gold_calls(task_id: str, domain: str = "retail") -> list[dict[str, Any]]:
    task = get_domain(domain).data.task(task_id)
    return [call(a.name, f"call_{i}", **a.arguments) for i, a in enumerate(task.actions)]


def test_scripted_conversation_end_to_end() -> None:
    env = make_env(["I want to exchange items of an order.", "Yes, do it.", "###STOP###"])
    obs, info = env.reset(options={"task_id": RETAIL_TASK})
    assert obs[0]["role"] == "system" and "Retail agent policy" in obs[0]["content"]
    assert obs[1] == {"role": "assistant", "content": "Hi! How can I help you today?"}
    assert obs[2] == {"role": "user", "content": "I want to exchange items of an order."}
    assert info["task_id"] == RETAIL_TASK and info["domain"] == "retail"
    names = {tool["function"]["name"] for tool in info["tools"]}
    assert {"exchange_delivered_order_items", "transfer_to_human_agents", "calculate"} <= names

    obs, reward, terminated, truncated, info = env.step(call("get_order_details", order_id=ORDER))
    assert obs[0]["role"] == "tool" and obs[0]["tool_call_id"] == "call_1"
    assert json.loads(obs[0]["content"])["status"] == "delivered"
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info["tool_results"] == [
        {"tool_call_id": "call_1", "name": "get_order_details", "error": None}
    ]

    obs, reward, terminated, _, _ = env.step("I can exchange them. Confirm?")
    assert obs == [{"role": "user", "content": "Yes, do it."}] and not terminated

    for message in gold_calls(RETAIL_TASK):
        env.step(message)
    obs, reward, terminated, truncated, info = env.step("Done, the exchange is requested.")
    assert obs == [{"role": "user", "content": "###STOP###"}]
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info["success"] and info["termination"] == "user_stop"
    assert info["reward_info"]["breakdown"] == {"DB": 1.0, "COMMUNICATE": 1.0}
    with pytest.raises(EpisodeEnded):
        env.step("anything")


def test_tool_errors_are_messages_not_exceptions() -> None:
    env = make_env()
    env.reset(options={"task_id": RETAIL_TASK})
    obs, *_, info = env.step(
        call("cancel_pending_order", order_id=ORDER, reason="no longer needed")
    )
    assert obs[0]["content"] == "Error: Non-pending order cannot be cancelled"
    assert info["tool_results"][0]["error"] == "tool_exception"
    obs, *_, info = env.step(call("get_order_details", order_id="#W0"))
    assert obs[0]["content"] == "Error: Order not found"
    obs, *_, info = env.step(call("get_order_details", order_ids="x"))
    assert obs[0]["content"].startswith("Error: unknown argument 'order_ids'")
    assert info["tool_results"][0]["error"] == "bad_arguments"
    obs, *_, info = env.step(call("calculate", expression="(2 + 3) * 1.5"))
    assert obs[0]["content"] == "7.5"
    obs, *_, info = env.step(call("calculate", expression="__import__('os')"))
    assert obs[0]["content"] == "Error: Invalid characters in expression"


def test_transfer_to_human_agents_ends_the_episode() -> None:
    env = make_env()
    env.reset(options={"task_id": "50"})  # gold: transfer right away
    obs, reward, terminated, truncated, info = env.step(
        call("transfer_to_human_agents", summary="The user wants a human.")
    )
    assert obs[0]["content"] == "Transfer successful"
    assert (terminated, truncated) == (True, False)
    assert info["termination"] == "transfer" and reward == 1.0 and info["success"]
    with pytest.raises(EpisodeEnded):
        env.step("hello?")


@pytest.mark.parametrize(
    ("token", "reason"),
    [("###TRANSFER###", "transfer"), ("###OUT-OF-SCOPE###", "out_of_scope")],
)
def test_user_stop_tokens_end_the_episode(token: str, reason: str) -> None:
    env = make_env(["Hello.", f"Fine. {token}"])
    env.reset(options={"task_id": "57"})  # no gold actions, nothing to communicate
    _, reward, terminated, _, info = env.step("How can I help?")
    assert terminated and info["termination"] == reason and reward == 1.0


def test_agent_stop_token_ends_the_episode_and_a_write_fails_a_read_only_task() -> None:
    env = make_env(["Hello."] * 5)
    env.reset(options={"task_id": "57"})
    env.step(call("cancel_pending_order", order_id="#W8855135", reason="ordered by mistake"))
    _, reward, terminated, _, info = env.step("###STOP###")
    assert terminated and info["termination"] == "agent_stop"
    assert reward == 0.0 and info["reward_info"]["changed"] == ["orders/#W8855135"]


def test_max_turns_truncates_with_zero_reward() -> None:
    env = make_env(["Hello."] * 10, max_turns=2)
    env.reset(options={"task_id": "57"})
    _, _, terminated, truncated, _ = env.step("Hi")
    assert not (terminated or truncated)
    _, reward, terminated, truncated, info = env.step("Hi again")
    assert (terminated, truncated, reward) == (False, True, 0.0)
    assert info["termination"] == "max_turns" and info["final_reward"] == 0.0
    assert not info["success"]


def test_concurrent_episodes_do_not_share_database_state() -> None:
    pending = "#W8855135"
    a, b = make_env(), make_env()
    a.reset(options={"task_id": "57"})
    b.reset(options={"task_id": "57"})
    obs, *_ = a.step(call("cancel_pending_order", order_id=pending, reason="ordered by mistake"))
    assert json.loads(obs[0]["content"])["status"] == "cancelled"
    obs, *_ = b.step(call("get_order_details", order_id=pending))
    assert json.loads(obs[0]["content"])["status"] == "pending"
    assert get_domain("retail").data.db["orders"][pending]["status"] == "pending"
    # a fresh episode of the same env starts from the pristine database again
    a.reset(options={"task_id": "57"})
    obs, *_ = a.step(call("get_order_details", order_id=pending))
    assert json.loads(obs[0]["content"])["status"] == "pending"


def test_concurrent_threads_each_get_their_own_outcome() -> None:
    """Eight threads run the same task at once: the odd ones make a wrong write."""
    results: dict[int, float] = {}
    calls = gold_calls(RETAIL_TASK)
    wrong = call(
        "exchange_delivered_order_items",
        "call_x",
        order_id=ORDER,
        item_ids=["1151293680"],
        new_item_ids=["7706410293"],
        payment_method_id="credit_card_9513926",
    )
    barrier = threading.Barrier(8)

    def episode(index: int) -> None:
        env = make_env()
        env.reset(options={"task_id": RETAIL_TASK})
        barrier.wait()
        for message in calls[:-1] + ([wrong] if index % 2 else [calls[-1]]):
            env.step(message)
        results[index] = env.step("All done.")[1]

    threads = [threading.Thread(target=episode, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {i: 0.0 if i % 2 else 1.0 for i in range(8)}


def test_dense_reward_credits_matching_writes_once() -> None:
    env = make_env(dense_reward=True, dense_weight=0.2)
    env.reset(options={"task_id": "11"})
    task = get_domain("retail").data.task("11")
    writes = [a for a in task.actions if a.name in get_domain("retail").write_tools]
    assert len(writes) == 2
    total = 0.0
    for message in gold_calls("11"):
        total += env.step(message)[1]
    assert total == pytest.approx(0.2)
    assert env.step(gold_calls("11")[-1])[1] == 0.0  # repeating a write earns nothing
    off = make_env()
    off.reset(options={"task_id": "11"})
    assert sum(off.step(m)[1] for m in gold_calls("11")) == 0.0


def test_agent_driven_mode_tools_and_score() -> None:
    env = make_env()
    env.reset(options={"task_id": RETAIL_TASK})
    tools = {tool.name: tool for tool in env.tools()}
    for action in get_domain("retail").data.task(RETAIL_TASK).actions:
        assert tools[action.name].call(dict(action.arguments)).ok
    reward, info = env.score([{"role": "assistant", "content": "Exchange requested."}])
    assert reward == 1.0 and info["success"]


def test_splits_seeds_and_task_selection() -> None:
    env = make_env(split="test")
    ids = env.task_ids()
    assert len(ids) == 40 and set(ids) == set(get_domain("retail").data.splits["test"])
    first = env.reset(seed=3)
    assert env.reset(seed=3) == first and first[1]["task_id"] in ids
    assert env.reset(options={"task_index": 0})[1]["task_id"] == ids[0]
    with pytest.raises(UserError, match="not in tau2 retail split 'test'"):
        env.reset(options={"task_id": "no-such-task"})


def test_configuration_errors_are_clear() -> None:
    with pytest.raises(ConfigError, match="domain"):
        Tau2Env("telecom")
    with pytest.raises(ConfigError, match="split"):
        Tau2Env("retail", split="validation")
    with pytest.raises(ConfigError, match="needs a user simulator"):
        Tau2Env("retail").reset()


class _BrokenUser(UserSimulator):
    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at

    async def respond(self, task: Any, conversation: Any) -> str:
        if sum(m["role"] == "user" for m in conversation) >= self.fail_at:
            raise RuntimeError("simulator down")
        return "Hello."


@pytest.mark.parametrize("fail_at", [0, 1])
@pytest.mark.parametrize("first_action", ["How can I help?", call("list_all_airports")])
def test_user_simulator_failure_is_recorded_not_raised(fail_at: int, first_action: Any) -> None:
    env = Tau2Env("airline", user_simulator=_BrokenUser(fail_at))
    _, info = env.reset(options={"task_id": "0"})
    assert ("error" in info) == (fail_at == 0)
    if fail_at == 1 and isinstance(first_action, dict):  # a tool turn does not ask the user
        assert not env.step(first_action)[2]
        first_action = "How can I help?"
    _, reward, terminated, _, info = env.step(first_action)
    assert terminated and reward == 0.0 and not info["success"]
    assert info["error"]["kind"] == "env_error" and "simulator down" in info["error"]["message"]


@pytest.mark.parametrize("env_id", ["areal/Tau2Retail-v0", "areal/Tau2Airline-v0"])
def test_check_env_passes_with_the_scripted_user(env_id: str) -> None:
    user = ScriptedUserSimulator(["Hello, I need help.", "###STOP###"])
    env = envs.make(env_id, user_simulator=user)
    assert isinstance(env.unwrapped, Tau2Env)
    check_env(env.unwrapped)
    check_env(Tau2Env("airline" if "Airline" in env_id else "retail", user_simulator=user))


def test_airline_tool_errors_match_the_benchmark() -> None:
    env = make_env(domain="airline")
    env.reset(options={"task_id": "0"})
    booking: dict[str, Any] = {
        "user_id": "mia_li_3668",
        "origin": "JFK",
        "destination": "SEA",
        "flight_type": "one_way",
        "cabin": "economy",
        "flights": [{"flight_number": "HAT136", "date": "2024-05-20"}],
        "passengers": [{"first_name": "Mia", "last_name": "Li", "dob": "1990-04-05"}],
        "payment_methods": [{"payment_id": "credit_card_4421486", "amount": 1}],
        "total_baggages": 0,
        "nonfree_baggages": 0,
        "insurance": "no",
    }
    obs, *_ = env.step(call("book_reservation", **booking))
    assert obs[0]["content"].startswith("Error: Payment amount does not add up, total price is ")
    missing_dob: dict[str, Any] = {
        **booking,
        "passengers": [{"first_name": "Mia", "last_name": "Li"}],
    }
    obs, *_, info = env.step(call("book_reservation", **missing_dob))
    assert "missing key 'dob'" in obs[0]["content"]
    assert info["tool_results"][0]["error"] == "bad_arguments"
    obs, *_ = env.step(call("get_flight_status", flight_number="HAT999", date="2024-05-20"))
    assert obs[0]["content"] == "Error: Flight HAT999 not found"
    obs, *_ = env.step(call("send_certificate", user_id="nobody", amount=100))
    assert obs[0]["content"] == "Error: User nobody not found"
    assert env.db is not None and env.db.diff(get_domain("airline").new_database()) == []
