"""Server-backed engines for ``areal-agent serve`` and ``eval`` (``--backend vllm|sglang``).

``--backend vllm`` (or ``sglang``) either starts a server for ``--model`` with the Python of
that server's own environment (``--engine-python``), or attaches to running servers
(``--engine-url``, once per server; several become one engine with session-sticky
routing). The proxy's tokenizer comes from ``--model``, or else from the model directory
the server reports. The options are defined with the parser, in :mod:`areal_agents.cli.main`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from areal_agents.engines.router import RoutedEngine
from areal_agents.engines.sglang import SGLangEngine
from areal_agents.engines.vllm import VLLMEngine
from areal_agents.errors import ConfigError
from areal_agents.model import resolve_model
from areal_agents.serve.chat import ChatTokenizer

__all__ = ["load_server_engine"]


def load_server_engine(args: argparse.Namespace) -> tuple[Any, Any]:
    """(engine, ChatTokenizer) for ``--backend vllm|sglang``."""
    if getattr(args, "ray", False) or getattr(args, "ray_address", None):
        raise ConfigError("--ray runs the embedded engine; drop --ray with --backend vllm/sglang")
    cls: Any = VLLMEngine if args.backend == "vllm" else SGLangEngine
    if args.engine_url:
        model_dir = resolve_model(args.model) if args.model else None
        print(f"attaching to {', '.join(args.engine_url)} ...", file=sys.stderr)
        engines = [cls.connect(url, model_dir=model_dir) for url in args.engine_url]
        model_dir = model_dir or engines[0].model_dir
        if model_dir is None:
            raise ConfigError(
                f"the {args.backend} server reports no local model directory; pass --model "
                "<HF directory> so the proxy can load its tokenizer"
            )
        engine: Any = engines[0] if len(engines) == 1 else RoutedEngine(engines)
        tokenizer = ChatTokenizer.from_dir(model_dir)
        for e in engines:
            e.decode = tokenizer.decode
        return engine, tokenizer
    path = resolve_model(args.model)
    tokenizer = ChatTokenizer.from_dir(path)
    print(f"starting a {args.backend} server for {path} ...", file=sys.stderr)
    options: dict[str, Any] = {
        "python": args.engine_python,
        "port": args.engine_port,
        "dtype": args.dtype,
        "lora_rank": args.lora_rank,
        "extra_args": shlex.split(args.engine_args),
        "log_path": args.engine_log,
        "start_timeout_s": args.engine_timeout,
        "decode": tokenizer.decode,
    }
    if args.backend == "vllm":
        options["max_num_seqs"] = args.max_batch_size
    engine = cls.launch(path, **options)
    log_path = engine.server.log_path if engine.server is not None else None
    print(f"{args.backend} server at {engine.url} (log: {log_path})", file=sys.stderr)
    return engine, tokenizer
