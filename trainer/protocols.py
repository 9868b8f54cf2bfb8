"""What a training step needs of the models it trains: the :class:`Policy` and :class:`Critic`
protocols, and the losses they take (:class:`PolicyLoss`, :class:`CriticLoss`).

The classes that meet them do so structurally (none names a protocol):

* ``areal_agents.trainer.policy.Policy`` and ``areal_agents.trainer.critic.Critic``: the
  models in this process (or, on a trainer rank, that rank's shards of them);
* ``areal_agents.trainer.distributed.DistributedPolicy`` and ``DistributedCritic``: rank 0's
  handles on the models of every trainer rank, which send each call to all ranks with that
  rank's part of the data;
* ``areal_agents.trainer.time_budget.TimeBoxed`` (:class:`Trainable` only): the policy as
  the warm start sees it under ``train.time_limit_min``.

A loss is data as much as a function. The step builds it over the whole batch
(:mod:`areal_agents.trainer.step`); the model evaluates it on each micro-batch, between the
forward and the backward pass, wherever the weights are: on a trainer rank, each rank gets
its part of it (``select``, by whole groups: ``group_ids``).

tests/trainer/test_step_protocols.py checks that each of these classes has every method with
the protocol's parameters; mypy checks the types, with ``disallow_any_explicit`` for this
module, the step and the loop (pyproject.toml).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, TypeAlias

import torch

from areal_agents.engines.protocol import WeightUpdate

Temperature: TypeAlias = float | Sequence[torch.Tensor]
"""One sampling temperature for every token, or per sequence one per token 1..n-1 (the
temperature each token was sampled with; ``Batch.temps``)."""


class PolicyLoss(Protocol):
    """A policy loss over a batch's samples, as ``Policy.train_step`` evaluates it: called
    on each micro-batch with the indices of its samples (``items``), their token logprobs
    and their entropies (over tokens 1..n-1), it returns the micro-batch's loss and its
    stats (token-weighted sums, which add up over micro-batches and ranks)."""

    @property
    def group_ids(self) -> list[str]:
        """Per sample, its group: trainer ranks split the samples by whole groups."""
        ...

    def select(self, idx: list[int]) -> PolicyLoss:
        """The loss of samples ``idx`` only (its items then index ``idx``), with everything
        computed over the whole batch (weights, advantages) kept as it is."""
        ...

    def __call__(
        self, items: list[int], logps: list[torch.Tensor], ents: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


class CriticLoss(Protocol):
    """A value loss over a batch's samples, as ``Critic.train_step`` evaluates it: called on
    each micro-batch with its samples' indices and their values (tokens 0..n-2)."""

    @property
    def group_ids(self) -> list[str]: ...

    def select(self, idx: list[int]) -> CriticLoss: ...

    def __call__(
        self, items: list[int], values: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


class Trainable(Protocol):
    """What a warm start trains (``areal_agents.trainer.sft.run_sft``)."""

    def set_lr(self, lr: float) -> None:
        """Every parameter group's learning rate, until the schedule's next step."""
        ...

    def train_step(
        self,
        seqs: Sequence[Sequence[int]],
        loss_fn: PolicyLoss,
        temperature: Temperature,
        micro_batch_tokens: int = 4096,
        needed: Sequence[torch.Tensor] | None = None,
        entropy_grad: bool = False,
    ) -> dict[str, float]:
        """One optimizer step over ``seqs``: per micro-batch a forward pass, ``loss_fn`` on
        its logprobs and entropies (with gradient if ``entropy_grad``), a backward pass;
        then the clipped gradient's step. Returns ``loss_fn``'s summed stats with
        ``micro_batches`` and ``grad_norm``."""
        ...


class Policy(Trainable, Protocol):
    """The model being trained, its optimizer, and how its weights reach the engine."""

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step uses."""
        ...

    @property
    def model(self) -> torch.nn.Module:
        """The trained module (this process's; rank 0's with trainer ranks)."""
        ...

    @property
    def vocab_size(self) -> int:
        """The rows of the model's input embeddings (the token ids it reads)."""
        ...

    def logprobs(
        self,
        seqs: Sequence[Sequence[int]],
        temperature: Temperature,
        micro_batch_tokens: int = 4096,
        needed: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Per sequence, the logprob of tokens 1..n-1 given their prefix (no gradient)."""
        ...

    def ref_logprobs(
        self,
        seqs: Sequence[Sequence[int]],
        temperature: Temperature,
        micro_batch_tokens: int = 4096,
        needed: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """:meth:`logprobs` under the reference policy (a KL penalty)."""
        ...

    def step_schedule(self) -> None:
        """Advance the learning-rate schedule by one training step."""
        ...

    def reset_optimizer(self, lr: float) -> None:
        """A fresh optimizer state and schedule, peak ``lr`` (after a warm start)."""
        ...

    def weight_update(self, version: int) -> WeightUpdate:
        """The current weights for the inference engine, tagged ``version``."""
        ...

    def save(self, directory: str | Path) -> None: ...

    def load(self, directory: str | Path) -> None: ...

    def export(
        self, directory: str | Path, tokenizer_dir: str | Path, merge_lora: bool = True
    ) -> Path:
        """A transformers directory that ``areal-agent serve --model`` loads."""
        ...


class Critic(Protocol):
    """PPO's value model and its optimizer."""

    @property
    def lr(self) -> float: ...

    def values(
        self, seqs: Sequence[Sequence[int]], micro_batch_tokens: int = 4096
    ) -> list[torch.Tensor]:
        """Per sequence, the value at tokens 0..n-2 (no gradient)."""
        ...

    def train_step(
        self, seqs: Sequence[Sequence[int]], loss_fn: CriticLoss, micro_batch_tokens: int = 4096
    ) -> dict[str, float]:
        """One optimizer step over ``seqs`` on ``loss_fn``; its summed stats with
        ``value_grad_norm``."""
        ...

    def step_schedule(self) -> None: ...

    def save(self, directory: str | Path) -> None: ...

    def load(self, directory: str | Path) -> None: ...
