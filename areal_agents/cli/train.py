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
from areal_agents.run_state import FILE, find_run_dir, read_run_state, run_log
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.trainer.config_io import format_config, load_config
from areal_agents.trainer.memory import estimate_for_config
from areal_agents.trainer.run_dir import claim_output_dir

__all__ = ["demos_command", "train_command"]


def train_command(args: argparse.Namespace) -> int:
    """Train on the resolved config (``--dry-run``: print it and the memory estimate).

    ``--resume RUN`` continues the run in directory RUN: its own resolved config
    (``RUN/config.yaml``, or ``--config``) with the overrides given now, in RUN. ``--resume``
    alone continues the config's ``train.output_dir``."""
    overrides = list(args.overrides)
    resume, config = args.resume, args.config
    if isinstance(resume, str) and "=" in resume and not Path(resume).exists():
        overrides.insert(0, resume)  # `--resume a.b=c`: an override, not a run directory
        resume = True
    if args.nproc is not None:
        overrides.append(f"train.nproc={args.nproc}")
    overrides += engine_overrides(args)
    if isinstance(resume, str):
        run = find_run_dir(resume)
        config = config or _run_config(run)
        if any(o.partition("=")[0].strip() == "train.output_dir" for o in overrides):
            raise ConfigError(
                f"--resume {resume} continues the run in {run}: drop the train.output_dir "
                "override (or resume that directory instead)"
            )
        overrides.append(f"train.output_dir={json.dumps(str(run))}")
    cfg = claim_output_dir(load_config(config, overrides), bool(resume))  # train.if_exists
    if args.dry_run:
        print(format_config(cfg))
        print(f"# estimated training memory per rank:\n{estimate_for_config(cfg).format()}")
        return 0
    from areal_agents.trainer.loop import train  # noqa: PLC0415  loads torch to train

    out = cfg.train.output_dir
    _refuse_running(out)
    with run_log(out):  # what this prints goes to RUN_DIR/train.log too
        print(view_hint(out), flush=True)
        summary = train(cfg, resume=bool(resume), quiet=args.quiet)
        keys = ("reward_mean", "success_rate", "staleness_mean", "train_tokens_per_s")
        print(" ".join(f"{k}={summary[k]:.3g}" for k in keys if k in summary))
        if summary.get("stopped_by_request"):
            state = read_run_state(out)
            step = state.step if state is not None else "?"
            print(
                f"stopped after step {step} (areal-agent stop); continue it with: "
                f"areal-agent train --resume {out}"
            )
            return 0
        if summary.get("held_out"):
            print(summary["held_out"])
        print(f"final model: {summary.get('final_model')}")
        print(f"run directory: {out} ({view_hint(out)})")
    return 0


def _run_config(run: Path) -> str:
    """``RUN/config.yaml``, the resolved config the run wrote, for ``--resume RUN``."""
    path = run / "config.yaml"
    if not path.is_file():
        raise ConfigError(
            f"--resume {run}: it has no config.yaml (not a run of areal-agent train?); "
            "pass the run's config too: --config FILE --resume RUN"
        )
    return str(path)


def _refuse_running(out: str) -> None:
    """A ConfigError when the run in ``out`` is still running (two trainers in one directory
    would overwrite each other's checkpoints)."""
    state = read_run_state(out)
    if state is None or state.effective().status != "running":
        return
    raise ConfigError(
        f"{out} is running (pid {state.pid} on {state.host}): stop it first with "
        f"`areal-agent stop {out}` (if it is not running, delete {Path(out) / FILE})"
    )


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
