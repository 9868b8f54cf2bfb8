"""The runs of ``areal-agent train``, from the shell: ``runs`` (a table of a directory's
runs), ``status`` (one run), ``logs`` (its ``train.log``) and ``stop``.

A run's status is its own account of it, ``RUN_DIR/run.json`` (:mod:`areal_agents.run_state`;
a ``running`` run whose process is gone reads as failed), so these work for runs started by
any means; what else they show (steps, held-out results, the last metrics) they read the way
``areal-agent view`` does (:class:`areal_agents.view.sources.Run`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from areal_agents.errors import ConfigError
from areal_agents.run_state import (
    FILE,
    LOG_FILE,
    RunState,
    find_run_dir,
    read_run_state,
    read_stop_request,
    request_stop,
)
from areal_agents.view.sources import Run, is_run_dir

__all__ = ["logs_command", "runs_command", "status_command", "stop_command"]

_FROM_VIEW = {"training": "running"}
"""The view's word for a run's state -> this command line's (runs without ``run.json``)."""
LAST_STEP_KEYS = (
    "reward_mean",
    "success_rate",
    "loss",
    "entropy",
    "grad_norm",
    "staleness_mean",
    "turns_mean",
    "tool_call_valid_rate",
    "gen_tokens_per_s",
    "train_tokens_per_s",
)
"""The metrics of the last step that ``status`` shows (those the step has)."""
POLL_S = 0.5


