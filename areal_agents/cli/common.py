"""What several ``areal-agent`` commands share: JSON flags, ``--agent``, the view hint.

Light on purpose: ``worker`` imports it, and a worker has only httpx and openai.
"""

from __future__ import annotations

import json
import os
from typing import Any

from areal_agents.errors import ConfigError
from areal_agents.rollout.task_agent import load_agent

__all__ = ["json_object", "load_agent_arg", "view_hint"]


def json_object(text: str, flag: str) -> dict[str, Any]:
    """The JSON object ``text`` given to ``flag`` (e.g. ``--env-kwargs``), else a
    ConfigError naming the flag."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{flag} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object, got {text!r}")
    return value


def load_agent_arg(spec: str, kwargs_json: str = "{}", max_turns: int | None = None) -> Any:
    """``--agent`` (and ``--agent-kwargs``) as the runner's agent (see ``task_agent``)."""
    return load_agent(spec, json_object(kwargs_json, "--agent-kwargs"), max_turns=max_turns)


def view_hint(run_dir: str | os.PathLike[str]) -> str:
    """The command that shows ``run_dir`` in the browser (train and eval print it)."""
    return f"see it in the browser: areal-agent view {run_dir}"
