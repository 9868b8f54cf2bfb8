"""The training-inference mismatch of a step's fresh tokens: the metrics by hand, the case
without a fresh token, masked-out tokens left out, and the loglinear step's extra forward
pass over only the samples that have a fresh token."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from areal_agents.trainer.batch import Batch
from areal_agents.trainer.config_io import load_config
from areal_agents.trainer.mismatch import mismatch_stats
from areal_agents.trainer.step import measure_mismatch


def t(xs: list[float]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


# Two samples. d = trainer - server:
#   sample 0: d = [0, 0.5, -0.5], fresh [1, 1, 0]       -> fresh in-mask d: 0, 0.5
#   sample 1: d = [1.9, 53.0],    mask [1, 0]           -> fresh in-mask d: 1.9
#             (its second token is fresh but out of the mask: never read)
# k3 = exp(d) - 1 - d:  k3(0) = 0,  k3(0.5) = 1.6487213 - 1.5 = 0.1487213,
#                       k3(1.9) = 6.6858944 - 2.9 = 3.7858944
# kl = (0 + 0.1487213 + 3.7858944) / 3 = 1.3115386;  abs_max = 1.9
# cap 5: exp(1.9) = 6.686 > 5, exp(0.5) = 1.65 and exp(0) = 1 are not -> masked_share = 1/3
# in-mask tokens 3 + 1 = 4, fresh among them 3 -> fresh_share = 0.75, tokens = 3
TRAINER = [t([-1.0, -0.5, -2.0]), t([-0.1, 50.0])]
SERVER = [t([-1.0, -1.0, -1.5]), t([-2.0, -3.0])]
MASK = [t([1, 1, 1]), t([1, 0])]
FRESH = [torch.tensor([True, True, False]), torch.tensor([True, True])]


def test_the_metrics_by_hand() -> None:
    got = mismatch_stats(TRAINER, SERVER, MASK, FRESH, cap=5.0)
    assert got == pytest.approx(
        {
            "mismatch/kl": 1.3115386,
            "mismatch/abs_max": 1.9,
            "mismatch/masked_share": 1 / 3,
            "mismatch/fresh_share": 0.75,
            "mismatch/tokens": 3.0,
        },
        abs=1e-6,
    )
    # a cap above every weight cuts none
    assert mismatch_stats(TRAINER, SERVER, MASK, FRESH, cap=7.0)["mismatch/masked_share"] == 0


def test_masked_out_and_stale_tokens_are_not_read() -> None:
    # anything at sample 0's stale token and sample 1's masked-out one: the same metrics
    wild = [t([-1.0, -0.5, 40.0]), t([-0.1, -90.0])]
    assert mismatch_stats(wild, SERVER, MASK, FRESH, 5.0) == mismatch_stats(
        TRAINER, SERVER, MASK, FRESH, 5.0
    )
    # equal logprobs: no mismatch at all
    same = mismatch_stats(SERVER, SERVER, MASK, FRESH, 5.0)
    assert same["mismatch/kl"] == 0 and same["mismatch/abs_max"] == 0
    assert same["mismatch/masked_share"] == 0


def test_without_a_fresh_token_there_is_no_kl() -> None:
    stale = [torch.zeros(3, dtype=torch.bool), torch.tensor([False, True])]  # fresh: masked out
    got = mismatch_stats(TRAINER, SERVER, MASK, stale, 5.0)
    assert got == {"mismatch/fresh_share": 0.0, "mismatch/tokens": 0.0}
    assert mismatch_stats([], [], [], [], 5.0) == {
        "mismatch/fresh_share": 0.0,
        "mismatch/tokens": 0.0,
    }
    with pytest.raises(ValueError, match="one tensor per sample"):
        mismatch_stats(TRAINER, SERVER[:1], MASK, FRESH, 5.0)


class Scorer:
    """A policy whose logprobs are the engine's plus 0.1, recording what it scored."""

    def __init__(self, batch: Batch) -> None:
        self.behav = {tuple(s): b for s, b in zip(batch.seqs, batch.behav, strict=True)}
        self.calls: list[list[list[int]]] = []

    def logprobs(self, seqs: Any, temps: Any, mbt: int, needed: Any) -> list[torch.Tensor]:
        self.calls.append([list(s) for s in seqs])
        return [self.behav[tuple(s)] + 0.1 for s in seqs]


def _batch(versions: list[list[int]]) -> Batch:
    """Three samples of 3 tokens (4 ids), each token at ``versions``; all in the mask."""
    n = len(versions)
    seqs = [[10 * i + k for k in range(4)] for i in range(n)]
    ones = [torch.ones(3) for _ in range(n)]
    return Batch(
        seqs=seqs,
        mask=ones,
        behav=[t([-1.0, -2.0, -0.5]) for _ in range(n)],
        versions=[torch.tensor(v) for v in versions],
        adv=ones,
        weights=ones,
        segments=[torch.zeros(3, dtype=torch.long) for _ in range(n)],
        temps=ones,
    )


def test_a_loglinear_step_scores_only_the_samples_with_a_fresh_token() -> None:
    cfg = load_config(None, ["env.id=x", "loss.proximal=loglinear"])
    spec = cfg.algorithm_spec()
    batch = _batch([[3, 3, 3], [2, 3, 2], [2, 2, 2]])
    policy = Scorer(batch)
    got = measure_mismatch(policy, batch, spec, cfg, version=3)
    assert policy.calls == [[batch.seqs[0], batch.seqs[1]]]  # not the all-stale third
    k3 = torch.exp(torch.tensor(0.1, dtype=torch.float64)) - 1.1
    assert got["mismatch/kl"] == pytest.approx(float(k3), abs=1e-6)
    assert got["mismatch/abs_max"] == pytest.approx(0.1, abs=1e-6)
    assert got["mismatch/tokens"] == 4 and got["mismatch/fresh_share"] == pytest.approx(4 / 9)

    stale = Scorer(batch)
    assert measure_mismatch(stale, batch, spec, cfg, version=4) == {
        "mismatch/fresh_share": 0.0,
        "mismatch/tokens": 0.0,
    }
    assert stale.calls == []  # no fresh token: no pass


def test_a_recompute_step_reads_the_proximal_logprobs() -> None:
    cfg = load_config(None, ["env.id=x", "loss.proximal=recompute"])
    spec = cfg.algorithm_spec()
    batch = _batch([[0, 0, 0], [0, 0, 0], [0, 0, 0]])
    batch.prox = [b - 0.2 for b in batch.behav]
    policy = Scorer(batch)
    got = measure_mismatch(policy, batch, spec, cfg, version=0)
    assert policy.calls == []
    k3 = torch.exp(torch.tensor(-0.2, dtype=torch.float64)) - 0.8
    assert got["mismatch/kl"] == pytest.approx(float(k3), abs=1e-6)
    assert got["mismatch/fresh_share"] == 1.0 and got["mismatch/tokens"] == 9