# ---------------------------------------------------------------------------- runs
def runs_command(args: argparse.Namespace) -> int:
    """A table of the training runs in ``DIR`` (default ``runs/``), oldest start first."""
    root = Path(args.dir)
    if not root.is_dir():
        raise ConfigError(f"no directory {root}: name the directory of your runs (runs DIR)")
    if _is_train_run(root):  # one run
        dirs = [root]
    else:
        dirs = [c for c in sorted(root.iterdir()) if _is_train_run(c)]
    rows = sorted((describe(d) for d in dirs), key=lambda r: (r["started_at"] or 0.0, r["run"]))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no training runs in {root}")
        return 0
    table = [("RUN", "STATUS", "STEP", "HELD-OUT", "STARTED", "WALL", "DETAIL")]
    for r in rows:
        table.append(
            (
                r["run"],
                r["status"],
                _steps(r["step"], r["target_steps"]),
                _held_out(r["held_out"]) or "-",
                _local_time(r["started_at"]),
                _duration(r["wall_s"]),
                (r["detail"] or "")[:60],  # a failure's whole message: status RUN
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        cells = [c.ljust(w) for c, w in zip(row, widths, strict=False)]
        print("  ".join([*cells, row[-1]]).rstrip())
    return 0


def _is_train_run(path: Path) -> bool:
    return is_run_dir(path) and Run(path.name, path=path).kind == "train"


def describe(run_dir: Path) -> dict[str, Any]:
    """One run as ``runs`` shows it: ``{run, path, status, reason, phase, step,
    target_steps, held_out, started_at, ended_at, wall_s, stop_requested, detail}``
    (``held_out``: the last held-out stage, None without one)."""
    run = Run(run_dir.name, path=run_dir)
    view = run.status()
    st = run.run_state()  # run.json as readers show it: a dead pid's "running" is failed
    stages = run.stages()
    status = st.status if st is not None else _FROM_VIEW.get(view["state"], view["state"])
    started = st.started_at if st is not None and st.started_at else None
    ended = st.ended_at if st is not None else None
    if st is not None and started:
        end = ended or (time.time() if st.status == "running" else st.updated_at or started)
        wall = max(0.0, end - started)
    else:
        wall = view["elapsed_s"]
    stop = status == "running" and read_stop_request(run_dir) is not None
    return {
        "run": run.name,
        "path": str(run_dir),
        "status": status,
        "reason": st.reason if st is not None else view["reason"],
        "phase": view["phase"],
        "step": view["steps"],
        "target_steps": view["target_steps"],
        "held_out": stages[-1] if stages else None,
        "started_at": started,
        "ended_at": ended,
        "wall_s": wall,
        "stop_requested": stop,
        "detail": _detail(st, status, view, stop),
    }


def _detail(st: RunState | None, status: str, view: dict[str, Any], stop: bool) -> str | None:
    """A few words on the run: what a running run does, why an ended one ended."""
    if status == "running":
        words = view["phase"] or ""
        return f"{words}, stop requested" if stop else words
    if st is None:
        return view["reason"]
    reason = st.reason or ""
    return {"steps_done": "steps done", "time_limit": "time limit"}.get(reason, reason)


def _steps(step: Any, target: Any) -> str:
    return f"{step}/{target}" if target else str(step)


def _held_out(stage: dict[str, Any] | None) -> str | None:
    """The last held-out stage in a few words: ``success 0.81 (final)``."""
    value = _result(stage)
    if stage is None or value is None:
        return None
    return f"{value} ({stage.get('name') or stage.get('label')})"


def _result(stage: dict[str, Any] | None) -> str | None:
    """A held-out stage's result: ``success 0.81`` (``reward 0.40`` without success)."""
    if stage is None:
        return None
    if stage.get("success_rate") is not None:
        return f"success {stage['success_rate']:.2f}"
    if stage.get("mean_reward") is not None:
        return f"reward {stage['mean_reward']:.2f}"
    return None


def _local_time(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else "-"


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


# ---------------------------------------------------------------------------- status
def status_command(args: argparse.Namespace) -> int:
    """One run: what it trains, where it is, its last step's metrics, its held-out results."""
    path = find_run_dir(args.run)
    if not _is_train_run(path):
        raise ConfigError(f"{path} is no training run (no run.json, config.yaml or metrics.jsonl)")
    run = Run(path.name, path=path)
    row = describe(path)
    cfg = run.config()
    metrics = run.metrics()
    last = metrics[-1] if metrics else {}
    if args.json:
        stages = run.stages()
        print(json.dumps({**row, "last_step": last, "stages": stages}, indent=1))
        return 0
    st = run.run_state()
    lines: list[tuple[str, str]] = [("run", str(path))]
    status = row["status"]
    if st is not None and status == "running":
        status += f" ({row['detail']}), pid {st.pid} on {st.host}"
    elif row["detail"] and row["detail"] != status:
        status += f": {row['detail']}"
    lines.append(("status", status))
    model = (cfg.get("model") or {}).get("path") or "the default model"
    lines += [
        ("algorithm", str(cfg.get("algorithm", "-"))),
        ("env", str((cfg.get("env") or {}).get("id", "-"))),
        ("model", str(model)),
        ("steps", _steps(row["step"], row["target_steps"])),
        ("started", _local_time(row["started_at"])),
        ("wall time", _duration(row["wall_s"])),
    ]
    if last:
        shown = [f"{k} {_number(last[k])}" for k in LAST_STEP_KEYS if k in last]
        lines.append((f"step {last.get('step')}", "  ".join(shown)))
    for stage in run.stages():
        episodes = f" ({stage['episodes']} episodes)" if stage.get("episodes") else ""
        lines.append((f"held-out {stage['name']}", f"{_result(stage) or '-'}{episodes}"))
    checkpoints = run.checkpoints()
    if checkpoints:
        lines.append(("checkpoint", str(path / "checkpoints" / checkpoints[-1])))
    if row["stop_requested"]:
        lines.append(("stop", "requested: it stops after its current step"))
    lines.append(("view", f"areal-agent view {path}"))
    if (path / LOG_FILE).exists():
        follow = " -f" if row["status"] == "running" else ""
        lines.append(("log", f"areal-agent logs {path}{follow}"))
    if row["status"] in ("stopped", "failed") and checkpoints:
        lines.append(("continue", f"areal-agent train --resume {path}"))
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        print(f"{k.ljust(width)}  {v}")
    return 0


def _number(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


# ---------------------------------------------------------------------------- logs
def logs_command(args: argparse.Namespace) -> int:
    """``RUN_DIR/train.log``; ``-f``: then what is appended, until the run is no longer
    running."""
    path = find_run_dir(args.run)
    log = path / LOG_FILE
    if not log.exists() and not (args.follow and _running(path)):
        raise ConfigError(
            f"{path} has no {LOG_FILE} (a run from before train.log, or not started by "
            f"areal-agent train); its metrics: areal-agent status {path}"
        )
    out = sys.stdout.buffer
    offset = _print_tail(log, args.lines, out) if log.exists() else 0
    if not args.follow:
        return 0
    while True:
        running = _running(path)  # before reading: what it wrote before it ended is shown
        if log.exists():
            if log.stat().st_size < offset:  # replaced or cut: from its start
                offset = 0
            with log.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            if chunk:
                out.write(chunk)
                out.flush()
                offset += len(chunk)
        if not running:
            return 0
        time.sleep(POLL_S)


def _print_tail(log: Path, lines: int | None, out: Any) -> int:
    """Print ``log`` (its last ``lines`` lines when given); returns the bytes read."""
    data = log.read_bytes()
    shown = data
    if lines is not None:
        shown = b"".join(data.splitlines(keepends=True)[-lines:]) if lines > 0 else b""
    out.write(shown)
    out.flush()
    return len(data)


def _running(path: Path) -> bool:
    st = read_run_state(path)
    return st is not None and st.effective().status == "running"


# ---------------------------------------------------------------------------- stop
def stop_command(args: argparse.Namespace) -> int:
    """Ask a running run to stop after its current step (it checkpoints, then ends as
    ``stopped``); asked again while it runs, SIGTERM (it stops now, as on ``kill``).
    ``--wait``: return once the run has ended."""
    path = find_run_dir(args.run)
    st = read_run_state(path)
    if st is None:
        raise ConfigError(
            f"{path} has no {FILE}: no run of areal-agent train (or one from before run.json) "
            "to stop; stop its process yourself"
        )
    seen = st.effective()
    if seen.status != "running":
        why = f" ({seen.reason})" if seen.reason else ""
        print(f"{path} is not running: {seen.status}{why}")
        return 0
    here = st.host == socket.gethostname()
    if read_stop_request(path) is None:
        request_stop(path)
        print(
            f"asked {path} to stop after its current step (pid {st.pid} on {st.host}, step "
            f"{st.step}): it checkpoints and ends as stopped; `areal-agent stop {path}` "
            "again stops it now"
        )
    elif here:
        os.kill(st.pid, signal.SIGTERM)
        print(
            f"{path} was already asked to stop: sent SIGTERM to pid {st.pid}; it ends now as "
            "stopped (steps since its last checkpoint are redone by a resume)"
        )
    else:
        print(
            f"{path} was already asked to stop and runs on {st.host}: to stop it now, "
            f"`kill {st.pid}` there",
            file=sys.stderr,
        )
        return 1
    if args.wait:
        while _running(path):
            time.sleep(POLL_S)
        end = read_run_state(path)
        if end is not None:
            end = end.effective()
            print(f"{path}: {end.status} ({end.reason}) at step {end.step}")
    return 0
