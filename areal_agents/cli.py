"""The ``areal-agent`` command line.

    areal-agent serve [--model M] [--port P] [--smoke]   the recording proxy + embedded engine
    areal-agent envs                                      registered environments

Heavy imports (torch, transformers, envs) happen inside the commands, so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from .errors import ArealError


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="areal-agent",
        description="Agent-environment gym and asynchronous RL for tool-using LLM agents.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="serve a model behind the recording OpenAI proxy")
    serve.add_argument(
        "--model",
        default=None,
        help="HF model directory or hub id (default: SmolLM2-135M-Instruct, offline)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--admin-key",
        default=os.environ.get("AREAL_ADMIN_KEY"),
        help="require this key for POST /sessions and allow it everywhere "
        "(default: $AREAL_ADMIN_KEY; none)",
    )
    serve.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    serve.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: auto)")
    serve.add_argument("--max-batch-size", type=int, default=64)
    serve.add_argument(
        "--smoke",
        action="store_true",
        help="start, answer one chat completion through the openai client, print "
        "the recorded trajectory, and exit",
    )
    serve.set_defaults(func=_serve)

    envs = sub.add_parser("envs", help="list the registered environments")
    envs.set_defaults(func=_envs)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ArealError as exc:
        print(f"areal-agent: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _load_proxy(args: argparse.Namespace) -> Any:
    from .chat import ChatTokenizer
    from .embedded import EmbeddedEngine
    from .model import resolve_model
    from .proxy import Proxy

    path = resolve_model(args.model)
    print(f"loading {path} ...", file=sys.stderr)
    engine = EmbeddedEngine.from_pretrained(
        path, dtype=args.dtype, device=args.device, max_batch_size=args.max_batch_size
    )
    tokenizer = ChatTokenizer.from_dir(path)
    engine._decode = tokenizer.decode
    return Proxy(engine, tokenizer, admin_key=args.admin_key)


def _serve(args: argparse.Namespace) -> int:
    proxy = _load_proxy(args)
    if args.smoke:
        return _smoke(proxy, args.host)
    from .server import serve_forever

    print(
        f"areal-agent proxy on http://{args.host}:{args.port}/v1  "
        f"(POST /sessions for a session key)",
        file=sys.stderr,
    )
    serve_forever(proxy, args.host, args.port)
    return 0


def _smoke(proxy: Any, host: str) -> int:
    """One recorded chat completion end to end, through the real HTTP stack."""
    import httpx
    from openai import OpenAI

    from .server import ProxyServer

    with ProxyServer.start(proxy, host=host) as server:
        headers = {"Authorization": f"Bearer {proxy.admin_key}"} if proxy.admin_key else {}
        made = httpx.post(f"{server.url}/sessions", json={}, headers=headers).json()
        client = OpenAI(base_url=made["base_url"], api_key=made["api_key"])
        reply = client.chat.completions.create(
            model=proxy.model_name,
            max_tokens=48,
            temperature=0,
            seed=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        text = reply.choices[0].message.content or ""
        traj = httpx.get(
            f"{server.url}/sessions/{made['id']}/trajectory",
            headers={"Authorization": f"Bearer {made['api_key']}"},
        ).json()
    comp = traj["completions"][0]
    decoded = proxy.tokenizer.decode(
        comp["output_ids"][:-1] if comp["finish_reason"] == "stop" else comp["output_ids"]
    )
    print(f"assistant: {text}")
    print(
        json.dumps(
            {
                "session": traj["session_id"],
                "prompt_tokens": len(comp["prompt_ids"]),
                "output_ids": comp["output_ids"],
                "output_logprobs": [round(x, 4) for x in comp["output_logprobs"]],
                "output_versions": comp["output_versions"],
                "finish_reason": comp["finish_reason"],
                "decodes_to_reply": decoded == text,
                "samples": len(traj["samples"]),
            },
            indent=1,
        )
    )
    asyncio.run(proxy.engine.close())
    return 0 if decoded == text else 1


def _envs(args: argparse.Namespace) -> int:
    from envs.registry import list_envs

    rows = list_envs()
    width = max((len(i) for i, _ in rows), default=10)
    for env_id, description in rows:
        print(f"{env_id:<{width}}  {description}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
