"""Loading the user's agent: ``"pkg.module:factory"`` (and its keyword arguments) to an agent
the episode runner can drive.

``pkg.module`` is imported by name; a ``path/to/file.py`` (relative to the working
directory) is loaded from that file. The factory is called once; what it returns decides
how each episode runs it:

* an OpenAI Agents SDK ``Agent``: run unchanged through
  :func:`areal_agents.integrations.openai_agents.run_agent` against the episode's proxy
  session, with its own function tools and handoffs plus the env's tools; the SDK's final
  output is the answer the env scores (running out of turns scores what was said so far);
* an object with ``async run(task)``, or a callable taking an
  :class:`~areal_agents.rollout.runner.AgentTask` (async, or sync: a sync one runs on a thread):
  used as it is; what it returns is the final answer.

Used by ``agent:`` in the training config and ``--agent`` of ``areal-agent eval``. Errors in
the spec or the factory are :class:`~areal_agents.errors.ConfigError` naming the fix, raised
before any episode starts. What an agent's prompts look like is found by
:mod:`areal_agents.rollout.observe`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from areal_agents.errors import ConfigError, check_import_name
from areal_agents.integrations.openai_agents import run_agent


def load_agent(
    spec: str, kwargs: Mapping[str, Any] | None = None, *, max_turns: int | None = None
) -> Any:
    """Import ``spec`` (``module:attr``), call it with ``kwargs``, adapt the result (see the
    module docstring). ``max_turns`` bounds an Agents SDK agent's model turns."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"agent factory {spec!r}: expected 'pkg.module:factory' or 'path/to/file.py:factory'"
        )
    if not module_name.endswith(".py"):
        check_import_name(spec, "agent factory")
    try:
        factory = getattr(_import(module_name), attr)
    except (ImportError, AttributeError, OSError) as exc:
        raise ConfigError(
            f"cannot load agent factory {spec!r}: {exc}; check the module is importable "
            "(on sys.path, e.g. run from its directory) and defines the name"
        ) from None
    if not callable(factory):
        raise ConfigError(f"agent factory {spec!r} is a {type(factory).__name__}, not callable")
    try:
        made = factory(**dict(kwargs or {}))
    except TypeError as exc:
        raise ConfigError(
            f"agent factory {spec!r} cannot take kwargs {dict(kwargs or {})}: {exc}"
        ) from None
    return as_task_agent(made, max_turns=max_turns, where=spec)


def _import(name: str) -> Any:
    """A module by dotted name, or by file path (``*.py``, relative to the working
    directory), loaded once under a name derived from its resolved path."""
    if not name.endswith(".py"):
        return importlib.import_module(name)
    path = Path(name).resolve()
    if not path.is_file():
        raise ImportError(f"no file {path}")
    key = "areal_user_agent_" + "_".join(path.with_suffix("").parts[1:]).replace("-", "_")
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[key]
        raise
    return module


def as_task_agent(obj: Any, *, max_turns: int | None = None, where: str = "the agent") -> Any:
    """``obj`` as something the runner calls with an ``AgentTask`` (module docstring)."""
    if _is_sdk_agent(obj):
        return SDKAgent(obj, max_turns=max_turns)
    if callable(getattr(obj, "run", None)) or callable(obj):
        return obj
    raise ConfigError(
        f"{where} returned a {type(obj).__name__}: expected an OpenAI Agents SDK Agent, an "
        "object with async run(task), or a callable taking an AgentTask"
    )


class SDKAgent:
    """An OpenAI Agents SDK ``Agent`` as a task agent: one ``Runner.run`` per episode."""

    def __init__(self, agent: Any, *, max_turns: int | None = None) -> None:
        self.agent = agent
        self.max_turns = max_turns

    @property
    def name(self) -> str:
        return str(getattr(self.agent, "name", "agent"))

    async def run(self, task: Any) -> str | None:
        """One SDK run on the task's session. Running out of turns, or the model misbehaving
        (a reply cut at its token limit, a call to an unknown tool, arguments that do not
        parse), ends the run there and the env scores what was said so far: for RL these
        are the model's failures, to be scored, not errors to drop from the data."""
        # The SDK is an optional extra (areal-agents[agents]), present when its Agent is.
        from agents import MaxTurnsExceeded, ModelBehaviorError  # noqa: PLC0415  an optional extra

        try:
            result = await run_agent(
                self.agent,
                task.messages,
                base_url=task.base_url,
                api_key=task.api_key,
                tools=task.tools,
                max_turns=self.max_turns,
            )
        except (MaxTurnsExceeded, ModelBehaviorError):
            return None
        return None if result.final_output is None else str(result.final_output)


def _is_sdk_agent(obj: Any) -> bool:
    """An ``agents.Agent`` (checked by class, without importing the SDK when it is absent)."""
    for cls in type(obj).__mro__:
        if cls.__name__ == "Agent" and cls.__module__.split(".")[0] == "agents":
            return True
    return False
