"""Embedded engine throughput: total output tokens/s at 16 concurrent requests.

Baseline: ``model.generate`` on one request at a time (the same model object, the same
dtype, sampling, the same number of new tokens per request). Ours: the embedded engine with
16 requests submitted concurrently (continuous batching). Both ignore end-of-sequence so that
every request produces exactly ``--new-tokens`` tokens. The sequential rate does not depend on
how many requests run, so the baseline times ``--baseline-requests`` of them.

    python benchmarks/engine_throughput.py [--model DIR] [--dtype auto] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch


def prompts(tokenizer, n: int) -> list[list[int]]:
    topics = [
        "the sea",
        "a mountain",
        "bread",
        "a robot",
        "the moon",
        "rain",
        "a library",
        "trains",
        "coffee",
        "a garden",
        "winter",
        "music",
        "a bridge",
        "chess",
        "birds",
        "a city",
    ]
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Write a short story about {topics[i % 16]}."}]
        out.append(tokenizer.encode_chat(msgs))
    return out


def main() -> None:
    from transformers import AutoModelForCausalLM

    from areal_agents.engines.embedded import EmbeddedEngine
    from areal_agents.engines.protocol import SamplingParams
    from areal_agents.hardware import resolve_dtype
    from areal_agents.model import resolve_model
    from areal_agents.serve.chat import ChatTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF directory (default: the default model)")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 where the CPU has it natively")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--baseline-requests", type=int, default=3)
    args = ap.parse_args()

    path = resolve_model(args.model)
    tok = ChatTokenizer.from_dir(path)
    args.dtype = resolve_dtype(args.dtype, "cpu")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    batch = prompts(tok, args.concurrency)
    n_new = args.new_tokens
    print(
        f"model {path} ({args.dtype}), {torch.get_num_threads()} threads, "
        f"{n_new} new tokens per request"
    )

    # Baseline: sequential model.generate.
    torch.manual_seed(0)
    with torch.inference_mode():
        model.generate(torch.tensor([batch[0]]), max_new_tokens=4, do_sample=True)  # warm-up
        start = time.perf_counter()
        produced = 0
        for ids in batch[: args.baseline_requests]:
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
            )
            produced += out.shape[1] - len(ids)
        base_s = time.perf_counter() - start
    base_rate = produced / base_s
    print(f"sequential model.generate: {produced} tokens in {base_s:.1f} s = {base_rate:.1f} tok/s")

    # Ours: concurrent requests through the engine (eos ignored).
    engine = EmbeddedEngine(model, eos_token_ids=(), max_batch_size=args.concurrency)
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=n_new, seed=i) for i in range(len(batch))
    ]

    async def run() -> tuple[int, float]:
        await engine.generate(batch[0], SamplingParams(max_new_tokens=4))  # warm-up
        t = time.perf_counter()
        results = await asyncio.gather(
            *[engine.generate(p, s) for p, s in zip(batch, params, strict=True)]
        )
        dt = time.perf_counter() - t
        await engine.close()
        return sum(len(r.output_ids) for r in results), dt

    ours_tokens, ours_s = asyncio.run(run())
    ours_rate = ours_tokens / ours_s
    print(
        f"embedded engine, {args.concurrency} concurrent: {ours_tokens} tokens in "
        f"{ours_s:.1f} s = {ours_rate:.1f} tok/s"
    )
    print(f"ratio (ours / sequential): {ours_rate / base_rate:.2f}x")


if __name__ == "__main__":
    main()
