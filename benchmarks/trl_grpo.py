"""GRPO training throughput: our trainer against TRL's ``GRPOTrainer``, trained samples/s.

Both train the same model with the same LoRA adapter on the same single-turn task with the
same batch shape, for the same number of steps, on the CPU in float32 with the same number of
threads, and both time the steps after a warm-up step:

* task: ``bench/Arithmetic-v0`` (``rl_common.py``): the calculator task's arithmetic questions,
  no tools, one answer; reward 1 when the final number is right. Both sides get the same
  prompts in the same order (TRL's dataset is written from the env's tasks, unshuffled), and
  the script checks that TRL's chat template gives the same prompt token ids as ours;
* batch: ``--prompts`` prompts x ``--generations`` samples per step, at most
  ``--max-completion-length`` new tokens, temperature 1, no top-p / top-k;
* objective: GRPO with group-normalized advantages (mean and std), clip 0.2, per-sequence
  token mean (TRL ``loss_type="grpo"``), no KL term, constant learning rate, AdamW,
  gradient clipping at 1.0, one optimizer step per batch;
* ours: ``areal_agents.trainer.loop.Trainer`` (the code path of ``areal-agent train``) in this
  process: the embedded engine (continuous batching, KV cache) generates through the recording
  proxy and the episode runner, the policy trains on packed sequences; synchronous by default
  (``--eta 0``, the same on-policy schedule as TRL), proximal logprobs by the log-linear rule
  (no extra forward pass; TRL skips its old-logprob pass too when generation and the
  optimizer step are aligned, as here);
* TRL: ``GRPOTrainer`` (``model.generate`` on one left-padded batch, then one padded
  forward/backward), in its own environment (``requirements/make_trl_venv.sh``), run by
  ``trl_grpo_runner.py`` in a subprocess with the same thread count. Gradient checkpointing,
  which TRL's config turns on by default, is off on both sides.

Where the time goes, per timed step: "generating" is TRL's time inside ``model.generate``
and, for ours, the engine's busy passes (prefill and decode spans, ``time/busy_engine``) in
the step's window; "the rest" is everything else in the step (for TRL: rewards, the
logprob and training passes; for ours: the trainer's passes, the proxy and runner, the
weight update).

Differences that remain: the reward function is each side's own (ours: the env's answer
extraction; TRL: the runner's final-number match), generation samples different tokens
(so completion lengths differ a little: both are printed, with tokens/s), and each side
logs its own metrics.

    python benchmarks/trl_grpo.py [--model default|tiny|DIR] [--steps 8] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_TRL_PYTHON = REPO / ".venv-trl" / "bin" / "python"
ENV_SEED = 1000
WARMUP_STEPS = 1
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--model", default="default", help="default, tiny, or a HF model directory")
    ap.add_argument("--prompts", type=int, default=4, help="prompts (groups) per step")
    ap.add_argument("--generations", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-completion-length", type=int, default=32, help="new tokens at most")
    ap.add_argument("--steps", type=int, default=8, help="timed steps (after 1 warm-up step)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--eta", type=int, default=0, help="our rollout.max_head_offpolicyness")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trl-python", default=str(DEFAULT_TRL_PYTHON), help="TRL venv's python")
    ap.add_argument("--only", choices=("both", "ours", "trl"), default="both")
    ap.add_argument("--out", default="runs/bench/trl_grpo", help="where our run writes")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 2 prompts x 2 generations x 16 tokens, 2 timed steps",
    )
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.generations, args.max_completion_length, args.steps = 2, 2, 16, 2
    if args.generations < 2:
        ap.error("--generations must be >= 2 (GRPO normalizes within a group)")
    return args


def run_trl(args: argparse.Namespace, model: str, rows: list[dict[str, Any]], ids: Any) -> Any:
    """Run the TRL side in its own environment; returns its result JSON."""
    python = Path(args.trl_python)
    if not python.exists():
        sys.exit(
            f"no TRL environment at {python}: build it with requirements/make_trl_venv.sh "
            "(or pass --trl-python, or --only ours)"
        )
    spec = {
        "model": model,
        "rows": rows,
        "prompt_ids": ids,
        "prompts_per_step": args.prompts,
        "num_generations": args.generations,
        "max_completion_length": args.max_completion_length,
        "steps": args.steps,
        "warmup_steps": WARMUP_STEPS,
        "lr": args.lr,
        "grad_clip": 1.0,
        "temperature": 1.0,
        "lora": {
            "r": args.lora_r,
            "alpha": args.lora_alpha,
            "dropout": 0.0,
            "target_modules": list(TARGETS),
        },
        "threads": args.threads,
        "seed": args.seed,
        "quiet": args.quiet,
    }
    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        env.update(
            OMP_NUM_THREADS=str(args.threads),
            HF_HUB_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            PYTHONWARNINGS="ignore",
        )
        cmd = [str(python), str(HERE / "trl_grpo_runner.py"), str(spec_path), str(result_path)]
        proc = subprocess.run(cmd, env=env, check=False)
        if proc.returncode != 0 or not result_path.exists():
            sys.exit(f"the TRL run failed (exit code {proc.returncode})")
        return json.loads(result_path.read_text())


def run_ours(args: argparse.Namespace, model: str) -> Any:
    """Run our trainer in this process; returns the finished TimedTrainer."""
    from rl_common import ARITHMETIC_ENV_ID, TimedTrainer

    from areal_agents.trainer.config_io import load_config

    total = WARMUP_STEPS + args.steps
    group = args.prompts * args.generations
    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    overrides = [
        f"env.id={ARITHMETIC_ENV_ID}",
        f"env.seed={ENV_SEED}",
        f"model.path={model}",
        "model.dtype=float32",
        "model.device=cpu",
        "model.lora.enabled=true",
        f"model.lora.r={args.lora_r}",
        f"model.lora.alpha={args.lora_alpha}",
        "model.lora.dropout=0.0",
        f"model.lora.target_modules=[{', '.join(TARGETS)}]",
        "algorithm=grpo",
        "sampling.temperature=1.0",
        "sampling.top_p=1.0",
        "sampling.top_k=0",
        f"sampling.max_new_tokens={args.max_completion_length}",
        f"rollout.group_size={args.generations}",
        f"rollout.batch_size={args.prompts}",
        f"rollout.max_head_offpolicyness={args.eta}",
        f"rollout.concurrency={group * (args.eta + 1)}",
        "rollout.max_turns=1",
        "loss.proximal=loglinear",
        f"optim.lr={args.lr}",
        "optim.grad_clip=1.0",
        f"train.steps={total}",
        f"train.save_every={total}",
        f"train.seed={args.seed}",
        f"train.output_dir={out}",
        "metrics.tensorboard=false",
    ]
    cfg = load_config(None, overrides)
    trainer = TimedTrainer(cfg, quiet=args.quiet)
    asyncio.run(trainer.run())
    shutil.rmtree(out / "final", ignore_errors=True)  # the exported model: not needed here
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return trainer


def summarize_trl(args: argparse.Namespace, res: Any) -> dict[str, float]:
    ends, logs = res["step_ends"], res["logs"]
    timed = ends[-1] - ends[WARMUP_STEPS - 1]
    n = len(ends) - WARMUP_STEPS
    samples = n * args.prompts * args.generations
    lengths = [log.get("completions/mean_length", 0.0) for log in logs[WARMUP_STEPS:]]
    rewards = [log.get("reward", 0.0) for log in logs[WARMUP_STEPS:]]
    mean_len = sum(lengths) / max(len(lengths), 1)
    gen = res.get("generate_ends") or []
    generate = (gen[-1] - gen[WARMUP_STEPS - 1]) / n if len(gen) == len(ends) else math.nan
    return {
        "generate_s_per_step": generate,
        "steps": n,
        "seconds": timed,
        "samples": samples,
        "samples_per_s": samples / timed,
        "s_per_step": timed / n,
        "completion_tokens_mean": mean_len,
        "completion_tokens_per_s": samples * mean_len / timed,
        "reward_mean": sum(rewards) / max(len(rewards), 1),
    }


def summarize_ours(trainer: Any) -> dict[str, float]:
    ends, stats = trainer.step_ends, trainer.step_stats[WARMUP_STEPS:]
    timed = ends[-1] - ends[WARMUP_STEPS - 1]
    n = len(ends) - WARMUP_STEPS
    samples = sum(int(s["samples"]) for s in stats)
    episodes = trainer.episodes_per_step[WARMUP_STEPS:]
    tokens = sum(s["episode_tokens_mean"] * e for s, e in zip(stats, episodes, strict=True))
    # The spans' busy shares of each step window (time/*): engine passes and trainer passes.
    walls = [b - a for a, b in zip(ends[WARMUP_STEPS - 1 :], ends[WARMUP_STEPS:], strict=False)]
    engine = [s.get("time/busy_engine", math.nan) * w for s, w in zip(stats, walls, strict=True)]
    return {
        "generate_s_per_step": sum(engine) / max(n, 1),
        "steps": n,
        "seconds": timed,
        "samples": samples,
        "samples_per_s": samples / timed,
        "s_per_step": timed / n,
        "completion_tokens_mean": tokens / max(sum(episodes), 1),
        "completion_tokens_per_s": tokens / timed,
        "reward_mean": sum(s["reward_mean"] for s in stats) / max(n, 1),
        "staleness_mean": sum(s["staleness_mean"] for s in stats) / max(n, 1),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(HERE))
    from rl_common import arithmetic_prompts, load_average, resolve_bench_model, set_threads

    from areal_agents.serve.chat import ChatTokenizer

    args.threads = set_threads(args.threads)
    model = resolve_bench_model(args.model)
    rows = arithmetic_prompts((WARMUP_STEPS + args.steps) * args.prompts, ENV_SEED)
    tok = ChatTokenizer.from_dir(model)
    ids = [tok.encode_chat(row["prompt"]) for row in rows]
    per_step = args.prompts * args.generations
    print(
        f"model {model} (float32, LoRA r={args.lora_r} alpha={args.lora_alpha:g} on "
        f"{','.join(TARGETS)}), {args.threads} threads; {args.prompts} prompts x "
        f"{args.generations} generations = {per_step} samples per step, "
        f"<= {args.max_completion_length} new tokens; {args.steps} timed steps after "
        f"{WARMUP_STEPS} warm-up; prompt tokens mean {sum(map(len, ids)) / len(ids):.1f}; "
        f"load {load_average()}",
        flush=True,
    )
    results: dict[str, dict[str, float]] = {}
    if args.only in ("both", "trl"):
        res = run_trl(args, model, rows, ids)
        results["TRL GRPOTrainer"] = summarize_trl(args, res)
        versions = " ".join(f"{k} {v}" for k, v in res["versions"].items())
        same = "identical" if res["same_prompt_ids"] else "DIFFERENT"
        print(f"TRL side: {versions}, {res['threads']} threads; prompt token ids {same}")
    if args.only in ("both", "ours"):
        trainer = run_ours(args, model)
        results[f"ours (eta={args.eta})"] = summarize_ours(trainer)
    print(f"\nload after the runs: {load_average()}")
    header = (
        "| run | s/step | generating s/step | the rest s/step | samples/s | "
        "completion tokens (mean) | completion tok/s | reward |"
    )
    print(header)
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        gen = r["generate_s_per_step"]
        print(
            f"| {name} | {r['s_per_step']:.2f} | {gen:.2f} | {r['s_per_step'] - gen:.2f} | "
            f"{r['samples_per_s']:.2f} | "
            f"{r['completion_tokens_mean']:.1f} | {r['completion_tokens_per_s']:.1f} | "
            f"{r['reward_mean']:.3f} |"
        )
    if len(results) == 2:
        trl_r, ours_r = results["TRL GRPOTrainer"], results[f"ours (eta={args.eta})"]
        print(
            f"ratio (ours / TRL), trained samples/s: "
            f"{ours_r['samples_per_s'] / trl_r['samples_per_s']:.2f}x"
        )
        for part, key in (("generating", "generate_s_per_step"), ("the rest", None)):
            t = trl_r[key] if key else trl_r["s_per_step"] - trl_r["generate_s_per_step"]
            o = ours_r[key] if key else ours_r["s_per_step"] - ours_r["generate_s_per_step"]
            print(f"  {part}: TRL {t:.2f} s/step, ours {o:.2f} s/step ({t / o:.2f}x)")


if __name__ == "__main__":
    main()
