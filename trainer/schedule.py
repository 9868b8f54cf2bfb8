"""The learning-rate schedule of ``optim``: linear warmup, then constant, linear or cosine.

The schedule counts training steps (policy versions, ``train.steps``): every update of one
step (``train.minibatches`` of them) uses the same rate. With peak rate ``lr``, ``W =
warmup_steps`` and ``T = total_steps`` (``train.steps`` when unset), training step ``k + 1``
(``k`` = steps done before it, 0-based) uses ``lr * f(k)``::

    k < W:   f = (k + 1) / W                  warmup: lr / W at step 1, ..., lr at step W
    k >= W:  p = min((k - W) / (T - W), 1)    decay progress, 0 at the step after warmup
             constant: f = 1
             linear:   f = 1 - p
             cosine:   f = (1 + cos(pi * p)) / 2

so no step of the warmup runs at rate 0, the first step after it runs at ``lr``, and the
decay reaches 0 at step ``T + 1``, just after the schedule ends (steps past ``T`` run at 0
with linear and cosine). ``torch.optim.lr_scheduler.LambdaLR`` applies ``f``; its state (the
step count) is checkpointed with the optimizer, so a resumed run continues the schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

ScheduleKind = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True)
class LrSchedule:
    """``optim.schedule``, ``optim.warmup_steps`` and ``optim.total_steps`` (resolved)."""

    kind: ScheduleKind = "constant"
    warmup_steps: int = 0
    total_steps: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "linear", "cosine"):
            raise ValueError(f"schedule must be constant, linear or cosine, got {self.kind!r}")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(
                f"warmup_steps must be in [0, total_steps={self.total_steps}], "
                f"got {self.warmup_steps}"
            )

    def factor(self, k: int) -> float:
        """The multiplier of the peak rate at training step ``k + 1`` (module docstring)."""
        w, t = self.warmup_steps, self.total_steps
        if k < w:
            return (k + 1) / w
        if self.kind == "constant":
            return 1.0
        p = 1.0 if k >= t else (k - w) / (t - w)
        if self.kind == "linear":
            return 1.0 - p
        return 0.5 * (1.0 + math.cos(math.pi * p))

    def scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """A ``LambdaLR`` on ``optimizer`` that applies :meth:`factor`; step it once per
        training step."""
        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.factor)
