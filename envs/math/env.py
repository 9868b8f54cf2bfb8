"""Math environments: ``areal/Math-v0`` (:class:`MathEnv`) and ``areal/Calculator-v0``
(:class:`CalculatorEnv`).

An episode is one problem. Each assistant turn either calls tools (the env runs them and
returns ``tool`` messages) or answers. An answer is the content of an assistant message
without tool calls; its final answer is extracted (``\\boxed{}``, ``#### X``,
"answer is X", else the last number; see :mod:`areal_agents.envs.math.answer`) and checked against
the gold answer.

Rewards (defaults in brackets), per step:

- an answer turn, correct: ``correct_reward`` [1.0]; the episode terminates with
  ``success=True``;
- an answer turn, wrong or without a findable answer: ``wrong_reward`` [0.0]. While fewer
  than ``max_attempts`` answers were given, the env replies with a feedback ``user``
  message and the episode goes on; after the last attempt it terminates with
  ``success=False``;
- a tool turn: ``tool_call_reward`` [0.0] when every call in it succeeded, else 0.

:class:`CalculatorEnv` can also give partial credit for a grounded calculator call
(``grounded_call_reward`` c [0.0], off by default): the first calculator call of the episode
that evaluates without error earns, on its turn,

    r_call = c   if nums(expr) == nums(question)
    r_call = 0   otherwise

where ``nums`` is the multiset of numbers written in the text: the call must use every number
of the question once and no other (the shape of every generated task's solution); a call
that copies one number, or invents one, earns nothing, so no shortcut earns part of c.
``grounded_ops_reward`` c_ops [0.0] adds credit for a grounded call that also uses the
operators of the task's solution (``ops``: the multiset of ``+ - * /`` in it, parentheses
and order aside):

    r_call += c_ops   if nums(expr) == nums(question) and ops(expr) == ops(solution)

so a call that combines the right numbers with the wrong operation (``8 * 4 + 50`` for
``50 - 8 * 4``) earns less than one with the right operation, and with c = 0 nothing at
all: partial credit then does not teach one problem's operation on another. Only the first
successful call counts, so repeating calls earns nothing more. Success is unchanged: only a
correct final answer succeeds.

``max_turns`` counts assistant messages; running out of turns truncates the episode
(``success=False``). The end-of-episode ``info`` has ``success``, ``final_reward`` (the
reward of the outcome), ``attempts``, ``predicted``, ``answer``, ``kind``, ``tool_used``.

:class:`CalculatorEnv` may also require a successful calculator call before a correct
answer counts (``require_tool``; off by default): a correct answer without one ends the
episode with ``wrong_reward`` and ``info["reason"] = "no_tool_call"``.
"""

from __future__ import annotations

import difflib
import json
import random
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from areal_agents.envs.base import AgentEnv, Message
from areal_agents.envs.math.answer import answers_match, extract_answer
from areal_agents.envs.math.generator import ARITHMETIC_SHAPES, generate_task
from areal_agents.envs.math.tasks import (
    MathTask,
    TaskPool,
    cached_pool,
    load_jsonl,
    reasoning_gym_pool,
)
from areal_agents.tools.calculator import calculator
from areal_agents.tools.tool import Tool

__all__ = ["CalculatorEnv", "MathEnv", "demos"]

DEFAULT_NUM_TASKS = {"train": 5000, "test": 500}
MATH_SYSTEM_PROMPT = (
    "Solve the math problem step by step. You can call the tools for arithmetic. "
    "When you are done, give the final answer as \\boxed{<answer>}."
)
CALCULATOR_SYSTEM_PROMPT = (
    "You are a careful assistant with a calculator tool. First call the calculator with the "
    "arithmetic expression that answers the question. After you read the result, reply with: "
    "The answer is <number>."
)
WRONG_FEEDBACK = "Your answer {predicted} is not correct. Check your work and try again."
NO_ANSWER_FEEDBACK = "I could not find a final answer. {format_hint}"

ToolSource = Tool | Callable[[], Tool]


