"""``areal-agent train`` (asynchronous RL from a config) and ``areal-agent demos`` (an env's
demonstrations for a warm start). torch loads only when training starts, so ``--dry-run``
prints the resolved config and the memory estimate without it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from areal_agents.cli.common import json_object, load_agent_arg, view_hint
from areal_agents.envs.registry import make
from areal_agents.errors import ConfigError
from areal_agents.model import resolve_model
from areal_agents.rollout.observe import observe_prompt
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.trainer.config_io import format_config, load_config
from areal_agents.trainer.memory import estimate_for_config

__all__ = ["demos_command", "train_command"]


def train_command(args: argparse.Namespace) -> int:
    """Train on the resolved config (``--dry-run``: print it and the memory estimate)."""
    overrides = list(args.overrides)
    if args.nproc is not None:
        overrides.append(f"train.nproc={args.nproc}")
    overrides += engine_overrides(args)
    cfg = load_config(args.config, overrides)
    if args.dry_run:
        print(format_config(cfg))
        print(f"# estimated training memory per rank:\n{estimate_for_config(cfg).format()}")
        return 0
    from areal_agents.trainer.loop import train  # noqa: PLC0415  loads torch to train

    print(view_hint(cfg.train.output_dir), flush=True)
    summary = train(cfg, resume=args.resume, quiet=args.quiet)
    keys = ("reward_mean", "success_rate", "staleness_mean", "train_tokens_per_s")
    print(" ".join(f"{k}={summary[k]:.3g}" for k in keys if k in summary))
    if summary.get("held_out"):
        print(summary["held_out"])
    print(f"final model: {summary.get('final_model')}")
    print(f"run directory: {cfg.train.output_dir} ({view_hint(cfg.train.output_dir)})")
    return 0


def engine_overrides(args: argparse.Namespace) -> list[str]:
    """``--backend``, ``--engine-url``, ``--engine-python``, ``--engine-args`` as overrides
    of the config's ``engine`` section (before the positional overrides' later ones)."""
    out = []
    if args.backend is not None:
        out.append(f"engine.backend={args.backend}")
    if args.engine_url:
        out.append(f"engine.urls={json.dumps(list(args.engine_url))}")
    if args.engine_python is not None:
        out.append(f"engine.launch.python={json.dumps(args.engine_python)}")
    if args.engine_args is not None:
        out.append(f"engine.launch.args={json.dumps(args.engine_args)}")
    return out


def demos_command(args: argparse.Namespace) -> int:
    """The env's demonstrations as JSONL rows ``{"messages": [...]}``; with ``--agent``, the
    agent's leading messages are put before each and the row carries the agent's tool list
    (``"tools"``), which a warm start renders them with."""
    env_kwargs = json_object(args.env_kwargs, "--env-kwargs")
    env = make(args.env, **env_kwargs)
    maker = getattr(env.unwrapped, "demos", None)
    env.close()
    if maker is None:
        raise ConfigError(
            f"{args.env} offers no demos(); write the JSONL yourself "
            "(one list of chat messages per line)"
        )
    kwargs = {"kind": args.kind} if args.kind else {}
    rows = maker(args.n, seed=args.seed, **kwargs)
    prefix: list[dict[str, Any]] = []
    tools = None
    if args.agent:
        agent = load_agent_arg(args.agent, args.agent_kwargs)
        tokenizer = ChatTokenizer.from_dir(resolve_model(args.model))
        prefix, tools = asyncio.run(
            observe_prompt(agent, lambda: make(args.env, **env_kwargs), tokenizer, seed=args.seed)
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        for messages in rows:
            row: dict[str, Any] = {"messages": [*prefix, *messages]}
            if tools is not None:
                row["tools"] = tools
            f.write(json.dumps(row) + "\n")
    how = f" as agent {args.agent} prompts ({len(tools or [])} tools)" if args.agent else ""
    print(f"wrote {len(rows)} demonstrations{how} to {args.out}")
    return 0
