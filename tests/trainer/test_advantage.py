"""Advantages: group baselines over episodes (by id), GAE, loss weights, DAPO's helpers."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from areal_agents.trainer.advantage import (
    completion_returns,
    completion_weights,
    expand_to_tokens,
    filter_uniform_groups,
    gae,
    group_advantages,
    overlong_penalty,
    tree_gae,
    whiten,
)
from areal_agents.trajectory import Completion, Episode


def chain(session_id: str, group_id: str, turn_rewards: list[float], final: float) -> Episode:
    """An episode of len(turn_rewards) turns in a line, each turn continuing the previous."""
    ep = Episode(session_id, group_id=group_id, final_reward=final)
    messages = [{"role": "user", "content": f"task {group_id}"}]
    for k, r in enumerate(turn_rewards):
        reply = {"role": "assistant", "content": f"{session_id} turn {k}"}
        ep.add(
            Completion(
                id=f"{session_id}-{k}",
                messages=list(messages),
                prompt_ids=[1],
                output_ids=[2],
                output_logprobs=[-0.1],
                output_versions=[0],
                message=reply,
                finish_reason="stop",
                reward=r,
            )
        )
        messages = [*messages, reply, {"role": "user", "content": f"feedback {k}"}]
    return ep


def close(a: torch.Tensor, b: Any, tol: float = 1e-5) -> None:
    torch.testing.assert_close(a.double(), torch.tensor(b, dtype=torch.float64), rtol=0, atol=tol)


# ------------------------------------------------------------------ group baselines
def test_grpo_by_hand():
    # R = [1, 0, 0]: mean 1/3, std (n-1) = sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    # A = (2/3) / sqrt(1/3) = 2/sqrt(3) and (-1/3) / sqrt(1/3) = -1/sqrt(3)
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0]), ["g"] * 3, ["a", "b", "c"], eps=0.0)
    s3 = math.sqrt(3)
    close(adv, [2 / s3, -1 / s3, -1 / s3])


def test_rloo_by_hand():
    # baseline = mean of the OTHER episodes: a: (0 + 0)/2 = 0, b: (1 + 0)/2, c: (1 + 0)/2
    adv = group_advantages(
        torch.tensor([1.0, 0.0, 0.0]), ["g"] * 3, ["a", "b", "c"], baseline="rloo", scale="none"
    )
    close(adv, [1.0, -0.5, -0.5])


def test_rloo_single_episode_group_gets_zero():
    adv = group_advantages(torch.tensor([3.0]), ["g"], ["a"], baseline="rloo", scale="none")
    close(adv, [0.0])


def test_dr_grpo_no_std_by_hand():
    # mean 1/3: A = 1 - 1/3, 0 - 1/3, 0 - 1/3
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0]), ["g"] * 3, [0, 1, 2], scale="none")
    close(adv, [2 / 3, -1 / 3, -1 / 3])


TWO_R = torch.tensor([1.0, 0.0, 1.0, 1.0])
TWO_G = ["g1", "g1", "g2", "g2"]


def test_lite_ppo_group_mean_batch_std_by_hand():
    # batch R = [1, 0, 1, 1]: mean 0.75, std (n-1) = sqrt((3 * 0.0625 + 0.5625) / 3) = 0.5
    # g1 mean 0.5 -> (1 - 0.5)/0.5 = 1, (0 - 0.5)/0.5 = -1;  g2 mean 1 -> 0, 0
    adv = group_advantages(TWO_R, TWO_G, [0, 1, 2, 3], scale="batch_std", eps=0)
    close(adv, [1.0, -1.0, 0.0, 0.0])


def test_reinforce_pp_batch_normalization_by_hand():
    # (R - 0.75) / 0.5 = [0.5, -1.5, 0.5, 0.5]
    adv = group_advantages(
        TWO_R,
        TWO_G,
        [0, 1, 2, 3],
        baseline="batch",
        scale="batch_std",
        eps=0,
    )
    close(adv, [0.5, -1.5, 0.5, 0.5])


def test_reinforce_pp_baseline_by_hand():
    # centered by group mean: [0.5, -0.5, 0, 0]; std (n-1) = sqrt(0.5 / 3) = 0.408248
    # A = [0.5, -0.5, 0, 0] / 0.408248 = [1.224745, -1.224745, 0, 0]
    adv = group_advantages(
        TWO_R,
        TWO_G,
        [0, 1, 2, 3],
        baseline="mean",
        scale="batch_centered_std",
        eps=0,
    )
    close(adv, [1.224745, -1.224745, 0.0, 0.0])


def test_final_reward_only_gamma_one_equals_plain_grpo():
    # Groups of 4 episodes with 1..5 turns each and only a final reward: every completion's
    # return is its episode's reward, so each completion's advantage is plain GRPO's.
    gen = torch.Generator().manual_seed(0)
    episodes, plain = [], {}
    for g in range(5):
        rewards = torch.rand(4, generator=gen, dtype=torch.float64)
        mean, std = rewards.mean(), rewards.std()
        for i in range(4):
            turns = int(torch.randint(1, 6, (1,), generator=gen))
            episodes.append(chain(f"g{g}e{i}", f"g{g}", [0.0] * turns, float(rewards[i])))
            plain[f"g{g}e{i}"] = float((rewards[i] - mean) / (std + 1e-6))
    rows = completion_returns(episodes, gamma=1.0)
    adv = group_advantages(rows.returns, rows.group_ids, rows.episode_ids, roots=rows.roots)
    expected = torch.tensor([plain[e] for e in rows.episode_ids], dtype=torch.float64)
    assert len(rows.episode_ids) > 20  # several completions per episode
    # equal up to float64 summation order
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)


def test_final_reward_only_rows_in_any_order_equal_plain_grpo():
    # The same claim on hand-made rows with uneven turn counts per episode.
    r = torch.tensor([[0.3, 0.9, 0.1], [1.0, 0.0, 0.5]], dtype=torch.float64)
    turns = [[1, 3, 2], [5, 1, 2]]
    returns, groups, eps, roots = [], [], [], []
    for g in range(2):
        for i in range(3):
            for k in range(turns[g][i]):
                returns.append(float(r[g, i]))
                groups.append(f"g{g}")
                eps.append(f"{g}-{i}")
                roots.append(k == 0)
    adv = group_advantages(
        torch.tensor(returns, dtype=torch.float64), groups, eps, roots=torch.tensor(roots)
    )
    plain = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)
    expected = [float(plain[int(e[0]), int(e[2])]) for e in eps]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


def test_three_turn_episode_with_per_turn_rewards_by_hand():
    # gamma = 0.9.  e1: turn rewards [0.1, 0.0, 0.5], final 1.0 (credited to the last turn)
    #   G3 = 0.5 + 1.0 = 1.5;  G2 = 0 + 0.9 * 1.5 = 1.35;  G1 = 0.1 + 0.9 * 1.35 = 1.315
    # e2: one turn, final 0: G = 0.   e3: two turns, final 1: G2 = 1.0, G1 = 0.9
    # episode returns R = [1.315, 0, 0.9]: mean 0.738333, sum of squares 0.903817
    #   std = sqrt(0.903817 / 2) = 0.672241
    # A(c) = (G(c) - 0.738333) / 0.672241
    #   e1: 0.857827, 0.909892, 1.133026   e2: -1.098316   e3: 0.240489, 0.389245
    eps_ = [
        chain("e1", "g", [0.1, 0.0, 0.5], 1.0),
        chain("e2", "g", [0.0], 0.0),
        chain("e3", "g", [0.0, 0.0], 1.0),
    ]
    rows = completion_returns(eps_, gamma=0.9)
    close(rows.returns, [1.315, 1.35, 1.5, 0.0, 0.9, 1.0])
    assert rows.roots.tolist() == [True, False, False, True, True, False]
    adv = group_advantages(rows.returns, rows.group_ids, rows.episode_ids, roots=rows.roots, eps=0)
    close(adv, [0.857827, 0.909892, 1.133026, -1.098316, 0.240489, 0.389245])


def test_groups_are_found_by_id_not_row_order():
    gen = torch.Generator().manual_seed(1)
    returns = torch.rand(12, generator=gen)
    groups = [f"g{(i // 2) % 3}" for i in range(12)]  # interleaved groups
    episodes = [f"e{i // 2}" for i in range(12)]  # two completions per episode
    roots = torch.tensor([i % 2 == 0 for i in range(12)])
    for baseline, scale in [("mean", "std"), ("rloo", "none"), ("mean", "batch_centered_std")]:
        kw: dict[str, Any] = dict(baseline=baseline, scale=scale)
        ref = group_advantages(returns, groups, episodes, roots=roots, **kw)
        perm = torch.randperm(12, generator=gen)
        shuffled = group_advantages(
            returns[perm],
            [groups[i] for i in perm],
            [episodes[i] for i in perm],
            roots=roots[perm],
            **kw,
        )
        torch.testing.assert_close(shuffled, ref[perm])


def test_uniform_group_gives_zero_not_explosion():
    # Two successful 2-turn episodes, gamma 0.9: G = [0.9, 1.0] each; std over R = 0.
    # GRPO's rule would divide 1.0 - 0.9 by eps; the group carries no signal: 0.
    rows = completion_returns([chain("a", "g", [0, 0], 1.0), chain("b", "g", [0, 0], 1.0)], 0.9)
    adv = group_advantages(rows.returns, rows.group_ids, rows.episode_ids, roots=rows.roots)
    close(adv, [0.0, 0.0, 0.0, 0.0])
    # Without scaling, the later turn is still 0.1 above the episode return.
    adv = group_advantages(
        rows.returns, rows.group_ids, rows.episode_ids, roots=rows.roots, scale="none"
    )
    close(adv, [0.0, 0.1, 0.0, 0.1])


def test_group_advantages_rejects_bad_input():
    r = torch.tensor([1.0, 0.0])
    with pytest.raises(ValueError, match="two groups"):
        group_advantages(r, ["g1", "g2"], ["e", "e"], roots=torch.tensor([True, False]))
    with pytest.raises(ValueError, match="roots="):
        group_advantages(r, ["g", "g"], ["e", "e"])
    with pytest.raises(ValueError, match="baseline: expected one of"):
        group_advantages(r, ["g", "g"], ["a", "b"], baseline="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected 2 ids"):
        group_advantages(r, ["g"], ["a", "b"])


# ------------------------------------------------------------------ weights
def test_episode_weighting_five_turns_weigh_as_much_as_one():
    # Episode A: five completions of 2 tokens (one row each); episode B: one of 4 tokens.
    tc = torch.full((6, 4), -1)
    tc[:5, 1:3] = 0
    tc[5, :] = 0
    eps_ = ["A"] * 5 + ["B"]
    w = completion_weights(tc, eps_)  # episode / mean: each episode sums to 1/2
    assert w[:5].sum().item() == pytest.approx(0.5)
    assert w[5].sum().item() == pytest.approx(0.5)
    assert w[0, 1].item() == pytest.approx(0.5 / 10)  # 10 tokens share A's half
    assert w[5, 0].item() == pytest.approx(0.5 / 4)
    assert (w[tc < 0] == 0).all()
    # A loss of 1 on A's tokens and 0 on B's: 0.5 with episode weighting, 10/14 per token.
    token_loss = (torch.arange(6) < 5).float().unsqueeze(1).expand(6, 4)
    assert (w * token_loss).sum().item() == pytest.approx(0.5)
    wt = completion_weights(tc, eps_, weighting="token")
    assert (wt * token_loss).sum().item() == pytest.approx(10 / 14)
    wc = completion_weights(tc, eps_, weighting="completion")  # 6 completions, 1/6 each
    assert (wc * token_loss).sum().item() == pytest.approx(5 / 6)


def test_weights_of_merged_rows_and_reductions():
    # One merged row with two completions (2 and 3 tokens), one row of one completion (1 token)
    tc = torch.tensor([[-1, 0, 0, -1, 1, 1, 1], [0, -1, -1, -1, -1, -1, -1]])
    wc = completion_weights(tc, ["x", "y"], weighting="completion")
    close(wc[0], [0, 1 / 6, 1 / 6, 0, 1 / 9, 1 / 9, 1 / 9])  # 3 units: 1/(3*2), 1/(3*3)
    close(wc[1, :1], [1 / 3])
    ws = completion_weights(tc, ["x", "y"], reduce="sum")  # 2 episodes: 1/2 per token
    close(ws[0], [0, 0.5, 0.5, 0, 0.5, 0.5, 0.5])
    wn = completion_weights(tc, ["x", "y"], reduce="sum_norm", max_tokens=8)  # 1/(2*8)
    close(wn[1, :1], [1 / 16])
    with pytest.raises(ValueError, match="max_tokens"):
        completion_weights(tc, ["x", "y"], reduce="sum_norm")


def test_micro_batch_losses_add_up_to_the_batch_loss():
    gen = torch.Generator().manual_seed(2)
    tc = torch.randint(-1, 3, (6, 5), generator=gen)
    eps_ = ["a", "a", "b", "c", "c", "c"]
    loss_tok = torch.rand(6, 5, generator=gen)
    w = completion_weights(tc, eps_)
    whole = (w * loss_tok).sum()
    parts = (w[:2] * loss_tok[:2]).sum() + (w[2:] * loss_tok[2:]).sum()
    assert parts.item() == pytest.approx(whole.item())


def test_expand_to_tokens():
    values = torch.tensor([[0.5, -1.0], [2.0, 0.0]])
    tc = torch.tensor([[-1, 0, 0, 1], [0, 0, -1, -1]])
    close(expand_to_tokens(values, tc), [[0, 0.5, 0.5, -1.0], [2.0, 2.0, 0, 0]])


# ------------------------------------------------------------------ DAPO helpers
def test_filter_uniform_groups():
    # a: all 1 -> drop; b: 0 and 1 -> keep; c: all 0 -> drop
    keep = filter_uniform_groups(
        torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]), ["a", "b", "a", "a", "c", "b", "c"]
    )
    assert keep.tolist() == [False, True, False, False, False, True, False]


def test_overlong_penalty_by_hand():
    # max_len 10, cache 4: free up to 6; 8 -> (6 - 8)/4 = -0.5; 10 -> -1; 11 (over) -> -1
    close(
        overlong_penalty(torch.tensor([5, 6, 7, 8, 10, 11]), 10, 4),
        [0, 0, -0.25, -0.5, -1, -1],
    )
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(torch.tensor([1]), 10, 11)


# ------------------------------------------------------------------ GAE
def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    # gamma = lam = 1: A_t = sum of future rewards - V_t
    adv, ret = gae(rewards, values, mask, 1.0, 1.0)
    close(adv, [[0.5, 0.4, 0.3]])
    close(ret, [[1.0, 1.0, 1.0]])
    # gamma 0.9, lam 0.5: deltas 0.3, 0 + 0.9*0.7 - 0.6 = 0.03, 0.9*0.6 - 0.5 = 0.04
    # A2 = 0.3; A1 = 0.03 + 0.45 * 0.3 = 0.165; A0 = 0.04 + 0.45 * 0.165 = 0.11425
    adv, _ = gae(rewards, values, mask, 0.9, 0.5)
    close(adv, [[0.11425, 0.165, 0.3]])


def _gae_loop(r, v, m, gamma, lam, boot):
    """Reference: plain GAE over each row's sampled tokens only."""
    out = [[0.0] * len(r[0]) for _ in r]
    for b in range(len(r)):
        idx = [t for t in range(len(r[b])) if m[b][t]]
        nxt_v, nxt_a = boot[b], 0.0
        for t in reversed(idx):
            delta = r[b][t] + gamma * nxt_v - v[b][t]
            nxt_a = delta + gamma * lam * nxt_a
            out[b][t] = nxt_a
            nxt_v = v[b][t]
    return out


