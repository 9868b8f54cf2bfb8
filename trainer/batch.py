"""Batch math of a training step: training samples with per-token advantages and loss
weights (``build_batch``), DAPO's overlong penalty, mini-batches (``split_batch``) and, for
a critic, GAE's inputs and targets (``add_gae``). The step that trains on the batch, and
the losses it hands the policy and the critic, are :mod:`areal_agents.trainer.step`'s."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from areal_agents.trainer.advantage import (
    completion_returns,
    completion_state_keys,
    group_advantages_of,
    overlong_penalty,
    step_group_advantages_of,
)
from areal_agents.trainer.algorithms import AlgorithmSpec, OverlongSpec
from areal_agents.trainer.critic import (
    GaeInputs,
    critic_targets,
    gae_inputs,
    turn_critic_targets,
)
from areal_agents.trainer.loss import loss_weights
from areal_agents.trajectory import UNMERGEABLE, Completion, Episode, TrainingSample


@dataclass(frozen=True)
class CompletionRef:
    """A completion of a training sample, as the ``train_tokens`` record needs it."""

    id: str
    ret: float
    """Its discounted return (the advantages' input; DAPO's overlong penalty included)."""
    merged: bool
    """Whether it merged into its parent's sample (``Episode.samples``' decision)."""
    merge_reason: str
    tokens: int
    """Its number of output tokens."""


@dataclass
class Batch:
    seqs: list[list[int]]
    mask: list[torch.Tensor]  # per sample, over tokens 1..n-1
    behav: list[torch.Tensor]
    versions: list[torch.Tensor]
    adv: list[torch.Tensor]
    weights: list[torch.Tensor]
    segments: list[torch.Tensor]
    prox: list[torch.Tensor] | None = None
    gae: GaeInputs | None = None
    """PPO: each sample's rewards, discounts and links; ``add_gae`` fills the rest."""
    old_values: list[torch.Tensor] | None = None
    returns: list[torch.Tensor] | None = None
    value_mask: list[torch.Tensor] | None = None
    """Where the value loss applies when not on every sampled token: turn-level GAE
    (``advantage.estimator: turn_gae``) trains the value of each turn's boundary only."""
    value_weights: list[torch.Tensor] | None = None
    """The value loss's weights with ``value_mask``: each boundary carries the summed loss
    weights of its turn's tokens, so each episode weighs in the value loss as in the policy's."""
    ref: list[torch.Tensor] | None = None
    """Reference-policy logprobs, for a KL penalty (``loss.kl_coef > 0``)."""
    completions: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Per sample, the index of each token's completion within it (-1: not sampled)."""
    episode_ids: list[str] = dataclasses.field(default_factory=list)
    """Per sample, the episode it comes from."""
    group_ids: list[str] = dataclasses.field(default_factory=list)
    """Per sample, its episode's group (the unit trainer ranks split the batch by)."""
    temps: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Per sample, over tokens 1..n-1, the temperature each token was sampled with (its
    completion's recorded ``sampling.temperature``; 1 where not sampled). The trainer scores
    every token at it, so an agent that sets its own temperature, or calls at several, keeps
    the behaviour and current logprobs on one scale."""
    sample_completions: list[list[CompletionRef]] = dataclasses.field(default_factory=list)
    """Per sample, its completions in the order ``completions`` indexes them."""

    def select(self, idx: list[int]) -> Batch:
        """The samples ``idx`` (in that order) with everything computed over the whole
        batch kept as it is: advantages, loss weights, proximal, reference and critic
        values (GAE inputs, already used, are dropped)."""

        def pick(xs: list[Any] | None) -> list[Any] | None:
            return None if xs is None else [xs[i] for i in idx]

        def some(xs: list[Any]) -> list[Any]:
            return [xs[i] for i in idx] if xs else []

        return Batch(
            seqs=some(self.seqs),
            mask=some(self.mask),
            behav=some(self.behav),
            versions=some(self.versions),
            adv=some(self.adv),
            weights=some(self.weights),
            segments=some(self.segments),
            prox=pick(self.prox),
            old_values=pick(self.old_values),
            returns=pick(self.returns),
            value_mask=pick(self.value_mask),
            value_weights=pick(self.value_weights),
            ref=pick(self.ref),
            completions=some(self.completions),
            episode_ids=some(self.episode_ids),
            group_ids=some(self.group_ids),
            temps=some(self.temps),
            sample_completions=some(self.sample_completions),
        )


def build_batch(
    episodes: list[Episode],
    spec: AlgorithmSpec,
    gamma: float,
    max_tokens: int,
    temperature: float = 1.0,
    trained_agents: Collection[str] = (),
) -> tuple[Batch, dict[str, float]]:
    """Training samples with per-token advantages and batch-normalized loss weights.

    ``temperature``: for completions that recorded none (the proxy records the one each call
    used; ``Batch.temps``).

    ``trained_agents`` (``agent.train``): when given, the tokens of completions made by any
    other agent (``Completion.agent``) are masked out: they stay in the prompts of later
    turns and in the returns, but carry no loss and no weight (``masked_completions``).

    With a critic (PPO) the advantages are left at 0 and ``batch.gae`` is set: pass the
    critic's values to ``add_gae``. With ``spec.overlong`` (DAPO) each completion's reward
    first gets the soft overlong penalty of its output length (``max_tokens`` = L_max).

    With ``advantage.estimator: step_group`` (GiGPO) the completions' advantages add the
    step-level part (``AdvantageSpec.step_group``) and the stats carry
    ``adv/step_group_share`` (the share of completions in step groups of more than one) and
    ``adv/env_state_share`` (the share anchored by the env's ``info["state_key"]``)."""
    overlong: dict[str, float] = {}
    if spec.overlong is not None:
        episodes, overlong = apply_overlong(episodes, spec.overlong, max_tokens)
    rows = completion_returns(episodes, gamma)
    step_stats: dict[str, float] = {}
    if spec.needs_critic:
        adv = torch.zeros_like(rows.returns)
    elif spec.advantage.estimator == "step_group":
        keys = completion_state_keys(episodes)
        adv, steps = step_group_advantages_of(
            spec.advantage, rows.returns, rows.group_ids, rows.episode_ids, keys, rows.roots
        )
        step_stats = {
            "adv/step_group_share": steps.share,
            "adv/env_state_share": sum(k.startswith("env:") for k in keys) / max(len(keys), 1),
        }
    else:
        adv = group_advantages_of(
            spec.advantage, rows.returns, rows.group_ids, rows.episode_ids, rows.roots
        )
    adv_of = dict(zip(rows.completion_ids, adv.tolist(), strict=True))
    seqs, tcs, sample_eps, sample_groups = [], [], [], []
    out = Batch([], [], [], [], [], [], [], gae=GaeInputs() if spec.needs_critic else None)
    merged = eligible = 0
    trained = set(trained_agents)
    masked_completions = 0
    for ep in episodes:
        temp_of = {c.id: _sampled_at(c, temperature) for c in ep.completions}
        masked = {c.id for c in ep.completions if trained and c.agent not in trained}
        masked_completions += len(masked)
        samples, merges = ep.samples(gamma)
        if masked:
            samples = [_masked(s, masked) for s in samples]
        merged += sum(1 for m in merges if m["merged"])
        eligible += sum(1 for m in merges if m["reason"] not in UNMERGEABLE)
        if out.gae is not None:
            out.gae.extend(gae_inputs(ep, samples, gamma))
        decision = {c.id: m for c, m in zip(ep.completions, merges, strict=True)}
        n_out = {c.id: len(c.output_ids) for c in ep.completions}
        for s in samples:
            out.sample_completions.append(
                [
                    CompletionRef(
                        cid, ret, decision[cid]["merged"], decision[cid]["reason"], n_out[cid]
                    )
                    for cid, ret in zip(s.completion_ids, s.returns, strict=True)
                ]
            )
            seqs.append(s.input_ids)
            tcs.append(s.token_completion[1:])
            sample_eps.append(ep.session_id)
            sample_groups.append(ep.group_id or ep.session_id)
            tok_adv = [
                adv_of[s.completion_ids[k]] if k >= 0 else 0.0 for k in s.token_completion[1:]
            ]
            out.mask.append(torch.tensor(s.loss_mask[1:], dtype=torch.float32))
            out.behav.append(torch.tensor(s.logprobs[1:], dtype=torch.float32))
            out.versions.append(torch.tensor(s.versions[1:]))
            out.adv.append(torch.tensor(tok_adv, dtype=torch.float32))
            out.segments.append(torch.tensor(s.token_completion[1:]))
            out.temps.append(
                torch.tensor(
                    [
                        temp_of[s.completion_ids[k]] if k >= 0 else 1.0
                        for k in s.token_completion[1:]
                    ],
                    dtype=torch.float32,
                )
            )
    out.seqs = seqs
    out.completions = [torch.tensor(t) for t in tcs]
    out.episode_ids = sample_eps
    out.group_ids = sample_groups
    out.weights = _loss_weights(out, spec, max_tokens)
    stats = {
        "adv_mean": float(adv.mean()),
        "adv_std": float(adv.std()) if adv.numel() > 1 else 0.0,
        "adv_abs_max": float(adv.abs().max()),
        "merge_rate": merged / eligible if eligible else 0.0,
        "samples": len(seqs),
        **overlong,
        **step_stats,
    }
    if trained:
        stats["masked_completions"] = masked_completions
    return out, stats


def _masked(sample: TrainingSample, masked: set[str]) -> TrainingSample:
    """``sample`` with the tokens of the ``masked`` completions out of the loss: mask 0 and
    completion index -1 (as for prompt tokens)."""
    off = {k for k, cid in enumerate(sample.completion_ids) if cid in masked}
    if not off:
        return sample
    drop = [k in off for k in sample.token_completion]
    return dataclasses.replace(
        sample,
        loss_mask=[0 if d else m for m, d in zip(sample.loss_mask, drop, strict=True)],
        token_completion=[
            -1 if d else k for k, d in zip(sample.token_completion, drop, strict=True)
        ],
    )


def _sampled_at(c: Completion, default: float) -> float:
    """The temperature ``c`` was sampled with (``default`` when it recorded none)."""
    t = c.sampling.get("temperature")
    return default if t is None else float(t)


def split_batch(batch: Batch, n: int, spec: AlgorithmSpec, max_tokens: int) -> list[Batch]:
    """The batch as ``n`` mini-batches of whole episodes, in order, for ``n`` optimizer
    steps (``train.minibatches``); fewer when it has fewer episodes.

    Advantages (and proximal, reference and critic values) are the whole batch's: a group's
    baseline does not change with the split. Only the loss weights are computed again over
    each mini-batch's own samples (``completion_weights``), so each mini-batch's loss is the
    mean of its own units, as a batch of that size would be. Episode k of E goes to
    mini-batch ``floor(k * n / E)``: with groups in order and n dividing their number, whole
    groups stay together."""
    if n < 1:
        raise ValueError(f"n: the number of mini-batches must be >= 1, got {n}")
    if not batch.episode_ids:
        raise ValueError("split_batch needs a batch from build_batch (it has no episode ids)")
    order = list(dict.fromkeys(batch.episode_ids))
    n = min(n, len(order))
    if n == 1:
        return [batch]
    part = {e: k * n // len(order) for k, e in enumerate(order)}
    out = []
    for j in range(n):
        mb = batch.select([i for i, e in enumerate(batch.episode_ids) if part[e] == j])
        mb.weights = _loss_weights(mb, spec, max_tokens)
        out.append(mb)
    return out


def _loss_weights(batch: Batch, spec: AlgorithmSpec, max_tokens: int) -> list[torch.Tensor]:
    """Per-sample loss weights normalized over ``batch``'s own samples."""
    tc = _pad(batch.completions, -1).long()
    w = loss_weights(spec.loss, tc, batch.episode_ids, max_tokens=max_tokens)
    return [w[i, : len(t)] for i, t in enumerate(batch.completions)]


def apply_overlong(
    episodes: list[Episode], spec: OverlongSpec, max_tokens: int
) -> tuple[list[Episode], dict[str, float]]:
    """Copies of ``episodes`` whose completions' rewards include DAPO's soft overlong
    penalty (``overlong_penalty`` of each completion's output length); the recorded
    episodes are left as they are. Returns the copies and the penalty's metrics."""
    comps = [c for ep in episodes for c in ep.completions]
    if not comps:
        return episodes, {}
    lengths = torch.tensor([len(c.output_ids) for c in comps])
    pens = overlong_penalty(lengths, max_tokens, spec.cache(max_tokens)).tolist()
    it = iter(pens)
    out = []
    for ep in episodes:
        copy_ = copy.copy(ep)
        copy_.completions = [
            dataclasses.replace(c, reward=c.reward + next(it)) for c in ep.completions
        ]
        out.append(copy_)
    return out, {
        "overlong_penalty_mean": sum(pens) / len(pens),
        "overlong_fraction": sum(p < 0 for p in pens) / len(pens),
    }


def add_gae(batch: Batch, values: list[torch.Tensor], spec: AlgorithmSpec) -> dict[str, float]:
    """PPO: per-token advantages and returns of ``batch`` by GAE from the critic's ``values``
    (``areal_agents.trainer.critic.critic_targets``; ``turn_critic_targets`` with
    ``advantage.estimator: turn_gae``, which also sets the value loss's ``value_mask`` and
    ``value_weights``); returns their metrics."""
    assert batch.gae is not None, "build_batch sets batch.gae for a critic algorithm"
    critic = spec.critic
    assert critic is not None, "add_gae is for an algorithm with a critic"
    if spec.advantage.estimator == "turn_gae":
        batch.adv, batch.returns, batch.value_mask, stats = turn_critic_targets(
            batch.gae, values, batch.mask, batch.segments, critic
        )
        batch.value_weights = [
            _turn_weights(w, seg, b)
            for w, seg, b in zip(batch.weights, batch.segments, batch.value_mask, strict=True)
        ]
    else:
        batch.adv, batch.returns, stats = critic_targets(batch.gae, values, batch.mask, critic)
    batch.old_values = values
    return stats


def _turn_weights(
    weights: torch.Tensor, segments: torch.Tensor, bounds: torch.Tensor
) -> torch.Tensor:
    """``weights`` summed over each turn's tokens, put on the turn's boundary."""
    out = torch.zeros_like(weights)
    for t in torch.nonzero(bounds).flatten().tolist():
        out[t] = weights[segments == segments[t]].sum()
    return out


def _pad(xs: list[torch.Tensor], value: float = 0.0) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(xs, batch_first=True, padding_value=value)
