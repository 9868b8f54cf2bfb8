"""The search env and its generated knowledge base: determinism, answerable chains,
scripted episodes (search -> open -> answer), EM / F1 rewards, user corpora, splits and
the conformance checker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from areal_agents import envs
from areal_agents.envs.search import SearchEnv, generate_knowledge_base
from areal_agents.envs.search.answer import exact_match, extract_answer, f1_score, normalize_answer
from areal_agents.envs.search.kb import QAExample
from areal_agents.tools.retriever import Document


def _call(i: int, name: str, **arguments: Any) -> dict[str, Any]:
    call = {"id": f"call_{i}", "type": "function", "function": {"name": name}}
    call["function"]["arguments"] = json.dumps(arguments)  # type: ignore[index]
    return {"role": "assistant", "content": None, "tool_calls": [call]}


@pytest.fixture(scope="module")
def kb() -> Any:
    return generate_knowledge_base(7, n_questions=300)


def test_generation_is_deterministic(kb: Any) -> None:
    again = generate_knowledge_base(7, n_questions=300)
    assert again.documents == kb.documents and again.questions == kb.questions
    other = generate_knowledge_base(8, n_questions=300)
    assert other.documents != kb.documents


def test_kb_shape(kb: Any) -> None:
    ids = [d.id for d in kb.documents]
    titles = [d.title.lower() for d in kb.documents]
    assert len(set(ids)) == len(ids) and len(set(titles)) == len(titles)
    assert len(kb.documents) == len(kb.entities)
    assert {q.hops for q in kb.questions} == {1, 2, 3}
    assert len({q.question for q in kb.questions}) == len(kb.questions)
    assert len(kb.questions) >= 250


def test_every_question_is_answerable_by_following_its_chain(kb: Any) -> None:
    docs = {d.id: d for d in kb.documents}
    for q in kb.questions:
        assert len(q.chain) == q.hops
        # the question names the first entity ...
        assert docs[q.chain[0]].title in q.question, q
        # ... each hop's document mentions the next entity ...
        for here, there in zip(q.chain, q.chain[1:], strict=False):
            assert docs[there].title in docs[here].text, (q, here, there)
        # ... and the last one states the answer, which the question does not contain.
        assert q.answers[0] in docs[q.chain[-1]].text, q
        assert normalize_answer(q.answers[0]) not in normalize_answer(q.question), q


def test_multi_hop_question_wording(kb: Any) -> None:
    three = [q.question for q in kb.questions if q.hops == 3]
    assert any(q.startswith("In which country is the city where the") for q in three)


def test_answer_extraction_and_scoring() -> None:
    assert extract_answer("Let me think.\nAnswer: Velo River") == "Velo River"
    assert extract_answer("so it is \\boxed{Tarn {x}} indeed") == "Tarn {x}"
    assert extract_answer("  just this  ") == "just this"
    assert normalize_answer("The  Velo-River!") == "veloriver"
    assert exact_match("the Velo River.", ["Velo River"]) == 1.0
    assert exact_match("Velo", ["Velo River"]) == 0.0
    assert f1_score("Maren", ["Maren Tolvask"]) == pytest.approx(2 / 3)
    assert f1_score("nothing", ["Maren Tolvask", "Maren"]) == 0.0


@pytest.fixture(scope="module")
def env() -> SearchEnv:
    return SearchEnv(kb_seed=3, kb_questions=120, split="all")


def _three_hop(env: SearchEnv) -> QAExample:
    return next(t for t in env.tasks if t.hops == 3)


def test_scripted_episode_search_open_answer_gets_reward_1(env: SearchEnv) -> None:
    task = _three_hop(env)
    messages, info = env.reset(seed=0, options={"task_id": task.id})
    assert messages[-1] == {"role": "user", "content": task.question}
    assert [t["function"]["name"] for t in info["tools"]] == ["search", "open"]
    assert info["task_id"] == task.id and info["hops"] == 3

    first = env.retriever.get(task.chain[0])
    assert first is not None
    obs, reward, terminated, truncated, info = env.step(_call(1, "search", query=first.title))
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert obs[0]["tool_call_id"] == "call_1" and f"id: {first.id}" in obs[0]["content"]
    for i, doc_id in enumerate(task.chain, start=2):
        obs, reward, terminated, _, info = env.step(_call(i, "open", doc=doc_id))
        assert obs[0]["content"].startswith(f"id: {doc_id}\n")
        assert info["tool_results"][0]["error"] is None
    assert task.answers[0] in obs[0]["content"]

    final = {"role": "assistant", "content": f"Following the chain.\nAnswer: {task.answers[0]}"}
    obs, reward, terminated, truncated, info = env.step(final)
    assert (obs, reward, terminated, truncated) == ([], 1.0, True, False)
    assert info["success"] is True and info["em"] == 1.0
    score, score_info = env.score(env.messages)
    assert score == 1.0 and score_info["success"] is True
    wrong = [*env.messages[:-1], {"role": "assistant", "content": "Answer: somewhere"}]
    assert env.score(wrong)[0] == 0.0


def test_wrong_answer_gets_0_and_boxed_is_accepted(env: SearchEnv) -> None:
    task = _three_hop(env)
    env.reset(options={"task_id": task.id})
    _, reward, terminated, _, info = env.step("Answer: Nowhere Atall")
    assert (reward, terminated, info["success"]) == (0.0, True, False)
    env.reset(options={"task_id": task.id})
    _, reward, _, _, _ = env.step(f"It is \\boxed{{{task.answers[0].upper()}}}")
    assert reward == 1.0


def test_f1_reward_gives_partial_credit() -> None:
    docs = [Document("p1", "Maren Tolvask", "Maren Tolvask was born in Velburg.")]
    qa = [QAExample("q1", "Where was the painter born?", ("Velburg Old Town",), ("p1",), 1)]
    env = SearchEnv(corpus=docs, qa=qa, split="all", reward="f1")
    env.reset(seed=0)
    _, reward, _, _, info = env.step("Answer: Velburg")
    assert reward == pytest.approx(0.5)
    assert info["em"] == 0.0 and info["f1"] == pytest.approx(0.5) and not info["success"]


def test_turn_reward_and_tool_errors(env: SearchEnv) -> None:
    env_with_cost = SearchEnv(kb_seed=3, kb_questions=30, turn_reward=-0.1, max_turns=3)
    env_with_cost.reset(seed=1)
    obs, reward, _, _, info = env_with_cost.step(_call(1, "open", doc="no such doc"))
    assert reward == pytest.approx(-0.1)
    assert obs[0]["content"].startswith("Error: no document has the id or title 'no such doc'")
    assert info["tool_results"][0]["error"] == "tool_exception"
    obs, _, _, _, _ = env_with_cost.step(_call(2, "search", query="zzzzqqq"))
    assert obs[0]["content"].startswith("No document matches")
    _, _, terminated, truncated, info = env_with_cost.step(_call(3, "search", query="river"))
    assert (terminated, truncated, info["success"]) == (False, True, False)


def test_user_corpus_and_qa_files_with_explicit_split(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    qa = tmp_path / "qa.jsonl"
    docs = [
        {"id": "a", "title": "Alpha", "text": "Alpha is a moon of Beta."},
        {"id": "b", "title": "Beta", "text": "Beta is a planet orbiting Gamma."},
    ]
    rows = [
        {"id": "q1", "question": "What does the body Alpha orbits orbit?", "answer": ["Gamma"],
         "split": "train"},
        {"question": "Which planet has the moon Alpha?", "answer": "Beta", "split": "test"},
    ]  # fmt: skip
    corpus.write_text("\n".join(map(json.dumps, docs)))
    qa.write_text("\n".join(map(json.dumps, rows)))
    train = SearchEnv(corpus=corpus, qa=qa, split="train")
    test = SearchEnv(corpus=corpus, qa=qa, split="test")
    assert [t.id for t in train.tasks] == ["q1"] and [t.answers for t in test.tasks] == [("Beta",)]
    test.reset(seed=0)
    assert test.step("Answer: beta")[1] == 1.0
    with pytest.raises(ValueError, match="corpus was given without qa"):
        SearchEnv(corpus=corpus)


def test_seeded_split_is_disjoint_and_stable() -> None:
    train = SearchEnv(kb_seed=1, kb_questions=100, split="train", split_seed=5)
    test = SearchEnv(kb_seed=1, kb_questions=100, split="test", split_seed=5)
    train_ids, test_ids = {t.id for t in train.tasks}, {t.id for t in test.tasks}
    assert not train_ids & test_ids and len(train_ids | test_ids) == 100
    assert len(test_ids) == 20
    again = SearchEnv(kb_seed=1, kb_questions=100, split="test", split_seed=5)
    assert {t.id for t in again.tasks} == test_ids


def test_registered_env_passes_the_checker() -> None:
    env = envs.make("areal/Search-v0", kb_questions=60)
    assert isinstance(env, SearchEnv)
    envs.check_env(env)
