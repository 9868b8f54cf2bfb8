"""Asynchronous against synchronous RL when tools are slow: wall-clock to the same training.

The same training config runs twice through ``areal_agents.trainer.loop.Trainer`` (the code path of
``areal-agent train``), once with ``rollout.max_head_offpolicyness=0`` (synchronous: the
baseline) and once with ``--eta`` (asynchronous, 4 by default). The env is
``bench/SlowCalculator-v0`` (``rl_common.py``): the two-turn calculator task (call the
calculator, read the result, answer) whose every step, running the tool call or grading the
answer, takes a seeded heavy-tailed time: log-normal, median 0.5 s, clipped to [0.2, 2] s.

Measured for each run: wall-clock from the start of rollouts to the end of the last step
(the same number of steps, so the same number of trained episodes), episodes trained per
second, the training reward (all steps, and the last half), and, with ``--eval-episodes``,
greedy success of the final model on held-out tasks (the same tasks for both, without the
delays). Printed: both, and the speed-up (synchronous wall / asynchronous wall).

Why asynchronous wins here. Synchronously, a step's ``batch_size x group_size`` episodes
start together after the previous step's weights reach the engine, and the step trains only
when the slowest of them is done: while most episodes wait on a tool, and while the trainer
trains, nothing else runs, and with heavy-tailed tool times the slowest episode of a batch is
usually near the 2 s clip on every turn. Asynchronously, the staleness gate keeps up to
``(eta + 1) x batch_size`` groups in flight: while some episodes wait on tools, others
generate, the trainer trains on the first groups to finish, and generation of the next
groups overlaps training. The settings let that happen: ``rollout.concurrency`` (the same in
both runs; the synchronous gate never fills it) is ``(eta + 1) x batch_size x group_size``,
so the gate, not the runner, bounds the episodes in flight, and the engine batches them all
(its ``max_batch_size`` follows ``rollout.concurrency``); env steps run on the runner's
thread pool (64 threads), so sleeping tools block no one.

Two settings, each a sync and an async run (``--setting``):

* ``shared``: one process; the engine and the trainer share every core and take turns on
  them (a compute lock), so asynchrony can only fill the time the synchronous run leaves
  the cores idle. Bound: 1 / (the sync run's busy fraction of all cores).
* ``pinned``: disaggregated, as separate inference and training GPUs would be. With
  ``scheduler=ray`` the engine is a process of its own pinned to one core
  (``rollout.engine_cpus``), the trainer process is pinned to another (``train.cpus``),
  and both runs use the same pinning. Synchronously each core waits while the other works;
  asynchronously both work at once. Bound: the sync wall over its busier core's busy time
  (about 2x when generation and training take as long, plus the tool tail that
  synchronous batches wait for).

In both, the bound is the sync wall over the least wall its measured work allows
(``/proc/stat`` busy seconds per core, every process counted; ``OMP_WAIT_POLICY=passive`` so
that spinning threads do not count). The async run does at least the same work, so its
speed-up cannot exceed the bound; the tables give each ratio beside its bound.

    python benchmarks/async_vs_sync.py [--model default|tiny|DIR] [--steps 12]
        [--setting shared|pinned|both] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ENV_SEED = 2000
EVAL_SEED = 7000
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--model", default="default", help="default, tiny, or a HF model directory")
    ap.add_argument("--steps", type=int, default=12, help="training steps of each run")
    ap.add_argument("--group-size", type=int, default=4, help="episodes per task")
    ap.add_argument("--batch-size", type=int, default=2, help="groups per step")
    ap.add_argument("--eta", type=int, default=4, help="max_head_offpolicyness of the async run")
    ap.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="rollout.concurrency of both runs (default: (eta + 1) x batch x group)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=32, help="per model call")
    ap.add_argument("--max-turns", type=int, default=3, help="model calls per episode at most")
    ap.add_argument("--few-shot", type=int, default=1, help="worked examples in the prompt")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    ap.add_argument("--no-lora", action="store_true", help="full fine-tuning instead of LoRA")
    ap.add_argument("--delay-min", type=float, default=0.2, help="seconds")
    ap.add_argument("--delay-max", type=float, default=2.0, help="seconds")
    ap.add_argument("--delay-median", type=float, default=0.5, help="seconds, before clipping")
    ap.add_argument("--delay-sigma", type=float, default=1.0, help="log-sd of the delay")
    ap.add_argument(
        "--eval-episodes", type=int, default=64, help="greedy held-out episodes per final model"
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--order", choices=("sync-first", "async-first"), default="sync-first")
    ap.add_argument(
        "--setting",
        choices=("shared", "pinned", "both"),
        default="both",
        help="shared cores (one process), pinned (engine and trainer on cores of their own), "
        "or both",
    )
    ap.add_argument(
        "--kv-on-update",
        choices=("recompute", "keep"),
        default="recompute",
        help="rollout.kv_on_update of both runs: what a weight update does with requests in "
        "flight (only the async run has any)",
    )
    ap.add_argument("--engine-core", type=int, default=0, help="the pinned engine's core")
    ap.add_argument("--trainer-core", type=int, default=1, help="the pinned trainer's core")
    ap.add_argument(
        "--ray-processes",
        choices=("trainer-core", "any-core"),
        default="trainer-core",
        help="pinned setting: where Ray's own processes and the rollout workers (proxy, "
        "runner, env) run; trainer-core leaves the engine's core to the engine alone",
    )
    ap.add_argument("--out", default="runs/bench/async_vs_sync", help="where the runs write")
    ap.add_argument("--keep", action="store_true", help="keep final models and checkpoints")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 4 steps, 2 groups of 2, 24 new tokens, 8 eval episodes",
    )
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.group_size, args.batch_size = 4, 2, 2
        args.max_new_tokens, args.eval_episodes = 24, min(args.eval_episodes, 8)
    if args.group_size < 2:
        ap.error("--group-size must be >= 2 (GRPO normalizes within a group)")
    if args.eta < 1:
        ap.error("--eta must be >= 1 (the asynchronous run); the baseline always uses 0")
    if args.concurrency is None:
        args.concurrency = (args.eta + 1) * args.batch_size * args.group_size
    return args


def env_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "kind": "arithmetic",
        "few_shot": args.few_shot,
        "delay_min": args.delay_min,
        "delay_max": args.delay_max,
        "delay_median": args.delay_median,
        "delay_sigma": args.delay_sigma,
    }


def delay_summary(args: argparse.Namespace, n: int = 20_000) -> str:
    """Mean and quantiles of one env step's delay (the distribution the env samples)."""
    rng = random.Random(0)
    xs = sorted(
        min(
            max(rng.lognormvariate(math.log(args.delay_median), args.delay_sigma), args.delay_min),
            args.delay_max,
        )
        for _ in range(n)
    )
    q = {p: xs[int(p / 100 * (n - 1))] for p in (50, 90, 99)}
    batch = args.batch_size * args.group_size
    slowest = statistics.fmean(max(rng.choice(xs) for _ in range(batch)) for _ in range(2000))
    return (
        f"env step delay: mean {statistics.fmean(xs):.2f} s, p50 {q[50]:.2f}, p90 {q[90]:.2f}, "
        f"p99 {q[99]:.2f} (clipped to [{args.delay_min:g}, {args.delay_max:g}]); "
        f"slowest of {batch} episodes: {slowest:.2f} s on average"
    )


