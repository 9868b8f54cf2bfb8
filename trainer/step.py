"""One training step on a batch: the passes before the update, the updates, the critic's.

:func:`train_on_batch` runs a step as the loop does (:mod:`areal_agents.trainer.loop`): the
proximal logprobs (``loss.proximal=recompute``), the reference logprobs (a KL penalty), the
critic's values and GAE (PPO), the policy's updates over the mini-batches and epochs
(:func:`policy_updates`), then the critic's step. :class:`Update` is one optimizer step's
inputs, kept to run again while the next batch is not in (``train.fill_passes``,
:func:`apply_update`). :func:`record_train_tokens` queues the step's per-token records in the
run's episode store.

Every step also measures the training-inference mismatch (:mod:`areal_agents.trainer.mismatch`)
on its fresh tokens, those sampled by the weights the trainer holds (version ``version``): the
engine's logprob against the trainer's own, ``batch.prox`` with ``loss.proximal=recompute``
(already computed), else one more forward pass over the samples that have a fresh token
(none: no pass). Its ``mismatch/*`` metrics go into ``bstats``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from areal_agents.trainer.algorithms import AlgorithmSpec
from areal_agents.trainer.batch import (
    ADDITIVE_STATS,
    Batch,
    SampleTokens,
    add_gae,
    make_loss_fn,
    make_value_loss_fn,
    split_batch,
    train_token_rows,
)
from areal_agents.trainer.config import TrainConfig
from areal_agents.trainer.mismatch import mismatch_stats

log = logging.getLogger(__name__)


def record_train_tokens(store: Any, records: list[SampleTokens], version: int) -> Any:
    """Queue the ``train_tokens`` rows of the step that trained policy ``version`` (step
    ``version + 1``) in ``store``; returns the write's future (a failed write is logged,
    the run goes on: the records are for inspection)."""
    fut = store.put_train_tokens(train_token_rows(records, version + 1, version))

    def report(done: Any) -> None:
        if not done.cancelled() and done.exception() is not None:
            log.warning("train_tokens of step %d not stored: %r", version + 1, done.exception())

    fut.add_done_callback(report)
    return fut


def train_on_batch(
    policy: Any,
    critic: Any,
    batch: Batch,
    bstats: dict[str, float],
    spec: AlgorithmSpec,
    cfg: TrainConfig,
    version: int,
    records: list[SampleTokens] | None = None,
    keep: list[Update] | None = None,
) -> dict[str, float]:
    """One training step on ``batch``: the proximal logprobs (``loss.proximal=recompute``),
    the reference logprobs (a KL penalty), the critic's values and GAE (PPO), the policy's
    updates (:func:`policy_updates`), then the critic's. Returns their summed stats;
    ``bstats`` gets the training-inference mismatch (:func:`measure_mismatch`), the GAE
    metrics and the value loss. ``records`` (a list) gets the per-token record of every
    sample, ``keep`` (a list) the updates (see :func:`policy_updates`)."""
    temp = batch.temps  # each token at the temperature it was sampled with
    mbt = cfg.train.micro_batch_tokens
    if cfg.loss.proximal == "recompute":
        batch.prox = policy.logprobs(batch.seqs, temp, mbt, batch.mask)
    bstats.update(measure_mismatch(policy, batch, spec, cfg, version))
    if spec.loss.kl_coef > 0:
        batch.ref = policy.ref_logprobs(batch.seqs, temp, mbt, batch.mask)
    if critic is not None:
        bstats.update(add_gae(batch, critic.values(batch.seqs, mbt), spec))
    stats = policy_updates(policy, batch, spec, cfg, version, records, keep)
    if critic is not None:
        vstats = critic.train_step(batch.seqs, make_value_loss_fn(batch, spec), mbt)
        stats.update(vstats)
        bstats["value_loss"] = vstats["value_loss"]
        critic.step_schedule()
    return stats


def measure_mismatch(
    policy: Any, batch: Batch, spec: AlgorithmSpec, cfg: TrainConfig, version: int
) -> dict[str, float]:
    """The ``mismatch/*`` metrics of ``batch`` before any update (see
    :mod:`areal_agents.trainer.mismatch`): its tokens of version ``version`` are fresh. The
    trainer's logprobs are ``batch.prox`` when recomputed; otherwise a forward pass of
    ``policy`` over the samples with a fresh token, none when no sample has one."""
    fresh = [v == version for v in batch.versions]
    if cfg.loss.proximal == "recompute":
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


def policy_updates(
    policy: Any,
    batch: Batch,
    spec: AlgorithmSpec,
    cfg: TrainConfig,
    version: int,
    records: list[SampleTokens] | None = None,
    keep: list[Update] | None = None,
) -> dict[str, float]:
    """One optimizer step per mini-batch of ``batch`` (``train.minibatches``, see
    ``split_batch``), the mini-batches in order ``train.epochs`` times (PPO's epochs: mini-batch
    ``j`` of pass ``e`` is update ``e * minibatches + j``). Their stats add up (token-weighted
    sums, micro-batches), except the losses and the gradient norm: the mean over the updates.
    With ``records`` (a list), the losses record (``BatchLoss(record=True)``) and the list
    gets every sample's record, as the first pass trained it. ``keep`` (a list) gets one
    pass's updates in order, to run again with :func:`apply_update` (``train.fill_passes``)."""
    parts = split_batch(batch, cfg.train.minibatches, spec, cfg.sampling.max_new_tokens)
    # One loss per mini-batch for all passes: its records keep the first pass's values.
    updates = [
        Update(mb, make_loss_fn(mb, spec, cfg, version, record=records is not None)) for mb in parts
    ]
    totals: dict[str, float] = {}
    for _ in range(cfg.train.epochs):
        for update in updates:
            for k, v in apply_update(policy, update, spec, cfg).items():
                totals[k] = totals.get(k, 0.0) + float(v)
    if keep is not None:
        keep.extend(updates)
    if records is not None:
        for u in updates:
            records.extend(u.loss_fn.records[i] for i in sorted(u.loss_fn.records))
    for k in (*ADDITIVE_STATS, "grad_norm"):
        if k in totals:
            totals[k] /= len(parts) * cfg.train.epochs
    policy.step_schedule()  # once per training step: every mini-batch used the same rate
    return totals


@dataclasses.dataclass
class Update:
    """One optimizer step's inputs: a mini-batch and its loss."""

    batch: Batch
    loss_fn: Any


def apply_update(policy: Any, update: Update, spec: AlgorithmSpec, cfg: TrainConfig) -> Any:
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
