"""``areal-agent worker``: run an agent in this process on the tasks a trainer hands out.

Needs only httpx and openai (``requirements/client.txt``): no torch, no fastapi.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from areal_agents.cli.common import load_agent_arg
from areal_agents.client import AgentWorker
from areal_agents.errors import ConfigError

__all__ = ["worker_command"]


def worker_command(args: argparse.Namespace) -> int:
    """Post the agent's results for the trainer's tasks until stopped (or ``--max-tasks``)."""
    token = args.token or os.environ.get("AREAL_WORKER_TOKEN")
    if not token:
        raise ConfigError(
            "areal-agent worker needs the trainer's worker token: --token T or $AREAL_WORKER_TOKEN"
        )
    if args.concurrency < 1 or (args.max_tasks is not None and args.max_tasks < 1):
        raise ConfigError("--concurrency and --max-tasks must be >= 1")
    if os.getcwd() not in sys.path:  # the agent's module may sit where the worker starts
        sys.path.insert(0, os.getcwd())
    agent = load_agent_arg(args.agent, args.agent_kwargs)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for quiet in ("httpx", "httpx2"):  # not a line per heartbeat and model call
        logging.getLogger(quiet).setLevel(logging.WARNING)
    worker = AgentWorker(args.connect, token, concurrency=args.concurrency, wait_s=args.wait)
    print(f"areal-agent worker {worker.worker_id}: tasks from {worker.url}", file=sys.stderr)
    done = worker.serve_sync(agent, max_tasks=args.max_tasks)
    print(f"areal-agent worker {worker.worker_id}: {done} result(s) posted", file=sys.stderr)
    return 0
