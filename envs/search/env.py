"""``areal/Search-v0``: multi-hop question answering over a local corpus.

The agent gets a question and two tools:

- ``search(query)``: the top-k documents for a query (id, title and a snippet each);
- ``open(doc)``: the full text of a document, by id or by title.

It ends the episode with an assistant message without tool calls whose final answer is
written as ``Answer: X`` (or ``\\boxed{X}``; a message with neither counts as the answer
in full). The reward is the exact match of the normalized answer (``reward="em"``) or its
token F1 (``reward="f1"``) against the accepted aliases; tool turns earn
``turn_reward`` (0 by default) plus ``evidence_reward`` for each gold document they open for
the first time (0 by default; see below)::

    r_turn = turn_reward + evidence_reward * |newly opened gold documents|

so an episode's evidence earns at most ``hops * evidence_reward``, however often it opens.
With ``evidence_on_answer`` the evidence is paid with the answer instead, and only to an
episode that answers::

    r_answer = match + evidence_reward * |gold documents opened|     r_turn = turn_reward

so every turn of an episode has the same return (with ``rollout.gamma`` 1), and neither
opening documents until the turns run out nor the answer turn itself is singled out: with
the evidence paid per turn, a tool turn's return-to-go holds the evidence and the answer
turn's does not, so a group's baseline marks answering down whenever the answer is wrong.

**Evidence.** A question's gold ``chain`` is the documents to read, in order (one per hop:
the last states the answer). The reset info gives ``hops`` and ``kind`` = ``"<hops>-hop"``
(so evaluation reports success per hop count) but not the documents, which an agent sees;
the env records the documents the episode opened (successful ``open`` calls), and the info
of every later step holds ``gold_documents`` and ``opened_documents``; the final one also
``gold_documents_opened`` and::

    grounded = success and set(gold_documents) <= set(opened_documents)

(None for a question without a gold chain): a *grounded success* answered from the
documents that state the answer, not from a guess. :meth:`SearchEnv.demos` writes solved
episodes along the gold chains of the train split, for a supervised warm start.

Data: by default a procedurally generated knowledge base of fictional entities
(:mod:`areal_agents.envs.search.kb`), so answers cannot be memorized; or any corpus (JSONL
``{"id", "title", "text"}``) with a QA file (JSONL ``{"question", "answer", "id"?}``).
Questions are split into train and test by a seeded shuffle, or by the QA rows' own
``"split"`` field.

    >>> env = SearchEnv(kb_questions=30)
    >>> messages, info = env.reset(seed=0)
    >>> [t["function"]["name"] for t in info["tools"]]
    ['search', 'open']
"""

from __future__ import annotations

import difflib
import json
import os
import random
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from areal_agents.envs.base import AgentEnv
from areal_agents.envs.search.answer import (
    exact_match,
    extract_answer,
    f1_score,
    load_qa,
    split_examples,
)
from areal_agents.envs.search.kb import QAExample, generate_knowledge_base
from areal_agents.errors import ToolError, UserError
from areal_agents.tools.retriever import (
    BM25Retriever,
    DenseRetriever,
    Document,
    Retriever,
    load_documents,
)
from areal_agents.tools.tool import Tool, function_tool

__all__ = ["SYSTEM_PROMPT", "SearchEnv"]

Message = dict[str, Any]

SYSTEM_PROMPT = (
    "You answer questions using a document collection. Call search(query) to find "
    "documents (it returns ids, titles and snippets) and open(doc) with a document id or "
    "title to read a document in full. Questions may need several steps: find the "
    "first entity, read its document, then follow what it says. When you know the answer, "
    "reply without calling a tool and end with a line 'Answer: <short answer>'."
)


