"""Server-backed engines for ``areal-agent serve`` and ``eval`` (``--backend vllm|sglang``).

``--backend vllm`` (or ``sglang``) either starts a server for ``--model`` with the Python of
that server's own environment (``--engine-python``), or attaches to running servers
(``--engine-url``, once per server; several become one engine with session-sticky
routing). The proxy's tokenizer comes from ``--model``, or else from the model directory
the server reports. The options are defined with the parser, in :mod:`areal_agents.cli.main`.

:func:`eval_split` is ``eval``'s default split: the env's ``test`` split.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import sys
from pathlib import Path
from typing import Any

from areal_agents.engines.servers import (
    Launch,
    LaunchConfig,
    start_server_engine,
    vllm_lora_rank,
)
from areal_agents.envs.registry import make
from areal_agents.errors import ConfigError
from areal_agents.model import resolve_model
from areal_agents.serve.chat import ChatTokenizer

__all__ = ["eval_split", "load_server_engine"]

EVAL_SPLIT = "test"
"""The split ``eval`` scores where the env has splits and ``--env-kwargs`` names none (as the
trainer's held-out evaluation, ``eval.split``; training takes ``env.split``, ``train``)."""


def eval_split(env_id: str, env_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``eval``'s env kwargs: ``env_kwargs`` with ``split: "test"`` added where the env's
    class takes a ``split`` and none is given, so that ``eval`` never scores the tasks a run
    trains on unless asked (``--env-kwargs '{"split": "all"}'``). Makes the env (an unknown
    id or kwargs the env does not take fail here, before a model loads)."""
    try:
        env = make(env_id, **env_kwargs)
    except TypeError as exc:
        raise ConfigError(f"--env-kwargs: {env_id} does not take them: {exc}") from None
    takes = "split" in inspect.signature(type(env.unwrapped).__init__).parameters
    env.close()
    if not takes or "split" in env_kwargs:
        return env_kwargs
    chosen = {**env_kwargs, "split": EVAL_SPLIT}
    try:
        make(env_id, **chosen).close()
    except ConfigError as exc:
        raise ConfigError(
            f"{env_id}: eval scores the {EVAL_SPLIT!r} split unless --env-kwargs names one, "
            f"and this env has none ({exc}); choose one with --env-kwargs "
            '\'{"split": "NAME"}\' ("all": every task)'
        ) from None
    other = """--env-kwargs '{"split": ...}'"""
    print(f"eval: the {EVAL_SPLIT} split of {env_id} ({other} for another)", file=sys.stderr)
    return chosen


def load_server_engine(args: argparse.Namespace) -> tuple[Any, Any]:
    """(engine, ChatTokenizer) for ``--backend vllm|sglang``
    (:func:`areal_agents.engines.servers.start_server_engine`, as a training run's
    ``engine`` section builds its own)."""
    if getattr(args, "ray", False) or getattr(args, "ray_address", None):
        raise ConfigError("--ray runs the embedded engine; drop --ray with --backend vllm/sglang")
    say = functools.partial(print, file=sys.stderr)
    if args.engine_url:
        model_dir = resolve_model(args.model) if args.model else None
        engine = start_server_engine(args.backend, model_dir, urls=args.engine_url, say=say)
        replicas = list(getattr(engine, "engines", [engine]))
        model_dir = model_dir or replicas[0].model_dir
        if model_dir is None:
            raise ConfigError(
                f"the {args.backend} server reports no local model directory; pass --model "
                "<HF directory> so the proxy can load its tokenizer"
            )
        tokenizer = ChatTokenizer.from_dir(model_dir)
        for e in replicas:
            e.decode = tokenizer.decode
        return engine, tokenizer
    path = resolve_model(args.model)
    tokenizer = ChatTokenizer.from_dir(path)
    log = Path(args.engine_log) if args.engine_log else None
    settings = LaunchConfig(
        python=args.engine_python,
        args=args.engine_args or "",
        port=args.engine_port,
        start_timeout_s=args.engine_timeout,
        max_restarts=0,  # serve reports a dead server in /health; its user restarts it
    )
    launch = Launch(
        settings,
        log_dir=str(log.parent) if log else None,
        log_name=log.name if log else None,
    )
    rank = args.lora_rank
    if rank and args.backend == "vllm":
        rank = vllm_lora_rank(rank)
    engine = start_server_engine(
        args.backend,
        path,
        launch=launch,
        dtype=args.dtype,
        lora_rank=rank,
        max_num_seqs=args.max_batch_size,
        decode=tokenizer.decode,
        say=say,
    )
    return engine, tokenizer
