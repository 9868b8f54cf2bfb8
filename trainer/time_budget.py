"""``train.time_limit_min``: the one budget a run's warm start and RL steps share.

The clock starts when the run starts (a resumed run carries the seconds it had already
spent, ``RunState.elapsed_s``). The warm start trains a batch only while that batch is
expected to end within the budget (:class:`TimeBoxed`); RL checks before every step,
the first included, and stops when the next step would end past the limit
(:func:`out_of_time_budget`), after which the last checkpoint is written. The final held-out
evaluation and the export of the final model come after the budget: they are not cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from areal_agents.trainer.protocols import PolicyLoss, Temperature, Trainable

__all__ = ["TimeBoxed", "out_of_time_budget"]


def out_of_time_budget(elapsed_s: float, recent_steps_s: list[float], limit_s: float) -> bool:
    """Whether to stop before another step: the budget is spent, or the next step, taking as
    long as the longest of the recent ones, would end after it (so the last checkpoint falls
    inside ``train.time_limit_min`` rather than one step past it). The longest, not the mean:
    RL step times are heavy-tailed (a step waits for enough non-uniform groups), and a budget
    is a bound, so the estimate errs on the side of one step fewer."""
    if elapsed_s >= limit_s:
        return True
    if not recent_steps_s:
        return False
    return elapsed_s + max(recent_steps_s) > limit_s


class TimeBoxed:
    """The policy as ``run_sft`` sees it under ``train.time_limit_min`` (it calls only
    ``set_lr`` and ``train_step``): a batch trains only while it is expected to end within
    the budget (the next one taken to last as long as the longest so far, the rule of the RL
    steps: :func:`out_of_time_budget`); every batch after that is skipped, so the warm start
    ends within the budget and RL gets what is left of it."""

    def __init__(self, policy: Trainable, elapsed: Callable[[], float], limit_s: float) -> None:
        self.policy = policy
        self.elapsed = elapsed
        self.limit_s = limit_s
        self.steps = 0
        self.skipped = 0
        self._longest: list[float] = []
        self._last: dict[str, float] = {"nll": 0.0}

    def set_lr(self, lr: float) -> None:
        self.policy.set_lr(lr)

    def train_step(
        self,
        seqs: Sequence[Sequence[int]],
        loss_fn: PolicyLoss,
        temperature: Temperature,
        micro_batch_tokens: int = 4096,
        needed: Sequence[torch.Tensor] | None = None,
        entropy_grad: bool = False,
    ) -> dict[str, float]:
        if self.skipped or out_of_time_budget(self.elapsed(), self._longest, self.limit_s):
            self.skipped += 1
            return self._last
        t0 = self.elapsed()
        self._last = self.policy.train_step(
            seqs, loss_fn, temperature, micro_batch_tokens, needed, entropy_grad
        )
        self._longest = [max([*self._longest, self.elapsed() - t0])]
        self.steps += 1
        return self._last

    def stats(self) -> dict[str, float]:
        """``sft_steps`` (the batches trained) and, when the budget cut the warm start
        short, ``sft_skipped_batches``; no ``sft_nll`` when no batch trained."""
        out = {"sft_steps": float(self.steps)}
        if self.skipped:
            out["sft_skipped_batches"] = float(self.skipped)
        return out
