"""Rollout speed of the embedded engine with and without its prefix cache.

The same groups of calculator episodes (system prompt and tool list shared by every episode,
the second turn extending the first) run through the proxy and the runner twice: with
``prefix_cache_entries=0`` (every prompt prefilled in full, the baseline) and with the
default cache. Prints wall time, prefilled and reused prompt tokens, and the ratio.

    python benchmarks/prefix_cache.py                      # 8 groups x 8, the default model
    python benchmarks/prefix_cache.py --adapter runs/calculator-s0/checkpoints/step-000000/model
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from areal_agents.engines.embedded import EmbeddedEngine
from areal_agents.envs.registry import make
from areal_agents.model import resolve_model
from areal_agents.rollout.evaluate import evaluate
from areal_agents.rollout.runner import Runner
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.proxy import Proxy
from areal_agents.serve.server import ProxyServer


def run(path: str, adapter: str | None, entries: int, groups: int, k: int) -> dict[str, Any]:
    engine = EmbeddedEngine.from_pretrained(path, adapter=adapter, prefix_cache_entries=entries)
    tokenizer = ChatTokenizer.from_dir(path)
    engine._decode = tokenizer.decode
    proxy = Proxy(engine, tokenizer)
    with ProxyServer.start(proxy) as server:
        runner = Runner(
            proxy,
            base_url=server.base_url,
            concurrency=groups * k,
            max_turns=3,
            sampling={"temperature": 1.0, "max_tokens": 64},
        )

        async def go() -> dict[str, Any]:
            t0 = time.perf_counter()
            report, _ = await evaluate(
                runner,
                lambda: make("areal/Calculator-v0", kind="mixed"),
                env_id="areal/Calculator-v0",
                episodes=groups * k,
                k=k,
                seed=0,
            )
            wall = time.perf_counter() - t0
            health = await engine.health()
            await engine.close()
            return {"wall": wall, "success": report.success_rate, **health}

        return asyncio.run(go())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF directory (default: the default model)")
    ap.add_argument("--adapter", default=None, help="LoRA adapter directory to apply")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--k", type=int, default=8, help="episodes per group")
    args = ap.parse_args(argv)
    path = str(resolve_model(args.model))
    rows = {}
    for name, entries in (("no prefix cache", 0), ("prefix cache", 32)):
        r = run(path, args.adapter, entries, args.groups, args.k)
        rows[name] = r
        print(
            f"{name}: {args.groups * args.k} episodes in {r['wall']:.1f} s, success "
            f"{r['success']:.1%}, prefilled {r['prefill_tokens']} tokens, reused "
            f"{r['prefix_hit_tokens']}",
            flush=True,
        )
    ratio = rows["no prefix cache"]["wall"] / rows["prefix cache"]["wall"]
    print(f"speed-up with the prefix cache: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
