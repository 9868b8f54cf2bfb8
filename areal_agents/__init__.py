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
    from areal_agents.engines.embedded import EmbeddedEngine
    from areal_agents.engines.protocol import Engine, GenerateResult, SamplingParams, WeightUpdate
    from areal_agents.engines.router import RoutedEngine
    from areal_agents.engines.sglang import SGLangEngine
    from areal_agents.engines.vllm import VLLMEngine
    from areal_agents.errors import (
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
    from areal_agents.model import DEFAULT_MODEL, resolve_model
    from areal_agents.serve.chat import ChatTokenizer
    from areal_agents.serve.context import ContextPolicy
    from areal_agents.serve.proxy import Proxy
    from areal_agents.serve.server import ProxyServer
    from areal_agents.serve.session import Session, SessionStore
    from areal_agents.serve.toolcall import ParsedOutput, parse_tool_calls
    from areal_agents.testing.fake_engine import FakeEngine
    from areal_agents.trajectory import Completion, Episode, TrainingSample

__version__ = "0.2.0"

# Every public name and the submodule it lives in: imported on first access (PEP 562), so
# ``import areal_agents.client`` (a worker without torch or fastapi) loads none of the rest.
_LAZY: dict[str, str] = {
    "ChatTokenizer": "serve.chat",
    "ContextPolicy": "serve.context",
    "EmbeddedEngine": "engines.embedded",
    **dict.fromkeys(
        ("Engine", "GenerateResult", "SamplingParams", "WeightUpdate"), "engines.protocol"
    ),
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
    "FakeEngine": "testing.fake_engine",
    "DEFAULT_MODEL": "model",
    "resolve_model": "model",
    "Proxy": "serve.proxy",
    "RoutedEngine": "engines.router",
    "ProxyServer": "serve.server",
    "Session": "serve.session",
    "SessionStore": "serve.session",
    "SGLangEngine": "engines.sglang",
    "ParsedOutput": "serve.toolcall",
    "parse_tool_calls": "serve.toolcall",
    "Completion": "trajectory",
    "Episode": "trajectory",
    "TrainingSample": "trajectory",
    "VLLMEngine": "engines.vllm",
}


def make(env_id: str, **kwargs: Any) -> Any:
    """Create a registered environment (``gymnasium.make`` with areal's registry loaded)."""
    # gymnasium and numpy stay out of ``import areal_agents`` (a worker has neither).
    from areal_agents.envs.registry import make as _make  # noqa: PLC0415  envs load on use

    return _make(env_id, **kwargs)


def register(env_id: str, entry_point: Any, **kwargs: Any) -> None:
    """Register an environment under ``env_id`` (``gymnasium.register``)."""
    import gymnasium  # noqa: PLC0415  gymnasium (numpy) loads on use, not with the package

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
