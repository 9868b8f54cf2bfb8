"""The one policy loss and its settings, the value loss, and logprobs from logits."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from areal_agents.trainer.loss import (
    LossSpec,
    aggregate,
    approx_proximal_logp,
    entropy_from_logits,
    explained_variance,
    logprobs_from_logits,
    m2po_mask,
    policy_loss,
    value_loss,
)


def logp_of(ratios: list[list[float]]) -> torch.Tensor:
    """Current logprobs giving these ratios against a behaviour logprob of 0."""
    return torch.tensor(ratios).log().requires_grad_(True)


def grad(t: torch.Tensor) -> torch.Tensor:
    assert t.grad is not None
    return t.grad


def z(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.zeros(shape)


def approx(x: float, tol: float = 1e-5):
    return pytest.approx(x, abs=tol)


# ------------------------------------------------------------------ PPO clip
def test_token_ppo_clip_by_hand():
    # r = [1.5, 0.5, 1.1, 0.9], A = [1, -1, 1, -1], eps = 0.2
    # min(1.5, 1.2) = 1.2 (high clip) | min(-0.5, -0.8) = -0.8 (low clip) | 1.1 | -0.9
    # loss = -(1.2 - 0.8 + 1.1 - 0.9) / 4 = -0.15
    logp = logp_of([[1.5, 0.5, 1.1, 0.9]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, stats = policy_loss(logp, z((1, 4)), None, adv, torch.ones(1, 4))
    assert loss.item() == approx(-0.15)
    assert stats["clip_fraction"] == 0.5
    assert stats["clip_low_fraction"] == 0.25 and stats["clip_high_fraction"] == 0.25
    loss.backward()
    # clipped tokens have no gradient; d(-r A / 4)/d logp = -r A / 4: -0.275, +0.225
    torch.testing.assert_close(grad(logp), torch.tensor([[0.0, 0.0, -0.275, 0.225]]))


def test_clip_higher_is_asymmetric():
    # r = 1.25 with A = +1 and r = 0.75 with A = -1, eps_low = 0.2, eps_high = 0.28:
    # the first is inside 1 + 0.28 (obj 1.25), the second is below 1 - 0.2 (obj -0.8)
    logp = logp_of([[1.25, 0.75]])
    adv = torch.tensor([[1.0, -1.0]])
    loss, stats = policy_loss(
        logp, z((1, 2)), None, adv, torch.ones(1, 2), LossSpec(clip_high=0.28)
    )
    assert loss.item() == approx(-(1.25 - 0.8) / 2)
    assert stats["clip_high_fraction"] == 0.0 and stats["clip_low_fraction"] == 0.5
    loss.backward()
    torch.testing.assert_close(grad(logp), torch.tensor([[-1.25 / 2, 0.0]]))
    # symmetric 0.2: the first token is clipped too (obj 1.2)
    loss, stats = policy_loss(logp, z((1, 2)), None, adv, torch.ones(1, 2))
    assert loss.item() == approx(-(1.2 - 0.8) / 2)
    assert stats["clip_fraction"] == 1.0


def test_no_clip_bound():
    logp = logp_of([[3.0]])
    spec = LossSpec(clip_high=None)
    loss, _ = policy_loss(logp, z((1, 1)), None, torch.ones(1, 1), torch.ones(1, 1), spec)
    assert loss.item() == approx(-3.0)


# ------------------------------------------------------------------ decoupled PPO
def test_behaviour_weight_clip_mask_none_by_hand():
    # behaviour probs [0.1, 0.02], proximal [0.2, 0.2]: w = [2, 10]; current = proximal (r = 1)
    behav = torch.tensor([[0.1, 0.02]]).log()
    prox = torch.tensor([[0.2, 0.2]]).log()
    adv, mask = torch.ones(1, 2), torch.ones(1, 2)
    # clip: w = [2, 5]; mask: w = [2, 0]; none: w = [1, 1]. loss = -mean(w * r * A)
    expected = {"clip": -(2 + 5) / 2, "mask": -(2 + 0) / 2, "none": -(1 + 1) / 2}
    corr: Any
    for corr, want in expected.items():
        logp = prox.clone().requires_grad_(True)
        spec = LossSpec(behaviour_correction=corr, behaviour_cap=5.0)
        loss, stats = policy_loss(logp, behav, prox, adv, mask, spec)
        assert loss.item() == approx(want), corr
        assert stats["behaviour_clip_fraction"] == 0.5
        loss.backward()
        if corr == "mask":  # the masked token teaches nothing
            assert grad(logp)[0, 1].item() == 0.0 and grad(logp)[0, 0].item() < 0


def test_decoupled_ratio_is_against_the_proximal_policy():
    # behav 0.1, prox 0.2, current 0.3: r = 1.5 (clipped to 1.2 for A > 0), w = 2
    behav, prox = torch.tensor([[0.1]]).log(), torch.tensor([[0.2]]).log()
    logp = torch.tensor([[0.3]]).log().requires_grad_(True)
    loss, stats = policy_loss(logp, behav, prox, torch.ones(1, 1), torch.ones(1, 1))
    assert loss.item() == approx(-2 * 1.2)
    assert stats["ratio_mean"] == approx(1.5)


def test_approx_proximal_logp_by_hand():
    # behaviour -1.0, current -2.0 at version 5, proximal version 4:
    #   token of version 3: alpha = (4 - 3)/(5 - 3) = 0.5 -> -1.5
    #   token of version 4: alpha = 0 -> -1.0;  version 5 (= current): span 0 -> -1.0
    #   token of version 1: alpha = 3/4 -> -1.75
    behav = torch.full((1, 4), -1.0)
    cur = torch.full((1, 4), -2.0, requires_grad=True)
    out = approx_proximal_logp(behav, cur, torch.tensor([[3, 4, 5, 1]]), 5, 4)
    torch.testing.assert_close(out, torch.tensor([[-1.5, -1.0, -1.0, -1.75]]))
    assert not out.requires_grad


# ------------------------------------------------------------------ GSPO
def test_gspo_sequence_ratio_by_hand():
    # row 0 log-ratios [0.1, 0.3] -> s0 = exp(0.2) = 1.221403, A = +1
    # row 1 log-ratios [-0.2, 0.0, -0.1] -> s1 = exp(-0.1) = 0.904837, A = -1
    # eps 0.3 (unclipped), seq mean: loss = -(s0 - s1)/2 = -0.158283
    logp = torch.tensor([[0.1, 0.3, 0.0], [-0.2, 0.0, -0.1]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    # agg seq_mean_token_mean: each row (completion) weighs equally, tokens averaged in it
    spec = LossSpec(
        ratio_level="sequence", weighting="completion", agg="mean", clip_low=0.3, clip_high=0.3
    )
    loss, _ = policy_loss(logp, z((2, 3)), None, adv, mask, spec)
    s0, s1 = math.exp(0.2), math.exp(-0.1)
    assert loss.item() == approx(-(s0 - s1) / 2)
    loss.backward()
    # d s / d logp_t = s / |y|: row 0: -(1/2) s0 / 2 = -0.305351; row 1: (1/2) s1 / 3 = 0.150806
    want = torch.tensor([[-s0 / 4, -s0 / 4, 0.0], [s1 / 6, s1 / 6, s1 / 6]])
    torch.testing.assert_close(grad(logp), want)


def test_gspo_tight_clip_and_segments():
    logp = torch.tensor([[0.1, 0.3, 0.0], [-0.2, 0.0, -0.1]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # GSPO's 3e-4 / 4e-4: s0 = 1.22 > 1.0004 with A > 0 and s1 = 0.905 < 0.9997 with A < 0
    loss, stats = policy_loss(
        logp, z((2, 3)), None, torch.tensor([1.0, -1.0]), mask,
        LossSpec(ratio_level="sequence", weighting="completion", agg="mean",
                 clip_low=3e-4, clip_high=4e-4),
    )  # fmt: skip
    assert loss.item() == approx(-(1.0004 - 0.9997) / 2)
    assert stats["clip_fraction"] == 1.0
    loss.backward()
    assert grad(logp).abs().max().item() == 0.0
    # one merged row, two completions (segments): each its own geometric mean
    # tokens: s0, s0, -s1, -s1, -s1 -> token mean (2 * 1.221403 - 3 * 0.904837) / 5 = -0.054341
    logp = torch.tensor([[0.1, 0.3, -0.2, 0.0, -0.1]])
    loss, _ = policy_loss(
        logp, z((1, 5)), None, torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]]), torch.ones(1, 5),
        LossSpec(ratio_level="sequence", weighting="token", clip_low=0.3, clip_high=0.3),
        segment_ids=torch.tensor([[0, 0, 1, 1, 1]]),
    )  # fmt: skip
    assert loss.item() == approx(0.054341)


# ------------------------------------------------------------------ SAPO
def test_sapo_gate_by_hand():
    # r = [1, 1.5], A = [1, -1], tau_pos = 1, tau_neg = 1.05
    # token 0: f = sigmoid(0) * 4 / 1 = 2 -> obj 2; d obj/d logp = 4 * 0.25 * 1 * 1 = 1
    # token 1: sigmoid(1.05 * 0.5) = 0.628316, f = 0.628316 * 4 / 1.05 = 2.393585 -> obj -2.393585
    #          d obj/d logp = 4 * 0.628316 * 0.371684 * 1.5 * (-1) = -1.401210
    # loss = -(2 - 2.393585)/2 = 0.196793; grads = -[1, -1.401210] / 2
    logp = logp_of([[1.0, 1.5]])
    loss, stats = policy_loss(
        logp, z((1, 2)), None, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2),
        LossSpec(sapo_tau_pos=1.0, sapo_tau_neg=1.05),
    )  # fmt: skip
    assert loss.item() == approx(0.196793)
    loss.backward()
    torch.testing.assert_close(grad(logp), torch.tensor([[-0.5, 0.700605]]), rtol=0, atol=1e-5)
    assert stats["clip_fraction"] == 0.0
    assert 0 < stats["sapo_gate_mean"] < 1


def test_sapo_decays_smoothly_where_the_hard_clip_cuts():
    # r = 1.3, A = 1: the hard clip (0.2) gives no gradient, SAPO a smaller but nonzero one:
    # 4 * sigmoid(0.3) * (1 - sigmoid(0.3)) * 1.3 = 1.271 (vs 1.3 unclipped)
    for sapo, want in [(None, 0.0), (1.0, -4 * 0.574443 * 0.425557 * 1.3)]:
        logp = logp_of([[1.3]])
        loss, _ = policy_loss(
            logp, z((1, 1)), None, torch.ones(1, 1), torch.ones(1, 1),
            LossSpec(sapo_tau_pos=sapo, sapo_tau_neg=sapo),
        )  # fmt: skip
        loss.backward()
        assert grad(logp).item() == approx(want)


# ------------------------------------------------------------------ M2PO
def test_m2po_mask_by_hand():
    # log-ratios [0.5, -0.1, 0.1, 0.0]: squares [0.25, 0.01, 0.01, 0]; M2 = 0.27/4 = 0.0675
    lr = torch.tensor([[0.5, -0.1, 0.1, 0.0]])
    mask = torch.ones(1, 4)
    # tau 0.04: drop 0.25 -> M2 = 0.02/3 = 0.00667 <= 0.04
    assert m2po_mask(lr, mask, 0.04).tolist() == [[False, True, True, True]]
    # tau 0.1: 0.0675 already fine
    assert m2po_mask(lr, mask, 0.1).all()
    # tau 0.006: drop 0.25 (0.00667 > 0.006), then one 0.01 -> 0.01/2 = 0.005 <= 0.006
    keep = m2po_mask(lr, mask, 0.006)
    assert keep[0, 0].item() is False and keep[0, 3].item() is True and int(keep.sum()) == 2
    # padding never counts and is never kept
    assert not m2po_mask(lr, torch.tensor([[1.0, 1.0, 1.0, 0.0]]), 1.0)[0, 3]


def test_m2po_in_the_loss_by_hand():
    # log-ratios to behaviour [0.5, 0, 0, 0], A = 1 everywhere, no clip:
    # M2 = 0.25 / 4 = 0.0625 > 0.04 -> token 0 masked; the rest have r = 1
    # loss = -(0 + 1 + 1 + 1) / 4 = -0.75 (the masked token stays in the denominator)
    logp = torch.tensor([[0.5, 0.0, 0.0, 0.0]], requires_grad=True)
    loss, stats = policy_loss(
        logp, z((1, 4)), None, torch.ones(1, 4), torch.ones(1, 4),
        LossSpec(clip_low=None, clip_high=None, m2po_tau=0.04, weighting="token"),
    )  # fmt: skip
    assert loss.item() == approx(-0.75)
    assert stats["m2po_masked_fraction"] == 0.25 and stats["m2"] == approx(0.0625)
    loss.backward()
    assert grad(logp)[0, 0].item() == 0.0


# ------------------------------------------------------------------ KL, aggregation
def test_kl_estimators_by_hand():
    # d = logp - ref = 0.5: k1 = 0.5, k2 = 0.125, k3 = exp(-0.5) - 1 + 0.5 = 0.106531
    logp = torch.full((1, 2), 0.5)
    est: Any
    for est, want in [("k1", 0.5), ("k2", 0.125), ("k3", 0.106531)]:
        loss, stats = policy_loss(
            logp, logp, None, z((1, 2)), torch.ones(1, 2),
            LossSpec(kl_coef=1.0, kl_estimator=est), ref_logp=z((1, 2)),
        )  # fmt: skip
        assert loss.item() == approx(want) and stats["kl"] == approx(want)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, logp, None, z((1, 2)), torch.ones(1, 2), LossSpec(kl_coef=0.1))


def test_aggregations_by_hand():
    # per-token values: row 0 [1, 1, 1], row 1 [2, pad, pad]
    x = torch.tensor([[1.0, 1.0, 1.0], [2.0, 9.0, 9.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(x, m, "token_mean").item() == approx(5 / 4)
    assert aggregate(x, m, "seq_mean_token_mean").item() == approx((1 + 2) / 2)
    assert aggregate(x, m, "seq_mean_token_sum").item() == approx((3 + 2) / 2)
    assert aggregate(x, m, "seq_mean_token_sum_norm", max_tokens=4).item() == approx(5 / 8)
    with pytest.raises(ValueError, match="max_tokens"):
        aggregate(x, m, "seq_mean_token_sum_norm")
    # the policy loss with r = 1 is -agg(A)
    spec = LossSpec(weighting="completion", agg="sum")  # seq_mean_token_sum
    loss, _ = policy_loss(z((2, 3)), z((2, 3)), None, x, m, spec)
    assert loss.item() == approx(-2.5)
    # no spec = LossSpec() (GRPO's episode weighting): without weights each row is one unit,
    # seq_mean_token_mean -(1 + 2) / 2; token weighting is the token mean -5 / 4
    loss, _ = policy_loss(z((2, 3)), z((2, 3)), None, x, m)
    assert loss.item() == approx(-1.5)
    assert LossSpec().token_agg == "seq_mean_token_mean"
    loss, _ = policy_loss(z((2, 3)), z((2, 3)), None, x, m, LossSpec(weighting="token"))
    assert loss.item() == approx(-5 / 4)
    # explicit weights replace agg: sum(w * -A)
    w = torch.tensor([[0.1, 0.1, 0.1], [0.7, 0.0, 0.0]])
    loss, _ = policy_loss(z((2, 3)), z((2, 3)), None, x, m, weights=w)
    assert loss.item() == approx(-(0.3 + 1.4))


def test_empty_batch_gives_zero_and_finite_grads():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, _ = policy_loss(logp, z((2, 3)), None, torch.ones(2, 3), z((2, 3)))
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(grad(logp)).all()


def test_bad_settings_are_refused():
    x = z((1, 2))
    # settings are refused where they are made, before any data is seen
    with pytest.raises(ValueError, match="behaviour_correction"):
        LossSpec(behaviour_correction="clamp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sapo"):
        LossSpec(sapo_tau_pos=1.0)
    with pytest.raises(ValueError, match="shapes"):
        policy_loss(x, z((1, 3)), None, x, x)


# ------------------------------------------------------------------ gradient sanity
def test_gradients_through_a_tiny_model_have_the_expected_sign():
    torch.manual_seed(0)
    vocab, hidden = 7, 5
    emb = torch.nn.Embedding(vocab, hidden)
    head = torch.nn.Linear(hidden, vocab)
    inputs = torch.randint(0, vocab, (2, 4))
    targets = torch.randint(0, vocab, (2, 4))
    logits = head(emb(inputs))
    logp = logprobs_from_logits(logits, targets, temperature=0.7)
    behav = logp.detach()
    adv = torch.tensor([1.0, -1.0])  # row 0 good, row 1 bad
    loss, _ = policy_loss(logp, behav, None, adv, torch.ones(2, 4))
    g_logp = torch.autograd.grad(loss, logp, retain_graph=True)[0]
    assert (g_logp[0] < 0).all() and (g_logp[1] > 0).all()  # descent raises row 0, lowers row 1
    loss.backward()
    assert all(torch.isfinite(grad(p)).all() for p in [emb.weight, head.weight, head.bias])
    # one SGD step moves the logprobs the right way
    with torch.no_grad():
        for p in [emb.weight, head.weight, head.bias]:
            p -= 0.5 * grad(p)
        new = logprobs_from_logits(head(emb(inputs)), targets, temperature=0.7)
    assert new[0].sum() > behav[0].sum() and new[1].sum() < behav[1].sum()


# ------------------------------------------------------------------ value loss, logits
def test_value_loss_by_hand():
    # v = 1.5, old 1.0, R = 2.0, clip 0.2: v_clip = 1.2; max((0.5)^2, (0.8)^2) / 2 = 0.32
    v = torch.tensor([[1.5]], requires_grad=True)
    loss, stats = value_loss(v, torch.tensor([[1.0]]), torch.tensor([[2.0]]), torch.ones(1, 1))
    assert loss.item() == approx(0.32) and stats["value_clip_fraction"] == 1.0
    loss, _ = value_loss(
        v, torch.tensor([[1.0]]), torch.tensor([[2.0]]), torch.ones(1, 1), clip=None
    )
    assert loss.item() == approx(0.125)


def test_weighted_value_loss_and_its_gradient_by_hand():
    # clip 0.2, weights [0.25, 0.75]
    # token 0: v 1.5, old 1.0, R 2.0: (1.5 - 2)^2 = 0.25; v_clip = 1.2, (1.2 - 2)^2 = 0.64
    #          -> the clipped term is larger: 0.5 * 0.64 = 0.32, and its gradient is 0
    # token 1: v 0.9, old 1.0, R 1.0: within the clip, 0.5 * 0.01 = 0.005, grad 0.75 * -0.1
    # loss = 0.25 * 0.32 + 0.75 * 0.005 = 0.08375
    v = torch.tensor([[1.5, 0.9]], requires_grad=True)
    loss, stats = value_loss(
        v,
        torch.tensor([[1.0, 1.0]]),
        torch.tensor([[2.0, 1.0]]),
        torch.ones(1, 2),
        weights=torch.tensor([[0.25, 0.75]]),
    )
    assert loss.item() == approx(0.08375)
    assert stats["value_clip_fraction"] == approx(0.25)  # weighted
    assert stats["value_mean"] == approx(0.25 * 1.5 + 0.75 * 0.9)
    loss.backward()
    assert grad(v)[0].tolist() == pytest.approx([0.0, -0.075])
    # moving away from the old value is allowed when it lowers the error:
    # v 1.5, old 1.0, R 1.1: (0.4)^2 = 0.16 > (1.2 - 1.1)^2 = 0.01 -> 0.5 * 0.16 = 0.08
    loss, stats = value_loss(
        torch.tensor([[1.5]]), torch.tensor([[1.0]]), torch.tensor([[1.1]]), torch.ones(1, 1)
    )
    assert loss.item() == approx(0.08) and stats["value_clip_fraction"] == 0.0


def test_explained_variance_by_hand():
    # R - V = [0, 1]: Var 0.5 (Bessel); Var(R) = Var([1, 3]) = 2 -> 1 - 0.5 / 2 = 0.75
    ev = explained_variance(torch.tensor([1.0, 2.0, 7.0]), torch.tensor([1.0, 3.0, 0.0]),
                            torch.tensor([1, 1, 0]))  # fmt: skip
    assert ev == approx(0.75)
    assert explained_variance(torch.tensor([0.5, 2.0]), torch.tensor([1.0, 3.0]), torch.ones(2)) < 1
    assert (
        explained_variance(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 3.0]), torch.ones(2)) == 1
    )
    assert explained_variance(torch.zeros(2), torch.ones(2), torch.ones(2)) == 0.0  # constant R


def test_logprobs_follow_the_engine_convention():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=gen).to(torch.bfloat16)
    tokens = torch.randint(0, 11, (2, 3), generator=gen)
    for t in (0.7, 1.0):
        want = torch.log_softmax(logits.float() / t, -1).gather(-1, tokens[..., None])[..., 0]
        got = logprobs_from_logits(logits, tokens, temperature=t)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(
        logprobs_from_logits(logits, tokens, 0.0), logprobs_from_logits(logits, tokens, 1.0)
    )


def test_entropy_from_logits():
    assert entropy_from_logits(torch.zeros(3, 8)).tolist() == pytest.approx([math.log(8)] * 3)
    peaked = torch.tensor([[100.0, 0.0, 0.0]])
    assert entropy_from_logits(peaked).item() == approx(0.0)
    # temperature flattens: entropy at T = 2 exceeds entropy at T = 1
    x = torch.tensor([[2.0, 0.0, -1.0]])
    assert entropy_from_logits(x, 2.0).item() > entropy_from_logits(x, 1.0).item()


def test_entropy_bonus_by_hand():
    # Zero advantages: the loss is the bonus alone, -c * token_mean(H) over the mask.
    # H = [0.5, 1.5, (masked) 9.0], c = 0.2: -0.2 * (0.5 + 1.5) / 2 = -0.2.
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    ent = torch.tensor([[0.5, 1.5, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = policy_loss(
        logp, logp.detach(), None, torch.zeros(1), mask, LossSpec(entropy_coef=0.2), entropy=ent
    )
    assert loss.item() == approx(-0.2)
    assert stats["entropy"] == approx(1.0)
    loss.backward()
    assert grad(ent).tolist() == [pytest.approx([-0.1, -0.1, 0.0])]
    # without the coefficient the entropy is only reported
    loss0, _ = policy_loss(logp, logp.detach(), None, torch.zeros(1), mask, entropy=ent)
    assert loss0.item() == approx(0.0)
