"""The tau² reward: the benchmark's own rule, optional dense shaping, and pass^k.

The final reward of an episode that ended normally (the user stopped, was transferred or
ran out of scenario, or the agent transferred or stopped) is the product of the checks the
task's ``reward_basis`` names (by default ``DB`` and ``COMMUNICATE``):

- ``DB``: 1 if the episode's final database equals the database obtained by replaying the
  task's gold actions on a fresh copy, else 0. Read-only calls change nothing, so only the
  write actions (their arguments, and their order where it matters) decide. A task whose gold
  actions are all reads scores 1 only if the agent wrote nothing.
- ``COMMUNICATE``: 1 if every string of the task's ``communicate_info`` occurs in some
  assistant message (case-insensitive, after removing commas from the message), else 0.

An episode cut short (turn budget, user-simulator failure) gets 0, as in the benchmark.
Other bases (``ACTION``, ``ENV_ASSERTION``, ``NL_ASSERTION``) are not scored; none of the
shipped retail and airline tasks uses them.

Dense shaping (off by default, :func:`dense_write_credit`): each successful write call that
matches a not-yet-matched gold write action exactly (same tool, same arguments after JSON
canonicalization) earns ``weight / number of gold writes``, so the shaping of an episode
sums to at most ``weight``. It rewards progress, never replaces the final check.

:func:`pass_hat_k` is the benchmark's pass^k: the chance that ``k`` i.i.d. trials of a task
all succeed, estimated without bias from ``n`` trials with ``c`` successes as
``C(c, k) / C(n, k)`` and averaged over tasks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from areal_agents.envs.tau2.data import Task
from areal_agents.envs.tau2.db import Database
from areal_agents.envs.tau2.domain import Domain

SUPPORTED_BASES = frozenset({"DB", "COMMUNICATE"})


@dataclass(frozen=True)
class RewardInfo:
    """The outcome of scoring one episode.

    Attributes:
        reward: The final reward (0 or 1).
        db_match: Whether the final database equals the gold one (``None`` if not checked).
        communicate: For each required string, whether the agent said it.
        breakdown: The value of each scored basis (``{"DB": 1.0, "COMMUNICATE": 0.0}``).
        changed: ``table/id`` of the records that differ from the gold database.
        note: Why the episode was not scored normally, if so.
    """

    reward: float
    db_match: bool | None = None
    communicate: dict[str, bool] = field(default_factory=dict)
    breakdown: dict[str, float] = field(default_factory=dict)
    changed: tuple[str, ...] = ()
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict for an env's ``info``."""
        return {
            "reward": self.reward,
            "db_match": self.db_match,
            "communicate": dict(self.communicate),
            "breakdown": dict(self.breakdown),
            "changed": list(self.changed),
            "note": self.note,
        }


def _text(content: Any) -> str:
    """A message's text, whether ``content`` is a str or a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def communicate_checks(
    required: Sequence[str], messages: Sequence[dict[str, Any]]
) -> dict[str, bool]:
    """For each required string, whether some assistant message contains it.

    The comparison is case-insensitive and ignores commas in the message, as the benchmark's.
    """
    said = [
        _text(m.get("content")).lower().replace(",", "")
        for m in messages
        if m.get("role") == "assistant"
    ]
    return {info: any(info.lower() in text for text in said) for info in required}


def evaluate(
    domain: Domain,
    task: Task,
    db: Database,
    messages: Sequence[dict[str, Any]],
    *,
    completed: bool = True,
    note: str = "",
) -> RewardInfo:
    """Score an episode of ``task`` that left ``db`` behind and produced ``messages``.

    Args:
        domain: The task's domain.
        task: The task.
        db: The episode's final database.
        messages: The conversation (only assistant messages matter).
        completed: False if the episode was cut short: the reward is then 0.
        note: Why the episode was cut short (kept in the result).
    """
    if not completed:
        return RewardInfo(reward=0.0, note=note or "episode ended prematurely")
    gold = domain.gold_database(task)
    changed = tuple(db.diff(gold))
    checks = communicate_checks(task.communicate_info, messages)
    breakdown: dict[str, float] = {}
    if "DB" in task.reward_basis:
        breakdown["DB"] = 0.0 if changed else 1.0
    if "COMMUNICATE" in task.reward_basis:
        breakdown["COMMUNICATE"] = 1.0 if all(checks.values()) else 0.0
    unsupported = sorted(set(task.reward_basis) - SUPPORTED_BASES)
    if unsupported:
        note = f"reward bases {unsupported} are not scored"
    return RewardInfo(
        reward=math.prod(breakdown.values()),
        db_match=not changed,
        communicate=checks,
        breakdown=breakdown,
        changed=changed,
        note=note,
    )


def canonical_arguments(arguments: Any) -> str:
    """Tool arguments (a JSON string or a dict) as canonical JSON, for exact comparison."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
    return json.dumps(_integral(arguments), sort_keys=True)


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: _integral(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integral(item) for item in value]
    return value


def dense_write_credit(
    domain: Domain,
    task: Task,
    name: str,
    arguments: Any,
    matched: set[int],
    *,
    weight: float,
) -> float:
    """Shaping reward for one successful call of tool ``name`` (see the module docstring).

    ``matched`` holds the indices of the gold actions already credited; a newly matched one
    is added to it.
    """
    if name not in domain.write_tools:
        return 0.0
    writes = [i for i, a in enumerate(task.actions) if a.name in domain.write_tools]
    wanted = canonical_arguments(arguments)
    for index in writes:
        action = task.actions[index]
        if index in matched or action.name != name:
            continue
        if canonical_arguments(dict(action.arguments)) == wanted:
            matched.add(index)
            return weight / len(writes)
    return 0.0


def pass_hat_k(successes_per_task: Sequence[Sequence[bool]], k: int) -> float:
    """pass^k: the mean over tasks of ``C(c, k) / C(n, k)`` (``c`` successes of ``n`` trials).

    Args:
        successes_per_task: For each task, the success of each of its trials.
        k: How many trials must all succeed (``1 <= k <= n`` for every task).

    Raises:
        ValueError: If there is no task, ``k < 1``, or a task has fewer than ``k`` trials.

    Example:
        >>> pass_hat_k([[True, True, False], [True, False, False]], 2)
        0.16666666666666666
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"expected an int k >= 1, got {k!r}")
    if not successes_per_task:
        raise ValueError("expected at least one task's trials, got none")
    total = 0.0
    for index, trials in enumerate(successes_per_task):
        n, c = len(trials), sum(bool(t) for t in trials)
        if n < k:
            raise ValueError(f"task {index} has {n} trials; pass^{k} needs at least {k} per task")
        total += math.comb(c, k) / math.comb(n, k)
    return total / len(successes_per_task)
