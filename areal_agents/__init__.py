"""areal-agents: an agent-environment gym and asynchronous RL SDK for tool-using LLM agents.

The public API. Importing it is cheap: every name loads its submodule on first use, so
``import areal_agents`` imports neither torch nor fastapi, and the embedded engine (which
needs torch) loads on first use of ``areal_agents.EmbeddedEngine``.

Example::

    from areal_agents import EmbeddedEngine, Proxy, ProxyServer, ChatTokenizer, resolve_model

    path = resolve_model(None)                       # the offline default model
    tok = ChatTokenizer.from_dir(path)
    proxy = Proxy(EmbeddedEngine.from_pretrained(path, decode=tok.decode), tok)
    with ProxyServer.start(proxy) as server:
        session = proxy.sessions.create()
        # openai.OpenAI(base_url=server.base_url, api_key=session.api_key) ...
        episode = session.episode                    # the recorded token-level trajectory
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .chat import ChatTokenizer
    from .context import ContextPolicy
    from .embedded import EmbeddedEngine
    from .engine import Engine, GenerateResult, SamplingParams, WeightUpdate
    from .errors import (
        ArealError,
        BackendError,
        ConfigError,
        ContextOverflow,
        EnvError,
        EnvNotFound,
        EpisodeTimeout,
        ModelBehaviorError,
        ModelNotFound,
        RolloutError,
        SessionError,
        ToolCallParseError,
        ToolError,
        UserError,
    )
    from .fake_engine import FakeEngine
    from .model import DEFAULT_MODEL, resolve_model
    from .proxy import Proxy
    from .router import RoutedEngine
    from .server import ProxyServer
    from .session import Session, SessionStore
    from .sglang_engine import SGLangEngine
    from .toolcall import ParsedOutput, parse_tool_calls
    from .trajectory import Completion, Episode, TrainingSample
    from .vllm_engine import VLLMEngine

__version__ = "0.1.0"

# Every public name and the submodule it lives in: imported on first access (PEP 562), so
# ``import areal_agents.client`` (a worker without torch or fastapi) loads none of the rest.
_LAZY: dict[str, str] = {
    "ChatTokenizer": "chat",
    "ContextPolicy": "context",
    "EmbeddedEngine": "embedded",
    **dict.fromkeys(("Engine", "GenerateResult", "SamplingParams", "WeightUpdate"), "engine"),
    **dict.fromkeys(
        (
            "ArealError",
            "BackendError",
            "ConfigError",
            "ContextOverflow",
            "EnvError",
            "EnvNotFound",
            "EpisodeTimeout",
            "ModelBehaviorError",
            "ModelNotFound",
            "RolloutError",
            "SessionError",
            "ToolCallParseError",
            "ToolError",
            "UserError",
        ),
        "errors",
    ),
    "FakeEngine": "fake_engine",
    "DEFAULT_MODEL": "model",
    "resolve_model": "model",
    "Proxy": "proxy",
    "RoutedEngine": "router",
    "ProxyServer": "server",
    "Session": "session",
    "SessionStore": "session",
    "SGLangEngine": "sglang_engine",
    "ParsedOutput": "toolcall",
    "parse_tool_calls": "toolcall",
    "Completion": "trajectory",
    "Episode": "trajectory",
    "TrainingSample": "trajectory",
    "VLLMEngine": "vllm_engine",
}


def make(env_id: str, **kwargs: Any) -> Any:
    """Create a registered environment (``gymnasium.make`` with areal's registry loaded)."""
    from envs.registry import make as _make

    return _make(env_id, **kwargs)


def register(env_id: str, entry_point: Any, **kwargs: Any) -> None:
    """Register an environment under ``env_id`` (``gymnasium.register``)."""
    import gymnasium

    gymnasium.register(id=env_id, entry_point=entry_point, **kwargs)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'areal_agents' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later accesses skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "DEFAULT_MODEL",
    "ArealError",
    "BackendError",
    "ChatTokenizer",
    "Completion",
    "ConfigError",
    "ContextOverflow",
    "ContextPolicy",
    "EmbeddedEngine",
    "Engine",
    "EnvError",
    "EnvNotFound",
    "Episode",
    "EpisodeTimeout",
    "FakeEngine",
    "GenerateResult",
    "ModelBehaviorError",
    "ModelNotFound",
    "ParsedOutput",
    "Proxy",
    "ProxyServer",
    "RolloutError",
    "RoutedEngine",
    "SGLangEngine",
    "SamplingParams",
    "Session",
    "SessionError",
    "SessionStore",
    "ToolCallParseError",
    "ToolError",
    "TrainingSample",
    "UserError",
    "VLLMEngine",
    "WeightUpdate",
    "make",
    "parse_tool_calls",
    "register",
    "resolve_model",
]
