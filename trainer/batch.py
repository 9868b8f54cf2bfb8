"""Batch math of a training step: training samples with per-token advantages and loss
weights (``build_batch``), DAPO's overlong penalty, GAE inputs for a critic, the loss
callbacks ``Policy.train_step`` and ``Critic.train_step`` call per micro-batch, and the
per-token record of what the loss did (``BatchLoss(record=True)``, ``train_token_rows``)
for the episode store's ``train_tokens`` table."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from areal_agents.trainer.advantage import completion_returns, completion_state_keys
from areal_agents.trainer.algorithms import AlgorithmSpec, OverlongSpec
from areal_agents.trainer.config import TrainConfig
from areal_agents.trainer.critic import (
    GaeInputs,
    ValueLoss,
    critic_targets,
    gae_inputs,
    turn_critic_targets,
)
from areal_agents.trainer.loss import approx_proximal_logp
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
        adv, steps = spec.advantage.step_group(
            rows.returns, rows.group_ids, rows.episode_ids, keys, rows.roots
        )
        step_stats = {
            "adv/step_group_share": steps.share,
            "adv/env_state_share": sum(k.startswith("env:") for k in keys) / max(len(keys), 1),
        }
    else:
        adv = spec.advantage.group(rows.returns, rows.group_ids, rows.episode_ids, rows.roots)
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
    w = spec.loss.weights(tc, batch.episode_ids, max_tokens=max_tokens)
    return [w[i, : len(t)] for i, t in enumerate(batch.completions)]


def apply_overlong(
    episodes: list[Episode], spec: OverlongSpec, max_tokens: int
) -> tuple[list[Episode], dict[str, float]]:
    """Copies of ``episodes`` whose completions' rewards include DAPO's soft overlong
    penalty (``OverlongSpec.penalty`` of each completion's output length); the recorded
    episodes are left as they are. Returns the copies and the penalty's metrics."""
    comps = [c for ep in episodes for c in ep.completions]
    if not comps:
        return episodes, {}
    pens = spec.penalty(torch.tensor([len(c.output_ids) for c in comps]), max_tokens).tolist()
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
    if spec.advantage.estimator == "turn_gae":
        batch.adv, batch.returns, batch.value_mask, stats = turn_critic_targets(
            batch.gae, values, batch.mask, batch.segments, spec.advantage
        )
        batch.value_weights = [
            _turn_weights(w, seg, b)
            for w, seg, b in zip(batch.weights, batch.segments, batch.value_mask, strict=True)
        ]
    else:
        batch.adv, batch.returns, stats = critic_targets(
            batch.gae, values, batch.mask, spec.advantage
        )
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


def make_value_loss_fn(batch: Batch, spec: AlgorithmSpec) -> ValueLoss:
    """The callback ``Critic.train_step`` calls for each micro-batch (after ``add_gae``)."""
    assert batch.old_values is not None and batch.returns is not None, "call add_gae first"
    mask = batch.mask if batch.value_mask is None else [m.float() for m in batch.value_mask]
    weights = batch.weights if batch.value_weights is None else batch.value_weights
    return ValueLoss(spec.loss, batch.old_values, batch.returns, mask, weights, batch.group_ids)


def _pad(xs: list[torch.Tensor], value: float = 0.0) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(xs, batch_first=True, padding_value=value)


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
        if cfg.loss.proximal == "recompute":
            assert batch.prox is not None
            prox = rows(batch.prox)
        else:
            prox = approx_proximal_logp(behav, logp, rows(batch.versions), version + 1, version)
        tokens: dict[str, torch.Tensor] | None = {} if self.record else None
        loss, stats = spec.loss.policy_loss(
            logp,
            behav,
            prox,
            rows(batch.adv),
            mask,
            tokens,
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


def train_token_rows(
    records: Iterable[SampleTokens], step: int, version: int
) -> list[dict[str, Any]]:
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
            row: dict[str, Any] = {
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