class SearchEnv(AgentEnv):
    """Multi-hop question answering over a local corpus with search and open tools.

    Args:
        corpus: JSONL file of documents, or a list of :class:`Document`. ``None`` uses the
            generated knowledge base.
        qa: JSONL QA file, or a list of :class:`QAExample` (required with ``corpus``).
        split: ``"train"``, ``"test"`` or ``"all"`` (or a name used by the QA rows).
        split_seed: seed of the train/test shuffle.
        test_fraction: share of the questions in the test split.
        kb_seed: seed of the generated knowledge base.
        kb_questions: number of generated questions.
        hops: chain lengths of the generated questions.
        retriever: ``"bm25"``, ``"dense"`` (needs sentence-transformers), or a
            :class:`areal_agents.tools.retriever.Retriever` built over the same corpus.
        top_k: number of search results.
        reward: ``"em"`` (exact match) or ``"f1"`` (token F1) for the final answer.
        turn_reward: reward of each turn that calls tools.
        evidence_reward: reward of a tool turn per gold document it opens for the first
            time (a step-level signal along the gold chain; bounded by ``hops`` times it).
        evidence_on_answer: pay the evidence with the answer, to an episode that answers,
            instead of on the tool turns (see the module docstring).
        max_doc_chars: ``open`` cuts documents after this many characters.
        max_turns: the episode is truncated after this many assistant messages.
    """

    def __init__(
        self,
        *,
        corpus: str | os.PathLike[str] | Sequence[Document] | None = None,
        qa: str | os.PathLike[str] | Sequence[QAExample] | None = None,
        split: str = "train",
        split_seed: int = 0,
        test_fraction: float = 0.2,
        kb_seed: int = 0,
        kb_questions: int = 600,
        hops: Sequence[int] = (1, 2, 3),
        retriever: Literal["bm25", "dense"] | Retriever = "bm25",
        top_k: int = 5,
        reward: Literal["em", "f1"] = "em",
        turn_reward: float = 0.0,
        evidence_reward: float = 0.0,
        evidence_on_answer: bool = False,
        max_doc_chars: int = 4000,
        max_turns: int = 10,
    ) -> None:
        super().__init__(max_turns=max_turns)
        if reward not in ("em", "f1"):
            raise ValueError(f"reward: expected 'em' or 'f1', got {reward!r}")
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k: expected a positive int, got {top_k!r}")
        documents, examples, explicit = self._load(corpus, qa, kb_seed, kb_questions, hops)
        self.split = split
        self.tasks = split_examples(
            examples, split, explicit=explicit, seed=split_seed, test_fraction=test_fraction
        )
        self.retriever = _make_retriever(retriever, documents)
        self.reward_kind = reward
        self.turn_reward = float(turn_reward)
        self.evidence_reward = float(evidence_reward)
        self.evidence_on_answer = bool(evidence_on_answer)
        self.top_k = top_k
        self.max_doc_chars = max_doc_chars
        self.task: QAExample | None = None
        self._opened: list[str] = []
        self._tools = self._make_tools()

    @staticmethod
    def _load(
        corpus: str | os.PathLike[str] | Sequence[Document] | None,
        qa: str | os.PathLike[str] | Sequence[QAExample] | None,
        kb_seed: int,
        kb_questions: int,
        hops: Sequence[int],
    ) -> tuple[list[Document], list[QAExample], list[str | None] | None]:
        if corpus is None:
            if qa is not None:
                raise ValueError("qa was given without corpus: pass both, or neither")
            kb = generate_knowledge_base(kb_seed, n_questions=kb_questions, hops=hops)
            return kb.documents, kb.questions, None
        if qa is None:
            raise ValueError("corpus was given without qa: pass a QA file or list too")
        documents = (
            load_documents(corpus) if isinstance(corpus, (str, os.PathLike)) else list(corpus)
        )
        if isinstance(qa, (str, os.PathLike)):
            examples, explicit = load_qa(qa)
            return documents, examples, explicit
        return documents, list(qa), None

    # ------------------------------------------------------------------ tools

    def _make_tools(self) -> list[Tool]:
        retriever, top_k, max_chars = self.retriever, self.top_k, self.max_doc_chars

        def search(query: str) -> str:
            """Search the document collection.

            Args:
                query: Keywords or a question, e.g. the name of an entity.
            """
            if not query.strip():
                raise ToolError("the query is empty; pass keywords, e.g. an entity's name")
            hits = retriever.search(query, k=top_k)
            if not hits:
                return f"No document matches {query!r}. Try other keywords."
            lines = [
                f"[{i}] id: {h.doc_id} | title: {h.title}\n    {h.snippet}"
                for i, h in enumerate(hits, start=1)
            ]
            return "\n".join(lines)

        def open_document(doc: str) -> str:
            """Read a document in full.

            Args:
                doc: The document's id (from search results) or its exact title.
            """
            document = retriever.get(doc.strip())
            if document is None:
                titles = [d.title for d in retriever.documents]
                close = difflib.get_close_matches(doc, titles, n=3)
                hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
                raise ToolError(
                    f"no document has the id or title {doc!r}.{hint} "
                    "Use search to find document ids."
                )
            text = document.text
            if len(text) > max_chars:
                text = text[:max_chars] + f"\n[document truncated after {max_chars} characters]"
            return f"id: {document.id}\ntitle: {document.title}\n\n{text}"

        return [function_tool(search), function_tool(open_document, name="open")]

    # ------------------------------------------------------------------ episode hooks

    def num_tasks(self) -> int:
        return len(self.tasks)

    def _start(self, options: Mapping[str, Any]) -> tuple[list[Message], dict[str, Any]]:
        self.task = self._pick(options)
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": self.task.question},
        ]
        self._opened = []
        info: dict[str, Any] = {
            "task_id": self.task.id,
            "question": self.task.question,
            "hops": self.task.hops,
        }
        if self.task.hops:
            info["kind"] = f"{self.task.hops}-hop"
        return messages, info

    def _pick(self, options: Mapping[str, Any]) -> QAExample:
        if "task_id" in options:
            wanted = str(options["task_id"])
            for task in self.tasks:
                if task.id == wanted:
                    return task
            raise UserError(f"no task with id {wanted!r} in this split ({len(self.tasks)} tasks)")
        if "task_index" in options:
            index = options["task_index"]
            if not isinstance(index, int) or not 0 <= index < len(self.tasks):
                raise UserError(
                    f"task_index: expected an int in [0, {len(self.tasks)}), got {index!r}"
                )
            return self.tasks[index]
        return self.tasks[int(self.np_random.integers(len(self.tasks)))]

    def _tool_reward(self, message: Message, records: list[dict[str, Any]]) -> float:
        before = len(self._opened)
        calls = {
            c.get("id"): c for c in (message.get("tool_calls") or []) if isinstance(c, Mapping)
        }
        for record in records:
            if record["name"] != "open" or record["error"] is not None:
                continue
            doc_id = self._opened_id(calls.get(record["tool_call_id"]))
            if doc_id is not None and doc_id not in self._opened:
                self._opened.append(doc_id)
        chain = self.task.chain if self.task is not None else ()
        new_gold = sum(d in chain for d in self._opened[before:])
        if self.evidence_on_answer:  # paid with the answer (_answer_evidence)
            return self.turn_reward
        return self.turn_reward + self.evidence_reward * new_gold

    def _answer_evidence(self, task: QAExample) -> float:
        """The evidence paid with the answer (``evidence_on_answer``; else 0)."""
        if not self.evidence_on_answer:
            return 0.0
        return self.evidence_reward * sum(d in task.chain for d in self._opened)

    def _tool_info(self, message: Message, records: list[dict[str, Any]]) -> dict[str, Any]:
        assert self.task is not None
        return {"gold_documents": list(self.task.chain), "opened_documents": list(self._opened)}

    def _opened_id(self, call: Mapping[str, Any] | None) -> str | None:
        """The id of the document a successful ``open`` call read."""
        function = call.get("function") if call else None
        raw = function.get("arguments") if isinstance(function, Mapping) else None
        try:
            arguments = json.loads(raw) if isinstance(raw, str) else raw
        except json.JSONDecodeError:
            return None
        doc = arguments.get("doc") if isinstance(arguments, Mapping) else None
        document = self.retriever.get(doc.strip()) if isinstance(doc, str) else None
        return document.id if document is not None else None

    def _respond(self, message: Message) -> tuple[list[Message], float, bool, dict[str, Any]]:
        assert self.task is not None
        reward, info = self._grade(message.get("content"), self.task)
        reward += self._answer_evidence(self.task)
        return [], reward, True, {**info, "final_reward": reward}

    def _grade(self, content: str | None, task: QAExample) -> tuple[float, dict[str, Any]]:
        predicted = extract_answer(content)
        em = exact_match(predicted, task.answers)
        f1 = f1_score(predicted, task.answers)
        reward = em if self.reward_kind == "em" else f1
        info = {
            "success": em == 1.0,
            "final_reward": reward,
            "em": em,
            "f1": f1,
            "predicted": predicted,
            "answers": list(task.answers),
            **self._evidence(task, em == 1.0),
        }
        return reward, info

    def _evidence(self, task: QAExample, success: bool) -> dict[str, Any]:
        """The episode's gold and opened documents and whether its success is grounded
        (see the module docstring)."""
        gold = list(task.chain)
        opened = [d for d in gold if d in self._opened]
        return {
            "hops": task.hops,
            "gold_documents": gold,
            "opened_documents": list(self._opened),
            "gold_documents_opened": len(opened),
            "grounded": (success and len(opened) == len(gold)) if gold else None,
        }

    def score(self, messages: Sequence[Message]) -> tuple[float, dict[str, Any]]:
        """Score a conversation: the last assistant message without tool calls holds the
        answer to the current task (or, before any reset, the task whose question is the
        first user message). The documents it opened are replayed from its ``open`` calls
        (for ``grounded``), and its tool turns' ``turn_reward`` is ``info["tool_rewards"]``."""
        task = self.task = self.task or self._task_for(messages)  # the replay's evidence
        self._opened = []
        tool_rewards = self.tool_turn_rewards(messages)
        finals = [
            m
            for m in messages
            if isinstance(m, Mapping) and m.get("role") == "assistant" and not m.get("tool_calls")
        ]
        if not finals:  # no answer: graded as an empty one, worth nothing
            _, info = self._grade(None, task)
            info = {**info, "success": False, "final_reward": 0.0, "predicted": None}
            return 0.0, {**info, "tool_rewards": tool_rewards}
        reward, info = self._grade(finals[-1].get("content"), task)
        reward += self._answer_evidence(task)
        return reward, {**info, "final_reward": reward, "tool_rewards": tool_rewards}

    def demos(self, n: int, seed: int = 0) -> list[list[Message]]:
        """``n`` solved episodes of the train split, for a supervised warm start.

        Each follows its question's gold chain, one tool call per turn: for every gold
        document, ``search`` for the entity's name (the document's title: the question's
        mention for the first, the name the previous document gives for the next), then
        ``open`` the document by the id the search returned (by its title when the search
        missed it); then the answer ``Answer: <canonical answer>``. The tool results are
        those of the env's own tools, so a 1-hop demonstration is 5 messages after the
        question's 2 and a 2-hop one 9. Questions are distinct while ``n`` <= the number of
        train questions (then they repeat), in an order fixed by ``seed`` (for one chain
        length only, make the env with that ``hops``). Every demonstration earns reward 1
        and is grounded.

        Raises:
            UserError: the env is not the train split (demonstrations must never show test
                questions), or the questions have no gold chain.
        """
        if n < 0:
            raise ValueError(f"n must be non-negative, got {n}")
        if self.split != "train":
            raise UserError(
                f"demos() writes train questions only, but this env holds the {self.split!r} "
                "split; make it with split='train' (the default)"
            )
        pool = [t for t in self.tasks if t.chain]
        if not pool:
            raise UserError(
                "no train question has a gold chain, which demos follow: give the QA rows a "
                "'chain' of document ids, or use the generated knowledge base (corpus=None)"
            )
        rng = random.Random(seed)
        order: list[QAExample] = []
        while len(order) < n:
            order += rng.sample(pool, len(pool))
        return [self._demo(task, seed) for task in order[:n]]

    def _demo(self, task: QAExample, seed: int) -> list[Message]:
        """One solved episode of ``task`` along its gold chain (see :meth:`demos`)."""
        if 2 * len(task.chain) + 1 > self.max_turns:
            raise UserError(
                f"question {task.id} takes {2 * len(task.chain) + 1} turns (search and open "
                f"per document, then the answer), more than max_turns={self.max_turns}; "
                "raise max_turns, or draw shorter chains (hops=[1])"
            )
        self.reset(seed=seed, options={"task_id": task.id})
        turn = 0
        for doc_id in task.chain:
            document = self.retriever.get(doc_id)
            if document is None:
                raise UserError(
                    f"question {task.id}: its chain names document {doc_id!r}, which is not "
                    "in the corpus; fix the QA file's 'chain'"
                )
            self.step(_tool_call(f"call_{turn}", "search", query=document.title))
            found = any(
                h.doc_id == doc_id for h in self.retriever.search(document.title, k=self.top_k)
            )
            self.step(
                _tool_call(f"call_{turn + 1}", "open", doc=doc_id if found else document.title)
            )
            turn += 2
        _, _, terminated, _, info = self.step(f"Answer: {task.answers[0]}")
        if not (terminated and info.get("success") and info.get("grounded")):
            raise UserError(
                f"the demonstration of question {task.id} does not succeed ({info}): its "
                "answer or gold chain does not match the corpus; fix the QA row"
            )
        return [dict(m) for m in self.messages]

    def _task_for(self, messages: Sequence[Message]) -> QAExample:
        users = [m.get("content") for m in messages if m.get("role") == "user"]
        for task in self.tasks:
            if users and task.question == users[0]:
                return task
        raise UserError("score() needs reset() first, or a conversation asking a known question")


def _tool_call(call_id: str, name: str, **arguments: str) -> Message:
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


def _make_retriever(kind: str | Retriever, documents: list[Document]) -> Retriever:
    if isinstance(kind, Retriever):
        return kind
    if kind == "bm25":
        return BM25Retriever(documents)
    if kind == "dense":
        return DenseRetriever(documents)
    raise ValueError(f"retriever: expected 'bm25', 'dense' or a Retriever, got {kind!r}")