class _AnswerEnv(AgentEnv):
    """Shared episode logic: pick a task, run tools, check answers, give feedback."""

    format_hint = "Give the final answer as \\boxed{<answer>}."

    def __init__(
        self,
        pool: Sequence[MathTask],
        *,
        system_prompt: str,
        max_turns: int,
        max_attempts: int,
        correct_reward: float,
        wrong_reward: float,
        tool_call_reward: float,
        feedback: str,
        require_tool: bool = False,
    ) -> None:
        super().__init__(max_turns=max_turns)
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        self.pool = pool
        self.system_prompt = system_prompt
        self.max_attempts = max_attempts
        self.correct_reward = float(correct_reward)
        self.wrong_reward = float(wrong_reward)
        self.tool_call_reward = float(tool_call_reward)
        self.feedback = feedback
        self.require_tool = require_tool
        self.task: MathTask | None = None
        self.attempts = 0
        self.tool_used = False

    # ------------------------------------------------------------------ hooks

    def _start(self, options: Mapping[str, Any]) -> tuple[list[Message], dict[str, Any]]:
        self.task = self.pool[self._task_index(options)]
        self.attempts, self.tool_used = 0, False
        self._tools = self._episode_tools()
        messages = [{"role": "system", "content": self.system_prompt}, *self._prefix_messages()]
        messages.append({"role": "user", "content": self.task.question})
        return messages, {"task_id": self.task.task_id, "kind": self.task.kind}

    def num_tasks(self) -> int:
        return len(self.pool)

    def _task_index(self, options: Mapping[str, Any]) -> int:
        if "task_id" in options:
            index = self.pool.find(str(options["task_id"]))  # type: ignore[attr-defined]
            if index is None:
                raise ValueError(f"no task with task_id {options['task_id']!r} in this pool")
            return int(index)
        if "task_index" in options:
            index = int(options["task_index"])
            if not 0 <= index < len(self.pool):
                raise ValueError(f"task_index must be in [0, {len(self.pool)}), got {index}")
            return index
        return int(self.np_random.integers(len(self.pool)))

    def _episode_tools(self) -> list[Tool]:
        return [calculator]

    def _prefix_messages(self) -> list[Message]:
        return []

    def _tool_reward(self, message: Message, records: list[dict[str, Any]]) -> float:
        ok = bool(records) and all(r["error"] is None for r in records)
        if any(r["error"] is None and r["name"] == "calculator" for r in records):
            self.tool_used = True
        return self.tool_call_reward if ok else 0.0

    def _respond(self, message: Message) -> tuple[list[Message], float, bool, dict[str, Any]]:
        assert self.task is not None
        self.attempts += 1
        predicted = extract_answer(message.get("content"))
        correct = answers_match(predicted, self.task.answer)
        info = self._outcome_info(predicted)
        if correct and self.require_tool and not self.tool_used:
            info.update(success=False, final_reward=self.wrong_reward, reason="no_tool_call")
            return [], self.wrong_reward, True, info
        if correct:
            info.update(success=True, final_reward=self.correct_reward)
            return [], self.correct_reward, True, info
        if self.attempts >= self.max_attempts:
            info.update(success=False, final_reward=self.wrong_reward, reason="wrong_answer")
            return [], self.wrong_reward, True, info
        return [self._feedback_message(predicted)], self.wrong_reward, False, info

    def _feedback_message(self, predicted: str | None) -> Message:
        if predicted is None:
            text = NO_ANSWER_FEEDBACK.format(format_hint=self.format_hint)
        else:
            text = self.feedback.format(predicted=predicted)
        return {"role": "user", "content": text}

    def _outcome_info(self, predicted: str | None) -> dict[str, Any]:
        assert self.task is not None
        return {
            "attempts": self.attempts,
            "predicted": predicted,
            "answer": self.task.answer,
            "kind": self.task.kind,
            "tool_used": self.tool_used,
        }

    def score(self, messages: Sequence[Message]) -> tuple[float, dict[str, Any]]:
        """Score a conversation: its last assistant message without tool calls is the
        answer. Returns (``correct_reward`` or ``wrong_reward``, info with ``success`` and
        the tool turns' rewards, ``tool_rewards``: ``tool_call_reward``, the grounded-call
        credit, as stepping the same conversation gives them)."""
        if self.task is None:
            raise RuntimeError("call reset() before score(): the task is chosen at reset")
        finals = [m for m in messages if m.get("role") == "assistant" and not m.get("tool_calls")]
        predicted = extract_answer(finals[-1].get("content")) if finals else None
        self.tool_used = False  # replayed: the tool turns earn what they earn env-driven
        tool_rewards = self.tool_turn_rewards(messages)
        tool_used = _used_calculator(messages)
        success = answers_match(predicted, self.task.answer) and (
            tool_used or not self.require_tool
        )
        reward = self.correct_reward if success else self.wrong_reward
        info = {
            "success": success,
            "predicted": predicted,
            "answer": self.task.answer,
            "kind": self.task.kind,
            "tool_used": tool_used,
            "tool_rewards": tool_rewards,
        }
        return reward, info


