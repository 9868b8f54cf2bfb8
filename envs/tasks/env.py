"""``areal/Tasks-v0``: your tasks (a JSONL file) scored by your function, no env to write.

In a training or evaluation config::

    env:
      id: areal/Tasks-v0
      kwargs: {path: tasks.jsonl, score: "my_pkg.rewards:score"}

with one task per line (format: :mod:`areal_agents.envs.tasks.data`) and, in ``my_pkg/rewards.py``::

    def score(task, final_answer, episode):
        return final_answer.strip() == task["answer"]

An episode is one task. ``reset`` returns the task's messages (``system`` first, then
``messages`` or the ``prompt`` as a user message); ``info`` has ``task_id``, ``tools`` (the
task's tool schemas) and the task's ``kind`` when it has one (per-kind sampling and eval
reports read it). The task's other fields (``answer``, metadata...) go to the score
function only: ``info`` reaches the agent (and external workers), and the fields may hold
the gold answer.

Env-driven episodes: the first assistant message without tool calls ends the episode
(``terminated``) and is scored by ``fn(task, final_answer, episode)`` (see
:mod:`areal_agents.envs.tasks.scoring` for the arguments and the accepted return values); the reward
is given on that step and ``info["success"]`` is ``reward > 0`` unless the function says
otherwise. The tools of a task are schemas only: the model sees them, and a call gets a
``tool`` message "Error: the tool ... has no implementation in this environment" (error
``tool_exception``) and earns 0. Running out of ``max_turns`` truncates the episode
(``success=False``, no score).

Agent-driven episodes (an agent runs its own loop and tools): :meth:`TasksEnv.score` scores
the conversation with the same function, the final answer being the content of its last
assistant message.

A score function that raises or returns something else than a number makes that episode
fail with an :class:`areal_agents.errors.EnvError` (counted as ``env_error``; the run goes
on). Problems found when the env is made (a bad task line, a score function that cannot be
imported) raise a :class:`areal_agents.errors.ConfigError` at once.

Without ``path`` the env uses a small built-in file (``envs/tasks/example.jsonl``:
arithmetic questions with an ``answer``) and the built-in exact-match scorer
``areal_agents.envs.tasks.scoring:exact_match``, so ``make("areal/Tasks-v0")`` works as it is.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from areal_agents.envs.base import AgentEnv, Message
from areal_agents.envs.tasks.data import Task, load_tasks, select_split
from areal_agents.envs.tasks.scoring import ScoreFn, read_outcome, resolve_score
from areal_agents.errors import ConfigError, EnvError, UserError

__all__ = ["DEFAULT_SCORE", "EXAMPLE_TASKS", "TasksEnv"]

EXAMPLE_TASKS = Path(__file__).with_name("example.jsonl")
"""The built-in task file used when no ``path`` is given."""

DEFAULT_SCORE = "areal_agents.envs.tasks.scoring:exact_match"
"""The built-in scorer used with the built-in task file."""


class TasksEnv(AgentEnv):
    """Your own tasks from a JSONL file, scored by your function (``module:fn``).

    Args:
        path: The JSONL task file (one task per line; see :mod:`areal_agents.envs.tasks.data`). A
            relative path is read from the current directory. ``None`` uses the built-in
            example file.
        score: The score function, ``"package.module:function"`` (imported when the env is
            made) or a callable; called as ``fn(task, final_answer, episode)``. Required
            with ``path``; ``None`` without it means :data:`DEFAULT_SCORE`.
        split: ``"all"`` [default], or the tasks whose ``split`` field has this value; for
            tasks without ``split`` fields, ``"train"`` or ``"test"`` of a seeded shuffle
            (see :func:`areal_agents.envs.tasks.data.select_split`).
        split_seed: Seed of that shuffle.
        test_fraction: Share of the tasks in the shuffled ``"test"`` split.
        system_prompt: A system message for the tasks that have none (no default).
        max_turns: Assistant messages before an env-driven episode is truncated [8].
    """

    def __init__(
        self,
        *,
        path: str | os.PathLike[str] | None = None,
        score: str | ScoreFn | None = None,
        split: str = "all",
        split_seed: int = 0,
        test_fraction: float = 0.2,
        system_prompt: str | None = None,
        max_turns: int = 8,
    ) -> None:
        super().__init__(max_turns=max_turns)
        if score is None:
            if path is not None:
                raise ConfigError(
                    f"score: areal/Tasks-v0 with path={str(path)!r} needs a score function: "
                    "pass score='package.module:function' (called as fn(task, final_answer, "
                    f"episode)), or score={DEFAULT_SCORE!r} to compare with the tasks' "
                    "'answer' fields"
                )
            score = DEFAULT_SCORE
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ConfigError(f"system_prompt: expected a string, got {system_prompt!r}")
        self.score_fn, self.score_name = resolve_score(score)
        self.path = Path(path) if path is not None else EXAMPLE_TASKS
        self.tasks = select_split(
            load_tasks(self.path), split, seed=split_seed, test_fraction=test_fraction
        )
        self.split = split
        self.system_prompt = system_prompt
        self.task: Task | None = None

    # ------------------------------------------------------------------ episode hooks

    def num_tasks(self) -> int:
        return len(self.tasks)

    def _start(self, options: Mapping[str, Any]) -> tuple[list[Message], dict[str, Any]]:
        self.task = task = self._pick(options)
        self._tools = list(task.tools)
        messages = [dict(m) for m in task.messages]
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        info: dict[str, Any] = {"task_id": task.task_id}
        if "kind" in task.fields:
            info["kind"] = copy.deepcopy(task.fields["kind"])
        return messages, info

    def _pick(self, options: Mapping[str, Any]) -> Task:
        if "task_id" in options:
            wanted = str(options["task_id"])
            for task in self.tasks:
                if task.task_id == wanted:
                    return task
            raise UserError(f"no task with id {wanted!r} in this split ({len(self.tasks)} tasks)")
        if "task_index" in options:
            index = options["task_index"]
            if isinstance(index, bool) or not isinstance(index, int):
                raise UserError(f"task_index: expected an int, got {index!r}")
            if not 0 <= index < len(self.tasks):
                raise UserError(
                    f"task_index: expected an int in [0, {len(self.tasks)}), got {index!r}"
                )
            return self.tasks[index]
        return self.tasks[int(self.np_random.integers(len(self.tasks)))]

    def _respond(self, message: Message) -> tuple[list[Message], float, bool, dict[str, Any]]:
        try:
            reward, info = self._score(self.messages)
        except EnvError:
            self._active = False  # the episode cannot go on: reset() starts the next one
            raise
        return [], reward, True, info

    def score(self, messages: Sequence[Message]) -> tuple[float, dict[str, Any]]:
        """Score a conversation produced by an agent's own loop: its last assistant
        message's content is the final answer. Returns (reward, info with ``success``).

        Raises:
            EnvError: the score function raised or returned something unusable.
        """
        return self._score(messages)

    # ------------------------------------------------------------------ scoring

    def _score(self, messages: Sequence[Message]) -> tuple[float, dict[str, Any]]:
        if self.task is None:
            raise UserError("call reset() before score(): the task is chosen at reset")
        episode = [dict(m) for m in messages]
        final_answer = _final_answer(episode)
        try:
            value = self.score_fn(self.task.score_input(), final_answer, episode)
        except Exception as exc:
            raise EnvError(
                f"score function {self.score_name} raised {type(exc).__name__}: {exc} "
                f"(task {self.task.task_id!r})"
            ) from exc
        reward, info = read_outcome(value, self.score_name)
        return reward, {**info, "final_answer": final_answer}


def _final_answer(messages: Sequence[Message]) -> str:
    """The content of the last assistant message as a string (``""`` when none)."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return _text(message.get("content"))
    return ""


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        parts = [p.get("text") if isinstance(p, Mapping) else p for p in content]
        return "".join(p for p in parts if isinstance(p, str))
    return str(content)
