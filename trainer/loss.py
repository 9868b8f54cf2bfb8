"""One policy loss for the whole family, a PPO value loss, and logprobs from logits.

Choices made:

* One objective, the decoupled PPO loss of AReaL, with three policies: the behaviour policy
  that sampled each token (its logprob recorded by the engine), the proximal policy (the
  trust-region anchor: recomputed, or interpolated from versions) and the current policy::

      r = pi_theta / pi_prox          w = pi_prox / pi_behav  (clipped at cap, or masked)
      L = - agg( w * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) )

  Without a proximal logprob, pi_prox = pi_behav and w = 1: standard PPO.
* Every algorithm is a setting of this loss, one :class:`LossSpec`: asymmetric clip (DAPO),
  sequence-level geometric-mean ratio (GSPO), soft sigmoid gate instead of the clip (SAPO),
  second-moment token masking (M2PO), k1/k2/k3 KL to a reference, four aggregations or
  explicit weights. ``policy_loss`` takes the spec and data only; the spec validates itself.
* Tokens dropped by a correction (behaviour mask, M2PO) contribute 0 but stay in the
  aggregation's denominator, so the loss scale does not depend on how many were dropped.
* Log-ratios are clamped to +-20 before exp so that a wild token gives a large but finite
  loss instead of inf/NaN.
* Logprobs follow the engines' convention: ``log_softmax(logits / T)`` in float32, T = 1 for
  greedy (T = 0).

Left out: dual-clip PPO, token-level entropy bonuses beyond a plain coefficient, chunked
logprob computation over the vocabulary (the training loop chunks sequences if needed).
"""

from __future__ import annotations

from typing import get_args

import torch
from torch import Tensor

from areal_agents.trainer.advantage import Ids, completion_weights
from areal_agents.trainer.algorithms import Agg, BehaviourCorrection, KLEstimator, LossSpec

_MAX_LOG_RATIO = 20.0


def _check_choice(name: str, value: str, kind: object) -> None:
    choices = get_args(kind)
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")


# ------------------------------------------------------------------ logits
def scale_logits(logits: Tensor, temperature: float | Tensor = 1.0) -> Tensor:
    """``logits / T`` in float32, T = 1 where T == 0 (greedy: the engines record the plain
    distribution). ``temperature`` is one number or one per position (``logits.shape[:-1]``):
    each token is scored at the temperature it was sampled with."""
    if isinstance(temperature, Tensor):
        t = temperature.to(device=logits.device, dtype=torch.float32)
        t = torch.where(t > 0, t, torch.ones_like(t))
        return logits.float() / t.unsqueeze(-1)
    return logits.float() / (temperature if temperature > 0 else 1.0)


def logprobs_from_logits(
    logits: Tensor, tokens: Tensor, temperature: float | Tensor = 1.0
) -> Tensor:
    """Logprob of ``tokens`` under ``log_softmax(logits / T)`` in float32 (T = 1 when T == 0).

    The same quantity the inference engines record, so that the first training step on fresh
    data sees ratio 1. ``logits`` is ``[..., V]``, ``tokens`` ``[...]``; ``temperature`` is a
    number or ``[...]`` (see :func:`scale_logits`).
    """
    logp = torch.log_softmax(scale_logits(logits, temperature), dim=-1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: Tensor, temperature: float | Tensor = 1.0) -> Tensor:
    """Entropy ``-sum(p * log p)`` of ``softmax(logits / T)`` in float32, over the last axis."""
    logp = torch.log_softmax(scale_logits(logits, temperature), dim=-1)
    return -(logp.exp() * logp).sum(-1)


# ------------------------------------------------------------------ helpers
def approx_proximal_logp(
    behav_logp: Tensor,
    cur_logp: Tensor,
    behav_version: Tensor,
    cur_version: int,
    prox_version: int,
) -> Tensor:
    """Proximal logprobs without a forward pass: log-linear interpolation over versions.

    A token sampled by policy version v_b has a behaviour logprob; the current policy (about
    to be version ``cur_version``) gives ``cur_logp``. The proximal policy, version
    ``prox_version``, is taken on the straight line between them in log space::

        alpha         = clamp((prox_version - v_b) / (cur_version - v_b), 0, 1)
        log pi_prox  ~= log pi_behav + alpha * (log pi_theta - log pi_behav)

    (alpha = 0 when ``cur_version == v_b``.) Tokens from the proximal version itself get
    their behaviour logprob exactly. The result carries no gradient.
    """
    vb = behav_version.to(torch.float32)
    span = float(cur_version) - vb
    alpha = torch.where(span > 0, (float(prox_version) - vb) / span.clamp(min=1), 0.0)
    alpha = alpha.clamp(0.0, 1.0)
    b = behav_logp.detach().float()
    return b + alpha * (cur_logp.detach().float() - b)


