"""One training step on a batch, and the losses it trains on: the step's home.

The path of one batch from its source to the optimizer, in order (``module.function``; the
modules are those of ``areal_agents.trainer``, the policy and critic their
:mod:`~areal_agents.trainer.protocols`):

1. ``loop.Trainer._next_batch``: ``rollout.GroupSource.next_batch`` hands over the next
   ``rollout.batch_size`` groups, each ``rollout.group_size`` episodes of one task.
2. ``loop.Trainer._train_step``: ``batch.build_batch`` turns their episodes into training
   samples with per-token masks, behaviour logprobs, versions, advantages (the algorithm's
   estimator, :mod:`~areal_agents.trainer.advantage`) and loss weights.
3. ``step.train_on_batch``, the step itself (this module):
   a. ``Policy.logprobs``: the proximal logprobs (``loss.proximal=recompute``);
   b. ``step.measure_mismatch``: the training-inference mismatch
      (``mismatch.mismatch_stats``);
   c. ``Policy.ref_logprobs``: the reference logprobs (a KL penalty);
   d. ``Critic.values``, then ``batch.add_gae``: GAE advantages and returns (PPO).
4. ``step.policy_updates``: ``batch.split_batch`` into ``train.minibatches`` mini-batches,
   each with its loss (``step.make_loss_fn``: a :class:`BatchLoss`), then for every epoch
   and mini-batch ``step.apply_update`` -> ``Policy.train_step``: per micro-batch the
   forward pass, the mini-batch's ``BatchLoss`` (-> ``loss.policy_loss``), the backward
   pass; then the optimizer step. Then ``Policy.step_schedule``.
5. ``Critic.train_step`` on ``step.make_value_loss_fn``'s ``critic.ValueLoss``
   (-> ``loss.value_loss``), then ``Critic.step_schedule`` (PPO).
6. Back in ``loop.Trainer._train_step``: the step's metrics, and
   ``step.record_train_tokens`` (what the loss did with every token, for the episode
   store); then ``loop.Trainer._publish`` sends the new weights to the engine.

The loop calls the step, the step calls the rest; nothing calls back into the loop or
``batch``. The step builds both losses and hands them to the models, which evaluate them on
each micro-batch between the forward and the backward pass (on a trainer rank, its part of
them: :mod:`areal_agents.trainer.distributed`); the models know them only as the
:mod:`~areal_agents.trainer.protocols`' ``PolicyLoss`` / ``CriticLoss``.

Every function returns what it made: :func:`train_on_batch` a :class:`StepResult`,
:func:`policy_updates` an :class:`Updates`. :class:`Update` is one optimizer step's inputs,
kept to run again while the next batch is not in (``train.fill_passes``,
:func:`apply_update`).

Every step also measures the training-inference mismatch (:mod:`areal_agents.trainer.mismatch`)
on its fresh tokens, those sampled by the weights the trainer holds (version ``version``): the
engine's logprob against the trainer's own, ``batch.prox`` with ``loss.proximal=recompute``
(already computed), else one more forward pass over the samples that have a fresh token
(none: no pass). Its ``mismatch/*`` metrics go into ``StepResult.batch_stats``.

With ``record`` the policy loss also keeps what it did with every sample's tokens
(:class:`SampleTokens`); :func:`train_token_rows` makes them the episode store's
``train_tokens`` rows.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from areal_agents.trainer.algorithms import AlgorithmSpec
from areal_agents.trainer.batch import Batch, CompletionRef, add_gae, split_batch
from areal_agents.trainer.config import TrainConfig
from areal_agents.trainer.critic import ValueLoss
from areal_agents.trainer.loss import approx_proximal_logp, policy_loss
from areal_agents.trainer.mismatch import mismatch_stats
from areal_agents.trainer.protocols import Critic, Policy

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- the step
@dataclass(frozen=True)
class StepResult:
    """What :func:`train_on_batch` did."""

    stats: dict[str, float]
    """The policy updates' stats (see :class:`Updates`) and the critic step's."""
    batch_stats: dict[str, float]
    """Measured on the batch before the updates: the training-inference mismatch
    (``mismatch/*``), GAE's metrics and the critic's ``value_loss`` (PPO)."""
    updates: tuple[Update, ...]
    """The policy's updates (:attr:`Updates.updates`)."""
    records: tuple[SampleTokens, ...]
    """Each sample's per-token record (:attr:`Updates.records`); none without ``record``."""


def train_on_batch(
    policy: Policy,
    critic: Critic | None,
    batch: Batch,
    spec: AlgorithmSpec,
    cfg: TrainConfig,
    version: int,
    *,
    record: bool = False,
) -> StepResult:
    """One training step on ``batch`` (steps 3 to 5 of the module docstring): the proximal
    logprobs (``loss.proximal=recompute``), the training-inference mismatch
    (:func:`measure_mismatch`), the reference logprobs (a KL penalty), the critic's values
    and GAE (PPO), the policy's updates (:func:`policy_updates`; ``record``: the losses keep
    each sample's per-token record), then the critic's step. ``batch`` gets the logprobs,
    values and GAE's advantages and returns."""
    temp = batch.temps  # each token at the temperature it was sampled with
    mbt = cfg.train.micro_batch_tokens
    if spec.loss.proximal == "recompute":
        batch.prox = policy.logprobs(batch.seqs, temp, mbt, batch.mask)
    batch_stats = measure_mismatch(policy, batch, spec, cfg, version)
    if spec.loss.kl_coef > 0:
        batch.ref = policy.ref_logprobs(batch.seqs, temp, mbt, batch.mask)
    if critic is not None:
        batch_stats.update(add_gae(batch, critic.values(batch.seqs, mbt), spec))
    done = policy_updates(policy, batch, spec, cfg, version, record=record)
    stats = dict(done.stats)
    if critic is not None:
        vstats = critic.train_step(batch.seqs, make_value_loss_fn(batch, spec), mbt)
        stats.update(vstats)
        batch_stats["value_loss"] = vstats["value_loss"]
        critic.step_schedule()
    return StepResult(stats, batch_stats, done.updates, done.records)


def measure_mismatch(
    policy: Policy, batch: Batch, spec: AlgorithmSpec, cfg: TrainConfig, version: int
) -> dict[str, float]:
    """The ``mismatch/*`` metrics of ``batch`` before any update (see
    :mod:`areal_agents.trainer.mismatch`): its tokens of version ``version`` are fresh. The
    trainer's logprobs are ``batch.prox`` when recomputed; otherwise a forward pass of
    ``policy`` over the samples with a fresh token, none when no sample has one."""
    fresh = [v == version for v in batch.versions]
    if spec.loss.proximal == "recompute":
        assert batch.prox is not None, "train_on_batch computes batch.prox first"
        trainer_logp = batch.prox
    else:
        idx = [
            i for i, (f, m) in enumerate(zip(fresh, batch.mask, strict=True)) if (f & (m > 0)).any()
        ]
        # A sample without a fresh token keeps the engine's logprobs: they are not read.
        trainer_logp = list(batch.behav)
        if idx:
            sub = batch.select(idx)
            temps = sub.temps or cfg.sampling.temperature
            scored = policy.logprobs(sub.seqs, temps, cfg.train.micro_batch_tokens, sub.mask)
            for i, lp in zip(idx, scored, strict=True):
                trainer_logp[i] = lp
    return mismatch_stats(trainer_logp, batch.behav, batch.mask, fresh, spec.loss.behaviour_cap)


@dataclass(frozen=True)
class Updates:
    """What :func:`policy_updates` did."""

    stats: dict[str, float]
    """The updates' stats added up (token-weighted sums, micro-batches), except the losses
    and the gradient norm: the mean over the updates."""
    updates: tuple[Update, ...]
    """One pass's updates in order, to run again with :func:`apply_update`
    (``train.fill_passes``)."""
    records: tuple[SampleTokens, ...]
    """With ``record``, every sample's per-token record as the first pass trained it, in the
    mini-batches' order; else none."""


def policy_updates(
    policy: Policy,
    batch: Batch,
    spec: AlgorithmSpec,
    cfg: TrainConfig,
    version: int,
    *,
    record: bool = False,
) -> Updates:
    """One optimizer step per mini-batch of ``batch`` (``train.minibatches``, see
    ``split_batch``), the mini-batches in order ``train.epochs`` times (PPO's epochs: mini-batch
    ``j`` of pass ``e`` is update ``e * minibatches + j``). With ``record``, the losses record
    (``BatchLoss(record=True)``)."""
    parts = split_batch(batch, cfg.train.minibatches, spec, cfg.sampling.max_new_tokens)
    # One loss per mini-batch for all passes: its records keep the first pass's values.
    updates = tuple(Update(mb, make_loss_fn(mb, spec, cfg, version, record=record)) for mb in parts)
    totals: dict[str, float] = {}
    for _ in range(cfg.train.epochs):
        for update in updates:
            for k, v in apply_update(policy, update, spec, cfg).items():
                totals[k] = totals.get(k, 0.0) + float(v)
    records = tuple(u.loss_fn.records[i] for u in updates for i in sorted(u.loss_fn.records))
    for k in (*ADDITIVE_STATS, "grad_norm"):
        if k in totals:
            totals[k] /= len(parts) * cfg.train.epochs
    policy.step_schedule()  # once per training step: every mini-batch used the same rate
    return Updates(totals, updates, records)


@dataclass
class Update:
    """One optimizer step's inputs: a mini-batch and its loss."""

    batch: Batch
    loss_fn: BatchLoss


def apply_update(
    policy: Policy, update: Update, spec: AlgorithmSpec, cfg: TrainConfig
) -> dict[str, float]:
    """One optimizer step of ``policy`` on ``update``; returns the step's stats."""
    mb = update.batch
    return policy.train_step(
        mb.seqs,
        update.loss_fn,
        mb.temps or cfg.sampling.temperature,
        cfg.train.micro_batch_tokens,
        mb.mask,
        spec.loss.entropy_coef > 0,
    )


# ---------------------------------------------------------------------------- the losses
ADDITIVE_STATS = frozenset({"loss", "policy_loss"})
"""Policy-loss stats that are already batch-weighted sums (the rest are per-token means)."""


def make_loss_fn(
    batch: Batch, spec: AlgorithmSpec, cfg: TrainConfig, version: int, *, record: bool = False
) -> BatchLoss:
    """The callback ``Policy.train_step`` calls for each micro-batch (``record``: keep each
    sample's per-token loss values, see :class:`BatchLoss`)."""
    return BatchLoss(batch, spec, cfg, version, record)


RECORDED = (
    "advantage",
    "logp",
    "prox_logp",
    "behaviour_weight",
    "clipped",
    "behaviour_clipped",
)
"""The per-token values of ``policy_loss`` (its ``tokens``) that a record keeps, in the order
of :attr:`SampleTokens.values`' rows."""


@dataclass
class SampleTokens:
    """What the loss did with one training sample's tokens (over tokens 1..n-1)."""

    session_id: str
    completions: list[CompletionRef]
    segments: torch.Tensor
    """The index in ``completions`` of each token's completion (-1: not sampled)."""
    mask: torch.Tensor
    """The loss mask."""
    values: torch.Tensor
    """``[len(RECORDED), n - 1]`` float32: the :data:`RECORDED` values (flags as 0 / 1)."""


@dataclass
class BatchLoss:
    """The policy loss of ``batch``'s samples as the ``Policy.train_step`` callback:
    ``(item indices, per-item logprobs, per-item entropies) -> (loss, stats)``. A plain
    object (not a closure), so that :meth:`select` can send a trainer rank its part.

    With ``record``, each call also keeps, for every sample it sees for the first time, the
    per-token values ``policy_loss`` computed (:data:`RECORDED`) as a :class:`SampleTokens`
    in ``records`` (by sample index): what the first mini-batch, micro-batch and epoch that
    saw the sample trained it with. A training step sees each sample once; a loss called
    again on the same sample (a second pass) keeps the first record."""

    batch: Batch
    spec: AlgorithmSpec
    cfg: TrainConfig
    version: int
    record: bool = False
    records: dict[int, SampleTokens] = dataclasses.field(default_factory=dict)

    @property
    def group_ids(self) -> list[str]:
        return self.batch.group_ids

    def select(self, idx: list[int]) -> BatchLoss:
        """The loss of samples ``idx`` only, with the whole batch's weights and advantages
        (items then index ``idx``); it records if this one does, starting empty."""
        return BatchLoss(self.batch.select(idx), self.spec, self.cfg, self.version, self.record)

    def _keep(self, items: list[int], tokens: dict[str, torch.Tensor]) -> None:
        """Records of the samples among ``items`` not recorded yet (one copy to the CPU)."""
        new = [k for k, i in enumerate(items) if i not in self.records]
        if not new:
            return
        rows = torch.tensor(new, device=tokens["logp"].device)
        values = torch.stack([tokens[name].float() for name in RECORDED])[:, rows].cpu()
        batch = self.batch
        for j, k in enumerate(new):
            i = items[k]
            self.records[i] = SampleTokens(
                session_id=batch.episode_ids[i],
                completions=batch.sample_completions[i],
                segments=batch.completions[i],
                mask=batch.mask[i],
                values=values[:, j, : len(batch.mask[i])].clone(),
            )

    def __call__(
        self, items: list[int], logps: list[torch.Tensor], ents: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        batch, spec, cfg, version = self.batch, self.spec, self.cfg, self.version
        logp = _pad(logps)
        dev = logp.device  # the batch lives on the CPU; the policy may not

        def rows(xs: list[torch.Tensor], value: float = 0.0) -> torch.Tensor:
            return _pad([xs[i] for i in items], value).to(dev)

        mask, behav = rows(batch.mask), rows(batch.behav)
        extra = {"ref_logp": rows(batch.ref)} if batch.ref is not None else {}
        if spec.loss.entropy_coef > 0:
            if not any(e.requires_grad for e in ents):
                raise ValueError(
                    "loss.entropy_coef > 0 needs entropies with gradient: call "
                    "Policy.train_step(..., entropy_grad=True)"
                )
            extra["entropy"] = _pad(ents)
        if spec.loss.proximal == "recompute":
            assert batch.prox is not None
            prox = rows(batch.prox)
        else:
            prox = approx_proximal_logp(behav, logp, rows(batch.versions), version + 1, version)
        tokens: dict[str, torch.Tensor] | None = {} if self.record else None
        loss, stats = policy_loss(
            logp,
            behav,
            prox,
            rows(batch.adv),
            mask,
            spec.loss,
            tokens=tokens,
            weights=rows(batch.weights),
            segment_ids=rows(batch.segments, -1).long(),
            max_tokens=cfg.sampling.max_new_tokens,
            **extra,
        )
        n = float(mask.sum())
        # Per-token means become token-weighted sums, so that summing over micro-batches and
        # dividing by the batch's tokens gives the batch mean (losses already add up).
        stats = {k: v if k in ADDITIVE_STATS else v * n for k, v in stats.items()}
        stats["entropy_sum"] = float((_pad(ents) * mask).sum())
        stats["tokens"] = n
        if tokens is not None:
            self._keep(items, tokens)
        return loss, stats


def make_value_loss_fn(batch: Batch, spec: AlgorithmSpec) -> ValueLoss:
    """The callback ``Critic.train_step`` calls for each micro-batch (after ``add_gae``)."""
    assert batch.old_values is not None and batch.returns is not None, "call add_gae first"
    mask = batch.mask if batch.value_mask is None else [m.float() for m in batch.value_mask]
    weights = batch.weights if batch.value_weights is None else batch.value_weights
    assert spec.critic is not None, "make_value_loss_fn is for an algorithm with a critic"
    clip = spec.critic.value_clip
    return ValueLoss(clip, batch.old_values, batch.returns, mask, weights, batch.group_ids)


def _pad(xs: list[torch.Tensor], value: float = 0.0) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(xs, batch_first=True, padding_value=value)


# ---------------------------------------------------------------------------- the records
def train_token_rows(
    records: Iterable[SampleTokens], step: int, version: int
) -> list[dict[str, object]]:
    """The episode store's ``train_tokens`` rows of a training step (``EpisodeStore.
    put_train_tokens``): one per completion with at least one token in the loss, its
    arrays aligned with its output tokens. A completion's tokens sit at the end of its
    sample's positions where ``segments`` names it, so its ``tokens - m`` first outputs
    (m recorded; more than 0 only for an output token at position 0, which has no
    logprob) and every token outside the loss mask are NaN, their flags False."""
    floats = RECORDED.index("clipped")
    out = []
    for rec in records:
        for k, ref in enumerate(rec.completions):
            pos = (rec.segments == k).nonzero().squeeze(1)
            keep = rec.mask[pos] > 0
            if not bool(keep.any()):
                continue
            m, n = int(pos.numel()), ref.tokens
            if m > n:
                raise ValueError(
                    f"completion {ref.id!r}: {m} recorded tokens for {n} output tokens"
                )
            vals = rec.values[:, pos].double()
            arr = torch.full((len(RECORDED), n), math.nan, dtype=torch.float64)
            arr[:, n - m :] = torch.where(keep, vals, torch.full_like(vals, math.nan))
            flags = arr[floats:] > 0  # NaN > 0 is False
            row: dict[str, object] = {
                "session_id": rec.session_id,
                "completion_id": ref.id,
                "step": step,
                "version": version,
                "ret": ref.ret,
                "merged": ref.merged,
                "merge_reason": ref.merge_reason,
                "advantages": arr[0].tolist(),
                "train_logprobs": arr[1].tolist(),
                "prox_logprobs": arr[2].tolist(),
                "behaviour_weights": arr[3].tolist(),
                "clipped": flags[0].tolist(),
                "behaviour_clipped": flags[1].tolist(),
            }
            out.append(row)
    return out


class TrainTokenStore(Protocol):
    """Where a step's records go: the run's episode store (``EpisodeStore``)."""

    def put_train_tokens(
        self, rows: list[dict[str, object]]
    ) -> concurrent.futures.Future[object]: ...


def record_train_tokens(
    store: TrainTokenStore, records: Sequence[SampleTokens], version: int
) -> concurrent.futures.Future[object]:
    """Queue the ``train_tokens`` rows of the step that trained policy ``version`` (step
    ``version + 1``) in ``store``; returns the write's future (a failed write is logged,
    the run goes on: the records are for inspection)."""
    fut = store.put_train_tokens(train_token_rows(records, version + 1, version))

    def report(done: concurrent.futures.Future[object]) -> None:
        if not done.cancelled() and done.exception() is not None:
            log.warning("train_tokens of step %d not stored: %r", version + 1, done.exception())

    fut.add_done_callback(report)
    return fut
