"""Training metrics: one JSONL line per step (and one per held-out evaluation), TensorBoard
scalars and histograms, optional wandb. Writers never fail a run: a missing backend is
reported once and skipped."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np


class MetricsWriter:
    def __init__(
        self,
        out_dir: str | Path,
        *,
        jsonl: bool = True,
        tensorboard: bool = True,
        wandb: bool = False,
        config: dict[str, Any] | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        """``tags``: strings written into every JSONL row (e.g. ``{"engine": "vllm"}``)."""
        self.dir = Path(out_dir)
        self.tags = dict(tags or {})
        self.dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (self.dir / "metrics.jsonl").open("a") if jsonl else None
        self._tb: Any = None
        self._wandb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415  tensorboard loads only when enabled

                self._tb = SummaryWriter(str(self.dir / "tensorboard"))
            except ImportError:
                print("metrics: tensorboard is not installed; writing JSONL only", file=sys.stderr)
        if wandb:
            try:
                import wandb as wb  # noqa: PLC0415  wandb is an optional extra (metrics)

                self._wandb = wb.init(
                    project="areal-agents", config=config or {}, dir=str(self.dir)
                )
            except ImportError:
                print("metrics: wandb is not installed; skipping it", file=sys.stderr)

    def log(
        self, step: int, scalars: dict[str, float], histograms: dict[str, list[float]] | None = None
    ) -> None:
        if self._jsonl is not None:
            row: dict[str, Any] = {"step": step, **self.tags, **scalars}
            if histograms:
                row["histograms"] = {k: _counts(v) for k, v in histograms.items()}
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            for k, values in (histograms or {}).items():
                if values:
                    self._tb.add_histogram(k, np.asarray(values), step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def log_held_out(self, step: int, label: str, scalars: dict[str, float]) -> None:
        """A held-out evaluation as a JSONL row of its own: ``{"step", "held_out": label,
        "eval/...": ...}``, written for every stage (``base``, ``warm_start``, ``step-N``,
        ``final``). Such a row is not a training step: readers that chart steps skip rows
        carrying ``held_out``. (``step-N`` results are also in that step's own row.)"""
        if self._jsonl is not None and scalars:
            row = {"step": step, "held_out": label, **self.tags, **scalars}
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _counts(values: list[float]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        key = str(int(v)) if float(v).is_integer() else f"{v:.3g}"
        out[key] = out.get(key, 0) + 1
    return out