def m2po_mask(log_ratio: Tensor, mask: Tensor, tau: float) -> Tensor:
    """M2PO's second-moment mask: drop the largest squared log-ratios until M2 <= tau.

    Over the batch's valid tokens, ``M2 = mean(log_ratio ** 2)``. Tokens are removed in order
    of decreasing ``log_ratio ** 2`` until the M2 of those left is at most ``tau``. Returns
    the mask of kept tokens (a subset of ``mask``).
    """
    valid = mask.bool()
    sq = log_ratio.detach().float()[valid] ** 2
    n = sq.numel()
    if n == 0:
        return valid
    s, order = torch.sort(sq, descending=True)
    tail = s.flip(0).cumsum(0).flip(0)  # tail[k] = sum(s[k:])
    m2_after = tail / torch.arange(n, 0, -1, device=s.device, dtype=s.dtype)
    ok = torch.nonzero(m2_after <= tau)
    drop_n = int(ok[0]) if ok.numel() else n
    keep_valid = torch.ones(n, dtype=torch.bool, device=s.device)
    keep_valid[order[:drop_n]] = False
    keep = torch.zeros_like(valid)
    keep[valid] = keep_valid
    return keep


def _segment_mean_tokens(x: Tensor, mask: Tensor, segment_ids: Tensor | None) -> Tensor:
    """Mean of ``x`` over each (row, segment)'s valid tokens, broadcast back to its tokens."""
    rows, width = x.shape
    valid = mask.bool()
    seg = torch.zeros_like(x, dtype=torch.long) if segment_ids is None else segment_ids.long()
    k = int(seg.max().clamp(min=0)) + 1
    row_of = torch.arange(rows, device=x.device).unsqueeze(1).expand(rows, width)
    key = torch.where(valid, row_of * k + seg.clamp(min=0), torch.zeros_like(seg))
    _, inv = torch.unique(key[valid], return_inverse=True)
    n = int(inv.max()) + 1 if inv.numel() else 0
    tot = x.new_zeros(n).index_add(0, inv, x[valid])
    cnt = x.new_zeros(n).index_add(0, inv, torch.ones_like(x[valid]))
    out = torch.zeros_like(x)
    return out.masked_scatter(valid, (tot / cnt)[inv])


def aggregate(x: Tensor, mask: Tensor, agg: Agg, max_tokens: int | None = None) -> Tensor:
    """Reduce per-token values ``[B, T]`` to a scalar over the tokens where ``mask`` is set::

        token_mean               sum(x) / N_tokens                         (DAPO)
        seq_mean_token_mean      mean over rows of (sum_t x / n_tokens(row))  (GRPO, GSPO)
        seq_mean_token_sum       mean over rows of sum_t x                 (REINFORCE, RLOO)
        seq_mean_token_sum_norm  sum(x) / (B * max_tokens)                 (Dr.GRPO)

    Rows without tokens are left out of the seq means' count except in the last (a constant
    normalizer by design).
    """
    _check_choice("agg", agg, Agg)
    m = mask.to(x.dtype)
    xm = x * m
    if agg == "token_mean":
        return xm.sum() / m.sum().clamp(min=1)
    per_row, n_tok = xm.sum(-1), m.sum(-1)
    if agg == "seq_mean_token_sum_norm":
        if max_tokens is None or max_tokens < 1:
            raise ValueError(
                "max_tokens: agg='seq_mean_token_sum_norm' (Dr.GRPO) needs the constant "
                f"normalizer, e.g. sampling.max_new_tokens; got {max_tokens}"
            )
        return per_row.sum() / (x.shape[0] * max_tokens)
    has = (n_tok > 0).to(x.dtype)
    if agg == "seq_mean_token_mean":
        per_row = per_row / n_tok.clamp(min=1)
    return (per_row * has).sum() / has.sum().clamp(min=1)


