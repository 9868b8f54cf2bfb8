"""What ``areal-agent view`` reads: run directories, eval outputs and episode stores.

A *source* on the command line is

* a training run directory (``config.yaml``, ``metrics.jsonl``, ``run.json``, ``eval.json``,
  ``episodes.db``, ...);
* an eval output directory (``report.json``, ``episodes.jsonl``, ``episodes.db``);
* a directory holding such directories (``runs/``): each one is a run, and runs created
  later appear as the runs page is reloaded;
* an episode store of its own (``sessions.db`` of ``areal-agent serve --store``, or a
  ``postgresql://`` / ``sqlite:///`` URL).

Each becomes a :class:`Run`. Files are read as they are at each request (``metrics.jsonl``
incrementally: only the bytes appended since the last read are parsed), so a run that is
training updates live. The store is opened on first use and kept open.

A training run's status is its own account of it, ``run.json`` (docs/data-contract.md,
read through :mod:`areal_agents.run_state`), never the time a file was last changed:
opening a run's store changes the store's files. Runs from before ``run.json`` fall back to their
``final/`` directory and the times of ``metrics.jsonl`` and ``groups.jsonl``, which only the
trainer writes.

Held-out evaluations (base model, after the warm start, every ``eval.every`` steps, final:
:mod:`areal_agents.trainer.heldout`) are *stages*: read from ``eval.json``, else from the
``held_out`` rows of ``metrics.jsonl``, which are not training steps and never count as one.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from areal_agents.errors import ConfigError
from areal_agents.model import resolve_model
from areal_agents.run_state import RunState, read_run_state
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.store import EpisodeStore

__all__ = [
    "Run",
    "RunSet",
    "is_run_dir",
    "stage_name",
    "stage_of_group",
]

RUN_FILES = (
    "episodes.db",
    "metrics.jsonl",
    "report.json",
    "config.yaml",
    "episodes.jsonl",
    "run.json",
    "eval.json",
)
LIVE_WITHIN_S = 120.0
"""A run without ``run.json`` (from before the file) whose metrics or ledger changed this
recently, and that has no ``final/``, is shown as training. The store's files never count:
the view itself changes them when it opens the store."""
FILES_OF_A_LIVE_RUN = ("metrics.jsonl", "groups.jsonl")
"""The files only the trainer writes, whose times tell an old run's liveness."""

STATES = {"running": "training", "finished": "finished", "failed": "failed", "stopped": "stopped"}
"""``run.json``'s status -> the state the view shows (a running run is *training*)."""

_STAGE_LABEL = re.compile(r"^(base|warm_start|final|step-\d+)$")
_EVAL_GROUP = re.compile(r"^eval-(base|warm_start|final|step-\d+)-(-?\d+)$")


def stage_name(label: str) -> str:
    """A held-out stage's label as words: ``warm_start`` -> ``warm start``, ``step-40`` ->
    ``step 40``."""
    if label == "warm_start":
        return "warm start"
    if label.startswith("step-"):
        return "step " + label[5:]
    return label


def stage_order(label: str, step: int = 0) -> tuple[int, int]:
    """Where a stage comes in a run: base, warm start, each step-N by N, final."""
    if label == "base":
        return (0, 0)
    if label == "warm_start":
        return (1, 0)
    if label.startswith("step-") and label[5:].isdigit():
        return (2, int(label[5:]))
    if label == "final":
        return (3, step)
    return (4, step)


def stage_of_group(group_id: str | None) -> tuple[str, str] | None:
    """``(label, seed)`` of a held-out evaluation's group (``eval-<label>-<seed>``, as
    :mod:`areal_agents.trainer.heldout` names them); None for any other group."""
    m = _EVAL_GROUP.match(group_id or "")
    return (m.group(1), m.group(2)) if m else None


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def _reason_code(st: RunState) -> str | None:
    """``steps_done``, ``time_limit``, ``stopped``, ``failed`` or ``gone`` (the process
    vanished); None while the run runs."""
    reason = st.reason or ""
    if st.status == "running":
        return None
    if reason in ("steps_done", "time_limit", "stopped"):
        return reason
    if reason.startswith("process ") and reason.endswith(" is gone"):
        return "gone"
    return "failed" if st.status == "failed" or reason.startswith("failed") else None


