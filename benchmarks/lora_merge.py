"""Decoding with a LoRA adapter: merged into the float32 weights against peft's unmerged forward.

The same embedded engine (continuous batching, ``--concurrency`` requests of ``--new-tokens``
sampled tokens each, end-of-sequence ignored) serves the same adapter two ways: merged
(``W0 + s B A``, what the engine does for a float32 model:
``areal_agents.engines.weights.MergedLora``) and through peft's forward (``W x + s B (A x)``
per adapted layer, the baseline). The two run alternately, ``--repeats`` times each, and
the script prints each rate, the ratio of the medians, and how far one greedy request agrees
between the two (tokens, logprobs).

    python benchmarks/lora_merge.py [--adapter DIR] [--concurrency 32] [--new-tokens 64]

Without ``--adapter`` the adapter is random (r=16, alpha 32 on q/k/v/o, the trainer's
default targets).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import time

import torch


def main() -> None:
    from engine_throughput import prompts
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from areal_agents.engines.embedded import EmbeddedEngine
    from areal_agents.engines.protocol import SamplingParams, WeightUpdate
    from areal_agents.engines.weights import apply_weight_update
    from areal_agents.model import resolve_model
    from areal_agents.serve.chat import ChatTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF directory (default: the default model)")
    ap.add_argument("--adapter", default=None, help="peft adapter directory (default: random)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    path = resolve_model(args.model)
    tok = ChatTokenizer.from_dir(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if args.adapter:
        update = WeightUpdate(kind="lora", path=args.adapter)
    else:
        config = LoraConfig(
            r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
        )
        probe = get_peft_model(copy.deepcopy(base), copy.deepcopy(config))
        gen = torch.Generator().manual_seed(0)
        sd = {
            k: torch.randn(v.shape, generator=gen) * 0.02
            for k, v in get_peft_model_state_dict(probe).items()
        }
        update = WeightUpdate(kind="lora", state_dict=sd, lora_config=config)
    # Baseline: the model wrapped by peft before the engine sees it (a peft model is not merged).
    unmerged = apply_weight_update(copy.deepcopy(base), update)
    batch = prompts(tok, args.concurrency)
    n_new = args.new_tokens
    print(
        f"model {path} (float32), adapter {args.adapter or 'random r=16'}, "
        f"{torch.get_num_threads()} threads, {args.concurrency} x {n_new} tokens"
    )

    async def rate(engine: EmbeddedEngine) -> float:
        await engine.generate(batch[0], SamplingParams(max_new_tokens=4))  # warm-up
        params = [SamplingParams(temperature=1.0, max_new_tokens=n_new, seed=i) for i in range(64)]
        t = time.perf_counter()
        results = await asyncio.gather(
            *[engine.generate(p, s) for p, s in zip(batch, params, strict=False)]
        )
        return sum(len(r.output_ids) for r in results) / (time.perf_counter() - t)

    async def run() -> None:
        merged = EmbeddedEngine(
            copy.deepcopy(base), eos_token_ids=(), max_batch_size=args.concurrency
        )
        t = time.perf_counter()
        await merged.update_weights(update)
        print(f"merging the adapter (a weight update) took {time.perf_counter() - t:.2f} s")
        plain = EmbeddedEngine(unmerged, eos_token_ids=(), max_batch_size=args.concurrency)
        rates: dict[str, list[float]] = {"merged": [], "peft": []}
        for _ in range(args.repeats):
            for name, engine in (("merged", merged), ("peft", plain)):
                rates[name].append(await rate(engine))
                print(f"{name}: {rates[name][-1]:.1f} tok/s", flush=True)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=32)
        a, b = await merged.generate(batch[1], greedy), await plain.generate(batch[1], greedy)
        pairs = zip(a.output_ids, b.output_ids, strict=True)
        same = next((i for i, (x, y) in enumerate(pairs) if x != y), len(a.output_ids))
        diff = max(
            abs(x - y)
            for x, y in zip(a.output_logprobs[:same], b.output_logprobs[:same], strict=True)
        )
        await merged.close()
        await plain.close()
        m, p = statistics.median(rates["merged"]), statistics.median(rates["peft"])
        print(
            f"greedy: the first {same} of {len(a.output_ids)} tokens equal, "
            f"largest logprob difference over them {diff:.2e}"
        )
        print(f"ratio (merged / peft), medians: {m:.1f} / {p:.1f} = {m / p:.2f}x")

    asyncio.run(run())


if __name__ == "__main__":
    main()
