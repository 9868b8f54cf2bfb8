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
                                  format with its HTTP status (``areal_agents.serve.proxy``)

Every ``RolloutError`` has a short machine-readable ``kind`` used as the counted reason.
"""

from __future__ import annotations


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


__all__ = [
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
]