def test_gae_matches_a_hand_loop_with_holes_and_bootstrap():
    gen = torch.Generator().manual_seed(3)
    r = torch.rand(3, 9, generator=gen)
    v = torch.rand(3, 9, generator=gen)
    m = torch.ones(3, 9)
    m[0, 3:5] = 0  # tool tokens inside a merged sample
    m[1, 6:] = 0  # padding
    m[2, 0] = 0
    boot = torch.tensor([0.0, 0.7, 0.0])  # row 1 was truncated
    adv, ret = gae(r, v, m, 0.95, 0.9, bootstrap=boot)
    expected = _gae_loop(r.tolist(), v.tolist(), m.tolist(), 0.95, 0.9, boot.tolist())
    torch.testing.assert_close(adv, torch.tensor(expected))
    torch.testing.assert_close(ret, torch.where(m.bool(), adv + v, torch.zeros_like(v)))


def test_gae_three_tokens_gamma_09_lambda_08_by_hand():
    # r = [0, 0.5, 1], V = [0.5, 0.6, 0.7], gamma 0.9, lam 0.8 (gamma * lam = 0.72):
    # delta2 = 1 - 0.7 = 0.3                  A2 = 0.3
    # delta1 = 0.5 + 0.9 * 0.7 - 0.6 = 0.53   A1 = 0.53 + 0.72 * 0.3 = 0.746
    # delta0 = 0 + 0.9 * 0.6 - 0.5 = 0.04     A0 = 0.04 + 0.72 * 0.746 = 0.57712
    # returns A + V = [1.07712, 1.346, 1.0]; check R1 = r1 + gamma ((1 - lam) V2 + lam R2)
    # = 0.5 + 0.9 (0.2 * 0.7 + 0.8 * 1.0) = 1.346
    rewards = torch.tensor([[0.0, 0.5, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = gae(rewards, values, torch.ones(1, 3), 0.9, 0.8)
    close(adv, [[0.57712, 0.746, 0.3]])
    close(ret, [[1.07712, 1.346, 1.0]])


def test_gae_with_a_per_token_discount_skips_masked_tokens():
    # A merged row: completion 0 (tokens 0, 1), a masked tool token, completion 1 (token 3).
    # gamma 0.9 only after a completion's last token; lam 0.5.
    # t3: 1 - 0.4 = 0.6                                       A3 = 0.6
    # t1: 0.2 + 0.9 * 0.4 - 0.2 = 0.36 (next sampled is t3)   A1 = 0.36 + 0.45 * 0.6 = 0.63
    # t0: 0 + 1.0 * 0.2 - 0.1 = 0.1                           A0 = 0.1 + 0.5 * 0.63 = 0.415
    rewards = torch.tensor([[0.0, 0.2, 0.0, 1.0]])
    values = torch.tensor([[0.1, 0.2, 9.0, 0.4]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    discounts = torch.tensor([[1.0, 0.9, 1.0, 0.9]])
    adv, ret = gae(rewards, values, mask, discounts, 0.5)
    close(adv, [[0.415, 0.63, 0.0, 0.6]])
    close(ret, [[0.515, 0.83, 0.0, 1.0]])
    with pytest.raises(ValueError, match="gamma: expected a number or shape"):
        gae(rewards, values, mask, torch.ones(1, 3), 0.5)


def test_tree_gae_continues_into_children_and_bootstraps_truncation_by_hand():
    # Sample 0 (one token, V 0.5, r 0) continues into samples 1 and 2 (one token each:
    # V 0.2, r 1 and V 0.6, r 0, both terminal). gamma 0.9 after sample 0's token, lam 0.5.
    # A1 = 1 - 0.2 = 0.8, A2 = 0 - 0.6 = -0.6; V_next = 0.4, A_next = 0.1
    # A0 = 0 + 0.9 * 0.4 - 0.5 + 0.9 * 0.5 * 0.1 = -0.095
    # Sample 3 (truncated): V [0.3, 0.7], r 0, gamma 0.9 after its last token; bootstrap
    # V_next = 0.7 (the value before the last token), A_next = 0:
    # A(t1) = 0.9 * 0.7 - 0.7 = -0.07;  A(t0) = 0.7 - 0.3 + 0.5 * -0.07 = 0.365
    t = torch.tensor
    adv, ret = tree_gae(
        [t([0.0]), t([1.0]), t([0.0]), t([0.0, 0.0])],
        [t([0.5]), t([0.2]), t([0.6]), t([0.3, 0.7])],
        [t([1.0]), t([1.0]), t([1.0]), t([1.0, 1.0])],
        [t([0.9]), t([0.9]), t([0.9]), t([1.0, 0.9])],
        [[1, 2], [], [], []],
        0.5,
        truncated=[False, False, False, True],
    )
    for got, want in zip(adv, [[-0.095], [0.8], [-0.6], [0.365, -0.07]], strict=True):
        close(got, want)
    close(ret[0], [0.405])
    close(ret[3], [0.665, 0.63])
    with pytest.raises(ValueError, match=r"children\[1\]: expected indices in \(1, 2\)"):
        tree_gae([t([0.0])] * 2, [t([0.0])] * 2, [t([1.0])] * 2, [t([1.0])] * 2, [[1], [0]], 1.0)


def test_tree_gae_empty_sample_passes_its_continuation_on():
    # sample 1 has no sampled token: sample 0 sees sample 2's first (V, A) through it
    t = torch.tensor
    adv, _ = tree_gae(
        [t([0.0]), t([0.0]), t([1.0])],
        [t([0.0]), t([5.0]), t([0.25])],
        [t([1.0]), t([0.0]), t([1.0])],
        [t([1.0]), t([1.0]), t([1.0])],
        [[1], [2], []],
        1.0,
    )
    close(adv[2], [0.75])
    close(adv[0], [1.0])  # 0 + 0.25 - 0 + 0.75: the return 1 at the end


def test_whiten_by_hand():
    # selected [1, 3]: mean 2, Bessel std sqrt(2) -> [-0.707107, 0.707107]; masked -> 0
    out = whiten(torch.tensor([1.0, 3.0, 9.0]), torch.tensor([1, 1, 0]), eps=0.0)
    close(out, [-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0])
    assert whiten(torch.tensor([2.0, 2.0]), torch.ones(2)).tolist() == [0.0, 0.0]
