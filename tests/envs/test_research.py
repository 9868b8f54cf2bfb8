"""areal/Research-v0: task generation (answerable from the gold documents, deterministic),
the recall x precision reward against hand-computed values, state keys for step groups,
evidence rewards, agent-loop scoring and the conformance checker."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from areal_agents import envs
from areal_agents.envs import check_env
from areal_agents.envs.search.answer import normalize_answer
from areal_agents.envs.search.research import KINDS, ResearchEnv, ResearchTask


def _open(i: int, doc: str) -> dict[str, Any]:
    function = {"name": "open", "arguments": json.dumps({"doc": doc})}
    call = {"id": f"call_{i}", "type": "function", "function": function}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


@pytest.fixture(scope="module")
def env() -> ResearchEnv:
    return ResearchEnv(split="all", evidence_reward=0.1)


def _task(env: ResearchEnv, kind: str) -> ResearchTask:
    task = next(t for t in env.tasks if isinstance(t, ResearchTask) and t.kind == kind)
    return task


def _start_reading(env: ResearchEnv, task: ResearchTask) -> None:
    """Reset to ``task`` and open each of its gold documents (every fact grounded)."""
    env.reset(options={"task_id": task.id})
    for i, doc in enumerate(task.chain):
        env.step(_open(i, doc))


def test_tasks_cover_every_kind_and_are_deterministic(env: ResearchEnv) -> None:
    kinds = Counter(t.kind for t in env.tasks if isinstance(t, ResearchTask))
    assert set(kinds) == set(KINDS) and min(kinds.values()) >= 10, kinds
    assert len({t.question for t in env.tasks}) == len(env.tasks) >= 200
    again = ResearchEnv(split="all")
    assert again.tasks == env.tasks
    assert ResearchEnv(split="all", kb_seed=1).tasks != env.tasks
    train, test = ResearchEnv(split="train"), ResearchEnv(split="test")
    assert not {t.id for t in train.tasks} & {t.id for t in test.tasks}
    assert len(train.tasks) + len(test.tasks) == len(env.tasks)


def test_every_fact_is_stated_in_a_gold_document(env: ResearchEnv) -> None:
    docs = {d.id: normalize_answer(d.text) for d in env.kb.documents}
    for task in env.tasks:
        assert isinstance(task, ResearchTask)
        assert 3 <= len(task.facts) <= 6 and 3 <= len(task.chain) <= 6
        gold_text = " ".join(docs[d] for d in task.chain)
        for fact in task.facts:
            assert normalize_answer(fact.answers[0]) in gold_text, (task.id, fact)
            # ... and in the document the fact names as its source, one of the gold ones
            assert fact.source in task.chain, (task.id, fact)
            assert normalize_answer(fact.answers[0]) in docs[fact.source], (task.id, fact)
            # the question never gives a fact away
            assert normalize_answer(fact.answers[0]) not in normalize_answer(task.question)
        # the question names its first gold document's entity
        assert env.kb.entities[task.chain[0]].name in task.question


def test_reward_is_recall_times_precision_by_hand(env: ResearchEnv) -> None:
    task = _task(env, "person_profile")
    _start_reading(env, task)
    born, country, university, city, river = (f.answers for f in task.facts)
    native = next(
        e.name
        for e in env.kb.entities.values()
        if e.type == "person" and e.name not in task.allowed
    )
    # 4 of 5 facts (the university's city missing), by alias where one exists;
    # names stated: born, country, university, river + one stranger -> precision 1 - 1/5
    answer = (
        f"They were born in {born[0]}, a city in {country[0]}, and studied at {university[-1]}. "
        f"The {river[-1]} runs through it. {native} was too."
    )
    _, reward, terminated, _, info = env.step(answer)
    assert terminated and not info["success"]
    assert info["recall"] == pytest.approx(4 / 5)
    assert info["precision"] == pytest.approx(1 - 1 / 5)
    assert reward == pytest.approx(4 / 5 * 4 / 5)
    assert info["facts_missing"] == [task.facts[3].label]
    assert info["spurious"] == [native]
    assert city[0] not in answer

    _start_reading(env, task)
    full = f"Born in {born[0]} ({country[0]}); studied at {university[0]} in {city[0]}; {river[0]}."
    _, reward, _, _, info = env.step(full)
    assert reward == 1.0 and info["success"] and info["spurious"] == []


def test_only_the_first_max_answer_words_are_graded() -> None:
    env = ResearchEnv(split="all", max_answer_words=5)
    task = _task(env, "person_profile")
    _start_reading(env, task)
    answers = [f.answers[0] for f in task.facts]
    _, reward, _, _, info = env.step("Here is what I found: " + ", ".join(answers))
    assert reward == 0.0 and info["answer_words"] > 5
    _start_reading(env, task)
    _, reward, _, _, info = env.step(answers[0])
    assert info["recall"] == pytest.approx(1 / len(answers))


def test_state_key_tracks_documents_opened_and_evidence_reward(env: ResearchEnv) -> None:
    task = _task(env, "compare_founders")
    _, info = env.reset(options={"task_id": task.id})
    assert info["state_key"] == f"{task.id}:"
    first, second = task.chain[0], task.chain[1]
    title = env.kb.entities[first].name
    _, reward, _, _, info = env.step(_open(0, title))  # by title: the id is what counts
    assert reward == pytest.approx(0.1) and info["state_key"] == f"{task.id}:{first}"
    _, reward, _, _, info = env.step(_open(1, first))  # the same document again: nothing new
    assert reward == 0.0 and info["state_key"] == f"{task.id}:{first}"
    _, reward, _, _, info = env.step(_open(2, "no such document"))
    assert reward == 0.0 and info["tool_results"][0]["error"] == "tool_exception"
    outside = next(d.id for d in env.kb.documents if d.id not in task.chain)
    _, reward, _, _, info = env.step(_open(3, outside))  # opened, but not gold evidence
    assert reward == 0.0 and info["documents_opened"] == 2
    _, _, _, _, info = env.step(_open(4, second))
    # order-free: the key is the sorted set of documents opened
    assert info["state_key"] == f"{task.id}:{','.join(sorted([first, outside, second]))}"


def test_same_knowledge_in_another_order_gives_the_same_state_key(env: ResearchEnv) -> None:
    task = _task(env, "compare_rivers")
    keys = []
    for order in (task.chain[:2], task.chain[:2][::-1]):
        env.reset(options={"task_id": task.id})
        for i, doc in enumerate(order):
            *_, info = env.step(_open(i, doc))
        keys.append(info["state_key"])
    assert keys[0] == keys[1]


def test_score_replays_an_agent_loop(env: ResearchEnv) -> None:
    task = _task(env, "company_profile")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": task.question},
    ]
    for i, doc in enumerate(task.chain):
        messages.append(_open(i, doc))
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": "id: ..."})
    messages.append({"role": "assistant", "content": " ".join(f.answers[0] for f in task.facts)})
    fresh = ResearchEnv(split="all", evidence_reward=0.1)  # never reset: finds the task
    reward, info = fresh.score(messages)
    assert reward == 1.0 and info["success"]
    n = len(task.chain)
    assert info["tool_rewards"] == {f"call_{i}": pytest.approx(0.1) for i in range(n)}
    assert info["gold_documents_opened"] == n
    # without the last gold document, the facts it states do not count
    cut = [m for m in messages if m.get("tool_call_id") != f"call_{n - 1}"]
    cut = [m for m in cut if not any(c["id"] == f"call_{n - 1}" for c in m.get("tool_calls") or [])]
    reward, info = ResearchEnv(split="all").score(cut)
    unread = [f.label for f in task.facts if f.source == task.chain[-1]]
    assert unread and info["facts_ungrounded"] == unread
    assert reward == pytest.approx(1 - len(unread) / len(task.facts))


def test_an_answer_without_reading_earns_nothing(env: ResearchEnv) -> None:
    """Grounded grading: every fact stated right at once, from memory or a lucky guess,
    earns 0 (stopping early cannot pay); the facts of the one document opened count."""
    task = _task(env, "person_profile")
    every_fact = " ".join(f.answers[0] for f in task.facts)
    env.reset(options={"task_id": task.id})
    _, reward, terminated, _, info = env.step(every_fact)
    assert terminated and reward == 0.0 and not info["success"]
    assert info["facts_ungrounded"] == [f.label for f in task.facts]
    env.reset(options={"task_id": task.id})
    env.step(_open(0, task.chain[0]))  # the person's own document: birth city, university
    _, reward, _, _, info = env.step(every_fact)
    own = [f for f in task.facts if f.source == task.chain[0]]
    assert [f.label for f in own] == [task.facts[0].label, task.facts[2].label]
    assert info["recall"] == pytest.approx(len(own) / len(task.facts))
    loose = ResearchEnv(split="all", grounded=False)  # the reward before grounding
    loose.reset(options={"task_id": task.id})
    _, reward, _, _, info = loose.step(every_fact)
    assert reward == 1.0 and info["facts_ungrounded"] == []


def test_bad_arguments_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="kinds"):
        ResearchEnv(kinds=["essay"])
    with pytest.raises(ValueError, match="n_tasks"):
        ResearchEnv(n_tasks=0)
    with pytest.raises(ValueError, match="max_answer_words"):
        ResearchEnv(max_answer_words=0)


def test_registered_and_passes_the_checker() -> None:
    assert "areal/Research-v0" in dict(envs.list_envs())
    check_env("areal/Research-v0")
    check_env(envs.make("areal/Research-v0", split="test", kinds=["person_profile"]), seed=3)


async def test_runner_counts_tool_calls_and_errors_and_records_state_keys(tiny_model_dir):
    """A scripted policy through the real proxy: a bad open, a good one, then the answer.
    The episode's metadata, its result, the eval summary and the trainer's metrics count
    2 tool calls, 1 of them an error, and each completion has the env's state key."""
    from areal_agents.rollout.evaluate import summarize
    from areal_agents.rollout.runner import Runner
    from areal_agents.serve.chat import ChatTokenizer
    from areal_agents.serve.proxy import Proxy
    from areal_agents.testing.fake_engine import FakeEngine
    from areal_agents.trainer.loop import _tool_call_metrics

    tok = ChatTokenizer.from_dir(tiny_model_dir)
    env = ResearchEnv(split="all")
    task = _task(env, "person_profile")
    first = env.kb.entities[task.chain[0]].name
    end = tok.token_id("<|im_end|>")
    replies = iter(
        [
            '<tool_call>\n{"name": "open", "arguments": {"doc": "Nowhere at all"}}\n</tool_call>',
            f'<tool_call>\n{{"name": "open", "arguments": {{"doc": "{first}"}}}}\n</tool_call>',
            f"{first} was born in {task.facts[0].answers[0]}.",
        ]
    )
    proxy = Proxy(FakeEngine(lambda ids, params: [*tok.encode(next(replies)), end]), tok)
    result = await Runner(proxy, max_turns=6).run_episode(
        lambda: ResearchEnv(split="all"), options={"task_id": task.id}
    )
    assert result.end_reason == "terminated", result.error
    assert (result.tool_calls, result.tool_errors) == (2, 1)
    meta = result.episode.metadata
    assert (meta["tool_calls"], meta["tool_errors"]) == (2, 1)
    keys = [meta["state_keys"][c.id] for c in result.episode.completions]
    assert keys == [f"{task.id}:", f"{task.id}:", f"{task.id}:{task.chain[0]}"]
    assert result.info["recall"] == pytest.approx(1 / 5)
    report = summarize("areal/Research-v0", [[result]], k=1)
    assert report.mean_tool_calls == 2 and report.tool_call_validity == 0.5
    assert any(
        line.split()[:3] == ["valid", "tool", "calls"] and line.endswith("50.0%")
        for line in report.table().splitlines()
    )
    assert _tool_call_metrics([result]) == {"tool_calls_mean": 2.0, "tool_call_valid_rate": 0.5}
