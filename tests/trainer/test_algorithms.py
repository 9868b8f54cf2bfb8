"""Every algorithm as a configuration of the one loss, checked against hand-computed numbers."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from areal_agents.errors import ConfigError
from areal_agents.trainer.advantage import gae, group_advantages_of, overlong_penalty
from areal_agents.trainer.algorithms import (
    ALGORITHMS,
    AdvantageSpec,
    AlgorithmSpec,
    CriticConfig,
    LossSpec,
    check_async_correction,
    get_algorithm,
)
from areal_agents.trainer.loss import loss_weights, policy_loss, value_loss

# The shared batch: two groups of two single-turn episodes, one row each.
#   g1: e0 (R = 1, 2 tokens), e1 (R = 0, 1 token);  g2: e2 (R = 1, 2 tokens), e3 (R = 1, 1 token)
# Every token has ratio r = 1.25 against the behaviour policy (no proximal logprobs).
R = torch.tensor([1.0, 0.0, 1.0, 1.0])
GROUPS = ["g1", "g1", "g2", "g2"]
EPISODES = ["e0", "e1", "e2", "e3"]
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
S2 = 1 / math.sqrt(2)  # GRPO advantage in g1: (1 - 0.5) / std([1, 0]) = 0.5 / 0.707107
SIG = 1 / (1 + math.exp(-0.25))  # sigmoid(1.0 * (1.25 - 1)) = 0.562177
SIG_N = 1 / (1 + math.exp(-1.05 * 0.25))  # sigmoid(1.05 * 0.25) = 0.565251

# (advantages, loss); eps = 1e-6 in the std divisions, hence 1e-5 tolerances.
CASES: dict[str, tuple[list[float], float]] = {
    # A: g1 -> +-0.707107, g2 (uniform) -> 0.  Per-response means: e0 min(1.25, 1.2) A = 1.2 A,
    # e1 min(-1.25 S2, -1.2 S2) = -1.25 S2;  loss = -(1.2 S2 - 1.25 S2) / 4 = 0.008839
    "grpo": ([S2, -S2, 0, 0], -(1.2 * S2 - 1.25 * S2) / 4),
    # A = R - mean_g: [0.5, -0.5, 0, 0]. Token sums: e0 2 * 1.2 * 0.5 = 1.2, e1 -1.25 * 0.5;
    # divided by 4 rows * max_tokens 4: -(1.2 - 0.625) / 16 = -0.0359375
    "dr_grpo": ([0.5, -0.5, 0, 0], -(1.2 - 0.625) / 16),
    # A = (R - mean_g) / std_B(R) = [0.5, -0.5, 0, 0] / 0.5 (std of [1, 0, 1, 1]).
    # Token mean: (2 * 1.2 - 1.25) / 6 tokens -> loss -0.191667
    "lite_ppo": ([1, -1, 0, 0], -(2 * 1.2 - 1.25) / 6),
    # A = R - mean(others): e0 1 - 0, e1 0 - 1, e2 1 - 1, e3 1 - 1.
    # Per-response token sums: (2.4 - 1.25) / 4 rows -> -0.2875
    "rloo": ([1, -1, 0, 0], -(2.4 - 1.25) / 4),
    # GRPO's A; sequence ratio s = exp(mean log 1.25) = 1.25, clip [1 - 3e-4, 1 + 4e-4]:
    # e0 min(1.25, 1.0004) S2, e1 min(-1.25 S2, -1.0004 S2) = -1.25 S2; per-response mean / 4
    "gspo": ([S2, -S2, 0, 0], -(1.0004 * S2 - 1.25 * S2) / 4),
    # clip-higher 0.28: 1.25 is inside, so e0 keeps 1.25 S2 per token; token mean over 6
    "dapo": ([S2, -S2, 0, 0], -(2 * 1.25 * S2 - 1.25 * S2) / 6),
    # A = (R - 0.75) / 0.5 = [0.5, -1.5, 0.5, 0.5]. Tokens: e0 2 * 1.2 * 0.5 = 1.2,
    # e1 min(-1.875, -1.8) = -1.875, e2 1.2, e3 0.6 -> -(1.2 - 1.875 + 1.2 + 0.6) / 6 = -0.1875
    "reinforce_pp": ([0.5, -1.5, 0.5, 0.5], -(1.2 - 1.875 + 1.2 + 0.6) / 6),
    # centered [0.5, -0.5, 0, 0], std_B = sqrt(0.5 / 3) = 0.408248 -> A = +-1.224745
    # tokens: e0 2 * 1.2 * 1.224745, e1 -1.25 * 1.224745 -> /6 = -0.234743
    "reinforce_pp_baseline": (
        [1.224745, -1.224745, 0, 0],
        -(2 * 1.2 * 1.224745 - 1.25 * 1.224745) / 6,
    ),
    # gate f(r) = sigmoid(tau (r - 1)) 4 / tau: e0 4 * 0.562177 * S2 = 1.590075,
    # e1 -(4 / 1.05) * 0.565251 * S2 = -1.522639; per-response mean / 4 -> -0.016859
    "sapo": ([S2, -S2, 0, 0], -(4 * SIG * S2 - 4 / 1.05 * SIG_N * S2) / 4),
}


def run(name: str, log_ratios: torch.Tensor | None = None, **inputs: Any):
    spec = get_algorithm(name)
    adv = group_advantages_of(spec.advantage, R, GROUPS, EPISODES)
    logp = torch.full((4, 2), math.log(1.25)) if log_ratios is None else log_ratios
    logp = logp.clone().requires_grad_(True)
    loss, stats = policy_loss(logp, torch.zeros(4, 2), None, adv, MASK, spec.loss, **inputs)
    return adv, loss, stats, logp


@pytest.mark.parametrize("name", sorted(CASES))
def test_algorithm_by_hand(name):
    want_adv, want_loss = CASES[name]
    inputs: dict[str, Any] = {"max_tokens": 4} if name == "dr_grpo" else {}
    adv, loss, _, logp = run(name, **inputs)
    torch.testing.assert_close(adv, torch.tensor(want_adv, dtype=torch.float32), rtol=0, atol=1e-5)
    assert loss.item() == pytest.approx(want_loss, abs=1e-5)
    loss.backward()
    assert logp.grad is not None and torch.isfinite(logp.grad).all()


def test_m2po_by_hand():
    # log-ratios to behaviour: e1's token 0.5, all others 0. M2 = 0.25 / 6 = 0.041667 > 0.04:
    # e1's token is masked; e0's tokens have r = 1, A = S2, no clip.
    # token mean: -(2 * S2) / 6 = -0.235702 (without the mask e1 would add -exp(0.5) S2)
    lr = torch.zeros(4, 2)
    lr[1, 0] = 0.5
    _, loss, stats, logp = run("m2po", lr)
    assert loss.item() == pytest.approx(-2 * S2 / 6, abs=1e-6)
    assert stats["m2po_masked_fraction"] == pytest.approx(1 / 6)
    loss.backward()
    assert logp.grad is not None and logp.grad[1, 0].item() == 0.0


def test_ppo_by_hand():
    # one row of 3 tokens, reward 1 at the end, values [0.5, 0.6, 0.7], gamma 1, lam 0.95:
    # deltas: 0.6 - 0.5 = 0.1, 0.7 - 0.6 = 0.1, 1 - 0.7 = 0.3
    # A2 = 0.3; A1 = 0.1 + 0.95 * 0.3 = 0.385; A0 = 0.1 + 0.95 * 0.385 = 0.46575
    spec = get_algorithm("ppo")
    assert spec.critic is not None and spec.critic.whiten  # whitening spans a batch: the loop's
    assert (spec.critic.lam, spec.critic.value_clip) == (0.95, 0.2)
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    adv, ret = gae(torch.tensor([[0.0, 0.0, 1.0]]), values, mask, 1.0, spec.critic.lam)
    torch.testing.assert_close(adv, torch.tensor([[0.46575, 0.385, 0.3]]))
    # r = 1: policy loss = -mean(A) = -0.383583
    loss, _ = policy_loss(torch.zeros(1, 3), torch.zeros(1, 3), None, adv, mask, spec.loss)
    assert loss.item() == pytest.approx(-(0.46575 + 0.385 + 0.3) / 3, abs=1e-6)
    # value loss with V = V_old: 0.5 * mean(A^2) = 0.5 * (0.216923 + 0.148225 + 0.09) / 3
    vloss, _ = value_loss(values, values, ret, mask, clip=spec.critic.value_clip)
    assert vloss.item() == pytest.approx(0.5 * (0.46575**2 + 0.385**2 + 0.09) / 3, abs=1e-6)
    with pytest.raises(ConfigError, match="gae"):
        group_advantages_of(spec.advantage, R, GROUPS, EPISODES)


def test_every_algorithm_is_checked_by_hand():
    assert set(ALGORITHMS) == set(CASES) | {"m2po", "ppo"}


def test_specs_document_formula_and_reference():
    for name, spec in ALGORITHMS.items():
        assert spec.name == name
        assert "L" in spec.doc and "::" in spec.doc, name  # a formula block
        assert "20" in spec.reference, name  # author, year, title


def test_aggregation_of_each_algorithm():
    agg = {name: spec.loss.token_agg for name, spec in ALGORITHMS.items()}
    assert agg["grpo"] == agg["gspo"] == agg["sapo"] == agg["ppo"] == "seq_mean_token_mean"
    assert agg["dr_grpo"] == "seq_mean_token_sum_norm"
    assert agg["rloo"] == "seq_mean_token_sum"
    for name in ("dapo", "lite_ppo", "reinforce_pp", "reinforce_pp_baseline", "m2po"):
        assert agg[name] == "token_mean", name


def test_dapo_flags_and_overlong_penalty():
    spec = get_algorithm("dapo")
    assert spec.dynamic_sampling and spec.loss.clip_high == 0.28 and spec.loss.clip_low == 0.2
    assert spec.overlong is not None
    # budget 10, default cache 20% = 2: free up to 8; 9 -> (8 - 9)/2 = -0.5; 10 -> -1; 11 -> -1
    pen = overlong_penalty(torch.tensor([8, 9, 10, 11]), 10, spec.overlong.cache(10))
    torch.testing.assert_close(pen, torch.tensor([0.0, -0.5, -1.0, -1.0]))
    assert not get_algorithm("grpo").dynamic_sampling


def test_gspo_treats_each_completion_of_a_merged_row_as_a_sequence():
    spec = get_algorithm("gspo")
    logp = torch.tensor([[0.1, 0.3, -0.2, 0.0, -0.1]])
    kw = dict(segment_ids=torch.tensor([[0, 0, 1, 1, 1]]))
    _, stats = policy_loss(
        logp, torch.zeros(1, 5), None, torch.ones(1, 5), torch.ones(1, 5), spec.loss, **kw
    )
    # segment ratios exp(0.2) and exp(-0.1): mean over tokens (2 * 1.221403 + 3 * 0.904837) / 5
    assert stats["ratio_mean"] == pytest.approx((2 * math.exp(0.2) + 3 * math.exp(-0.1)) / 5)


def test_episode_weighting_through_the_spec():
    # a 5-turn episode (rows 0-4, 2 tokens each) and a 1-turn one (row 5, 4 tokens)
    tc = torch.full((6, 4), -1)
    tc[:5, :2] = 0
    tc[5] = 0
    w = loss_weights(get_algorithm("grpo").loss, tc, ["long"] * 5 + ["short"])
    assert w[:5].sum().item() == pytest.approx(w[5].sum().item()) == pytest.approx(0.5)
    wt = loss_weights(get_algorithm("dapo").loss, tc, ["long"] * 5 + ["short"])  # token level
    assert w[:5].sum().item() < wt[:5].sum().item()


def test_get_algorithm_forgives_spelling_and_suggests():
    assert get_algorithm("Dr.GRPO").name == "dr_grpo"
    assert get_algorithm("REINFORCE++").name == "reinforce_pp"
    assert get_algorithm("reinforce++-baseline").name == "reinforce_pp_baseline"
    assert get_algorithm("LitePPO").name == "lite_ppo"
    with pytest.raises(ConfigError, match="Did you mean 'grpo'"):
        get_algorithm("grpoo")
    with pytest.raises(ConfigError, match="Did you mean 'dapo'"):
        get_algorithm("dappo")
    with pytest.raises(ConfigError, match="Known algorithms: grpo"):
        get_algorithm("qqqqq")


def test_specs_are_frozen_and_validated():
    spec = get_algorithm("grpo")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.loss.clip_high = 0.3  # type: ignore[misc]
    custom = dataclasses.replace(spec, loss=dataclasses.replace(spec.loss, clip_high=0.28))
    assert custom.loss.clip_high == 0.28 and spec.loss.clip_high == 0.2
    with pytest.raises(ConfigError, match=r"loss\.agg: expected one of 'mean', 'sum'"):
        LossSpec(agg="avg")  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as info:
        LossSpec(behaviour_cap=0.5, sapo_tau_pos=1.0)
    assert len(info.value.problems) == 2  # every problem at once
    with pytest.raises(ConfigError, match="omega"):
        AdvantageSpec(omega=-1.0)
    with pytest.raises(ConfigError, match="critic"):
        AlgorithmSpec("x", "ref", AdvantageSpec(), LossSpec(), critic=CriticConfig())
    with pytest.raises(ConfigError, match="critic"):
        AlgorithmSpec("x", "ref", AdvantageSpec(estimator="gae"), LossSpec())


def test_async_without_a_correction_is_refused():
    check_async_correction(0, "none")  # synchronous: fine
    check_async_correction(4, "clip")
    check_async_correction(4, "mask")
    with pytest.raises(ConfigError, match=r"set loss\.behaviour_correction=clip \(or mask\)"):
        check_async_correction(2, "none")
    with pytest.raises(ValueError, match=">= 0"):
        check_async_correction(-1, "clip")
    assert all(s.loss.behaviour_correction != "none" for s in ALGORITHMS.values())


@pytest.mark.gpu
def test_every_algorithm_gives_the_same_numbers_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 2, generator=gen) * 0.3
    tc = torch.tensor([[0, 0], [0, -1], [0, 1], [0, -1]])
    for name, spec in ALGORITHMS.items():
        out = {}
        for dev in ("cpu", "cuda"):
            if spec.needs_critic:
                adv = gae(R[:, None].expand(4, 2).to(dev), logp.to(dev), MASK.to(dev), 1.0, 0.95)[0]
            else:
                adv = group_advantages_of(spec.advantage, R.to(dev), GROUPS, EPISODES)
            w = loss_weights(spec.loss, tc.to(dev), EPISODES, max_tokens=4)
            x = logp.to(dev).requires_grad_(True)
            loss, stats = policy_loss(
                x, torch.zeros(4, 2, device=dev), None, adv, MASK.to(dev), spec.loss, weights=w,
                segment_ids=tc.to(dev), ref_logp=torch.zeros(4, 2, device=dev),
            )  # fmt: skip
            loss.backward()
            assert x.grad is not None
            out[dev] = (loss.item(), x.grad.cpu(), stats)
        assert out["cuda"][0] == pytest.approx(out["cpu"][0], abs=1e-5), name
        torch.testing.assert_close(out["cuda"][1], out["cpu"][1], rtol=1e-4, atol=1e-5)


def test_the_registry_is_where_the_facts_come_from():
    """The config's ``algorithm`` values and the facts it checks against are the registry's."""
    import typing

    from areal_agents.trainer.algorithms import (
        CRITIC_ALGORITHMS,
        DYNAMIC_SAMPLING_ALGORITHMS,
        GROUP_ALGORITHMS,
        AlgorithmName,
    )

    assert tuple(ALGORITHMS) == typing.get_args(AlgorithmName)
    assert set(ALGORITHMS) - GROUP_ALGORITHMS == {"ppo", "reinforce_pp"}  # no group baseline
    assert [sorted(CRITIC_ALGORITHMS), sorted(DYNAMIC_SAMPLING_ALGORITHMS)] == [["ppo"], ["dapo"]]