def _used_calculator(messages: Sequence[Message]) -> bool:
    """True when a calculator call got a result that is not an error."""
    call_ids = {
        call.get("id")
        for m in messages
        if m.get("role") == "assistant"
        for call in (m.get("tool_calls") or [])
        if isinstance(call, dict) and call.get("function", {}).get("name") == "calculator"
    }
    return any(
        m.get("role") == "tool"
        and m.get("tool_call_id") in call_ids
        and not str(m.get("content", "")).startswith("Error")
        for m in messages
    )


class MathEnv(_AnswerEnv):
    """GSM8K-style word problems, multi-turn, with a calculator (and optional python) tool.

    Args:
        split: ``"train"`` or ``"test"`` (disjoint by question; see
            :mod:`areal_agents.envs.math.tasks`).
        data_path: A GSM8K-format JSONL file to use instead of generated tasks.
        datasets: reasoning-gym datasets to draw from (interleaved).
        num_tasks: Pool size [5000 train, 500 test].
        seed: Seed of the reasoning-gym generators (the task stream).
        python_tool: An extra tool (e.g. a sandboxed python tool), or a function returning
            a fresh one for each episode. Only the calculator by default.
        max_turns: Assistant messages before truncation [8].
        max_attempts: Answers allowed; wrong ones get feedback until then [2].
        correct_reward, wrong_reward, tool_call_reward: See the module docstring.
        feedback: Reply to a wrong answer; ``{predicted}`` is replaced by the answer read.
        system_prompt: The system message.
    """

    def __init__(
        self,
        *,
        split: Literal["train", "test"] = "train",
        data_path: str | None = None,
        datasets: Sequence[str] = ("gsm_symbolic",),
        num_tasks: int | None = None,
        seed: int = 0,
        python_tool: ToolSource | None = None,
        max_turns: int = 8,
        max_attempts: int = 2,
        correct_reward: float = 1.0,
        wrong_reward: float = 0.0,
        tool_call_reward: float = 0.0,
        feedback: str = WRONG_FEEDBACK,
        system_prompt: str = MATH_SYSTEM_PROMPT,
    ) -> None:
        if data_path is not None:
            pool: Sequence[MathTask] = load_jsonl(data_path)
        else:
            size = num_tasks or DEFAULT_NUM_TASKS[split]
            pool = reasoning_gym_pool(datasets, split, size, seed=seed)
        super().__init__(
            pool,
            system_prompt=system_prompt,
            max_turns=max_turns,
            max_attempts=max_attempts,
            correct_reward=correct_reward,
            wrong_reward=wrong_reward,
            tool_call_reward=tool_call_reward,
            feedback=feedback,
        )
        self.python_tool = python_tool

    def _episode_tools(self) -> list[Tool]:
        if self.python_tool is None:
            return [calculator]
        extra = self.python_tool if isinstance(self.python_tool, Tool) else self.python_tool()
        return [calculator, extra]


def calculator_pool(
    kind: str,
    split: str,
    num_tasks: int,
    word_fraction: float,
    shape_weights: Mapping[str, float] | None = None,
) -> TaskPool:
    """The (cached) pool of generated calculator tasks."""
    weights = dict(shape_weights or {})

    def build() -> TaskPool:
        return TaskPool(
            lambda j: generate_task(
                kind, j, word_fraction=word_fraction, shape_weights=weights or None
            ),
            split,  # type: ignore[arg-type]
            num_tasks,
        )

    key = ("calculator", kind, split, num_tasks, word_fraction, tuple(sorted(weights.items())))
    return cached_pool(key, build)