def _kl(log_ratio: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token KL(pi_theta || pi_ref) estimates from d = log pi_theta - log pi_ref."""
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return torch.exp(-log_ratio) - 1.0 + log_ratio


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


# ------------------------------------------------------------------ the setting
def loss_weights(
    spec: LossSpec, token_completion: Tensor, episode_ids: Ids, max_tokens: int | None = None
) -> Tensor:
    """Per-token weights over a whole batch (``completion_weights``) for the loss setting
    ``spec``: its ``weighting`` (the unit that weighs equally) and ``agg``."""
    return completion_weights(
        token_completion,
        episode_ids,
        weighting=spec.weighting,
        reduce=spec.agg,
        max_tokens=max_tokens,
    )


def _behaviour_weight(
    log_w: Tensor, valid: Tensor, correction: BehaviourCorrection, cap: float
) -> tuple[Tensor, Tensor]:
    """w = pi_prox / pi_behav after the correction, and where it exceeded ``cap``."""
    w = torch.exp(log_w.clamp(max=_MAX_LOG_RATIO))
    over = (w > cap) & valid
    if correction == "clip":
        w = w.clamp(max=cap)
    elif correction == "mask":
        w = torch.where(over, torch.zeros_like(w), w)
    else:
        w = torch.ones_like(w)
    return w, over


def _surrogate(
    ratio: Tensor,
    adv: Tensor,
    clip_low: float | None,
    clip_high: float | None,
    sapo: tuple[float, float] | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token objective, and where the low / high clip was binding."""
    if sapo is not None:
        tau = torch.where(adv > 0, sapo[0], sapo[1]).to(ratio.dtype)
        obj = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv
        none = torch.zeros_like(ratio, dtype=torch.bool)
        return obj, none, none
    lo = None if clip_low is None else 1.0 - clip_low
    hi = None if clip_high is None else 1.0 + clip_high
    clipped = ratio if lo is None and hi is None else ratio.clamp(min=lo, max=hi)
    obj = torch.minimum(ratio * adv, clipped * adv)
    r = ratio.detach()
    low = (adv < 0) & (r < lo) if lo is not None else torch.zeros_like(r, dtype=torch.bool)
    high = (adv > 0) & (r > hi) if hi is not None else torch.zeros_like(r, dtype=torch.bool)
    return obj, low, high


def policy_loss(
    logp: Tensor,
    behav_logp: Tensor,
    prox_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    spec: LossSpec | None = None,
    *,
    weights: Tensor | None = None,
    segment_ids: Tensor | None = None,
    max_tokens: int | None = None,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    tokens: dict[str, Tensor] | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The decoupled PPO objective with the setting ``spec`` (None: ``LossSpec()``, GRPO's).
    Returns ``(loss, stats)``; with ``tokens`` (a dict), also fills it with the per-token
    values below (see the end of this docstring).

    Inputs are ``[B, T]`` (``advantages`` may be ``[B]``, one per row); ``logp`` carries the
    gradient, the others are constants; every keyword is data, every setting is a field of
    ``spec``. Per token, with eps_low/eps_high = ``spec.clip_low``/``spec.clip_high`` (None:
    no bound on that side) and cap = ``spec.behaviour_cap``::

        r   = exp(logp - prox_logp)                           prox_logp = behav_logp if None
        w   = exp(prox_logp - behav_logp), then               spec.behaviour_correction
                clip: min(w, cap)   mask: 0 where w > cap   none: 1
        obj = min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
        L   = -agg(w * obj) + spec.kl_coef * agg(KL) - spec.entropy_coef * agg(H)

    ``spec.ratio_level="sequence"`` (GSPO) replaces r and w by their geometric mean over each
    sequence, ``exp(mean_t log r_t)``, where a sequence is a row or, with ``segment_ids``
    (e.g. ``token_completion``), each completion of a merged row. SAPO (``spec.sapo_tau_pos``,
    ``spec.sapo_tau_neg``) replaces the clipped min by a soft gate whose gradient is
    ``4 sigma(1 - sigma) r A grad log pi``, equal to the plain policy gradient at r = 1::

        obj = sigmoid(tau * (r - 1)) * 4 / tau * A,   tau = tau_pos if A > 0 else tau_neg

    M2PO (``spec.m2po_tau``) zeroes the tokens chosen by :func:`m2po_mask` on
    ``log pi_theta - log pi_behav``. KL to ``ref_logp`` (needed when ``spec.kl_coef > 0``;
    reported whenever given) with d = logp - ref_logp and ``spec.kl_estimator``: k1 = d,
    k2 = d^2 / 2, k3 = exp(-d) - 1 + d. H is ``entropy`` (reported whenever given).

    ``agg``: with ``weights`` (``spec.weights``, over a whole batch) each term is
    ``sum(weights * x)``; without them it is :func:`aggregate` with ``spec.token_agg``, the
    (``spec.weighting``, ``spec.agg``) pair with each row taken as one unit, and
    ``max_tokens`` as Dr.GRPO's normalizer. Dropped tokens stay in denominators.

    ``tokens`` gets detached ``[B, T]`` tensors, computed anyway for the loss and its stats
    (the loss and stats are the same with or without it): ``logp`` (log pi_theta),
    ``prox_logp`` (log pi_prox), ``advantage`` (A), ``ratio`` (r, after GSPO's sequence
    mean), ``behaviour_weight`` (w after the correction), ``clipped_low`` (A < 0 and
    r < 1 - eps_low), ``clipped_high`` (A > 0 and r > 1 + eps_high), ``clipped`` (either:
    the clip is binding, so the token's gradient is 0; always False under SAPO) and
    ``behaviour_clipped`` (a valid token whose w before the correction exceeded cap).
    """
    spec = LossSpec() if spec is None else spec
    _check_policy_inputs(logp, behav_logp, mask)
    if spec.kl_coef and ref_logp is None:
        raise ValueError("ref_logp: kl_coef > 0 needs the reference model's logprobs")
    valid = mask.bool()
    adv = advantages.detach().float()
    adv = adv.unsqueeze(-1).expand_as(logp) if adv.dim() == 1 else adv
    behav = behav_logp.detach().float()
    prox = behav if prox_logp is None else prox_logp.detach().float()
    cur = logp.float()

    log_r, log_w = cur - prox, prox - behav
    if spec.ratio_level == "sequence":
        log_r = _segment_mean_tokens(log_r, valid, segment_ids)
        log_w = _segment_mean_tokens(log_w, valid, segment_ids)
    ratio = torch.exp(log_r.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    w, over = _behaviour_weight(log_w, valid, spec.behaviour_correction, spec.behaviour_cap)
    keep = valid
    if spec.m2po_tau is not None:
        keep = m2po_mask(cur.detach() - behav, valid, spec.m2po_tau)
    tau_pos, tau_neg = spec.sapo_tau_pos, spec.sapo_tau_neg
    sapo = None if tau_pos is None or tau_neg is None else (tau_pos, tau_neg)
    obj, low, high = _surrogate(ratio, adv, spec.clip_low, spec.clip_high, sapo)
    per_token = -(w * keep.to(w.dtype) * obj)
    agg = spec.token_agg

    def reduce(x: Tensor) -> Tensor:
        if weights is not None:
            return (x * weights.to(x.dtype) * mask.to(x.dtype)).sum()
        return aggregate(x, mask, agg, max_tokens)

    loss = pg = reduce(per_token)
    if tokens is not None:
        tokens.update(
            logp=cur.detach(),
            prox_logp=prox,
            advantage=adv,
            ratio=ratio.detach(),
            behaviour_weight=w.detach(),
            clipped_low=low,
            clipped_high=high,
            clipped=low | high,
            behaviour_clipped=over,
        )
    stats = {
        "policy_loss": pg.detach(),
        "advantage_mean": _masked_mean(adv, valid),
        "ratio_mean": _masked_mean(ratio.detach(), valid),
        "approx_kl": _masked_mean(torch.expm1(log_r.detach()) - log_r.detach(), valid),
        "clip_fraction": _masked_mean((low | high).float(), valid),
        "clip_low_fraction": _masked_mean(low.float(), valid),
        "clip_high_fraction": _masked_mean(high.float(), valid),
        "behaviour_clip_fraction": _masked_mean(over.float(), valid),
        "behaviour_weight_mean": _masked_mean(w, valid),
    }
    if spec.m2po_tau is not None:
        stats["m2"] = _masked_mean((cur.detach() - behav) ** 2, valid)
        stats["m2po_masked_fraction"] = _masked_mean((valid & ~keep).float(), valid)
    if sapo is not None:
        sig = torch.sigmoid(torch.where(adv > 0, sapo[0], sapo[1]) * (ratio.detach() - 1.0))
        stats["sapo_gate_mean"] = _masked_mean(4.0 * sig * (1.0 - sig), valid)
    if ref_logp is not None:
        kl = _kl(cur - ref_logp.detach().float(), spec.kl_estimator)
        stats["kl"] = _masked_mean(kl.detach(), valid)
        if spec.kl_coef:
            loss = loss + spec.kl_coef * reduce(kl)
    if entropy is not None:
        stats["entropy"] = _masked_mean(entropy.detach().float(), valid)
        if spec.entropy_coef:
            loss = loss - spec.entropy_coef * reduce(entropy.float())
    stats["loss"] = loss.detach()
    return loss, _floats(stats)


def _check_policy_inputs(logp: Tensor, behav_logp: Tensor, mask: Tensor) -> None:
    if logp.dim() != 2 or behav_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(
            f"logp, behav_logp, mask: expected equal [B, T] shapes, got {tuple(logp.shape)}, "
            f"{tuple(behav_logp.shape)}, {tuple(mask.shape)}"
        )


def _floats(stats: dict[str, Tensor]) -> dict[str, float]:
    """Detached scalar tensors to floats with a single device sync."""
    values = torch.stack([v.detach().float().reshape(()) for v in stats.values()]).tolist()
    return dict(zip(stats, values, strict=True))


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = 0.2,
    agg: Agg = "token_mean",
    max_tokens: int | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped value loss. Returns ``(loss, stats)``::

        v_clip = old_values + clamp(values - old_values, -clip, clip)
        L      = agg(0.5 * max((values - R)^2, (v_clip - R)^2))       (clip=None: first term)

    The clip keeps the critic's prediction within ``clip`` of the values the advantages were
    computed with, unless moving further lowers the error. ``weights`` (see
    ``completion_weights``) replace ``agg``: ``L = sum(weights * term)``, and the stats
    (``value_clip_fraction``, ``value_mean``) are weighted sums too, so that micro-batch
    stats add up to the batch's.
    """
    v = values.float()
    ret = returns.detach().float()
    valid = mask.bool()
    err = (v - ret) ** 2
    if clip is None:
        per_token = 0.5 * err
        clipped = torch.zeros_like(err, dtype=torch.bool)
    else:
        old = old_values.detach().float()
        v_clip = old + (v - old).clamp(-clip, clip)
        err_clip = (v_clip - ret) ** 2
        per_token = 0.5 * torch.maximum(err, err_clip)
        clipped = err_clip > err

    def reduce(x: Tensor) -> Tensor:
        if weights is not None:
            return (x * weights.to(x.dtype) * mask.to(x.dtype)).sum()
        return aggregate(x, mask, agg, max_tokens)

    loss = reduce(per_token)
    if weights is None:
        frac, mean = _masked_mean(clipped.float(), valid), _masked_mean(v.detach(), valid)
    else:
        frac, mean = reduce(clipped.float()), reduce(v.detach())
    return loss, _floats({"value_loss": loss, "value_clip_fraction": frac, "value_mean": mean})


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """How much of the returns' variance the critic explains, over the tokens in ``mask``::

        EV = 1 - Var(R - V) / Var(R)

    1 is a perfect critic, 0 one no better than a constant, < 0 worse than a constant. When
    the returns do not vary (Var(R) = 0) it is 0: there is nothing to explain.

    >>> explained_variance(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]), torch.ones(2))
    0.75
    """
    m = mask.bool()
    r = returns.detach().double()[m]
    if r.numel() < 2 or float(r.var()) == 0.0:
        return 0.0
    return float(1.0 - (r - values.detach().double()[m]).var() / r.var())
