"""``areal/Tasks-v0``: train and evaluate on a JSONL file of tasks with your own score
function, without writing a gym env.

    >>> from areal_agents import envs
    >>> env = envs.make("areal/Tasks-v0")  # the built-in example tasks, exact-match scoring
    >>> messages, info = env.reset(options={"task_index": 0})
    >>> info["task_id"], messages[-1]["content"]
    ('add-1', 'What is 17 + 25?')
    >>> env.step({"role": "assistant", "content": "17 + 25 = 42.\\nAnswer: 42"})[1:3]
    (1.0, True)

The task format is in :mod:`areal_agents.envs.tasks.data`, the score functions in
:mod:`areal_agents.envs.tasks.scoring`, the episode in :mod:`areal_agents.envs.tasks.env`.
"""

from areal_agents.envs.tasks.data import Task, load_tasks, parse_tasks, select_split
from areal_agents.envs.tasks.env import DEFAULT_SCORE, EXAMPLE_TASKS, TasksEnv
from areal_agents.envs.tasks.scoring import (
    exact_match,
    extract_answer,
    normalize,
    read_outcome,
    resolve_score,
)

__all__ = [
    "DEFAULT_SCORE",
    "EXAMPLE_TASKS",
    "Task",
    "TasksEnv",
    "exact_match",
    "extract_answer",
    "load_tasks",
    "normalize",
    "parse_tasks",
    "read_outcome",
    "resolve_score",
    "select_split",
]
