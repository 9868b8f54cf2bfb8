"""``areal/Search-v0``: multi-hop question answering over a local corpus.

See :mod:`areal_agents.envs.search.env` for the environment,
:mod:`areal_agents.envs.search.kb` for the generated knowledge base of fictional entities, and
:mod:`areal_agents.envs.search.answer` for answer scoring.
"""

from areal_agents.envs.search.answer import (
    exact_match,
    extract_answer,
    f1_score,
    load_qa,
    normalize_answer,
)
from areal_agents.envs.search.env import SearchEnv
from areal_agents.envs.search.kb import KnowledgeBase, QAExample, generate_knowledge_base

__all__ = [
    "KnowledgeBase",
    "QAExample",
    "SearchEnv",
    "exact_match",
    "extract_answer",
    "f1_score",
    "generate_knowledge_base",
    "load_qa",
    "normalize_answer",
]
