"""Prefix sharing in the trainer: the tree layout gives the logprobs and gradients of
separate forward passes while computing shared prefixes once."""

from __future__ import annotations

import random

import pytest
import torch

from areal_agents.trainer.policy import Policy, make_tree_packed, pack_shared, tree_tokens


def _seqs() -> list[list[int]]:
    rng = random.Random(0)
    system = [1, *(rng.randrange(3, 200) for _ in range(12))]
    q1, q2 = [rng.randrange(3, 200) for _ in range(5)], [rng.randrange(3, 200) for _ in range(4)]
    turn = [rng.randrange(3, 200) for _ in range(6)]
    return [
        system + q1 + [rng.randrange(3, 200) for _ in range(7)],
        system + q1 + [rng.randrange(3, 200) for _ in range(3)],
        system + q1 + turn,  # a prefix of the next one (a two-turn episode's first call)
        system + q1 + turn + [rng.randrange(3, 200) for _ in range(5)],
        system + q2 + [rng.randrange(3, 200) for _ in range(6)],
        system + q2 + [rng.randrange(3, 200) for _ in range(6)],
        [7, 8, 9, 10, 11, 12],  # shares nothing
    ]


def test_tree_layout_hand_checked():
    seqs = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4], [9, 8]]
    assert tree_tokens(seqs) == 4 + 1 + 2  # [1 2 3 4] + [5] + [9 8]
    packed = make_tree_packed(seqs, [0, 1, 2, 3], "cpu")
    row = packed.input_ids[0].tolist()
    assert sorted(row) == sorted([1, 2, 3, 4, 5, 9, 8])
    for k, seq in enumerate(seqs):
        rows = packed.item_rows(k)
        assert [row[r] for r in rows.tolist()] == seq
        assert packed.position_ids[0, rows].tolist() == list(range(len(seq)))
    allowed = packed.attention_mask[0, 0] == 0
    r5 = packed.item_rows(1)[-1]
    # token 5 sees 1, 2 and itself, not 3 or 4 (another branch) nor 9, 8
    assert sorted(row[c] for c in allowed[r5].nonzero().flatten().tolist()) == [1, 2, 5]
    r8 = packed.item_rows(3)[-1]
    assert sorted(row[c] for c in allowed[r8].nonzero().flatten().tolist()) == [8, 9]
    assert pack_shared(seqs, 6) == [[0, 2, 1], [3]]  # sorted order; 4 + 0 + 1 tokens, then 2


@pytest.mark.parametrize("needed_windows", [False, True])
def test_tree_packing_equals_flat_logprobs_and_gradients(tiny_model_dir, needed_windows):
    seqs = _seqs()
    assert tree_tokens(seqs) < 0.6 * sum(len(s) for s in seqs)
    needed = None
    if needed_windows:
        needed = [torch.zeros(len(s) - 1) for s in seqs]
        for s, m in zip(seqs, needed, strict=True):
            m[len(s) - 6 :] = 1  # the last tokens: a completion
        needed[3][-9] = 1  # a window that reaches back into a shared segment
    flat = Policy(str(tiny_model_dir), dtype="float32", device="cpu", lr=1e-2, share_prefixes=False)
    tree = Policy(str(tiny_model_dir), dtype="float32", device="cpu", lr=1e-2)
    for budget in (20, 4096):  # several micro-batches, and one
        lp_flat = flat.logprobs(seqs, 0.7, 4096, needed)
        lp_tree = tree.logprobs(seqs, 0.7, budget, needed)
        for a, b in zip(lp_flat, lp_tree, strict=True):
            assert a.shape == b.shape
            assert torch.allclose(a, b, atol=1e-5)

    def loss_fn(items, logps, ents):
        weights = [torch.linspace(0.5, 1.5, len(seqs[i]) - 1) for i in items]
        terms = [(lp * w).sum() for lp, w in zip(logps, weights, strict=True)]
        return -torch.stack(terms).sum() / 50, {"ent": float(sum(e.sum() for e in ents))}

    s_flat = flat.train_step(seqs, loss_fn, 0.7, 4096, needed)
    s_tree = tree.train_step(seqs, loss_fn, 0.7, 30, needed)
    assert s_tree["micro_batches"] > 1
    assert s_flat["ent"] == pytest.approx(s_tree["ent"], rel=1e-5)
    assert s_flat["grad_norm"] == pytest.approx(s_tree["grad_norm"], rel=1e-4)
    for pf, pt in zip(flat.params, tree.params, strict=True):
        assert pf.grad is not None and pt.grad is not None
        assert (pf.grad - pt.grad).norm() <= 1e-4 * pf.grad.norm() + 1e-12


def test_tree_packing_with_lora_in_bfloat16(tiny_model_dir):
    """The mixed setup of the CPU recipe: a bfloat16 base with float32 adapters."""
    seqs = _seqs()[:4]
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    kw = {"dtype": "bfloat16", "device": "cpu", "lr": 1e-2, "lora": lora}
    flat = Policy(str(tiny_model_dir), share_prefixes=False, **kw)
    tree = Policy(str(tiny_model_dir), **kw)
    for a, b in zip(flat.logprobs(seqs, 1.0), tree.logprobs(seqs, 1.0), strict=True):
        assert torch.allclose(a, b, atol=3e-2)
