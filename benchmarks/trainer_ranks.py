"""Training-step throughput of 2 FSDP2 gloo ranks (1 thread each) against 1 process with 2
threads, on the same batch of the same model, in the same run.

    python benchmarks/trainer_ranks.py [--model DIR] [--groups 4] [--size 4] [--steps 2]

Both sides run ``areal_agents.trainer.step.train_on_batch`` (GRPO, LoRA by default, proximal
logprobs recomputed) on one batch of synthetic episodes (random prompt and output tokens; each
group shares its prompt). Reported: seconds per step (the mean after one warm-up step)
and trained tokens per second; the ratio is ranks over one process. On shared CPU cores
the ranks cannot be faster: they split the same cores and add the gradient reductions;
the point of ranks is more devices, not more speed per core.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

OVERRIDES = [
    "env.id=areal/Calculator-v0",
    "algorithm=grpo",
    "loss.proximal=recompute",
    "rollout.max_head_offpolicyness=1",
    "sampling.max_new_tokens=128",
    "train.micro_batch_tokens=2048",
]


def _episodes(groups: int, size: int, prompt_len: int, out_len: int) -> list[Any]:
    from areal_agents.trajectory import Completion, Episode

    g = torch.Generator().manual_seed(0)
    eps = []
    for gi in range(groups):
        prompt = torch.randint(1000, 20000, (prompt_len,), generator=g).tolist()
        for k in range(size):
            ep = Episode(f"e{gi}-{k}", group_id=f"g{gi}")
            n = out_len // 2 + int(torch.randint(0, out_len, (1,), generator=g))
            out = torch.randint(1000, 20000, (n,), generator=g).tolist()
            ep.add(
                Completion(
                    f"c{gi}-{k}",
                    [{"role": "user", "content": "q"}],
                    prompt,
                    out,
                    [-1.0] * n,
                    [0] * n,
                    {"role": "assistant", "content": "a"},
                    "stop",
                )
            )
            ep.final_reward = float(k % 2)
            eps.append(ep)
    return eps


def _time_steps(policy: Any, episodes: list[Any], cfg: Any, steps: int) -> dict[str, float]:
    from areal_agents.trainer.batch import build_batch
    from areal_agents.trainer.step import train_on_batch

    spec = cfg.algorithm_spec()
    times, tokens = [], 0.0
    for version in range(steps + 1):
        batch, _ = build_batch(episodes, spec, 1.0, cfg.sampling.max_new_tokens, 1.0)
        t0 = time.perf_counter()
        stats = train_on_batch(policy, None, batch, spec, cfg, version).stats
        if version:  # the first step warms up
            times.append(time.perf_counter() - t0)
            tokens = float(stats["tokens"])
    mean = sum(times) / len(times)
    return {"s_per_step": mean, "trained_tokens_per_s": tokens / mean}


def _config(model: str, lora: bool) -> Any:
    from areal_agents.trainer.config_io import load_config

    extra = ["model.lora.enabled=true"] if lora else []
    return load_config(None, [*OVERRIDES, *extra, f"model.path={model}"])


def _rank(data_path: str, out_path: str) -> None:
    from areal_agents.trainer import fsdp
    from areal_agents.trainer.distributed import DistributedPolicy, Ranks, _die_with_parent, serve
    from areal_agents.trainer.model_build import model_kwargs

    _die_with_parent()
    torch.set_num_threads(1)
    data = pickle.loads(Path(data_path).read_bytes())
    fsdp.init_process_group(timeout_s=600)
    try:
        if fsdp.rank() != 0:
            serve(seed=0)
            return
        ranks = Ranks(seed=0)
        cfg = _config(data["model"], data["lora"])
        kw, _ = model_kwargs(cfg, cfg.algorithm_spec(), data["model"])
        policy = DistributedPolicy(ranks, ranks.build("policy", "policy", kw))
        result = _time_steps(policy, data["episodes"], cfg, data["steps"])
        ranks.stop()
        Path(out_path).write_text(json.dumps(result))
    finally:
        fsdp.destroy_process_group()


def main() -> None:
    from areal_agents.model import DEFAULT_MODEL, resolve_model
    from areal_agents.trainer.distributed import run_ranks
    from areal_agents.trainer.model_build import model_kwargs
    from areal_agents.trainer.policy import Policy

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the default model)")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--size", type=int, default=4, help="episodes per group")
    p.add_argument("--prompt-tokens", type=int, default=120)
    p.add_argument("--output-tokens", type=int, default=60)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    args = p.parse_args()
    model = resolve_model(args.model or DEFAULT_MODEL, quiet=True)
    episodes = _episodes(args.groups, args.size, args.prompt_tokens, args.output_tokens)
    cfg = _config(model, not args.full)

    torch.set_num_threads(2)
    kw, _ = model_kwargs(cfg, cfg.algorithm_spec(), model)
    one = _time_steps(Policy(**kw), episodes, cfg, args.steps)

    with tempfile.TemporaryDirectory() as tmp:
        data, out = Path(tmp) / "data.pkl", Path(tmp) / "out.json"
        blob = {"model": model, "episodes": episodes, "steps": args.steps, "lora": not args.full}
        data.write_bytes(pickle.dumps(blob))
        os.environ["OMP_NUM_THREADS"] = "1"
        run_ranks(2, [__file__, "--rank", str(data), str(out)])
        two = json.loads(out.read_text())

    tokens = sum(len(c.prompt_ids) + len(c.output_ids) for e in episodes for c in e.completions)
    print(
        f"model {model}, {'full' if args.full else 'LoRA'}, {len(episodes)} episodes, "
        f"{tokens} tokens per step, {os.cpu_count()} cores"
    )
    print("| trainer | s / step | trained tokens / s |")
    print("|---|---|---|")
    print(f"| 1 process, 2 threads | {one['s_per_step']:.2f} | {one['trained_tokens_per_s']:.0f} |")
    print(
        f"| 2 gloo ranks, 1 thread each | {two['s_per_step']:.2f} | "
        f"{two['trained_tokens_per_s']:.0f} |"
    )
    print(f"ratio (2 ranks / 1 process, throughput): {one['s_per_step'] / two['s_per_step']:.2f}x")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        _rank(sys.argv[2], sys.argv[3])
    else:
        main()
