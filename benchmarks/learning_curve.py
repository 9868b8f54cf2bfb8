"""Held-out success of a training run's checkpoints against wall-clock minutes.

For each run directory (``areal-agent train ... train.output_dir=DIR``) every checkpoint
``DIR/checkpoints/step-N`` is evaluated greedily with ``areal-agent eval`` on the *test* split
of the run's env (the run's own ``config.yaml`` gives the env, its kwargs, the model and the
token / turn limits; the checkpoint's LoRA adapter is applied with ``--adapter``). Step 0 is
the warm-started model when the run had ``sft.enabled``. A run that trained an agent
(``agent.factory``) is evaluated with that agent (``--agent``, its kwargs, greedy). The model
runs in the run's ``model.dtype`` (``auto`` resolved on this machine as for the engine
during training; the resolved dtype is part of the cached request, so a report made in
another dtype is redone).
The x axis is the run's wall-clock time when the checkpoint was written (``state.json:
elapsed_s``, warm start included); evaluation time is not part of it.

    python benchmarks/learning_curve.py runs/calc-s0 runs/calc-s1 --episodes 128 \\
        --png benchmarks/learning_curve.png

Reports are cached in ``step-N/eval/`` (``eval-seedS/`` for ``--seed S`` other than 0) with
the request that made them (env kwargs, problems, seed, limits); a rerun only evaluates
checkpoints whose request differs or is new. ``--ends`` evaluates step 0 and the last
checkpoint only (a second evaluation seed needs no curve).
Prints one markdown table row per checkpoint (success, grounded success where the env
reports it, success per task kind: ``arithmetic`` / ``word``, ``1-hop`` / ``2-hop``) and, per
run, the gain of the last checkpoint
over step 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml


def checkpoints(run: Path) -> list[Path]:
    root = run / "checkpoints"
    found = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))
    if not found:
        raise SystemExit(f"{run}: no checkpoints under {root}; train with train.save_every > 0")
    return found


def eval_request(
    run: Path, episodes: int, seed: int, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What decides a checkpoint's held-out result: env, kwargs (the run's, ``overrides`` on
    top, the test split), problems, seed and the sampling and length limits."""
    from areal_agents.hardware import default_device, resolve_dtype

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    agent = cfg.get("agent") or {}
    request: dict[str, Any] = {}
    if agent.get("factory"):  # the run trained an agent: evaluate the same agent, greedy
        kwargs = dict(agent.get("kwargs") or {})
        if "temperature" in kwargs:
            kwargs["temperature"] = 0
        request = {"agent": agent["factory"], "agent_kwargs": kwargs}
    return {
        **request,
        "env": cfg["env"]["id"],
        "env_kwargs": {**(cfg["env"].get("kwargs") or {}), **(overrides or {}), "split": "test"},
        "model": cfg["model"].get("path"),
        "dtype": resolve_dtype(cfg["model"].get("dtype") or "auto", default_device()),
        "episodes": episodes,
        "seed": seed,
        "temperature": 0,
        "max_tokens": cfg["sampling"]["max_new_tokens"],
        "max_turns": cfg["rollout"]["max_turns"],
        "tasks": "distinct",  # areal-agent eval walks a permutation of the test pool
    }


