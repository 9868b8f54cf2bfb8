"""Math environments (``areal/Math-v0``, ``areal/Calculator-v0``), answer checking, and
supervised demonstrations for the calculator task.

    >>> from areal_agents.envs.math import demos
    >>> [m["role"] for m in demos(1, seed=0)[0]]
    ['system', 'user', 'assistant', 'tool', 'assistant']
"""

from areal_agents.envs.math.answer import answers_match, extract_answer
from areal_agents.envs.math.env import CalculatorEnv, MathEnv, demos
from areal_agents.envs.math.tasks import MathTask, load_jsonl, split_of

__all__ = [
    "CalculatorEnv",
    "MathEnv",
    "MathTask",
    "answers_match",
    "demos",
    "extract_answer",
    "load_jsonl",
    "split_of",
]