class CalculatorEnv(_AnswerEnv):
    """Two-turn calculator tool use: call calculator(expression), then answer.

    Args:
        split: ``"train"`` or ``"test"`` (disjoint by question).
        kind: ``"arithmetic"``, ``"word"`` or ``"mixed"`` tasks [mixed].
        word_fraction: Share of word problems when ``kind="mixed"`` [0.5].
        num_tasks: Pool size [5000 train, 500 test].
        few_shot: Number of worked example conversations placed before the question
            (``True`` means 2: one arithmetic, one word problem) [0].
        require_tool: Count a correct answer only after a successful calculator call [False].
        max_turns: Assistant messages before truncation [4].
        max_attempts: Answers allowed [1].
        correct_reward, wrong_reward, tool_call_reward: See the module docstring.
        grounded_call_reward: Partial credit c for the first successful calculator call
            when it uses exactly the question's numbers (module docstring) [0.0].
        grounded_ops_reward: Extra credit c_ops for that call when it also uses the
            operators of the task's solution (module docstring) [0.0].
        shape_weights: Relative weights of the arithmetic solution shapes
            (:data:`~areal_agents.envs.math.generator.ARITHMETIC_SHAPES`; unnamed ones weigh
            1), e.g. ``{"(a+b)*c": 3, "(a-b)*c": 3}`` to train more on the parenthesized
            ones. The split is by question text, so a reweighted pool never holds a test
            question [uniform].
        feedback: Reply to a wrong answer when ``max_attempts > 1``.
        system_prompt: The system message.
    """

    format_hint = "Reply with: The answer is <number>."

    @staticmethod
    def demos(
        n: int, seed: int = 0, kind: str = "mixed", balanced: bool = True, compact: bool = False
    ) -> list[list[Message]]:
        """Correct conversations for a supervised warm start (see :func:`demos`)."""
        return demos(n, seed=seed, kind=kind, balanced=balanced, compact=compact)  # type: ignore[arg-type]

    def __init__(
        self,
        *,
        split: Literal["train", "test"] = "train",
        kind: Literal["arithmetic", "word", "mixed"] = "mixed",
        word_fraction: float = 0.5,
        num_tasks: int | None = None,
        few_shot: int | bool = 0,
        require_tool: bool = False,
        max_turns: int = 4,
        max_attempts: int = 1,
        correct_reward: float = 1.0,
        wrong_reward: float = 0.0,
        tool_call_reward: float = 0.0,
        grounded_call_reward: float = 0.0,
        grounded_ops_reward: float = 0.0,
        shape_weights: Mapping[str, float] | None = None,
        feedback: str = WRONG_FEEDBACK,
        system_prompt: str = CALCULATOR_SYSTEM_PROMPT,
    ) -> None:
        for shape, weight in (shape_weights or {}).items():
            if shape not in ARITHMETIC_SHAPES:
                near = difflib.get_close_matches(str(shape), ARITHMETIC_SHAPES, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise ValueError(
                    f"shape_weights: unknown shape {shape!r}{hint} "
                    f"(shapes: {', '.join(ARITHMETIC_SHAPES)})"
                )
            if not isinstance(weight, int | float) or isinstance(weight, bool) or weight < 0:
                raise ValueError(f"shape_weights[{shape!r}] must be a number >= 0, got {weight!r}")
        if shape_weights and not any(shape_weights.get(s, 1.0) > 0 for s in ARITHMETIC_SHAPES):
            raise ValueError("shape_weights: at least one shape needs a weight > 0")
        for name, value in (
            ("grounded_call_reward", grounded_call_reward),
            ("grounded_ops_reward", grounded_ops_reward),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        size = num_tasks or DEFAULT_NUM_TASKS[split]
        super().__init__(
            calculator_pool(kind, split, size, word_fraction, shape_weights),
            system_prompt=system_prompt,
            max_turns=max_turns,
            max_attempts=max_attempts,
            correct_reward=correct_reward,
            wrong_reward=wrong_reward,
            tool_call_reward=tool_call_reward,
            feedback=feedback,
            require_tool=require_tool,
        )
        self.few_shot = 2 if few_shot is True else int(few_shot)
        self.grounded_call_reward = float(grounded_call_reward)
        self.grounded_ops_reward = float(grounded_ops_reward)

    def _prefix_messages(self) -> list[Message]:
        return [m for task in example_tasks(self.few_shot) for m in solved_turns(task, "example")]

    def _tool_reward(self, message: Message, records: list[dict[str, Any]]) -> float:
        first_call = not self.tool_used
        reward = super()._tool_reward(message, records)
        credit = self.grounded_call_reward + self.grounded_ops_reward
        if first_call and self.tool_used and credit > 0:
            assert self.task is not None
            ok_ids = {r["tool_call_id"] for r in records if r["error"] is None}
            for call in message.get("tool_calls") or []:
                if call.get("id") in ok_ids and call["function"]["name"] == "calculator":
                    expression = _call_expression(call)
                    if not grounded(expression, self.task.question):
                        return reward
                    reward += self.grounded_call_reward
                    solution = self.task.expression
                    if solution and _operators(expression) == _operators(solution):
                        reward += self.grounded_ops_reward
                    return reward
        return reward


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def grounded(expression: str, question: str, solution: str | None = None) -> bool:
    """True when ``expression`` uses exactly the numbers of ``question`` (as multisets) and
    the question has some: ``grounded("12 - 5", "Ann had 12 and gave away 5.")``; with a
    ``solution``, also exactly its operators: ``grounded("5 - 12", ..., "12 - 5")`` is True,
    ``grounded("12 + 5", ..., "12 - 5")`` is False."""
    given = Counter(_NUMBER.findall(question))
    if not given or Counter(_NUMBER.findall(expression)) != given:
        return False
    return solution is None or _operators(expression) == _operators(solution)


def _operators(expression: str) -> Counter[str]:
    return Counter(ch for ch in expression if ch in "+-*/")


def _call_expression(call: Mapping[str, Any]) -> str:
    try:
        arguments = json.loads(call["function"].get("arguments") or "{}")
    except (TypeError, ValueError):
        return ""
    value = arguments.get("expression") if isinstance(arguments, dict) else None
    return value if isinstance(value, str) else ""


def example_tasks(n: int) -> list[MathTask]:
    """``n`` fixed train-split tasks for few-shot prompts, alternating arithmetic and word."""
    pools = [calculator_pool(k, "train", 50, 0.5) for k in ("arithmetic", "word")]
    return [pools[i % 2][i // 2] for i in range(n)]


def solved_turns(task: MathTask, call_prefix: str = "call", compact: bool = False) -> list[Message]:
    """The correct turns for a calculator task: the question, the calculator call, its
    result and the final answer. With ``compact`` the call's arguments are compact JSON
    (``{"expression":"(1 + 2) * 3"}``, see :func:`demos`)."""
    assert task.expression is not None, "solved_turns needs a task with an expression"
    call_id = f"{call_prefix}_{task.task_id}"
    result = calculator.call({"expression": task.expression}).content
    separators = (",", ":") if compact else None
    return [
        {"role": "user", "content": task.question},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {
                        "name": "calculator",
                        "arguments": json.dumps(
                            {"expression": task.expression}, separators=separators
                        ),
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": result},
        {"role": "assistant", "content": f"The answer is {result}."},
    ]


def demos(
    n: int,
    seed: int = 0,
    kind: Literal["arithmetic", "word", "mixed"] = "mixed",
    balanced: bool = True,
    compact: bool = False,
) -> list[list[Message]]:
    """``n`` correct Calculator-v0 conversations for a supervised warm start.

    Each is ``[system, user, assistant tool call, tool result, assistant answer]``, with the
    default system prompt of :class:`CalculatorEnv` (render the calculator's schema
    ``areal_agents.tools.calculator.schema`` with them). Tasks are distinct, drawn from the
    train split only (never a test question), in an order fixed by ``seed``.

    With ``balanced`` [True] every solution shape (the task's kind and its expression with
    each number replaced by ``n``: ``(n + n) * n``) gets the same number of demonstrations,
    give or take one (with ``kind="mixed"`` the word shapes count as shapes of their own),
    so a small warm start does not leave a shape to the luck of the draw
    (100 uniformly drawn arithmetic demos hold 16, 13 and 25 of the two parenthesized
    shapes for seeds 0, 1 and 2); ``balanced=False`` draws tasks uniformly from the pool.

    With ``compact`` [False] the calls' arguments are written without spaces
    (``{"expression":"(12 + 5) * 3"}``). The default model's tokenizer merges a space, the
    opening quote and a leading parenthesis into one rare token (`` "(``), which a small
    warm start leaves at ~1-3% where a parenthesized expression should begin (so greedy
    decoding drops the parenthesis: ``12 + 5``); after the compact ``":"`` the parenthesis
    is the ordinary ``(`` token, and the same warm start gives it ~3x the probability.
    """
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    pool = calculator_pool(kind, "train", max(n, DEFAULT_NUM_TASKS["train"]), 0.5)
    rng = random.Random(seed)
    indices = _balanced_sample(pool, n, rng) if balanced else rng.sample(range(len(pool)), n)
    system = {"role": "system", "content": CALCULATOR_SYSTEM_PROMPT}
    return [[dict(system), *solved_turns(pool[i], compact=compact)] for i in indices]


def solution_shape(task: MathTask) -> str:
    """The task's kind and the shape of its solution: ``"arithmetic:(n + n) * n"``."""
    return f"{task.kind}:{_NUMBER.sub('n', task.expression or '')}"


def _balanced_sample(pool: Sequence[MathTask], n: int, rng: random.Random) -> list[int]:
    """``n`` distinct pool indices, round-robin over the solution shapes (in an order shuffled
    by ``rng``, each shape's tasks shuffled too), in shuffled order."""
    by_shape: dict[str, list[int]] = {}
    for i, task in enumerate(pool):
        by_shape.setdefault(solution_shape(task), []).append(i)
    queues = [by_shape[key] for key in sorted(by_shape)]
    rng.shuffle(queues)
    for queue in queues:
        rng.shuffle(queue)
    chosen: list[int] = []
    depth = 0
    while len(chosen) < n:
        chosen.extend(q[depth] for q in queues[: n - len(chosen)] if depth < len(q))
        depth += 1
    rng.shuffle(chosen)
    return chosen
