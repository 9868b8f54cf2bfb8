"""What ``areal-agent view`` reads: run directories, eval outputs and episode stores.

A *source* on the command line is

* a training run directory (``config.yaml``, ``metrics.jsonl``, ``episodes.db``, ...);
* an eval output directory (``report.json``, ``episodes.jsonl``, ``episodes.db``);
* a directory holding such directories (``runs/``): each one is a run, and runs created
  later appear as the runs page is reloaded;
* an episode store of its own (``sessions.db`` of ``areal-agent serve --store``, or a
  ``postgresql://`` / ``sqlite:///`` URL).

Each becomes a :class:`Run`. Files are read as they are at each request (``metrics.jsonl``
incrementally: only the bytes appended since the last read are parsed), so a run that is
training updates live. The store is opened on first use and kept open.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from areal_agents.errors import ConfigError
from areal_agents.model import resolve_model
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.store import EpisodeStore

__all__ = ["Run", "RunSet", "is_run_dir"]

RUN_FILES = ("episodes.db", "metrics.jsonl", "report.json", "config.yaml", "episodes.jsonl")
LIVE_WITHIN_S = 120.0
"""A run whose metrics, ledger or store changed this recently (and has no ``final/``) is
shown as training."""


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / f).exists() for f in RUN_FILES)


@dataclass
class _MetricsCache:
    offset: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)
    partial: bytes = b""
    inode: int | None = None


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
        if (self.path / "config.yaml").exists() or (self.path / "metrics.jsonl").exists():
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
        """The rows of ``metrics.jsonl`` (the last row per step, as a resume rewrites steps),
        read incrementally."""
        p = self.file("metrics.jsonl")
        if p is None or not p.exists():
            return []
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
                    if isinstance(row, dict) and isinstance(row.get("step"), int):
                        cache.rows.append(row)
            by_step: dict[int, dict[str, Any]] = {}
            for row in cache.rows:
                by_step[row["step"]] = row
            return [by_step[s] for s in sorted(by_step)]

    def metric_names(self) -> list[str]:
        names: dict[str, None] = {}
        for row in self.metrics():
            for k, v in row.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    names[k] = None
        return sorted(names)

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """``{state, steps, target_steps, elapsed_s, updated_at, latest}``."""
        rows = self.metrics()
        latest = rows[-1] if rows else {}
        target = (self.config().get("train") or {}).get("steps")
        updated = self._updated_at()
        if self.kind == "eval":
            state = "eval"
        elif self.kind == "store":
            state = "store"
        elif self.path is not None and (self.path / "final").exists():
            state = "finished"
        elif updated is not None and time.time() - updated < LIVE_WITHIN_S:
            state = "training"
        else:
            state = "stopped"
        elapsed = latest.get("elapsed_s")
        if elapsed is None and self.kind == "eval":
            elapsed = (self.report() or {}).get("duration_s")
        return {
            "state": state,
            "steps": latest.get("step", 0),
            "target_steps": target if isinstance(target, int) else None,
            "elapsed_s": elapsed,
            "updated_at": updated,
            "latest": {
                k: v
                for k, v in latest.items()
                if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            },
        }

    def _updated_at(self) -> float | None:
        if self.path is None:
            return None
        times = [
            (self.path / f).stat().st_mtime
            for f in ("metrics.jsonl", "groups.jsonl", "episodes.db-wal", "episodes.db")
            if (self.path / f).exists()
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

    def get(self, name: str) -> Run | None:
        run = self._runs.get(name)
        if run is None:
            self.runs()
            run = self._runs.get(name)
        return run

    def close(self) -> None:
        for r in self._runs.values():
            r.close()
