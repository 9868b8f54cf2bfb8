"""Decode step of the embedded engine: shared-prefix attention and the sliced vocabulary
projection against plain transformers ``sdpa`` attention and one projection matmul.

Both engines hold the same 32 rows: a shared 273-token prefix (the calculator task's system
prompt and tool list are that long) and each row's own ``--suffix`` tokens, sampled at
temperature 1. The steps are timed alternately, ``--rounds`` times 15 steps each, in one
process, and the ratio of the mean step times is printed.

    python benchmarks/decode_step.py [--suffix 40] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import torch


def build(path: str, new: bool, rows: int, suffix: int) -> Any:
    from transformers import AutoModelForCausalLM

    from areal_agents.engines import embedded as E
    from areal_agents.engines.batching import Request
    from areal_agents.engines.protocol import SamplingParams

    saved = E.slice_output_projection, E.use_cascade_attention
    if not new:  # the baseline: the engine without its two decode-step changes
        E.slice_output_projection = E.use_cascade_attention = lambda model: None  # type: ignore[assignment]
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        engine = E.EmbeddedEngine(model, eos_token_ids=(), max_batch_size=rows)
    finally:
        E.slice_output_projection, E.use_cascade_attention = saved
    asyncio.run(engine.close())  # the steps are driven from this thread below
    loop = asyncio.new_event_loop()
    shared = list(range(1000, 1273))
    for i in range(rows):
        params = SamplingParams(temperature=1.0, max_new_tokens=10_000, seed=i)
        own = [2000 + i + j for j in range(suffix - i % 7)]
        req = Request([*shared, *own], params, loop.create_future(), loop)
        req.generator = torch.Generator().manual_seed(i)
        engine._waiting.append(req)
    with torch.inference_mode():
        engine._admit()
        for _ in range(3):
            engine._decode_step()
    return engine


def main() -> None:
    from areal_agents.model import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF directory (default: the default model)")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--suffix", type=int, default=40, help="each row's own tokens")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    path = str(resolve_model(args.model))
    engines = {
        name: build(path, name == "ours", args.rows, args.suffix) for name in ("plain", "ours")
    }
    times: dict[str, list[float]] = {"plain": [], "ours": []}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, engine in engines.items():
                t = time.perf_counter()
                for _ in range(15):
                    engine._decode_step()
                times[name].append((time.perf_counter() - t) / 15 * 1000)
    for name, ts in times.items():
        print(f"{name}: " + " ".join(f"{t:.0f}" for t in ts) + " ms per step")
    plain, ours = (sum(times[n]) / len(times[n]) for n in ("plain", "ours"))
    print(
        f"{args.rows} rows, 273 shared + ~{args.suffix} own tokens: "
        f"ratio (plain / ours) {plain / ours:.2f}x"
    )


if __name__ == "__main__":
    main()
