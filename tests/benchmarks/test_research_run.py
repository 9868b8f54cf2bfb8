"""benchmarks/research_run.py: the summary of a run directory, against hand-computed means."""

from __future__ import annotations

import importlib.util
import json
import sqlite3
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _module():
    spec = importlib.util.spec_from_file_location("bench_research_run", BENCH / "research_run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summary_of_a_run_directory(tmp_path: Path) -> None:
    bench = _module()
    rows = [
        {"step": s, "reward_mean": r, "turns_mean": t, "tool_calls_mean": c, "elapsed_s": 60.0 * s}
        for s, r, t, c in [(1, 0.2, 8, 6), (2, 0.3, 9, 7), (3, 0.5, 10, 8), (4, 0.6, 12, 9)]
    ]
    rows.insert(2, {"step": 2, "eval/success_rate": 0.5})  # not a training row
    rows[0]["tool_call_valid_rate"] = 0.8
    rows[-1]["tool_call_valid_rate"] = 0.9
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    evals = [
        {"label": "base", "step": 0, "episodes": 4, "success_rate": 0.0, "mean_reward": 0.0,
         "mean_turns": 1.0, "mean_tool_calls": 0.0, "tool_call_validity": None},
        {"label": "final", "step": 4, "episodes": 4, "success_rate": 0.25, "mean_reward": 0.4,
         "mean_turns": 9.5, "mean_tool_calls": 8.25, "tool_call_validity": 0.75},
    ]  # fmt: skip
    (tmp_path / "eval.json").write_text(json.dumps(evals))
    with sqlite3.connect(tmp_path / "episodes.db") as db:
        db.execute("create table completions (id text, context_rewrite text)")
        db.executemany(
            "insert into completions values (?, ?)",
            [("a", None), ("b", None), ("c", "summary"), ("d", "summary_call")],
        )
    text = bench.summarize(tmp_path)
    assert "base (step 0) | 4 | 0.0% | 0.000 | 1.00 | 0.000 | -" in text
    assert "final (step 4) | 4 | 25.0% | 0.400 | 9.50 | 8.250 | 75.0%" in text
    assert "steps 1-1 vs 4-4 of 4 (4.0 min)" in text
    assert "reward | 0.200 | 0.600 | 3.00x" in text
    assert "tool calls | 6.000 | 9.000 | 1.50x" in text
    assert "valid calls | 0.800 | 0.900 | 1.12x" in text
    assert "judge score | - | - | -" in text
    assert "completions by context rewrite (4): none 2, summary 1, summary_call 1" in text
    assert bench.quarters(list(range(9))) == ([0, 1], [7, 8])
