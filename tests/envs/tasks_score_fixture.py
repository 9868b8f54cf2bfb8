"""Score functions for tests/envs/test_tasks_env.py, imported by the string
``"tasks_score_fixture:<name>"`` (the test puts this directory on ``sys.path``)."""

from __future__ import annotations

from typing import Any

CALLS: list[tuple[dict[str, Any], str, list[dict[str, Any]]]] = []
NOT_A_FUNCTION = 3


def score(task: dict[str, Any], final_answer: str, episode: list[dict[str, Any]]) -> bool:
    """Correct when the final answer is the task's answer (a bool reward)."""
    CALLS.append((task, final_answer, episode))
    return final_answer.strip() == str(task["answer"])


def with_info(task: dict[str, Any], final_answer: str, episode: list[dict[str, Any]]) -> Any:
    """Partial credit with extra info, and its own success rule."""
    return 0.5, {"success": final_answer == task["answer"], "length": len(final_answer)}


def as_dict(task: dict[str, Any], final_answer: str, episode: list[dict[str, Any]]) -> Any:
    return {"reward": 2, "turns": len(episode)}


def boom(task: dict[str, Any], final_answer: str, episode: list[dict[str, Any]]) -> float:
    raise RuntimeError("the verifier crashed")


def not_a_number(task: dict[str, Any], final_answer: str, episode: list[dict[str, Any]]) -> Any:
    return "yes"


def too_few_args(task: dict[str, Any]) -> float:
    return 1.0
