"""The exception hierarchy of areal-agents.

Errors split by blame. Caller errors are raised at once; rollout errors happen inside an
episode, are recorded on it, counted, and never crash a batch::

    ArealError
    ├── UserError                 the caller misused the SDK: raised at once
    │   ├── ConfigError           a configuration value is wrong (names the key and the fix)
    │   ├── EnvNotFound           an unknown environment id ("Did you mean ...?")
    │   ├── ModelNotFound         a model directory / default model cannot be found
    │   └── SessionError          an unknown, closed or foreign session
    ├── RolloutError              something failed inside an episode: recorded, not raised
    │   ├── ToolError             a tool raised or timed out
    │   ├── ToolCallParseError    the model emitted a tool call that cannot be parsed
    │   ├── ModelBehaviorError    the model did something else that cannot be used
    │   ├── BackendError          the inference engine or server failed
    │   ├── ContextOverflow       prompt + max tokens exceed the model's context
    │   ├── EnvError              the environment (or its user simulator) failed
    │   ├── EpisodeTimeout        the episode ran past its time limit
    │   ├── AgentError            the user's agent raised (in this process or a worker's)
    │   └── AgentLost             an agent in another process stopped answering (no
    │                             heartbeat, no result in time, or the worker hub closed)
    └── ApiError                  the proxy's answer to a bad call, in the OpenAI error
                                  format with its HTTP status (``areal_agents.serve.api_error``)

Every ``RolloutError`` has a short machine-readable ``kind`` used as the counted reason.

:func:`check_import_name` turns an import string that still uses a pre-0.2.0 name
(``tools.calculator:calculator``) into a ``ConfigError`` that names the new one.
"""

from __future__ import annotations

import importlib.util
import os


class ArealError(Exception):
    """Base class of every error raised by areal-agents."""


class UserError(ArealError):
    """The caller misused the SDK. The message says what is wrong and how to fix it."""


class ConfigError(UserError, ValueError):
    """A configuration value is wrong. May carry several problems at once."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        self.problems = list(problems or [])
        if self.problems:
            message = message + "\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message)


class EnvNotFound(UserError, LookupError):
    """An environment id is not registered."""


class ModelNotFound(UserError, FileNotFoundError):
    """A model cannot be found or prepared."""


class SessionError(UserError):
    """A session id or key is unknown, closed, or belongs to another session."""


class RolloutError(ArealError):
    """A failure inside an episode. Recorded on the episode and counted by ``kind``."""

    kind: str = "rollout_error"


class ToolError(RolloutError):
    kind = "tool_error"


class ToolCallParseError(RolloutError):
    kind = "tool_call_parse_error"


class ModelBehaviorError(RolloutError):
    kind = "model_behavior_error"


class BackendError(RolloutError):
    kind = "backend_error"


class ContextOverflow(RolloutError):
    kind = "context_overflow"


class EnvError(RolloutError):
    kind = "env_error"


class EpisodeTimeout(RolloutError):
    kind = "timeout"


class AgentError(RolloutError):
    """The user's agent raised (in this process, or in a worker, which posted the error)."""

    kind = "agent_error"


class AgentLost(RolloutError):
    """A worker that took the episode's task stopped heartbeating or ran out of time."""

    kind = "agent_lost"


RENAMED_FOLDERS = ("envs", "tools", "trainer")
"""Folders that installed as top-level packages before 0.2.0 and install inside
``areal_agents`` since (``envs.math.env`` -> ``areal_agents.envs.math.env``)."""


def renamed_import(name: str) -> str | None:
    """The 0.2.0 name of a module named by its pre-0.2.0 name, else ``None``.

    ``name`` is old when it starts with one of :data:`RENAMED_FOLDERS`, the same module exists
    under ``areal_agents``, and the bare top-level name is not some other installed package
    (a user's own ``tools`` package stays theirs): it resolves to nothing, or to this
    project's folder (as it does in a source checkout's root).
    """
    top = name.partition(".")[0]
    if top not in RENAMED_FOLDERS:
        return None
    new = f"areal_agents.{name}"
    try:
        ours = importlib.util.find_spec(new)
        package = importlib.util.find_spec(f"areal_agents.{top}")
    except (ImportError, ValueError):
        return None
    if ours is None or package is None or package.origin is None:
        return None
    try:
        bare = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        bare = None
    theirs = bare.origin if bare is not None else None
    if theirs is not None and os.path.realpath(theirs) != os.path.realpath(package.origin):
        return None
    return new


def check_import_name(spec: str, where: str) -> None:
    """Raise :class:`ConfigError` if the import string ``spec`` (``module`` or
    ``module:attr``) names a module by its pre-0.2.0 name; ``where`` names the setting."""
    module, sep, attr = spec.strip().partition(":")
    new = renamed_import(module)
    if new is not None:
        raise ConfigError(
            f"{where}: {spec.strip()!r} uses the name the module had before 0.2.0; it is now "
            f"{new + sep + attr!r} (envs/, tools/ and trainer/ install inside areal_agents)"
        )


__all__ = [
    "RENAMED_FOLDERS",
    "AgentError",
    "AgentLost",
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
    "check_import_name",
    "renamed_import",
]
