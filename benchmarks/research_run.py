"""What moves when the default model trains on ``areal/Research-v0``: a training run of
``examples/agents/research.yaml`` (warm start, step-level groups, the summarize context
policy, the rubric judge), summarized against its own baseline, the model before RL.

Reported, from the run directory:

- the held-out evaluation (``eval.json``) of the base model, after the warm start and after
  RL: success (every fact stated), mean reward (recall x precision), turns, tool calls per
  episode and the share of valid calls;
- the training episodes of the first and the last quarter of the RL steps
  (``metrics.jsonl``): reward, judge score, turns, tool calls and their validity, with the
  ratio last / first;
- the context rewrites recorded in the store (summaries and truncations) and the share of
  trained completions that start a new segment.

There is no target: the run is an honest measurement of a 135M model on 10-30-turn
episodes.

    python benchmarks/research_run.py --minutes 30          # train, then summarize
    python benchmarks/research_run.py --summarize RUN_DIR   # an existing run
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CONFIG = HERE.parent / "examples" / "agents" / "research.yaml"

TRAIN_KEYS = (
    ("reward_mean", "reward"),
    ("judge/score_mean", "judge score"),
    ("turns_mean", "turns"),
    ("tool_calls_mean", "tool calls"),
    ("tool_call_valid_rate", "valid calls"),
    ("success_rate", "success"),
)


def quarters(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The first and the last quarter of the steps (at least one step each)."""
    n = max(1, len(rows) // 4)
    return rows[:n], rows[-n:]


def mean_of(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def context_rewrites(db: Path) -> dict[str, int]:
    """Completions by ``context_rewrite`` (NULL: sent as the client wrote it)."""
    if not db.exists():
        return {}
    with sqlite3.connect(db) as conn:
        cols = {row[1] for row in conn.execute("pragma table_info(completions)")}
        if "context_rewrite" not in cols:
            return {}
        rows = conn.execute(
            "select coalesce(context_rewrite, 'none'), count(*) from completions group by 1"
        ).fetchall()
    return {str(k): int(v) for k, v in rows}


def _fmt(value: float | None, pct: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:.1%}" if pct else f"{value:.3f}"


def summarize(run: Path) -> str:
    lines = [f"run: {run}"]
    path = run / "eval.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    if rows:
        lines.append("held-out | episodes | success | reward | turns | tool calls | valid calls")
        for r in rows:
            lines.append(
                f"{r['label']} (step {r['step']}) | {r['episodes']} | {r['success_rate']:.1%} | "
                f"{r['mean_reward']:.3f} | {r['mean_turns']:.2f} | "
                f"{_fmt(r.get('mean_tool_calls'))} | {_fmt(r.get('tool_call_validity'), True)}"
            )
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    steps = [m for m in metrics if "reward_mean" in m]
    if steps:
        first, last = quarters(steps)
        lines.append(
            f"training episodes: steps {first[0]['step']}-{first[-1]['step']} vs "
            f"{last[0]['step']}-{last[-1]['step']} of {len(steps)} "
            f"({steps[-1].get('elapsed_s', 0) / 60:.1f} min)"
        )
        lines.append("metric | first quarter | last quarter | last / first")
        for key, name in TRAIN_KEYS:
            a, b = mean_of(first, key), mean_of(last, key)
            ratio = f"{b / a:.2f}x" if a and b is not None else "-"
            lines.append(f"{name} | {_fmt(a)} | {_fmt(b)} | {ratio}")
    rewrites = context_rewrites(run / "episodes.db")
    if rewrites:
        total = sum(rewrites.values())
        parts = ", ".join(f"{k} {v}" for k, v in sorted(rewrites.items()))
        lines.append(f"completions by context rewrite ({total}): {parts}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--summarize", metavar="RUN_DIR", help="summarize an existing run")
    ap.add_argument(
        "--minutes",
        type=float,
        default=30.0,
        help="wall-clock budget of the whole run (minutes), warm start and evaluations included",
    )
    ap.add_argument("--eval-episodes", type=int, default=12)
    ap.add_argument("--out", default="runs/research_bench")
    ap.add_argument("overrides", nargs="*", help="extra config overrides (key=value)")
    args = ap.parse_args(argv)
    if args.summarize:
        print(summarize(Path(args.summarize)))
        return 0
    cmd = [
        sys.executable, "-m", "areal_agents.cli.main", "train", "--config", str(CONFIG), "--quiet",
        f"train.output_dir={args.out}", f"train.time_limit_min={args.minutes}",
        "train.steps=1000", f"eval.episodes={args.eval_episodes}", *args.overrides,
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    print(summarize(Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
