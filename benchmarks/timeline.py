"""Draw where a training run's time went, from the spans it recorded (``RUN_DIR/spans.jsonl``,
see ``areal_agents/spans.py``).

    python benchmarks/timeline.py RUN_DIR [--png OUT.png] [--start S] [--end S]

Lanes, top to bottom: the engine's decode and prefill (re-prefills after a weight update in
their own colour) and its weight updates; an idle-priority engine replica's compute
(``rollout.idle_engine_cpus``); the trainer's logprob passes, forward, backward
and optimizer; the weight sync; waits for the compute lock, the staleness gate and a
group's slowest episode; and the number of episodes in flight. Below the lanes, the busy
share of each 10 s bin: some compute running, or, when the run's config put the engine and
the trainer on cores of their own (``rollout.engine_cpus``, ``train.cpus``), the share of
those cores' time spent computing (``time/busy_cores``). The title gives the same for the
whole drawn window. Writes ``RUN_DIR/timeline.png`` by default and prints a summary.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from areal_agents import spans as sp  # noqa: E402

LANES: list[tuple[str, list[tuple[str, str, str]]]] = [
    # label, [(span lane, span name, colour)]
    ("engine decode", [("engine", "decode", "#2e6bd1")]),
    (
        "engine prefill",
        [("engine", "prefill", "#7aa7f0"), ("engine", "reprefill", "#d9534f")],
    ),
    ("engine weight update", [("engine", "weight_update", "#8e44ad")]),
    (  # an idle-priority replica (rollout.idle_engine_cpus), its compute in CPU time
        "idle-priority engine",
        [
            ("engine_idle", "decode", "#5dade2"),
            ("engine_idle", "prefill", "#aed6f1"),
            ("engine_idle", "reprefill", "#d9534f"),
        ],
    ),
    ("trainer logprobs", [("trainer", "logprobs", "#f0ad4e")]),
    ("trainer forward", [("trainer", "forward", "#e67e22")]),
    ("trainer backward", [("trainer", "backward", "#c0392b")]),
    ("trainer optimizer", [("trainer", "optimizer", "#6d4c41")]),
    ("weight sync", [("trainer", "weight_sync", "#8e44ad"), ("trainer", "warm_start", "#95a5a6")]),
    (
        "waits",
        [
            ("engine", "lock_wait", "#bdc3c7"),
            ("trainer", "lock_wait", "#7f8c8d"),
            ("rollout", "gate_full", "#16a085"),
        ],
    ),
    ("group tail", [("rollout", "group_tail", "#27ae60")]),
]


def in_flight(episodes: list[dict[str, Any]]) -> tuple[list[float], list[int]]:
    """The number of episodes running over time, as a step function (times, counts)."""
    events = sorted([(e["start"], 1) for e in episodes] + [(e["end"], -1) for e in episodes])
    xs, ys, n = [], [], 0
    for t, d in events:
        n += d
        xs.append(t)
        ys.append(n)
    return xs, ys


def lane_cores(run_dir: Path) -> dict[str, int | str] | None:
    """``{"engine": n, "trainer": m}`` (and where an idle-priority replica runs) when the
    run's ``config.yaml`` pinned both sides to cores of their own, else None (one process
    sharing the cores)."""
    import yaml

    path = run_dir / "config.yaml"
    if not path.exists():
        return None
    cfg = yaml.safe_load(path.read_text()) or {}
    rollout = cfg.get("rollout") or {}
    return sp.pinned_lane_cores(
        rollout.get("engine_cpus"),
        (cfg.get("train") or {}).get("cpus"),
        rollout.get("idle_engine_cpus"),
    )


def draw(run_dir: Path, png: Path, start: float | None, end: float | None) -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, rows = sp.read(run_dir / "spans.jsonl")
    if not rows:
        raise SystemExit(f"{run_dir / 'spans.jsonl'} holds no spans: is this a training run?")
    lo = min(r["start"] for r in rows) if start is None else start
    hi = max(r["end"] for r in rows) if end is None else end
    rows = [r for r in rows if r["end"] > lo and r["start"] < hi]
    tuples = [(r["lane"], r["name"], r["start"], r["end"]) for r in rows]
    cores = lane_cores(run_dir)
    share = "time/busy_cores" if cores else "time/busy"
    summary = sp.busy_idle(tuples, lo, hi, cores=cores)

    fig, (ax, ax_ep, ax_busy) = plt.subplots(
        3, 1, figsize=(14, 7.5), sharex=True, gridspec_kw={"height_ratios": [5, 1.4, 1.2]}
    )
    labels = [label for label, _ in LANES]
    for y, (_, kinds) in enumerate(LANES):
        for lane, name, colour in kinds:
            bars = [
                (r["start"], r["end"] - r["start"])
                for r in rows
                if (r["lane"], r["name"]) == (lane, name)
            ]
            if bars:
                ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colour, label=name, linewidth=0)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, framealpha=0.8)
    ax.grid(axis="x", alpha=0.3)
    busy = summary.get(share, 0.0)
    what = "cores busy" if cores else "busy"
    ax.set_title(
        f"{run_dir.name}: {hi - lo:.0f} s, {what} {busy:.0%} "
        f"(engine {summary.get('time/busy_engine', 0.0):.0%}, "
        f"trainer {summary.get('time/busy_trainer', 0.0):.0%}), "
        f"idle {summary.get('time/idle_s', 0.0):.0f} s"
    )

    xs, ys = in_flight([r for r in rows if r["name"] == "episode"])
    ax_ep.step(xs, ys, where="post", color="#34495e")
    ax_ep.set_ylabel("episodes\nin flight", fontsize=8)
    ax_ep.grid(alpha=0.3)

    width = 10.0 if hi - lo > 100 else max((hi - lo) / 20, 0.5)
    bins, shares = [], []
    t = lo
    while t < hi:
        u = min(t + width, hi)
        bins.append(t)
        shares.append(sp.busy_idle(tuples, t, u, cores=cores).get(share, 0.0) * 100)
        t = u
    ax_busy.bar(bins, shares, width=width, align="edge", color="#2e6bd1", alpha=0.7)
    ax_busy.set_ylim(0, 100)
    ax_busy.set_ylabel(f"{what} %\n({width:g} s bins)", fontsize=8)
    ax_busy.set_xlabel("seconds since the run started")
    ax_busy.grid(alpha=0.3)
    ax_busy.set_xlim(lo, hi)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return {"window_s": hi - lo, **summary}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--png", type=Path, default=None, help="default: RUN_DIR/timeline.png")
    ap.add_argument("--start", type=float, default=None, help="seconds since the start")
    ap.add_argument("--end", type=float, default=None)
    args = ap.parse_args(argv)
    if not (args.run_dir / "spans.jsonl").exists():
        print(
            f"{args.run_dir} has no spans.jsonl: runs record it since spans were added; "
            "train again to get one",
            file=sys.stderr,
        )
        return 2
    png = args.png or args.run_dir / "timeline.png"
    summary = draw(args.run_dir, png, args.start, args.end)
    print(f"wrote {png}")
    for k, v in summary.items():
        print(f"  {k:28s} {v:10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
