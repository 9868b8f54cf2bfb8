"""Search-v0 demonstrations and evidence: ``demos()`` follows the gold chains of the train
split with the env's own tool results, a replayed demonstration is a grounded success, the
info names the gold and opened documents, evaluation reports grounded success and success
per hop count, and the recipe's kwargs give a test split of at least 128 questions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from areal_agents.envs.search import QAExample, SearchEnv
from areal_agents.errors import UserError
from areal_agents.rollout.evaluate import summarize
from areal_agents.rollout.runner import EpisodeResult
from areal_agents.tools.retriever import Document
from areal_agents.trajectory import Episode

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "agents" / "search.yaml"
KWARGS: dict[str, Any] = {"kb_questions": 600, "hops": [1, 2], "test_fraction": 0.25}


def _call(i: int, name: str, **arguments: Any) -> dict[str, Any]:
    function = {"name": name, "arguments": json.dumps(arguments)}
    call = {"id": f"call_{i}", "type": "function", "function": function}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


@pytest.fixture(scope="module")
def env() -> SearchEnv:
    return SearchEnv(**KWARGS)


@pytest.fixture(scope="module")
def demos(env: SearchEnv) -> list[list[dict[str, Any]]]:
    return env.demos(40, seed=3)


def _task(env: SearchEnv, question: str) -> QAExample:
    return next(t for t in env.tasks if t.question == question)


def test_demos_are_search_open_per_gold_document_then_the_answer(
    env: SearchEnv, demos: list[list[dict[str, Any]]]
) -> None:
    tools = {t.name: t for t in env.tools()}
    titles = {d.id: d.title for d in env.retriever.documents}
    assert {_task(env, d[1]["content"]).hops for d in demos} == {1, 2}
    for demo in demos:
        task = _task(env, demo[1]["content"])
        assert [m["role"] for m in demo[:2]] == ["system", "user"]
        assert len(demo) == 2 + 4 * task.hops + 1
        turns = demo[2:-1]
        for k, doc_id in enumerate(task.chain):
            search, found, opened, read = turns[4 * k : 4 * k + 4]
            [s_call], [o_call] = search["tool_calls"], opened["tool_calls"]
            assert s_call["function"]["name"] == "search" and o_call["function"]["name"] == "open"
            query = json.loads(s_call["function"]["arguments"])["query"]
            assert (
                query == titles[doc_id]
            )  # the entity's name, as the question or a document gives it
            assert json.loads(o_call["function"]["arguments"]) == {"doc": doc_id}
            assert (found["tool_call_id"], read["tool_call_id"]) == (s_call["id"], o_call["id"])
            # the observations are the env's own tools' results
            assert found["content"] == tools["search"].call(json.dumps({"query": query})).content
            assert read["content"] == tools["open"].call(json.dumps({"doc": doc_id})).content
        if task.hops == 2:  # the bridge entity is named in the first document
            assert titles[task.chain[1]] in turns[3]["content"]
        assert demo[-1] == {"role": "assistant", "content": f"Answer: {task.answers[0]}"}
        assert len({c["id"] for m in turns for c in m.get("tool_calls") or []}) == 2 * task.hops


def test_demos_use_train_questions_only_distinct_and_seeded(env: SearchEnv) -> None:
    test_questions = {t.question for t in SearchEnv(**KWARGS, split="test").tasks}
    train_questions = {t.question for t in env.tasks}
    every = env.demos(len(env.tasks), seed=0)
    asked = [d[1]["content"] for d in every]
    assert set(asked) == train_questions and not set(asked) & test_questions
    assert env.demos(5, seed=1) == env.demos(5, seed=1) != env.demos(5, seed=2)
    more = env.demos(len(env.tasks) + 3, seed=0)  # past the pool the questions repeat
    assert len(more) == len(env.tasks) + 3 and set(d[1]["content"] for d in more) == train_questions
    assert env.demos(0) == []


def test_a_replayed_demo_is_a_grounded_success(
    env: SearchEnv, demos: list[list[dict[str, Any]]]
) -> None:
    fresh = SearchEnv(**KWARGS)
    for demo in demos[:10]:
        task = _task(fresh, demo[1]["content"])
        obs, info = fresh.reset(seed=0, options={"task_id": task.id})
        assert obs == demo[:2] and info["hops"] == task.hops and info["kind"] == f"{task.hops}-hop"
        assert "gold_documents" not in info  # an agent sees the reset info
        position, reward, step_info = 2, 0.0, dict[str, Any]()
        for message in demo[2:]:
            if message["role"] != "assistant":
                continue
            new, reward, terminated, truncated, step_info = fresh.step(message)
            assert new == demo[position + 1 : position + 1 + len(new)]
            position += 1 + len(new)
        assert terminated and not truncated and reward == 1.0
        assert step_info["success"] and step_info["grounded"] is True
        assert step_info["hops"] == task.hops and step_info["gold_documents"] == list(task.chain)
        assert step_info["opened_documents"] == list(task.chain)
        assert step_info["gold_documents_opened"] == task.hops
        # scored as an agent's own conversation, the same
        score, score_info = SearchEnv(**KWARGS).score(demo)
        assert score == 1.0 and score_info["grounded"] is True


def test_grounded_needs_every_gold_document_opened(env: SearchEnv) -> None:
    task = next(t for t in env.tasks if t.hops == 2)
    env.reset(options={"task_id": task.id})
    *_, info = env.step(f"Answer: {task.answers[0]}")  # right, but from nowhere
    assert info["success"] and info["grounded"] is False and info["opened_documents"] == []
    env.reset(options={"task_id": task.id})
    *_, info = env.step(_call(0, "open", doc=task.chain[0]))
    assert info["gold_documents"] == list(task.chain)
    assert info["opened_documents"] == [task.chain[0]]
    env.step(_call(1, "open", doc="no such document"))  # an error opens nothing
    *_, info = env.step(f"Answer: {task.answers[0]}")
    assert info["success"] and info["grounded"] is False and info["gold_documents_opened"] == 1
    env.reset(options={"task_id": task.id})
    for i, doc in enumerate(task.chain):  # by title counts as well as by id
        env.step(_call(i, "open", doc=env.retriever.get(doc).title))  # type: ignore[union-attr]
    *_, info = env.step("Answer: somewhere else")
    assert not info["success"] and info["grounded"] is False  # grounded means a success
    assert info["gold_documents_opened"] == 2


def test_questions_without_a_gold_chain_have_no_grounding_and_no_demos() -> None:
    docs = [Document("d1", "Velo", "Velo is a river.")]
    qa = [QAExample("a", "What is Velo?", ("a river",)), QAExample("b", "Velo?", ("river",))]
    env = SearchEnv(corpus=docs, qa=qa, split="all")
    _, info = env.reset(options={"task_id": "a"})
    assert info["hops"] == 0 and "kind" not in info
    *_, info = env.step("Answer: a river")
    assert info["success"] and info["grounded"] is None
    with pytest.raises(UserError, match="split='train'"):
        env.demos(1)
    with pytest.raises(UserError, match="'chain' of document ids"):
        SearchEnv(corpus=docs, qa=qa, test_fraction=0.0).demos(1)


def test_demos_refuse_the_test_split_and_too_few_turns() -> None:
    with pytest.raises(UserError, match="split='train'"):
        SearchEnv(**KWARGS, split="test").demos(1)
    with pytest.raises(UserError, match="max_turns=4"):
        SearchEnv(**KWARGS, max_turns=4).demos(8)
    one_hop = SearchEnv(**{**KWARGS, "hops": [1]}, max_turns=4).demos(8)
    assert len(one_hop) == 8 and all(len(d) == 7 for d in one_hop)


def test_the_recipes_test_split_holds_128_questions_of_both_hop_counts() -> None:
    kwargs = yaml.safe_load(RECIPE.read_text())["env"]["kwargs"]
    test = SearchEnv(**kwargs, split="test").tasks
    train = SearchEnv(**kwargs).tasks
    assert len(test) >= 128
    assert {t.hops for t in test} == {t.hops for t in train} == {1, 2}
    assert min(sum(t.hops == h for t in test) for h in (1, 2)) >= 50
    assert not {t.id for t in test} & {t.id for t in train}


def test_evaluation_reports_grounded_success_and_success_per_hop_count(env: SearchEnv) -> None:
    def result(task: QAExample, messages: list[Any]) -> EpisodeResult:
        _, reset_info = env.reset(options={"task_id": task.id})
        info: dict[str, Any] = {}
        for message in messages:
            _, _, _, _, info = env.step(message)
        task_info = {k: v for k, v in reset_info.items() if k != "tools"}
        success = info.get("success")
        return EpisodeResult(
            Episode("s"), float(bool(success)), success, len(messages), "terminated",
            info={**info, "task": task_info},
        )  # fmt: skip

    one = next(t for t in env.tasks if t.hops == 1)
    two = next(t for t in env.tasks if t.hops == 2)
    read = [_call(0, "open", doc=one.chain[0]), f"Answer: {one.answers[0]}"]
    guessed = [f"Answer: {two.answers[0]}"]
    wrong = [_call(0, "open", doc=two.chain[0]), "Answer: nobody"]
    groups = [[result(one, read)], [result(two, guessed)], [result(two, wrong)]]
    report = summarize("areal/Search-v0", groups, k=1)
    assert report.success_rate == pytest.approx(2 / 3)
    assert report.grounded_success_rate == pytest.approx(1 / 3)
    assert report.by_kind == {"1-hop": 1.0, "2-hop": 0.5}
    assert "grounded success" in report.table()


def test_evidence_reward_pays_each_gold_document_once_by_hand() -> None:
    """r_turn = turn_reward + evidence_reward * |newly opened gold documents|: a 2-hop
    episode with turn_reward -0.01 and evidence_reward 0.25 that opens gold 1, gold 1 again,
    a wrong document, then gold 2, earns -0.01 + 0.25, -0.01, -0.01, -0.01 + 0.25, then 1."""
    env = SearchEnv(**KWARGS, turn_reward=-0.01, evidence_reward=0.25)
    task = next(t for t in env.tasks if t.hops == 2)
    other = next(d for d in env.retriever.documents if d.id not in task.chain)
    env.reset(options={"task_id": task.id})
    opens = [task.chain[0], task.chain[0], other.id, task.chain[1]]
    rewards = [env.step(_call(i, "open", doc=doc))[1] for i, doc in enumerate(opens)]
    assert rewards == pytest.approx([0.24, -0.01, -0.01, 0.24])
    _, final, terminated, _, info = env.step(f"Answer: {task.answers[0]}")
    assert terminated and final == 1.0 and info["grounded"] is True
    # the same conversation scored as an agent's own: the same turn rewards
    messages = [{"role": "user", "content": task.question}]
    for i, doc in enumerate(opens):
        messages += [_call(i, "open", doc=doc), {"role": "tool", "tool_call_id": f"call_{i}"}]
    messages.append({"role": "assistant", "content": f"Answer: {task.answers[0]}"})
    score, score_info = SearchEnv(**KWARGS, turn_reward=-0.01, evidence_reward=0.25).score(messages)
    assert score == 1.0 and score_info["grounded"] is True
    assert score_info["tool_rewards"] == pytest.approx(
        {"call_0": 0.24, "call_1": -0.01, "call_2": -0.01, "call_3": 0.24}
    )


def test_evidence_on_answer_by_hand() -> None:
    """With evidence_on_answer, the tool turns earn turn_reward only and the answer earns
    match + evidence_reward * |gold documents opened|: a 2-hop episode that opens both gold
    documents and answers wrong earns 0, 0, then 0.5; one that runs out of turns (max_turns
    3) earns 0; the right answer after both, 1.5."""
    kwargs = {**KWARGS, "evidence_reward": 0.25, "evidence_on_answer": True, "max_turns": 3}
    env = SearchEnv(**kwargs)
    task = next(t for t in env.tasks if t.hops == 2)
    env.reset(options={"task_id": task.id})
    rewards = [env.step(_call(i, "open", doc=doc))[1] for i, doc in enumerate(task.chain)]
    _, final, terminated, _, info = env.step("Answer: nowhere")
    assert [*rewards, final] == pytest.approx([0.0, 0.0, 0.5]) and terminated
    assert info["final_reward"] == 0.5 and info["success"] is False
    env.reset(options={"task_id": task.id})
    looped = [env.step(_call(i, "open", doc=doc))[1] for i, doc in enumerate(task.chain)]
    *_, truncated, _ = last = env.step(_call(2, "search", query="more"))
    assert [*looped, last[1]] == [0.0, 0.0, 0.0] and truncated
    env.reset(options={"task_id": task.id})
    for i, doc in enumerate(task.chain):
        env.step(_call(i, "open", doc=doc))
    assert env.step(f"Answer: {task.answers[0]}")[1] == pytest.approx(1.5)
    # scored as an agent's own conversation: the same rewards
    messages = [{"role": "user", "content": task.question}]
    for i, doc in enumerate(task.chain):
        messages += [_call(i, "open", doc=doc), {"role": "tool", "tool_call_id": f"call_{i}"}]
    score, info = SearchEnv(**kwargs).score(messages)
    assert score == 0.0 and info["tool_rewards"] == {}
    answered = [*messages, {"role": "assistant", "content": "Answer: nowhere"}]
    score, info = SearchEnv(**kwargs).score(answered)
    assert score == pytest.approx(0.5) and info["tool_rewards"] == {}