def make_config(
    args: argparse.Namespace, model: str, eta: int, out: Path, pinned: bool = False
) -> Any:
    from rl_common import SLOW_ENV_ID

    from areal_agents.trainer.config_io import load_config

    kwargs = ", ".join(f"{k}: {v}" for k, v in env_kwargs(args).items())
    lora = (
        [
            "model.lora.enabled=true",
            f"model.lora.r={args.lora_r}",
            f"model.lora.alpha={args.lora_alpha}",
            f"model.lora.target_modules=[{', '.join(TARGETS)}]",
        ]
        if not args.no_lora
        else []
    )
    overrides = [
        f"env.id={SLOW_ENV_ID}",
        f"env.kwargs={{{kwargs}}}",
        f"env.seed={ENV_SEED}",
        f"model.path={model}",
        *lora,
        "algorithm=grpo",
        "sampling.temperature=1.0",
        f"sampling.max_new_tokens={args.max_new_tokens}",
        f"rollout.group_size={args.group_size}",
        f"rollout.batch_size={args.batch_size}",
        f"rollout.max_head_offpolicyness={eta}",
        f"rollout.concurrency={args.concurrency}",
        f"rollout.max_turns={args.max_turns}",
        f"rollout.kv_on_update={args.kv_on_update}",
        "loss.proximal=loglinear",
        f"optim.lr={args.lr}",
        "train.micro_batch_tokens=2048",
        f"train.steps={args.steps}",
        f"train.save_every={args.steps}",
        f"train.seed={args.seed}",
        f"train.output_dir={out}",
        "metrics.tensorboard=false",
    ]
    if pinned:
        overrides += [
            "scheduler=ray",
            f"rollout.engine_cpus=[{args.engine_core}]",
            f"train.cpus=[{args.trainer_core}]",
        ]
    return load_config(None, overrides)


