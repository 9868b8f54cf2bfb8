"""``areal-agent envs`` (the registered environments) and ``areal-agent mcp-serve`` (an env's
tools served over MCP)."""

from __future__ import annotations

import argparse

from areal_agents.cli.common import json_object
from areal_agents.envs.mcp_serve import serve
from areal_agents.envs.registry import list_envs

__all__ = ["envs_command", "mcp_serve_command"]


def envs_command(args: argparse.Namespace) -> int:
    """Print every registered env id with its one-line description."""
    rows = list_envs()
    width = max((len(i) for i, _ in rows), default=10)
    for env_id, description in rows:
        print(f"{env_id:<{width}}  {description}")
    return 0


def mcp_serve_command(args: argparse.Namespace) -> int:
    """Serve ``--env``'s tools over MCP until the client goes or the process is stopped."""
    serve(
        args.env,
        json_object(args.env_kwargs, "--env-kwargs"),
        transport=args.transport,
        host=args.host,
        port=args.port,
        seed=args.seed,
    )
    return 0