def evaluate(
    run: Path,
    ckpt: Path,
    episodes: int,
    seed: int,
    concurrency: int,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The checkpoint's eval report, from ``step-N/eval/`` when it was made by the same
    request (``request.json``), else from a fresh ``areal-agent eval``."""
    out = ckpt / ("eval" if seed == 0 else f"eval-seed{seed}")  # one cache per task seed
    cached, recorded = out / "report.json", out / "request.json"
    request = eval_request(run, episodes, seed, overrides)
    if cached.exists() and recorded.exists() and json.loads(recorded.read_text()) == request:
        report: dict[str, Any] = json.loads(cached.read_text())
        return report
    cmd = [sys.executable, "-m", "areal_agents.cli.main", "eval", "--env", request["env"]]
    cmd += ["--env-kwargs", json.dumps(request["env_kwargs"]), "--adapter", str(ckpt / "model")]
    for flag in ("episodes", "seed", "temperature", "max_tokens", "max_turns", "dtype"):
        cmd += [f"--{flag.replace('_', '-')}", str(request[flag])]
    if "agent" in request:
        cmd += ["--agent", request["agent"], "--agent-kwargs", json.dumps(request["agent_kwargs"])]
    cmd += ["--concurrency", str(concurrency), "--out", str(out)]
    if request["model"]:
        cmd += ["--model", request["model"]]
    recorded.unlink(missing_ok=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    recorded.write_text(json.dumps(request, indent=1) + "\n")
    result: dict[str, Any] = json.loads(cached.read_text())
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (train.output_dir)")
    ap.add_argument("--episodes", type=int, default=128, help="held-out problems per eval")
    ap.add_argument("--seed", type=int, default=0, help="first held-out task seed")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--png", type=Path, default=None, help="write the plot here")
    ap.add_argument(
        "--ends", action="store_true", help="only step 0 and the last checkpoint of each run"
    )
    ap.add_argument(
        "--env-kwargs",
        type=json.loads,
        default={},
        help="JSON object over the run's env kwargs for the held-out set, e.g. "
        "'{\"word_fraction\": 0.5}' when training sampled another mix",
    )
    args = ap.parse_args(argv)

    curves: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    steps: dict[str, list[int]] = {}
    for run in args.runs:
        points, found = [], checkpoints(run)
        for ckpt in [found[0], found[-1]] if args.ends and len(found) > 1 else found:
            state = json.loads((ckpt / "state.json").read_text())
            report = evaluate(
                run, ckpt, args.episodes, args.seed, args.concurrency, args.env_kwargs
            )
            points.append((float(state.get("elapsed_s", 0.0)) / 60, report))
            steps.setdefault(run.name, []).append(int(state["step"]))
            print(f"{run.name} step {state['step']}: {report['success_rate']:.1%}", file=sys.stderr)
        curves[run.name] = points
    reports = [r for points in curves.values() for _, r in points]
    kinds = sorted({k for r in reports for k in r.get("by_kind") or {}})
    grounded = any(r.get("grounded_success_rate") is not None for r in reports)
    head = ["run", "step", "minutes", "success", *(["grounded"] if grounded else []), *kinds]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, points in curves.items():
        for step, (minutes, r) in zip(steps[name], points, strict=True):
            print(
                "| "
                + " | ".join([name, str(step), f"{minutes:.1f}", *_cells(r, grounded, kinds)])
                + " |"
            )
    for name, points in curves.items():
        (_, first), (minutes, last) = points[0], points[-1]
        parts = [f"success {_gain(first, last, 'success_rate')}"]
        if grounded:
            parts.append(f"grounded {_gain(first, last, 'grounded_success_rate')}")
        parts += [
            f"{k} {_gain(first.get('by_kind') or {}, last.get('by_kind') or {}, k)}" for k in kinds
        ]
        print(f"{name} in {minutes:.1f} min: " + "; ".join(parts))
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2))
        for name, points in curves.items():
            xs = [m for m, _ in points]
            (line,) = ax.plot(xs, [r["success_rate"] * 100 for _, r in points], "o-", label=name)
            for kind, style in zip(kinds, ("x--", "+:", "^-.", "v--"), strict=False):
                ys = [(r.get("by_kind") or {}).get(kind, 0.0) * 100 for _, r in points]
                ax.plot(xs, ys, style, color=line.get_color(), alpha=0.6, label=f"{name} ({kind})")
        ax.set_xlabel("wall-clock minutes (warm start included)")
        ax.set_ylabel(f"held-out success, % of {args.episodes}")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        print(f"wrote {args.png}")
    return 0


def _cells(report: dict[str, Any], grounded: bool, kinds: list[str]) -> list[str]:
    """A report's success, grounded success (when the env reports it) and success per kind."""
    cells = [f"{report['success_rate']:.1%}"]
    if grounded:
        g = report.get("grounded_success_rate")
        cells.append("-" if g is None else f"{g:.1%}")
    by_kind = report.get("by_kind") or {}
    return cells + [f"{by_kind[k]:.1%}" if k in by_kind else "-" for k in kinds]


def _gain(first: dict[str, Any], last: dict[str, Any], key: str) -> str:
    """``a -> b (+d points)`` of ``key`` between two reports (``-`` where one lacks it)."""
    a, b = first.get(key), last.get(key)
    if a is None or b is None:
        return "-"
    return f"{a:.1%} -> {b:.1%} ({(b - a) * 100:+.1f} points)"


if __name__ == "__main__":
    raise SystemExit(main())
