"""MCP tools in an env: ``envs.make(id, mcp=...)`` adds an MCP server's tools to the env's own.

:func:`add_mcp_tools` connects to each server (see :mod:`areal_agents.tools.mcp_client` for
the config and the connection's lifetime) and adds its tools to the env's own with
:meth:`envs.AgentEnv.add_tools`. The model sees them in ``info["tools"]`` of every reset;
env-driven, a call runs in ``env.step`` like any tool, and its result, or its error
(``"timeout"``, ``"tool_exception"``, ``"mcp_error"`` in ``info["tool_results"]`` and an
``"Error: ..."`` tool message the model reads), is part of the recorded episode.
Agent-driven, the agent gets them in ``task.tools``.

The other way round, serving an env's tools to an MCP client (``areal-agent mcp-serve``), is
:mod:`areal_agents.envs.mcp_serve`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from areal_agents.errors import ConfigError
from areal_agents.tools.mcp_client import MCPServerConfig, connect

__all__ = ["add_mcp_tools"]


def add_mcp_tools(env: Any, servers: Any, *, where: str = "mcp") -> None:
    """Add the tools of ``servers`` (one config mapping or a list of them) to ``env``.

    Raises:
        ConfigError: a malformed config, an env without ``add_tools`` (not an
            :class:`envs.AgentEnv`), or a server that cannot be started or reached.
    """
    configs = [servers] if isinstance(servers, Mapping) else servers
    if isinstance(configs, (str, bytes)) or not isinstance(configs, Sequence) or not configs:
        raise ConfigError(
            f"{where}: expected a server mapping ({{command: [python, server.py]}} or "
            f"{{url: http://127.0.0.1:8000/mcp}}) or a non-empty list of them, got {servers!r}"
        )
    if not callable(getattr(env, "add_tools", None)):
        raise ConfigError(
            f"{where}: {type(env).__name__} has no add_tools(); MCP tools go into envs that "
            "subclass envs.AgentEnv"
        )
    label = where if len(configs) == 1 else None
    parsed = [MCPServerConfig.parse(c, label or f"{where}[{i}]") for i, c in enumerate(configs)]
    for cfg in parsed:
        conn = connect(cfg)
        env.add_tools(conn.tools(), on_close=conn.close if cfg.scope == "env" else None)
