"""Environments for multi-turn, tool-using agents, registered with gymnasium.

    >>> from areal_agents import envs
    >>> env = envs.make("areal/Calculator-v0")
    >>> messages, info = env.reset(seed=0)
    >>> [m["role"] for m in messages], info["tools"][0]["function"]["name"]
    (['system', 'user'], 'calculator')

Importing ``envs`` registers the built-in ids (``areal/Math-v0``, ``areal/Calculator-v0``,
``areal/Search-v0``, ``areal/Research-v0``, ``areal/Tau2Retail-v0``,
``areal/Tau2Airline-v0``, ``areal/Tasks-v0``) by entry-point string; an env's module is
imported only when it is made.
"""

from areal_agents.envs.base import AgentEnv, EpisodeEnded, as_assistant_message, run_tool_calls
from areal_agents.envs.checker import EnvCheckError, check_env
from areal_agents.envs.registry import ENTRY_POINT_GROUP, list_envs, load_plugins, make, register
from areal_agents.envs.registry import _register_builtins as _register_builtins
from areal_agents.envs.spaces import AssistantMessage, ChatMessages

_register_builtins()

__all__ = [
    "ENTRY_POINT_GROUP",
    "AgentEnv",
    "AssistantMessage",
    "ChatMessages",
    "EnvCheckError",
    "EpisodeEnded",
    "as_assistant_message",
    "check_env",
    "list_envs",
    "load_plugins",
    "make",
    "register",
    "run_tool_calls",
]
