"""``areal/Research-v0``: open-ended research questions over the Search env's knowledge base.

Each task asks for several facts about one or two entities of the generated world
(:mod:`areal_agents.envs.search.kb`), to be answered in a few sentences::

    Compare the companies Qorvalix and Drentek: who founded each of them, in which city
    was each founder born, and in which country is each company headquartered?

The facts sit in different documents (the companies', their founders', their
headquarters cities'), so an episode takes many ``search`` / ``open`` calls: 4 to 6
documents to read, typically 10-30 turns, beyond the context window of a small model
unless the run manages it (``context.policy``). Question kinds:

- ``compare_founders``: two companies' founders, the founders' birth cities and the
  countries of the headquarters (6 facts, 6 documents);
- ``company_profile``: a company's founder and where they studied, its chief executive
  and their birth year, its headquarters city and the river through it (6 facts,
  4 documents);
- ``person_profile``: a person's birth city and its country, their university and its
  city, and the river through their birth city (5 facts, 3 documents);
- ``compare_rivers``: the rivers through two companies' headquarters cities and the
  countries where those rivers rise (4 facts, 6 documents).

**Reward** of the final answer (an assistant message without tool calls), its first
``max_answer_words`` words only::

    recall    = |{gold facts stated}| / |gold facts|
    precision = 1 - |spurious names| / max(1, |names stated|)
    reward    = recall * precision

A fact is stated when its value (or an alias: ``Velo`` for ``Velo River``) occurs in the
normalized answer as whole words, and (``grounded``, the default) the episode opened the
document that states it: an answer given at once, from memory or by guessing, earns nothing,
so stopping early cannot pay. *Names stated* are the knowledge base's entity names in
the answer; *spurious* ones are neither a fact's value nor an entity of the question or
of its gold documents, so listing every name of the corpus does not pay. ``success`` is
``recall == 1``. Tool turns earn ``evidence_reward`` for each gold document opened for the
first time (0 by default), so turn-level estimators see progress. An LLM judge can score
the same answers by rubric (``rewards.judge`` in the training config, see
``examples/agents/research.yaml``).

**State.** Every step's ``info["state_key"]`` names the task and the set of documents
opened so far, so step-level groups (``advantage.estimator: step_group``) compare turns
that start from the same knowledge, whatever order the documents were read in.

    >>> env = ResearchEnv(n_tasks=20)
    >>> messages, info = env.reset(seed=0)
    >>> info["kind"] in KINDS, len(info["facts"]) >= 4
    (True, True)
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from areal_agents.envs.search.answer import normalize_answer
from areal_agents.envs.search.env import SearchEnv
from areal_agents.envs.search.kb import (
    Entity,
    KnowledgeBase,
    QAExample,
    _aliases,
    generate_knowledge_base,
)
from areal_agents.tools.retriever import Retriever

__all__ = ["KINDS", "RESEARCH_PROMPT", "Fact", "ResearchEnv", "ResearchTask", "draw_tasks"]

Message = dict[str, Any]

KINDS = ("compare_founders", "company_profile", "person_profile", "compare_rivers")

RESEARCH_PROMPT = (
    "You research questions using a document collection. Call search(query) to find "
    "documents (it returns ids, titles and snippets) and open(doc) with a document id or "
    "title to read a document in full. The question asks for several facts that are "
    "spread over several documents: open each entity's document, note what it says, and "
    "follow the entities it mentions. Call one tool at a time. When you have every fact, "
    "reply without calling a tool: answer in a few sentences that state each fact asked "
    "for, and nothing else."
)


@dataclass(frozen=True)
class Fact:
    """One fact a research answer must state: what it is, its accepted values and the
    document that states it (``source``, a document id)."""

    label: str
    answers: tuple[str, ...]
    source: str = ""


@dataclass(frozen=True)
class ResearchTask(QAExample):
    """A research question: its gold facts, its kind and the names it may mention.

    ``chain`` holds the gold documents (every one the facts need, in reading order);
    ``answers`` the facts' canonical values; ``allowed`` the entity names that are not
    spurious in an answer (the question's entities and those of the gold documents).
    """

    kind: str = ""
    facts: tuple[Fact, ...] = ()
    allowed: tuple[str, ...] = ()


class ResearchEnv(SearchEnv):
    """Open-ended multi-fact research questions over the generated knowledge base.

    Args:
        split: ``"train"``, ``"test"`` or ``"all"``.
        split_seed: seed of the train/test shuffle.
        test_fraction: share of the tasks in the test split.
        kb_seed: seed of the generated knowledge base (the same world as
            ``areal/Search-v0`` with the same seed).
        n_tasks: number of tasks to draw (evenly over ``kinds``; fewer when the world is
            too small to phrase that many distinct ones).
        kinds: which question kinds to draw (see :data:`KINDS`).
        retriever: ``"bm25"``, ``"dense"`` or a :class:`areal_agents.tools.retriever.Retriever`.
        top_k: number of search results.
        evidence_reward: reward of a tool turn per gold document it opens for the first
            time.
        max_answer_words: only this many words of the final answer are graded.
        max_doc_chars: ``open`` cuts documents after this many characters.
        max_turns: the episode is truncated after this many assistant messages.
        grounded: a fact counts only when the episode opened the document that states it
            (its ``source``); an answer from memory, or a guess, earns nothing.
    """

    def __init__(
        self,
        *,
        split: str = "train",
        split_seed: int = 0,
        test_fraction: float = 0.2,
        kb_seed: int = 0,
        n_tasks: int = 400,
        kinds: Sequence[str] = KINDS,
        retriever: Literal["bm25", "dense"] | Retriever = "bm25",
        top_k: int = 5,
        evidence_reward: float = 0.0,
        max_answer_words: int = 150,
        max_doc_chars: int = 4000,
        max_turns: int = 30,
        grounded: bool = True,
    ) -> None:
        unknown = [k for k in kinds if k not in KINDS]
        if not kinds or unknown:
            raise ValueError(f"kinds: expected a non-empty subset of {list(KINDS)}, got {kinds!r}")
        if not isinstance(n_tasks, int) or n_tasks < 1:
            raise ValueError(f"n_tasks: expected a positive int, got {n_tasks!r}")
        if not isinstance(max_answer_words, int) or max_answer_words < 1:
            raise ValueError(f"max_answer_words: expected a positive int, got {max_answer_words!r}")
        kb = generate_knowledge_base(kb_seed, n_questions=1)
        tasks = draw_tasks(kb, n_tasks, kinds=kinds, seed=kb_seed)
        super().__init__(
            corpus=kb.documents,
            qa=tasks,
            split=split,
            split_seed=split_seed,
            test_fraction=test_fraction,
            retriever=retriever,
            top_k=top_k,
            max_doc_chars=max_doc_chars,
            max_turns=max_turns,
            evidence_reward=evidence_reward,
        )
        self.kb = kb
        self.grounded = bool(grounded)
        self.max_answer_words = max_answer_words
        self._names = {_key(e.name): e.name for e in kb.entities.values()}
        for entity in kb.entities.values():
            for alias in _aliases(entity.name):
                self._names[_key(alias)] = entity.name
        self._opened: list[str] = []

    # ------------------------------------------------------------------ episode hooks

    def _start(self, options: Mapping[str, Any]) -> tuple[list[Message], dict[str, Any]]:
        task = self._pick(options)
        assert isinstance(task, ResearchTask)
        self.task = task
        self._opened = []
        messages = [
            {"role": "system", "content": RESEARCH_PROMPT},
            {"role": "user", "content": task.question},
        ]
        info = {
            "task_id": task.id,
            "question": task.question,
            "kind": task.kind,
            "facts": [f.label for f in task.facts],
            "gold_documents": list(task.chain),
            "state_key": self._state_key(),
        }
        return messages, info

    def _state_key(self) -> str:
        assert self.task is not None
        return f"{self.task.id}:{','.join(sorted(self._opened))}"

    def _tool_info(self, message: Message, records: list[dict[str, Any]]) -> dict[str, Any]:
        return {"state_key": self._state_key(), "documents_opened": len(self._opened)}

    def demos(self, n: int, seed: int = 0, search_fraction: float = 0.5) -> list[list[Message]]:
        """``n`` solved episodes of this env's split, for a supervised warm start.

        Each opens the task's gold documents in reading order (one call per turn; with
        probability ``search_fraction`` a ``search`` for the entity's name comes first and
        the document is opened by the id it returned, else it is opened by title), with
        the tool results the env itself returns, then answers with one sentence per fact.
        Tasks are distinct while ``n`` <= the split's size (then they repeat), in an order
        fixed by ``seed``; every demonstration earns reward 1."""
        if n < 0:
            raise ValueError(f"n must be non-negative, got {n}")
        rng = random.Random(seed)
        order: list[int] = []
        while len(order) < n:
            order += rng.sample(range(len(self.tasks)), len(self.tasks))
        out = []
        for index in order[:n]:
            task = self.tasks[index]
            assert isinstance(task, ResearchTask)
            self.reset(seed=seed, options={"task_id": task.id})
            turn = 0
            for doc_id in task.chain:
                name = self.kb.entities[doc_id].name
                target = name
                if rng.random() < search_fraction:
                    self.step(_tool_call(f"call_{turn}", "search", query=name))
                    turn += 1
                    target = doc_id
                self.step(_tool_call(f"call_{turn}", "open", doc=target))
                turn += 1
            answer = " ".join(f"The {f.label} is {f.answers[0]}." for f in task.facts)
            _, reward, terminated, _, info = self.step(answer)
            assert terminated and reward == 1.0, (task.id, info)
            out.append([dict(m) for m in self.messages])
        return out

    def score(self, messages: Sequence[Message]) -> tuple[float, dict[str, Any]]:
        """Score a conversation from an agent's own loop: the final answer as in a stepped
        episode, the documents it opened replayed from its ``open`` calls, and their
        ``evidence_reward`` as ``info["tool_rewards"]``."""
        if self.task is None or not any(
            m.get("role") == "user" and m.get("content") == self.task.question for m in messages
        ):
            self.task = self._task_for(messages)
        return super().score(messages)

    def _grade(self, content: str | None, task: QAExample) -> tuple[float, dict[str, Any]]:
        assert isinstance(task, ResearchTask)
        words = (content or "").split()
        answer = normalize_answer(" ".join(words[: self.max_answer_words]))
        padded = f" {answer} "
        stated_facts = [f for f in task.facts if any(f" {_key(a)} " in padded for a in f.answers)]
        found = [f for f in stated_facts if self._grounded_in_episode(f)]
        stated = {name for key, name in self._names.items() if key and f" {key} " in padded}
        allowed = set(task.allowed) | {a for f in task.facts for a in f.answers}
        spurious = sorted(stated - allowed)
        recall = len(found) / len(task.facts)
        precision = 1.0 - len(spurious) / max(1, len(stated))
        reward = recall * precision
        info = {
            "success": recall == 1.0,
            "final_reward": reward,
            "recall": recall,
            "precision": precision,
            "facts_found": [f.label for f in found],
            "facts_missing": [f.label for f in task.facts if f not in found],
            "facts_ungrounded": [f.label for f in stated_facts if f not in found],
            "spurious": spurious,
            "answer_words": len(words),
            "documents_opened": len(self._opened),
            "gold_documents_opened": sum(d in task.chain for d in self._opened),
        }
        return reward, info

    def _grounded_in_episode(self, fact: Fact) -> bool:
        """Whether ``fact`` may count: always without ``grounded``, else only when the
        episode opened the document that states it."""
        return not self.grounded or not fact.source or fact.source in self._opened


def _tool_call(call_id: str, name: str, **arguments: str) -> Message:
    function = {"name": name, "arguments": json.dumps(arguments)}
    call = {"id": call_id, "type": "function", "function": function}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _key(text: str) -> str:
    return normalize_answer(text)


# ---------------------------------------------------------------------- task generation


def draw_tasks(
    kb: KnowledgeBase, n_tasks: int, *, kinds: Sequence[str] = KINDS, seed: int = 0
) -> list[ResearchTask]:
    """Draw up to ``n_tasks`` distinct research tasks (ids ``r00000``, ...), evenly over
    ``kinds``, deterministically from ``seed``. Facts whose value occurs in the question
    are dropped; a task keeps at least 3 facts."""
    rng = random.Random(seed)
    by_type: dict[str, list[Entity]] = {}
    for entity in kb.entities.values():
        by_type.setdefault(entity.type, []).append(entity)
    out: list[ResearchTask] = []
    seen: set[str] = set()
    for i in range(n_tasks):
        kind = kinds[i % len(kinds)]
        for _ in range(50):
            drawn = _DRAW[kind](rng, kb.entities, by_type)
            if drawn is None or drawn[0] in seen:
                continue
            question, facts, chain, subjects = drawn
            low = f" {_key(question)} "
            facts = [f for f in facts if not any(f" {_key(a)} " in low for a in f.answers)]
            if len(facts) < 3:
                continue
            seen.add(question)
            names = {kb.entities[d].name for d in chain} | {kb.entities[s].name for s in subjects}
            out.append(
                ResearchTask(
                    id=f"r{len(out):05d}",
                    question=question,
                    answers=tuple(f.answers[0] for f in facts),
                    chain=tuple(dict.fromkeys(chain)),
                    hops=len(dict.fromkeys(chain)),
                    kind=kind,
                    facts=tuple(facts),
                    allowed=tuple(sorted(names)),
                )
            )
            break
    return out


_Drawn = tuple[str, list[Fact], list[str], list[str]] | None
_SUFFIX = " Answer in a few sentences."


def _fact(label: str, entity: Entity, source: Entity) -> Fact:
    """The fact ``label`` whose value is ``entity``'s name, stated by ``source``'s document."""
    return Fact(label, (entity.name, *_aliases(entity.name)), source.id)


def _compare_founders(
    rng: random.Random, e: dict[str, Entity], by_type: dict[str, list[Entity]]
) -> _Drawn:
    c1, c2 = rng.sample(by_type["company"], 2)
    if c1.relations["founded_by"] == c2.relations["founded_by"]:
        return None
    facts, chain = [], []
    for c in (c1, c2):
        founder, hq = e[c.relations["founded_by"]], e[c.relations["headquartered_in"]]
        born, country = e[founder.relations["born_in"]], e[hq.relations["in_country"]]
        facts += [
            _fact(f"founder of {c.name}", founder, c),
            _fact(f"birth city of {founder.name}", born, founder),
            _fact(f"headquarters country of {c.name}", country, hq),
        ]
        chain += [c.id, founder.id, hq.id]
    question = (
        f"Compare the companies {c1.name} and {c2.name}: who founded each of them, in which "
        "city was each founder born, and in which country is each company headquartered?"
    )
    return question + _SUFFIX, facts, chain, [c1.id, c2.id]


def _company_profile(
    rng: random.Random, e: dict[str, Entity], by_type: dict[str, list[Entity]]
) -> _Drawn:
    c = rng.choice(by_type["company"])
    founder, ceo = e[c.relations["founded_by"]], e[c.relations["ceo"]]
    hq = e[c.relations["headquartered_in"]]
    if founder.id == ceo.id:
        return None
    facts = [
        _fact(f"founder of {c.name}", founder, c),
        _fact(f"university of {founder.name}", e[founder.relations["studied_at"]], founder),
        _fact(f"chief executive of {c.name}", ceo, c),
        Fact(f"birth year of {ceo.name}", (ceo.attributes["birth_year"],), ceo.id),
        _fact(f"headquarters of {c.name}", hq, c),
        _fact(f"river through {hq.name}", e[hq.relations["on_river"]], hq),
    ]
    question = (
        f"Write a short profile of the company {c.name}: who founded it and where that person "
        "studied, who its chief executive is and in which year they were born, and in which "
        "city it is headquartered and which river runs through that city."
    )
    return question + _SUFFIX, facts, [c.id, founder.id, ceo.id, hq.id], [c.id]


def _person_profile(
    rng: random.Random, e: dict[str, Entity], by_type: dict[str, list[Entity]]
) -> _Drawn:
    p = rng.choice(by_type["person"])
    born, university = e[p.relations["born_in"]], e[p.relations["studied_at"]]
    facts = [
        _fact(f"birth city of {p.name}", born, p),
        _fact(f"country of {born.name}", e[born.relations["in_country"]], born),
        _fact(f"university of {p.name}", university, p),
        _fact(f"city of {university.name}", e[university.relations["located_in"]], university),
        _fact(f"river through {born.name}", e[born.relations["on_river"]], born),
    ]
    question = (
        f"Tell me about {p.name}: in which city were they born and in which country is that "
        "city, which university did they attend and where is it located, and which river runs "
        "through their birth city?"
    )
    return question + _SUFFIX, facts, [p.id, born.id, university.id], [p.id]


def _compare_rivers(
    rng: random.Random, e: dict[str, Entity], by_type: dict[str, list[Entity]]
) -> _Drawn:
    c1, c2 = rng.sample(by_type["company"], 2)
    if c1.relations["headquartered_in"] == c2.relations["headquartered_in"]:
        return None
    facts, chain = [], []
    for c in (c1, c2):
        hq = e[c.relations["headquartered_in"]]
        river = e[hq.relations["on_river"]]
        facts += [
            _fact(f"river through the headquarters of {c.name}", river, hq),
            _fact(f"source country of the {river.name}", e[river.relations["rises_in"]], river),
        ]
        chain += [c.id, hq.id, river.id]
    question = (
        f"Which river runs through the city where {c1.name} is headquartered, and which "
        f"through the city where {c2.name} is headquartered? In which country does each of "
        "these rivers rise?"
    )
    return question + _SUFFIX, facts, chain, [c1.id, c2.id]


_DRAW = {
    "compare_founders": _compare_founders,
    "company_profile": _company_profile,
    "person_profile": _person_profile,
    "compare_rivers": _compare_rivers,
}