async def evaluate_model(args: argparse.Namespace, path: str) -> Any:
    """Greedy success of the model at ``path`` on held-out tasks (test split, no delays)."""
    from areal_agents.engines.embedded import EmbeddedEngine
    from areal_agents.envs.registry import make
    from areal_agents.rollout.evaluate import evaluate
    from areal_agents.rollout.runner import Runner
    from areal_agents.serve.chat import ChatTokenizer
    from areal_agents.serve.proxy import Proxy

    tok = ChatTokenizer.from_dir(path)
    n = args.eval_episodes
    engine = EmbeddedEngine.from_pretrained(path, decode=tok.decode, max_batch_size=n)
    runner = Runner(
        Proxy(engine, tok),
        concurrency=n,
        max_turns=args.max_turns,
        sampling={"temperature": 0.0, "max_tokens": args.max_new_tokens},
    )
    kwargs = {"kind": "arithmetic", "few_shot": args.few_shot, "split": "test"}
    try:
        report, _ = await evaluate(
            runner,
            lambda: make("areal/Calculator-v0", **kwargs),
            env_id="areal/Calculator-v0",
            episodes=n,
            seed=EVAL_SEED,
        )
    finally:
        await engine.close()
    return report


def run_one(
    args: argparse.Namespace, model: str, eta: int, out: Path, pinned: bool
) -> dict[str, Any]:
    from rl_common import TimedTrainer, core_busy_between, set_threads

    from areal_agents.hardware import pin_to_cpus

    name = "sync" if eta == 0 else "async"
    print(f"\n== {name} (max_head_offpolicyness={eta}) -> {out}", flush=True)
    trainer = TimedTrainer(make_config(args, model, eta, out, pinned), quiet=args.quiet)
    cores = sorted(os.sched_getaffinity(0))
    try:
        summary = asyncio.run(trainer.run())
    finally:  # the evaluation and the next run get every core back
        pin_to_cpus(cores, "every core")
        set_threads(args.threads)
    stats, n = trainer.step_stats, len(trainer.step_stats)
    wall = trainer.step_ends[-1] - trainer.t_start
    cpu = trainer.cpu_ends[-1] - trainer.cpu_start
    episodes = sum(trainer.episodes_per_step)
    half = stats[n // 2 :]
    row: dict[str, Any] = {
        "name": name,
        "eta": eta,
        "wall_s": wall,
        "episodes": episodes,
        "episodes_per_s": episodes / wall,
        "s_per_step": wall / n,
        "cpu_busy": cpu / (wall * args.threads),
        "core_busy_s": core_busy_between(trainer.cores_start, trainer.cores_end),
        "reward_all": statistics.fmean(s["reward_mean"] for s in stats),
        "reward_last_half": statistics.fmean(s["reward_mean"] for s in half),
        "success_last_half": statistics.fmean(s["success_rate"] for s in half),
        "staleness_mean": statistics.fmean(s["staleness_mean"] for s in stats),
        "wait_s": sum(s["wait_s"] for s in stats),
        "train_s": sum(s["train_s"] for s in stats),
        "engine": trainer.engine_stats(),
        "eval": None,
    }
    final = summary.get("final_model")
    if args.eval_episodes and final:
        report = asyncio.run(evaluate_model(args, final))
        row["eval"] = report.success_rate
        row["eval_episodes"] = report.episodes
    if not args.keep:
        shutil.rmtree(out / "final", ignore_errors=True)
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return row


def bound_of(sync: dict[str, Any], pinned: bool, cores: tuple[int, ...]) -> float:
    """The most the async run can gain: the sync wall over the least wall its busy work
    allows. Shared cores: all busy seconds spread over all cores, i.e.
    1 / (busy fraction). Pinned: the busier of the engine's and the trainer's cores."""
    busy = sync["core_busy_s"]
    if not busy:
        return math.nan
    least = max(busy.get(c, 0.0) for c in cores) if pinned else sum(busy.values()) / len(busy)
    return sync["wall_s"] / least if least > 0 else math.nan


def run_setting(
    args: argparse.Namespace, model: str, root: Path, pinned: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The sync and the async run of one setting; with ``pinned``, on a local Ray cluster
    whose workers register the ``bench/`` envs, its processes started on the trainer's core
    (``--ray-processes``), so that the engine's core runs the engine alone."""
    from rl_common import set_threads

    setting = "pinned" if pinned else "shared"
    ray = None
    if pinned:
        import ray

        from areal_agents.hardware import pin_to_cpus

        cores = sorted(os.sched_getaffinity(0))
        if args.ray_processes == "trainer-core":  # Ray's processes inherit this mask
            pin_to_cpus([args.trainer_core], "--trainer-core")
        paths = [str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]
        ray.init(
            address="local",
            num_cpus=len(cores),
            log_to_driver=False,
            logging_level="warning",
            runtime_env={
                "env_vars": {"PYTHONPATH": os.pathsep.join(p for p in paths if p)},
                "worker_process_setup_hook": "rl_common.ray_worker_setup",
            },
        )
        pin_to_cpus(cores, "every core")
        set_threads(args.threads)
    try:
        etas = [0, args.eta] if args.order == "sync-first" else [args.eta, 0]
        rows = {
            eta: run_one(
                args, model, eta, root / setting / ("sync" if eta == 0 else "async"), pinned
            )
            for eta in etas
        }
    finally:
        if ray is not None:
            ray.shutdown()
    for row in rows.values():
        row["setting"] = setting
    return rows[0], rows[args.eta]


def print_rows(
    args: argparse.Namespace, pairs: list[tuple[dict[str, Any], dict[str, Any]]]
) -> None:
    print(
        "| setting | run | wall s | episodes | episodes/s | s/step | busy s per core | "
        "reward (all) | reward (last half) | eval success | staleness | trainer waited s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in (r for pair in pairs for r in pair):
        ev = "-" if row["eval"] is None else f"{row['eval']:.1%} of {row['eval_episodes']}"
        busy = " / ".join(f"{v:.0f}" for _, v in sorted(row["core_busy_s"].items())) or "-"
        print(
            f"| {row['setting']} | {row['name']} (eta={row['eta']}) | {row['wall_s']:.1f} | "
            f"{row['episodes']} | {row['episodes_per_s']:.3f} | {row['s_per_step']:.1f} | "
            f"{busy} | {row['reward_all']:.3f} | {row['reward_last_half']:.3f} | {ev} | "
            f"{row['staleness_mean']:.2f} | {row['wait_s']:.1f} |"
        )
    for sync, asyn in pairs:
        for row in (sync, asyn):
            eng = row["engine"]
            if eng:
                print(
                    f"engine ({row['setting']}, {row['name']}): {eng.get('requests', 0)} "
                    f"requests, {eng.get('prefills', 0)} prefills, "
                    f"{eng.get('decode_steps', 0)} decode steps, "
                    f"{eng.get('output_tokens', 0)} output tokens"
                )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # spinning threads are not work
    sys.path.insert(0, str(HERE))
    from rl_common import load_average, resolve_bench_model, set_threads

    args.threads = set_threads(args.threads)
    model = resolve_bench_model(args.model)
    root = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    lora = "full fine-tuning" if args.no_lora else f"LoRA r={args.lora_r} alpha={args.lora_alpha:g}"
    print(
        f"model {model} ({lora}), {args.threads} threads; {args.steps} steps x "
        f"{args.batch_size} groups x {args.group_size} episodes, <= {args.max_new_tokens} "
        f"tokens per call, <= {args.max_turns} calls per episode; async eta={args.eta}, "
        f"rollout.concurrency={args.concurrency}, kv_on_update={args.kv_on_update}; "
        f"load {load_average()}"
    )
    print(delay_summary(args), flush=True)
    settings = {"shared": [False], "pinned": [True], "both": [False, True]}[args.setting]
    if True in settings and len({args.engine_core, args.trainer_core}) < 2:
        sys.exit("--engine-core and --trainer-core must differ (the pinned setting)")
    pairs = [run_setting(args, model, root, pinned) for pinned in settings]
    print(f"\nload after the runs: {load_average()}")
    print_rows(args, pairs)
    for (sync, asyn), pinned in zip(pairs, settings, strict=True):
        cores = (args.engine_core, args.trainer_core)
        bound = bound_of(sync, pinned, cores)
        ratio = sync["wall_s"] / asyn["wall_s"]
        print(
            f"{sync['setting']}: speed-up (sync wall / async wall) to {args.steps} steps: "
            f"{ratio:.2f}x; bound {bound:.2f}x ({ratio / bound:.0%} of it); samples/s sync "
            f"{sync['episodes_per_s']:.3f}, async {asyn['episodes_per_s']:.3f}"
        )
        # Noise of a mean of 0/1 rewards over the episodes of the last half of the steps.
        for key, label, count in (
            ("reward_last_half", "training reward, last half", sync["episodes"] / 2),
            ("eval", "eval success", sync.get("eval_episodes") or 0),
        ):
            if sync[key] is None or not count:
                continue
            p = (sync[key] + asyn[key]) / 2
            se = math.sqrt(max(p * (1 - p), 1e-9) * 2 / count)
            print(
                f"  {label}: async - sync = {asyn[key] - sync[key]:+.3f} "
                f"(standard error of the difference ~{se:.3f})"
            )


if __name__ == "__main__":
    main()
