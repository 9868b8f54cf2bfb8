"""Training-inference mismatch: the trainer's logprob of a token against the engine's.

A token sampled by policy version v, trained while the trainer holds the weights of version
v (staleness 0, *fresh*), has two logprobs of the same distribution: the one the inference
engine recorded when it sampled it and the one the trainer's forward gives. They differ
only by the numerics of the two stacks (kernels, dtypes, batching, sampling
implementations); the gap is the training-inference mismatch. Over the fresh, in-mask
tokens, with ``d = logp_trainer - logp_server`` per token::

    kl           = mean( exp(d) - 1 - d )       k3 estimator of KL(server || trainer),
                                                 the tokens being samples of the server
    abs_max      = max |d|
    masked_share = share with exp(d) > cap     (cap = loss.behaviour_cap: the tokens whose
                                                 behaviour weight pi_prox / pi_behav the
                                                 clip or mask correction would cut for
                                                 the mismatch alone)
    fresh_share  = fresh in-mask tokens / in-mask tokens   (what the check covers)
    tokens       = number of fresh in-mask tokens

k3 is unbiased for the KL and never negative (``exp(d) >= 1 + d``). The values are
computed in float64, so that a wild token gives a large finite number rather than inf.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def mismatch_stats(
    trainer_logp: Sequence[Tensor],
    server_logp: Sequence[Tensor],
    mask: Sequence[Tensor],
    fresh: Sequence[Tensor],
    cap: float,
) -> dict[str, float]:
    """The ``mismatch/*`` metrics of a batch (formulas in the module docstring).

    Each argument holds one tensor per sample over the same positions (tokens 1..n-1 of a
    ``Batch``): the trainer's and the engine's logprobs, the loss mask (> 0: trained) and
    whether the token is fresh (nonzero: sampled by the weights the trainer holds). Only
    fresh in-mask tokens enter ``kl``, ``abs_max`` and ``masked_share``; a trainer logprob
    elsewhere is not read. Without any fresh in-mask token the result is only
    ``{"mismatch/fresh_share": 0.0, "mismatch/tokens": 0.0}``: no ``kl`` (a missing value,
    not a fake 0)."""
    n = len(mask)
    if not (len(trainer_logp) == len(server_logp) == len(fresh) == n):
        raise ValueError(
            f"one tensor per sample in each argument: {len(trainer_logp)} trainer, "
            f"{len(server_logp)} server, {n} mask, {len(fresh)} fresh"
        )
    in_mask = [m > 0 for m in mask]
    picked = [keep & (f != 0) for keep, f in zip(in_mask, fresh, strict=True)]
    trained = sum(int(keep.sum()) for keep in in_mask)
    count = sum(int(p.sum()) for p in picked)
    if count == 0:
        return {"mismatch/fresh_share": 0.0, "mismatch/tokens": 0.0}
    d = torch.cat(
        [
            t.detach().double().cpu()[p.cpu()] - s.detach().double().cpu()[p.cpu()]
            for t, s, p in zip(trainer_logp, server_logp, picked, strict=True)
        ]
    )
    w = torch.exp(d)
    return {
        "mismatch/kl": float((w - 1.0 - d).mean()),
        "mismatch/abs_max": float(d.abs().max()),
        "mismatch/masked_share": float((w > cap).double().mean()),
        "mismatch/fresh_share": count / trained,
        "mismatch/tokens": float(count),
    }