def _run_state_words(st: RunState, steps: int, target: int | None) -> str | None:
    """Why a run ended, in words (None while it runs)."""
    of = f"{steps} of {target} steps" if target else f"{steps} steps"
    reason = st.reason or ""
    if st.status == "running":
        return None
    if reason == "time_limit":
        return f"stopped by the time limit after {of}"
    if reason == "steps_done":
        return "finished: all steps done"
    if reason == "stopped":
        return f"stopped (Ctrl-C / SIGTERM) after {of}"
    if reason.startswith("process ") and reason.endswith(" is gone"):
        return f"{reason}: it ended without recording why (killed?), after {of}"
    if reason.startswith("failed"):
        return reason
    if st.status == "failed":
        return f"failed: {reason}" if reason else "failed"
    return f"{st.status}: {reason}" if reason else st.status


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / f).exists() for f in RUN_FILES)


@dataclass
class _MetricsCache:
    offset: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)
    partial: bytes = b""
    inode: int | None = None
    held_out: list[dict[str, Any]] = field(default_factory=list)


class Run:
    """One run, eval output or store (see the module docstring)."""

    def __init__(self, name: str, path: Path | None = None, store_spec: str | None = None):
        self.name = name
        self.path = path
        self.store_spec = store_spec
        self._store: EpisodeStore | None = None
        self._store_error: str | None = None
        self._metrics = _MetricsCache()
        self._lock = threading.Lock()
        self._tokenizer: ChatTokenizer | None = None
        self._tokenizer_error: str | None = None

    def __repr__(self) -> str:
        return f"Run({self.name!r}, {self.path or self.store_spec})"

    # ------------------------------------------------------------------ what it is
    @property
    def kind(self) -> str:
        """``train``, ``eval`` or ``store``."""
        if self.path is None:
            return "store"
        if (self.path / "report.json").exists():
            return "eval"
        if any((self.path / f).exists() for f in ("config.yaml", "metrics.jsonl", "run.json")):
            return "train"
        return "store"

    def file(self, name: str) -> Path | None:
        return None if self.path is None else self.path / name

    def config_text(self) -> str | None:
        p = self.file("config.yaml")
        return p.read_text(encoding="utf-8") if p is not None and p.exists() else None

    def config(self) -> dict[str, Any]:
        text = self.config_text()
        if not text:
            return {}
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            return {}
        return data if isinstance(data, dict) else {}

    @property
    def gamma(self) -> float:
        g = (self.config().get("rollout") or {}).get("gamma", 1.0)
        return float(g) if isinstance(g, int | float) else 1.0

    def report(self) -> dict[str, Any] | None:
        p = self.file("report.json")
        if p is None or not p.exists():
            return None
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return None
        return data if isinstance(data, dict) else None

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> list[dict[str, Any]]:
        """The training steps of ``metrics.jsonl`` (the last row per step, as a resume
        rewrites steps), read incrementally. Held-out rows (``held_out``: their label) are
        not steps: :meth:`held_out_rows` has them."""
        return self._read_metrics()[0]

    def held_out_rows(self) -> list[dict[str, Any]]:
        """The held-out rows of ``metrics.jsonl`` (``{"step", "held_out": label,
        "eval/...": ...}``), in the order written."""
        return self._read_metrics()[1]

    def _read_metrics(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        p = self.file("metrics.jsonl")
        if p is None or not p.exists():
            return [], []
        with self._lock:
            cache = self._metrics
            st = p.stat()
            if st.st_ino != cache.inode or st.st_size < cache.offset:  # replaced or cut
                cache = self._metrics = _MetricsCache(inode=st.st_ino)
            if st.st_size > cache.offset:
                with p.open("rb") as f:
                    f.seek(cache.offset)
                    chunk = cache.partial + f.read()
                cache.offset = st.st_size
                *lines, cache.partial = chunk.split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                        continue
                    if row.get("held_out") is not None:
                        cache.held_out.append(row)
                    else:
                        cache.rows.append(row)
            by_step: dict[int, dict[str, Any]] = {}
            for row in cache.rows:
                by_step[row["step"]] = row
            return [by_step[s] for s in sorted(by_step)], list(cache.held_out)

    def metric_names(self) -> list[str]:
        names: dict[str, None] = {}
        for row in self.metrics():
            for k, v in row.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    names[k] = None
        return sorted(names)

    # ------------------------------------------------------------------ held-out stages
    def stages(self) -> list[dict[str, Any]]:
        """The run's held-out evaluations, base -> warm start -> step-N -> final, each
        ``{label, name, step, episodes, success_rate, mean_reward, mean_turns,
        mean_tool_calls, tool_call_validity, by_kind, end_reasons, duration_s}`` (None where
        not recorded). From ``eval.json``; a run without one: the ``held_out`` rows of
        ``metrics.jsonl``, else the ``eval/*`` metrics of its step rows (``step-N``). The
        latest result of each label counts (a resumed run may evaluate a label again)."""
        rows = self._eval_json()
        if rows is None:
            rows = [self._stage_from_metrics(str(r["held_out"]), r) for r in self.held_out_rows()]
        if not rows:
            rows = [
                self._stage_from_metrics(f"step-{r['step']}", r)
                for r in self.metrics()
                if _number(r.get("eval/success_rate")) is not None
            ]
        latest: dict[str, dict[str, Any]] = {}
        for r in rows:
            latest[r["label"]] = r
        out = sorted(latest.values(), key=lambda r: stage_order(r["label"], r["step"] or 0))
        for r in out:
            r["name"] = stage_name(r["label"])
        return out

    def _eval_json(self) -> list[dict[str, Any]] | None:
        p = self.file("eval.json")
        if p is None or not p.exists():
            return None
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(data, list):
            return None
        out = []
        for r in data:
            if not isinstance(r, dict) or not _STAGE_LABEL.match(str(r.get("label", ""))):
                continue
            step = r.get("step")
            out.append(
                {
                    "label": str(r["label"]),
                    "step": step if isinstance(step, int) else None,
                    "episodes": r.get("episodes") if isinstance(r.get("episodes"), int) else None,
                    **{
                        k: _number(r.get(k))
                        for k in (
                            "success_rate",
                            "mean_reward",
                            "mean_turns",
                            "mean_tool_calls",
                            "tool_call_validity",
                            "duration_s",
                        )
                    },
                    "by_kind": {
                        str(k): v
                        for k, v in (r.get("by_kind") or {}).items()
                        if _number(v) is not None
                    }
                    if isinstance(r.get("by_kind"), dict)
                    else {},
                    "end_reasons": r.get("end_reasons")
                    if isinstance(r.get("end_reasons"), dict)
                    else {},
                }
            )
        return out

    @staticmethod
    def _stage_from_metrics(label: str, row: dict[str, Any]) -> dict[str, Any]:
        """A stage from ``eval/*`` metrics (``metrics.jsonl``: no episode count, no end
        reasons)."""
        by_kind = {
            k[len("eval/success_") :]: v
            for k, v in row.items()
            if k.startswith("eval/success_") and k != "eval/success_rate" and _number(v) is not None
        }
        return {
            "label": label,
            "step": row.get("step") if isinstance(row.get("step"), int) else None,
            "episodes": None,
            "success_rate": _number(row.get("eval/success_rate")),
            "mean_reward": _number(row.get("eval/mean_reward")),
            "mean_turns": _number(row.get("eval/mean_turns")),
            "mean_tool_calls": _number(row.get("eval/tool_calls_mean")),
            "tool_call_validity": _number(row.get("eval/tool_call_valid_rate")),
            "duration_s": None,
            "by_kind": by_kind,
            "end_reasons": {},
        }

    # ------------------------------------------------------------------ status
    def run_state(self) -> RunState | None:
        """``run.json`` as a reader should show it (a running run whose process is gone is
        failed); None without one."""
        if self.path is None:
            return None
        st = read_run_state(self.path)
        return None if st is None else st.effective()

    def status(self) -> dict[str, Any]:
        """``{state, reason, reason_code, phase, steps, target_steps, elapsed_s,
        updated_at, latest, pid, from_run_file}``: ``state`` is ``training`` (running),
        ``finished``, ``stopped``, ``failed``, or ``eval`` / ``store`` for what is no
        training run; ``reason`` why it ended, in words; ``reason_code`` the same as one of
        ``steps_done``, ``time_limit``, ``stopped``, ``failed``, ``gone`` (None while it
        runs, or without run.json)."""
        rows = self.metrics()
        latest = rows[-1] if rows else {}
        target = (self.config().get("train") or {}).get("steps")
        target = target if isinstance(target, int) and not isinstance(target, bool) else None
        steps = latest.get("step", 0)
        elapsed = latest.get("elapsed_s")
        reason: str | None = None
        reason_code: str | None = None
        phase: str | None = None
        pid: int | None = None
        run_state = self.run_state() if self.kind == "train" else None
        updated = self._updated_at()
        if self.kind == "eval":
            state = "eval"
            elapsed = (self.report() or {}).get("duration_s") if elapsed is None else elapsed
        elif self.kind == "store":
            state = "store"
        elif run_state is not None:
            state = STATES[run_state.status]
            steps = max(steps, run_state.step)
            target = run_state.target_steps if run_state.target_steps is not None else target
            reason = _run_state_words(run_state, steps, target)
            reason_code = _reason_code(run_state)
            phase = run_state.phase if run_state.status == "running" else None
            pid = run_state.pid
            updated = run_state.ended_at or run_state.updated_at or updated
            if elapsed is None and run_state.started_at:
                end = run_state.ended_at or (
                    time.time() if run_state.status == "running" else run_state.updated_at
                )
                if end is not None:
                    elapsed = max(0.0, end - run_state.started_at)
        elif self.path is not None and (self.path / "final").exists():
            state = "finished"
        elif updated is not None and time.time() - updated < LIVE_WITHIN_S:
            state = "training"
        else:
            state = "stopped"
            if updated is not None:
                reason = "no run.json; its metrics stopped changing"
        return {
            "state": state,
            "reason": reason,
            "reason_code": reason_code,
            "phase": phase,
            "pid": pid,
            "from_run_file": run_state is not None,
            "steps": steps,
            "target_steps": target,
            "elapsed_s": elapsed,
            "updated_at": updated,
            "latest": {
                k: v
                for k, v in latest.items()
                if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            },
        }

    def _updated_at(self) -> float | None:
        """When the trainer last wrote its metrics or ledger (never the store's files,
        which a reader changes by opening the store)."""
        if self.path is None:
            return None
        times = [
            (self.path / f).stat().st_mtime for f in FILES_OF_A_LIVE_RUN if (self.path / f).exists()
        ]
        return max(times) if times else None

    def checkpoints(self) -> list[str]:
        p = self.file("checkpoints")
        if p is None or not p.is_dir():
            return []
        return sorted(c.name for c in p.iterdir() if c.is_dir() and c.name.startswith("step-"))

    def tensorboard_dir(self) -> Path | None:
        p = self.file("tensorboard")
        return p if p is not None and p.is_dir() else None

    def groups(self) -> list[dict[str, Any]]:
        """``groups.jsonl``, the trainer's ledger of consumed groups."""
        p = self.file("groups.jsonl")
        if p is None or not p.exists():
            return []
        out = []
        for line in p.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                out.append(row)
        return out

    # ------------------------------------------------------------------ the store
    def store_location(self) -> str | None:
        if self.store_spec is not None:
            return self.store_spec
        p = self.file("episodes.db")
        return str(p) if p is not None and p.exists() else None

    def store(self) -> EpisodeStore | None:
        """The run's episode store, opened on first use; None when it has none (an old run:
        ``areal-agent view --import RUN_DIR`` builds one from its JSONL)."""
        with self._lock:
            if self._store is not None:
                return self._store
            location = self.store_location()
            if location is None:
                return None
            try:
                self._store = EpisodeStore(location)
            except ConfigError:
                raise
            except Exception as exc:  # a store another version wrote, a broken file
                self._store_error = f"cannot open the store {location}: {exc}"
                raise ConfigError(self._store_error) from exc
            return self._store

    def missing_store_hint(self) -> str:
        if self.path is not None and (self.path / "episodes.jsonl").exists():
            return (
                f"{self.path} has episodes.jsonl but no episodes.db: run "
                f"`areal-agent view --import {self.path}` once to build its store"
            )
        return f"{self.name} has no episode store (episodes.db)"

    def tokenizer(self) -> ChatTokenizer | None:
        """The run's tokenizer, for showing tokens as text: ``final/`` when it has one, else
        the config's model (``model.path``, the default model when unset); None when none
        can be found (tokens are then shown as ids)."""
        with self._lock:
            if self._tokenizer is not None or self._tokenizer_error is not None:
                return self._tokenizer
            candidates: list[str] = []
            final = self.file("final")
            if final is not None and (final / "tokenizer.json").exists():
                candidates.append(str(final))
            if self.kind == "train":
                try:
                    model = (self.config().get("model") or {}).get("path")
                    candidates.append(resolve_model(model, quiet=True))
                except Exception as exc:
                    self._tokenizer_error = str(exc)
            for c in candidates:
                try:
                    self._tokenizer = ChatTokenizer.from_dir(c)
                    return self._tokenizer
                except Exception as exc:
                    self._tokenizer_error = str(exc)
            self._tokenizer_error = self._tokenizer_error or "no tokenizer"
            return None

    def set_tokenizer(self, tokenizer: ChatTokenizer) -> None:
        self._tokenizer = tokenizer

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


class RunSet:
    """The runs named on the command line; parent directories are rescanned on
    :meth:`runs`, so new runs show up."""

    def __init__(self, specs: list[str | Path]) -> None:
        self._runs: dict[str, Run] = {}
        self._parents: list[Path] = []
        self._lock = threading.Lock()
        if not specs:
            raise ConfigError(
                "areal-agent view: name a run directory, a runs/ directory or a store"
            )
        for spec in specs:
            self._add_spec(spec)

    def _add_spec(self, spec: str | Path) -> None:
        text = str(spec)
        if "://" in text:
            name = text.rsplit("/", 1)[-1] or "store"
            self._add(Run(name.split("?")[0], store_spec=text))
            return
        path = Path(text).expanduser().resolve()
        if path.is_file():
            if path.suffix != ".db":
                raise ConfigError(f"{path}: expected a run directory or an episode store (.db)")
            self._add(Run(path.stem, store_spec=str(path)))
            return
        if not path.is_dir():
            raise ConfigError(f"{path}: no such run directory or store")
        if is_run_dir(path):
            self._add(Run(path.name, path=path))
            return
        children = [c for c in sorted(path.iterdir()) if is_run_dir(c)]
        self._parents.append(path)
        for c in children:
            self._add(Run(c.name, path=c))
        if not children:
            # an empty runs/ directory is fine: runs started later appear
            pass

    def _add(self, run: Run) -> None:
        name, n = run.name, 2
        while name in self._runs:
            if self._runs[name].path == run.path and run.path is not None:
                return
            name = f"{run.name}-{n}"
            n += 1
        run.name = name
        self._runs[name] = run

    def runs(self) -> list[Run]:
        with self._lock:
            known = {r.path for r in self._runs.values() if r.path is not None}
            for parent in self._parents:
                if not parent.is_dir():
                    continue
                for c in sorted(parent.iterdir()):
                    if c.resolve() not in known and is_run_dir(c):
                        self._add(Run(c.name, path=c.resolve()))
            return list(self._runs.values())

    @property
    def watches_directories(self) -> bool:
        """Whether a directory of runs was named: runs may appear in it later."""
        return bool(self._parents)

    def get(self, name: str) -> Run | None:
        run = self._runs.get(name)
        if run is None:
            self.runs()
            run = self._runs.get(name)
        return run

    def close(self) -> None:
        for r in self._runs.values():
            r.close()
