"""The training loop's parts on a tiny model: packing, the gate, every algorithm, resume."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from areal_agents.errors import ConfigError
from areal_agents.run_state import read_run_state
from areal_agents.trainer.algorithms import ALGORITHMS
from areal_agents.trainer.batch import add_gae, build_batch, split_batch
from areal_agents.trainer.checkpoint import RunState
from areal_agents.trainer.config_io import load_config
from areal_agents.trainer.critic import Critic
from areal_agents.trainer.loop import Trainer
from areal_agents.trainer.policy import Policy, pack
from areal_agents.trainer.rollout import GroupSource, SourceSettings
from areal_agents.trainer.staleness import StalenessGate
from areal_agents.trainer.step import make_loss_fn, make_value_loss_fn, policy_updates
from areal_agents.trainer.time_budget import out_of_time_budget
from areal_agents.trajectory import Completion, Episode


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path) -> Policy:
    return Policy(str(tiny_model_dir), dtype="float32", device="cpu", lr=1e-2)


def test_pack_fills_budget_without_splitting():
    bins = pack([5, 3, 8, 2, 9], max_tokens=10)
    assert sorted(i for b in bins for i in b) == [0, 1, 2, 3, 4]
    lengths = [5, 3, 8, 2, 9]
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 3


def test_packed_logprobs_equal_one_sequence_at_a_time(policy):
    seqs = [list(range(10, 30)), list(range(40, 47)), list(range(5, 18))]
    packed = policy.logprobs(seqs, temperature=0.7, micro_batch_tokens=64)
    for seq, lp in zip(seqs, packed, strict=True):
        (alone,) = policy.logprobs([seq], temperature=0.7)
        assert lp.shape == (len(seq) - 1,)
        assert torch.allclose(lp, alone, atol=1e-5)
    with torch.no_grad():
        logits = policy.model(torch.tensor([seqs[0]])).logits[0, :-1].float() / 0.7
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(seqs[0][1:]).unsqueeze(1))
    assert torch.allclose(packed[0], ref.squeeze(1), atol=1e-5)


def test_needed_windows_give_the_same_logprobs_and_gradients(tiny_model_dir):
    """Logits only over each sequence's needed window: equal logprobs there, 0 outside,
    and exactly the same gradient for a loss that masks the rest."""
    seqs = [list(range(10, 30)), list(range(40, 47)), list(range(5, 18)), list(range(60, 66))]
    needed = [torch.zeros(len(s) - 1) for s in seqs]
    needed[0][12:19] = 1
    needed[1][2] = 1
    needed[2][[3, 9]] = 1  # a gap inside the window (a masked tool turn)
    full = Policy(str(tiny_model_dir), dtype="float32", device="cpu", lr=1e-2)
    part = Policy(str(tiny_model_dir), dtype="float32", device="cpu", lr=1e-2)
    lp_full = full.logprobs(seqs, 0.7, 32)
    lp_part = part.logprobs(seqs, 0.7, 32, needed)
    for a, b, m in zip(lp_full, lp_part, needed, strict=True):
        assert b.shape == a.shape
        assert torch.allclose(a[m > 0], b[m > 0], atol=1e-5)
        lo, hi = (int(m.nonzero()[0]), int(m.nonzero()[-1]) + 1) if m.any() else (0, 0)
        assert torch.all(b[:lo] == 0) and torch.all(b[hi:] == 0)

    def loss_fn(items, logps, ents):
        terms = [(lp * needed[i]).sum() for i, lp in zip(items, logps, strict=True)]
        loss = -torch.stack(terms).sum() / 10
        return loss, {
            "ent": float(sum((e * needed[i]).sum() for i, e in zip(items, ents, strict=True)))
        }

    s_full = full.train_step(seqs, loss_fn, 0.7, 32)
    s_part = part.train_step(seqs, loss_fn, 0.7, 32, needed)
    assert s_full["ent"] == pytest.approx(s_part["ent"], rel=1e-5)
    assert s_full["grad_norm"] == pytest.approx(s_part["grad_norm"], rel=1e-4)
    for pf, pp in zip(full.params, part.params, strict=True):  # the step left its gradients
        assert pf.grad is not None and pp.grad is not None
        assert (pf.grad - pp.grad).norm() <= 1e-4 * pf.grad.norm() + 1e-12


def test_each_token_is_scored_at_the_temperature_it_was_sampled_with(policy):
    """Per-token temperatures (``Batch.temps``): every token's logprob and entropy equal the
    plain computation at its own temperature, in flat and prefix-shared packing alike."""
    shared = list(range(10, 22))
    seqs = [shared + list(range(30, 40)), shared + list(range(50, 56)), list(range(5, 18))]
    temps = [torch.full((len(s) - 1,), 1.0) for s in seqs]
    temps[0][:11] = 0.5  # a first turn at 0.5, then a second at 1.0 (merged turns)
    temps[1][:] = 1.7
    temps[2][4:] = 0.0  # greedy: scored at 1, as the engines record it
    with torch.no_grad():
        want = []
        for s, t in zip(seqs, temps, strict=True):
            logits = policy.model(torch.tensor([s])).logits[0, :-1].float()
            t1 = torch.where(t > 0, t, torch.ones_like(t)).unsqueeze(1)
            logp = torch.log_softmax(logits / t1, -1)
            want.append(logp.gather(1, torch.tensor(s[1:]).unsqueeze(1)).squeeze(1))
    for budget in (16, 4096):  # each sequence alone / one prefix tree
        got = policy.logprobs(seqs, temps, budget)
        for g, w in zip(got, want, strict=True):
            assert torch.allclose(g, w, atol=1e-5)
    needed = [torch.zeros(len(s) - 1) for s in seqs]
    for m in needed:
        m[8:13] = 1  # logits only over a window (across seq 0's two temperatures)
    for g, w, m in zip(policy.logprobs(seqs, temps, 4096, needed), want, needed, strict=True):
        assert torch.allclose(g[m > 0], w[m > 0], atol=1e-5)
    assert not torch.allclose(policy.logprobs(seqs, 1.0)[0], want[0], atol=1e-3)

    seen = {}

    def loss_fn(items, logps, ents):
        for i, lp in zip(items, logps, strict=True):
            seen[i] = lp.detach()
        return -torch.stack([lp.sum() for lp in logps]).sum() * 0, {}

    policy.train_step(seqs, loss_fn, temps, 4096)
    for i, w in enumerate(want):
        assert torch.allclose(seen[i], w, atol=1e-5)


def test_sampled_logprobs_match_the_trainers_at_each_calls_temperature(
    tiny_model_dir, tmp_path, parity_env
):
    """Episodes whose calls chose their own temperature (0.5 and 1.6, while the config says
    1.0): the batch scores each token at its call's temperature, so the trainer's logprobs
    under the sampling weights equal the engine's (ratio 1 on fresh data)."""
    from areal_agents.trainer.loop import Trainer

    cfg = load_config(
        None,
        [
            "env.id=test/Parity-v0",
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            "rollout.group_size=3",
            "sampling.max_new_tokens=12",
            "sampling.by_kind={other: {temperature: 0.3}}",  # a kind this env never has
            "metrics.tensorboard=false",
            f"train.output_dir={tmp_path}",
        ],
    )
    trainer = Trainer(cfg, quiet=True)
    trainer._build()
    runner = trainer.source.runner
    assert runner.sampling_by_kind == {"other": {"temperature": 0.3}}

    async def sample() -> list:
        episodes = []
        for g, t in enumerate((0.5, 1.6)):
            runner.sampling["temperature"] = t
            results = await runner.run_group(trainer.make_env, 3, seed=g, sampling_seed=g)
            episodes += [r.episode for r in results]
        await trainer.engine.close()
        return episodes

    episodes = asyncio.run(sample())
    batch, _ = build_batch(episodes, trainer.spec, 1.0, 12, temperature=1.0)
    used = {round(float(t[m > 0][0]), 4) for t, m in zip(batch.temps, batch.mask, strict=True)}
    assert used == {0.5, 1.6}
    got = trainer.policy.logprobs(batch.seqs, batch.temps)
    flat = trainer.policy.logprobs(batch.seqs, 1.0)
    for lp, lp1, behav, m in zip(got, flat, batch.behav, batch.mask, strict=True):
        assert torch.allclose(lp[m > 0], behav[m > 0], atol=1e-4)
        assert not torch.allclose(lp1[m > 0], behav[m > 0], atol=1e-3)


async def test_gate_eta0_admits_one_batch_per_version_and_eta2_three():
    gate = StalenessGate(batch_size=2, eta=0)
    await gate.acquire()
    await gate.acquire()
    assert gate.capacity() == 0
    waiter = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    await gate.finish(accepted=True)
    await gate.finish(accepted=True)
    await asyncio.sleep(0.01)
    assert not waiter.done(), "eta=0: the next batch waits for the next version"
    await gate.set_version(1)
    await asyncio.wait_for(waiter, 1)
    gate2 = StalenessGate(batch_size=2, eta=2)
    for _ in range(6):
        await asyncio.wait_for(gate2.acquire(), 1)
    assert gate2.capacity() == 0
    await gate2.finish(accepted=False)  # a rejected group frees its slot
    assert gate2.capacity() == 1


def _episodes(policy: Policy, n_groups: int = 2, size: int = 3) -> list[Episode]:
    """Groups of scripted one- and two-turn episodes with behaviour logprobs from the policy."""
    eps = []
    g = torch.Generator().manual_seed(0)
    for gi in range(n_groups):
        for k in range(size):
            ep = Episode(f"e{gi}-{k}", group_id=f"g{gi}")
            prompt = list(range(100 + gi, 112 + gi))
            out = torch.randint(200, 300, (5 + k,), generator=g).tolist()
            (lp,) = policy.logprobs([prompt + out], 1.0)
            c = Completion(
                f"c{gi}{k}",
                [{"role": "user", "content": "q"}],
                prompt,
                out,
                lp[-len(out) :].tolist(),
                [0] * len(out),
                {"role": "assistant", "content": f"a{k}"},
                "stop",
            )
            ep.add(c)
            if k == 2:  # a second turn that extends the first exactly
                prompt2 = [*prompt, *out, 7, 8]
                out2 = [301, 302, 303]
                (lp2,) = policy.logprobs([prompt2 + out2], 1.0)
                ep.add(
                    Completion(
                        f"d{gi}{k}",
                        [
                            {"role": "user", "content": "q"},
                            {"role": "assistant", "content": f"a{k}"},
                            {"role": "user", "content": "more"},
                        ],
                        prompt2,
                        out2,
                        lp2[-3:].tolist(),
                        [0] * 3,
                        {"role": "assistant", "content": "b"},
                        "stop",
                    )
                )
            ep.final_reward = float(k == gi)
            eps.append(ep)
    return eps


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_trains_two_steps(narrow_model_dir, name):
    """Two full fine-tuning steps of each algorithm on the narrow tiny model."""
    policy = Policy(str(narrow_model_dir), dtype="float32", device="cpu", lr=1e-2)
    critic = None
    if ALGORITHMS[name].needs_critic:
        critic = Critic(str(narrow_model_dir), dtype="float32", device="cpu", lr=1e-3)
        critic_before = {k: v.clone() for k, v in critic.params.items()}
    cfg = load_config(
        None,
        [
            "env.id=areal/Calculator-v0",
            f"algorithm={name}",
            "rollout.max_head_offpolicyness=1",
            "sampling.max_new_tokens=16",
        ],
    )
    spec = cfg.algorithm_spec()
    before = {k: v.clone() for k, v in policy.model.named_parameters()}
    for step in range(2):
        batch, stats = build_batch(_episodes(policy), spec, 1.0, 16)
        assert stats["merge_rate"] == 1.0
        if critic is not None:
            gstats = add_gae(batch, critic.values(batch.seqs, 64), spec)
            assert abs(gstats["adv_mean"]) < 1e-5 and gstats["adv_std"] == pytest.approx(1.0)
        batch.prox = policy.logprobs(batch.seqs, 1.0)
        out = policy.train_step(batch.seqs, make_loss_fn(batch, spec, cfg, step), 1.0, 64)
        assert torch.isfinite(torch.tensor([out["grad_norm"], out["loss"]])).all()
        assert out["micro_batches"] >= 2
        if critic is not None:
            vout = critic.train_step(batch.seqs, make_value_loss_fn(batch, spec), 64)
            assert vout["value_loss"] > 0
            assert torch.isfinite(torch.tensor([vout["value_loss"], vout["value_grad_norm"]])).all()
    changed = [k for k, v in policy.model.named_parameters() if not torch.equal(v, before[k])]
    assert changed, f"{name}: no parameter changed"
    if critic is not None:
        moved = {k for k, v in critic.params.items() if not torch.equal(v, critic_before[k])}
        assert "head.weight" in moved and any(k.startswith("backbone.") for k in moved)


@pytest.mark.parametrize("name", ["dapo", "grpo", "dr_grpo"])
def test_a_minibatch_of_whole_groups_is_that_groups_own_batch(policy, name):
    """Split in two, a batch of four groups gives the batches of groups 0-1 and 2-3: the
    same samples and advantages (group baselines), loss weights over each half alone."""
    spec = load_config(None, ["env.id=x", f"algorithm={name}"]).algorithm_spec()
    episodes = _episodes(policy, n_groups=4)
    for ep in episodes[6:]:
        ep.final_reward = float(ep.session_id.endswith("-1"))  # groups 2, 3 not uniform
    full, _ = build_batch(episodes, spec, 1.0, 16)
    halves = split_batch(full, 2, spec, 16)
    assert len(halves) == 2
    for half, eps in zip(halves, (episodes[:6], episodes[6:]), strict=True):
        alone, _ = build_batch(eps, spec, 1.0, 16)
        assert half.seqs == alone.seqs and half.episode_ids == alone.episode_ids
        for field in ("mask", "behav", "versions", "adv", "weights", "segments"):
            for a, b in zip(getattr(half, field), getattr(alone, field), strict=True):
                assert torch.allclose(a.float(), b.float(), atol=1e-6), field
    if name == "dapo":  # token mean: each half's weights are 1 / (its sampled tokens)
        for half in halves:
            tokens = float(sum(m.sum() for m in half.mask))
            assert all(torch.allclose(w[m > 0], torch.tensor(1 / tokens)) for w, m in
                       zip(half.weights, half.mask, strict=True))  # fmt: skip
    assert split_batch(full, 1, spec, 16) == [full]
    assert len(split_batch(full, 50, spec, 16)) == 12  # at most one per episode
    with pytest.raises(ValueError, match="must be >= 1"):
        split_batch(full, 0, spec, 16)


TWO_MINIBATCHES = [
    "env.id=areal/Calculator-v0",
    "algorithm=dapo",
    "train.minibatches=2",
    "train.micro_batch_tokens=64",
    "sampling.max_new_tokens=16",
    "loss.proximal=loglinear",
]
"""DAPO in two mini-batches of tiny micro-batches, for the mini-batch and epoch tests."""


def test_minibatches_take_one_optimizer_step_each(tiny_model_dir):
    policy = Policy(str(tiny_model_dir), dtype="float32", device="cpu", lr=1e-2)
    cfg = load_config(None, TWO_MINIBATCHES)
    spec = cfg.algorithm_spec()
    batch, _ = build_batch(_episodes(policy, n_groups=2), spec, 1.0, 16)
    halves = split_batch(batch, 2, spec, 16)
    manual = Policy(str(tiny_model_dir), dtype="float32", device="cpu", lr=1e-2)
    by_hand = [manual.train_step(h.seqs, make_loss_fn(h, spec, cfg, 0), 1.0, 64) for h in halves]
    stats = policy_updates(policy, batch, spec, cfg, 0).stats
    steps = {int(s["step"]) for s in policy.optimizer.state_dict()["state"].values()}
    assert steps == {2}, "two mini-batches: two optimizer steps"
    for key in ("loss", "grad_norm"):  # the mean over the mini-batches
        assert stats[key] == pytest.approx((by_hand[0][key] + by_hand[1][key]) / 2, rel=1e-4)
    assert stats["micro_batches"] == by_hand[0]["micro_batches"] + by_hand[1]["micro_batches"]
    assert stats["tokens"] == pytest.approx(float(sum(m.sum() for m in batch.mask)))
    for p, q in zip(policy.params, manual.params, strict=True):
        assert torch.allclose(p, q, atol=1e-6)
    with pytest.raises(ValueError, match="minibatches"):
        load_config(None, ["env.id=x", "train.minibatches=0"])


def test_epochs_repeat_the_minibatches_in_order_and_record_the_first_pass(tiny_model_dir):
    """train.epochs=2 with two mini-batches: updates h0, h1, h0, h1 (four optimizer steps,
    one policy version), stats the mean over the four, and each sample's record as the
    first pass (the same as a one-pass step from the same weights) trained it."""
    cfg = load_config(None, [*TWO_MINIBATCHES, "train.epochs=2"])
    spec = cfg.algorithm_spec()
    policy = Policy(str(tiny_model_dir), dtype="float32", device="cpu", lr=1e-2)
    batch, _ = build_batch(_episodes(policy, n_groups=2), spec, 1.0, 16)
    halves = split_batch(batch, 2, spec, 16)
    manual = Policy(str(tiny_model_dir), dtype="float32", device="cpu", lr=1e-2)
    by_hand = [
        manual.train_step(h.seqs, make_loss_fn(h, spec, cfg, 0), 1.0, 64)
        for h in (*halves, *halves)
    ]
    one_pass = Policy(str(tiny_model_dir), dtype="float32", device="cpu", lr=1e-2)
    one_cfg = load_config(None, TWO_MINIBATCHES)
    first = policy_updates(one_pass, batch, spec, one_cfg, 0, record=True).records
    done = policy_updates(policy, batch, spec, cfg, 0, record=True)
    stats, records = done.stats, done.records
    steps = {int(s["step"]) for s in policy.optimizer.state_dict()["state"].values()}
    assert steps == {4}, "two passes over two mini-batches: four optimizer steps"
    for key in ("loss", "grad_norm"):
        assert stats[key] == pytest.approx(sum(o[key] for o in by_hand) / 4, rel=1e-4)
    assert stats["tokens"] == pytest.approx(2 * float(sum(m.sum() for m in batch.mask)))
    for p, q in zip(policy.params, manual.params, strict=True):
        assert torch.allclose(p, q, atol=1e-6)
    assert not all(
        torch.allclose(p, q, atol=1e-6) for p, q in zip(policy.params, one_pass.params, strict=True)
    ), "the second pass moved the weights further"
    assert len(records) == len(first) == len(batch.seqs)
    for r, f in zip(records, first, strict=True):
        assert r.session_id == f.session_id
        assert torch.allclose(r.values, f.values, atol=1e-6)
    with pytest.raises(ValueError, match="epochs"):
        load_config(None, ["env.id=x", "train.epochs=0"])


class _Arriving(GroupSource):
    """A source whose batch is complete after ``ready`` said no ``late`` times."""

    def __init__(self, late: int) -> None:
        super().__init__(SourceSettings.of(batch_size=1, group_size=2, eta=0), RunState())
        self.late, self.asked = late, 0

    def ready(self, n: int) -> bool:
        self.asked += 1
        return self.asked > self.late

    async def next_batch(self, n: int) -> list:
        return [("group", [])]


@pytest.mark.parametrize(("late", "filled"), [(3, 3), (9, 4), (0, 0)])
def test_fill_passes_repeat_the_last_batch_only_while_the_next_is_not_in(
    narrow_model_dir, late, filled
):
    """train.fill_passes=2 after a step of two mini-batches (h0, h1): while the next batch is
    not complete the trainer repeats h0, h1, h0, h1, one update per check, and stops at the
    first check that finds it complete (late=3: three updates) or when the passes are spent
    (late=9: four); a batch already in gets none. The weights are those of the same updates
    made by hand, and no pass is left for the batch after (the narrow tiny model: full
    fine-tuning updates of a quarter of the cost)."""
    cfg = load_config(None, [*TWO_MINIBATCHES, "train.fill_passes=2"])
    spec = cfg.algorithm_spec()
    policy = Policy(str(narrow_model_dir), dtype="float32", device="cpu", lr=1e-2)
    batch, _ = build_batch(_episodes(policy, n_groups=2), spec, 1.0, 16)
    manual = Policy(str(narrow_model_dir), dtype="float32", device="cpu", lr=1e-2)
    halves = split_batch(batch, 2, spec, 16)
    for h in [*halves, *[*halves, *halves][:filled]]:
        manual.train_step(h.seqs, make_loss_fn(h, spec, cfg, 0), 1.0, 64)
    kept = list(policy_updates(policy, batch, spec, cfg, 0).updates)
    assert [u.batch.seqs for u in kept] == [h.seqs for h in halves]
    trainer = Trainer.__new__(Trainer)  # only what _next_batch reads
    trainer.cfg, trainer.spec, trainer.policy = cfg, spec, policy
    trainer.source = _Arriving(late)
    trainer._fills = kept * cfg.train.fill_passes
    groups, fill = asyncio.run(trainer._next_batch())
    assert groups == [("group", [])]
    assert fill["fill_updates"] == filled and fill["fill_s"] >= 0
    assert trainer._fills == []
    steps = {int(s["step"]) for s in policy.optimizer.state_dict()["state"].values()}
    assert steps == {2 + filled}
    for p, q in zip(policy.params, manual.params, strict=True):
        assert torch.allclose(p, q, atol=1e-6)
    with pytest.raises(ValueError, match="fill_passes"):
        load_config(None, ["env.id=x", "train.fill_passes=-1"])


def test_a_synchronous_run_fills_each_wait_with_updates_of_the_last_batch(
    narrow_model_dir, tmp_path
):
    """Synchronous (eta=0): when a step's weights are out, the next batch has not started, so
    every step after the first repeats at least one of the last batch's two updates and at
    most both (fill_passes=1); the optimizer counts them on top of the steps' own. On the
    narrow tiny model."""
    out = tmp_path / "run"
    cfg = load_config(
        None,
        [
            *TWO_MINIBATCHES,
            "algorithm=grpo",  # keeps the groups whose rewards are all equal (the tiny model's)
            "env.kwargs={kind: arithmetic}",
            f"model.path={narrow_model_dir}",
            "model.dtype=float32",
            "rollout.group_size=2",
            "rollout.batch_size=2",
            "rollout.max_head_offpolicyness=0",
            "train.steps=3",
            "train.fill_passes=1",
            "metrics.tensorboard=false",
            f"train.output_dir={out}",
        ],
    )
    trainer = Trainer(cfg, quiet=True)
    asyncio.run(trainer.run())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    fills = [r["fill_updates"] for r in rows]
    # loss.proximal=loglinear: the mismatch takes a forward pass of its own; step 1 trains the
    # weights that sampled it (no fill before it). Measured: kl 2.5e-13, abs_max 1.9e-6.
    assert all("mismatch/kl" in r and r["mismatch/fresh_share"] == 1.0 for r in rows)
    assert rows[0]["mismatch/kl"] < 5e-9 and rows[0]["mismatch/abs_max"] < 1e-4
    assert len(fills) == 3 and fills[0] == 0
    assert all(1 <= f <= 2 for f in fills[1:]), fills
    assert all(r["fill_s"] >= 0 and r["wait_s"] >= 0 for r in rows)
    steps = {int(s["step"]) for s in trainer.policy.optimizer.state_dict()["state"].values()}
    assert steps == {3 * 2 + sum(fills)}


def test_a_source_is_ready_when_its_queue_holds_the_batch_or_it_failed():
    async def check() -> None:
        src = GroupSource(SourceSettings.of(batch_size=2, group_size=2, eta=0), RunState())
        assert not src.ready(2)
        src._queue.put_nowait(("g0", []))
        assert src.ready(1) and not src.ready(2)
        src._queue.put_nowait(("g1", []))
        assert src.ready(2)
        empty = GroupSource(SourceSettings.of(batch_size=2, group_size=2, eta=0), RunState())
        empty._failure = asyncio.get_running_loop().create_future()
        assert not empty.ready(1)
        empty._failure.set_exception(RuntimeError("env could not be made"))
        assert empty.ready(1), "next_batch raises at once: no pass waits for it"
        empty._failure.exception()

    asyncio.run(check())


def test_probe_size_is_checked_and_only_for_dynamic_sampling():
    from areal_agents.trainer.config import DYNAMIC_SAMPLING_ALGORITHMS

    assert {n for n, spec in ALGORITHMS.items() if spec.dynamic_sampling} == set(
        DYNAMIC_SAMPLING_ALGORITHMS
    )
    ok = ["env.id=x", "algorithm=dapo", "rollout.group_size=8"]
    assert load_config(None, [*ok, "rollout.probe_size=4"]).rollout.probe_size == 4
    for bad in ("1", "8"):
        with pytest.raises(ConfigError, match=r"probe_size.*in \[2, group_size\)"):
            load_config(None, [*ok, f"rollout.probe_size={bad}"])
    with pytest.raises(ConfigError, match="only algorithms that drop uniform groups"):
        load_config(None, ["env.id=x", "algorithm=grpo", "rollout.probe_size=2"])


@pytest.mark.slow
def test_a_uniform_probe_drops_its_group_before_the_rest_is_generated(tiny_model_dir, tmp_path):
    """Even tasks pay 0.5 whatever the reply: their groups stop after the probe's episodes.
    Odd ones pay the parity of the reply's length: those that pass are completed."""
    from collections import Counter

    from areal_agents import envs
    from areal_agents.envs.base import AgentEnv
    from areal_agents.trainer.loop import Trainer

    resets: Counter[int] = Counter()
    order: list[int] = []

    class HalfConstant(AgentEnv):
        def _start(self, options):
            self.task = int(self.np_random.integers(1_000_000))
            resets[self.task] += 1
            order.append(self.task)
            return [{"role": "user", "content": "Say something."}], {"task_id": str(self.task)}

        def tools(self):
            return []

        def _respond(self, message):
            parity = float(len(message.get("content") or "") % 2)
            reward = 0.5 if self.task % 2 == 0 else parity
            return [], reward, True, {"success": reward > 0}

    envs.register("test/HalfConstant-v0", HalfConstant, description="probe test", override=True)
    cfg = load_config(
        None,
        [
            "env.id=test/HalfConstant-v0",
            "algorithm=dapo",
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            "rollout.group_size=6",
            "rollout.probe_size=2",
            "rollout.batch_size=2",
            "rollout.max_head_offpolicyness=1",
            "sampling.max_new_tokens=8",
            "train.steps=2",
            "metrics.tensorboard=false",
            f"train.output_dir={tmp_path}",
        ],
    )
    summary = asyncio.run(Trainer(cfg, quiet=True).run())
    resets[order[0]] -= (
        1  # the up-front check of the env (areal_agents.envs.registry.probe) reset it once
    )
    even = [n for t, n in resets.items() if t % 2 == 0]
    assert even and max(even) == 2, "an all-equal probe ends its group after 2 episodes"
    assert summary["dropped/uniform_probe"] >= len(even)
    assert "dropped/uniform_group" not in summary  # a mixed probe cannot give a uniform group
    rows = [json.loads(x) for x in (tmp_path / "groups.jsonl").read_text().splitlines()]
    assert [r["episodes"] for r in rows] == [6, 6, 6, 6]
    assert sum(1 for t, n in resets.items() if t % 2 and n == 6) >= len(rows)


def test_ppo_takes_the_critic_settings_and_its_advantages_are_returns_minus_values(tiny_model_dir):
    cfg = load_config(
        None,
        [
            "env.id=areal/Calculator-v0",
            "algorithm=ppo",
            "rollout.gamma=0.9",
            "critic.lam=0.5",
            "critic.value_clip=null",
            "critic.whiten=false",
        ],
    )
    spec = cfg.algorithm_spec()
    assert spec.critic == cfg.critic  # the section is what the critic receives
    assert (spec.critic.lam, spec.critic.whiten, spec.critic.value_clip) == (0.5, False, None)
    default = load_config(None, ["env.id=x", "algorithm=ppo"]).algorithm_spec().critic
    assert default is not None
    assert (default.lam, default.whiten, default.value_clip) == (0.95, True, 0.2)
    # Without whitening and with lambda 1 the advantages are G(c) - V at each sampled token.
    policy = Policy(str(tiny_model_dir), dtype="float32", device="cpu")
    episodes = _episodes(policy)
    raw = dataclasses.replace(spec, critic=dataclasses.replace(spec.critic, lam=1.0))
    batch, _ = build_batch(episodes, raw, 0.9, 16)
    values = [torch.full_like(m, 0.25) for m in batch.mask]
    stats = add_gae(batch, values, raw)
    returns = {c: g for ep in episodes for c, g in ep.returns(0.9).items()}
    for ep in episodes:
        samples, _ = ep.samples(0.9)
        for s in samples:
            i = next(i for i, q in enumerate(batch.seqs) if q == s.input_ids)
            for t, k in enumerate(s.token_completion[1:]):
                want = returns[s.completion_ids[k]] - 0.25 if k >= 0 else 0.0
                assert batch.adv[i][t].item() == pytest.approx(want, abs=1e-5)
    assert stats["value_mean"] == pytest.approx(0.25)


def test_lora_sync_ships_adapter_only(tiny_model_dir):
    policy = Policy(
        str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    )
    update = policy.weight_update(version=3)
    assert update.kind == "lora" and update.version == 3
    assert update.state_dict and all("lora_" in k for k in update.state_dict)


def _train_cmd(model: Path, out: Path, steps: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "areal_agents.cli.main",
        "train",
        "--quiet",
        "env.id=areal/Calculator-v0",
        "env.kwargs={kind: arithmetic}",
        f"model.path={model}",
        "model.dtype=float32",
        "rollout.group_size=2",
        "rollout.batch_size=2",
        "rollout.max_head_offpolicyness=1",
        "sampling.max_new_tokens=8",
        f"train.steps={steps}",
        "train.save_every=1",
        f"train.output_dir={out}",
    ]


@pytest.mark.slow
def test_kill_9_then_resume_loses_and_repeats_no_group(narrow_model_dir, tmp_path):
    """On the narrow tiny model: the ledger is the point, not the model."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        _train_cmd(narrow_model_dir, out, 4),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    latest = out / "checkpoints" / "latest"
    deadline = time.time() + 300
    while not (latest.exists() and latest.read_text().strip() >= "step-000002"):
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = read_run_state(out)  # the file still says running; readers say failed
    assert killed is not None and killed.status == "running"
    assert killed.effective().reason == f"process {proc.pid} is gone"
    done = subprocess.run(
        [*_train_cmd(narrow_model_dir, out, 4), "--resume"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(x) for x in (out / "groups.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 2, 2, 3, 3, 4, 4]
    groups = [r["group"] for r in rows]
    assert len(set(groups)) == len(groups), "a group was consumed twice"
    state = json.loads((out / "checkpoints" / "step-000004" / "state.json").read_text())
    assert state["episodes_consumed"] == 16
    unconsumed = set(range(state["next_group"])) - set(groups) - set(state["skipped_groups"])
    assert all(g >= max(groups) for g in unconsumed), "an earlier group was lost"
    assert (out / "final" / "config.json").exists()
    resumed = read_run_state(out)
    assert resumed is not None
    assert (resumed.status, resumed.reason, resumed.step) == ("finished", "steps_done", 4)


@pytest.mark.slow
def test_eta0_async_loop_equals_a_synchronous_step(tiny_model_dir, tmp_path, parity_env):
    """With max_head_offpolicyness = 0 the loop is the synchronous baseline: the same groups,
    all sampled by version 0, and the same update as generating first and then training."""
    from areal_agents.trainer.loop import Trainer

    def cfg_for(out: Path):
        return load_config(
            None,
            [
                "env.id=test/Parity-v0",
                f"model.path={tiny_model_dir}",
                "model.dtype=float32",
                "rollout.group_size=4",
                "rollout.batch_size=2",
                "rollout.max_head_offpolicyness=0",
                "sampling.max_new_tokens=8",
                "train.steps=1",
                "optim.lr=1e-2",
                "metrics.tensorboard=false",
                f"train.output_dir={out}",
            ],
        )

    class Recording(Trainer):
        async def _train_step(self, got, *args):
            self.got = got
            return await super()._train_step(got, *args)

    trainer = Recording(cfg_for(tmp_path / "async"), quiet=True)
    summary = asyncio.run(trainer.run())
    assert summary["staleness_max"] == 0.0  # every token was sampled by version 0
    # The embedded engine samples with the trainer's weights: every trained token is fresh and
    # its engine logprob is the trainer's (loss.proximal=recompute: batch.prox). Measured on
    # the CPU in float32: kl 2.6e-13, abs_max 1.9e-6; the bounds are the 1e-4 logprob
    # tolerance of test_sampled_logprobs_match_the_trainers_at_each_calls_temperature and its
    # k3 ((1e-4)^2 / 2): room for other kernels (a GPU's), none for a real mismatch.
    assert summary["mismatch/fresh_share"] == 1.0 and summary["mismatch/tokens"] > 0
    assert 0 <= summary["mismatch/kl"] < 5e-9 and summary["mismatch/abs_max"] < 1e-4
    assert summary["mismatch/masked_share"] == 0.0
    assert summary["adv_abs_max"] > 0, "the test needs a nonzero gradient"
    trained = {k: v.clone() for k, v in trainer.policy.model.named_parameters()}

    ref = Trainer(cfg_for(tmp_path / "sync"), quiet=True)
    ref._build()

    async def sync_step() -> None:
        groups = await asyncio.gather(
            *[
                ref.source.runner.run_group(
                    ref.make_env,
                    4,
                    seed=ref.seed_base + g,
                    group_id=f"g{g}",
                    sampling_seed=(ref.seed_base + g) * 4,
                )
                for g in range(2)
            ]
        )
        await ref.engine.close()

        # The loop trained on exactly these groups: same tasks, same sampled tokens.
        def outputs(results):
            return sorted(tuple(c.output_ids) for r in results for c in r.episode.completions)

        assert {g: outputs(eps) for g, eps in trainer.got} == {
            g: outputs(eps) for g, eps in enumerate(groups)
        }
        episodes = [r.episode for group in groups for r in group]
        batch, _ = build_batch(episodes, ref.spec, 1.0, 8)
        batch.prox = ref.policy.logprobs(batch.seqs, 1.0)
        ref.policy.train_step(batch.seqs, make_loss_fn(batch, ref.spec, ref.cfg, 0), 1.0)

    asyncio.run(sync_step())
    initial = dict(Policy(str(tiny_model_dir), dtype="float32").model.named_parameters())
    sync_delta = torch.cat(
        [(v - initial[k]).flatten() for k, v in ref.policy.model.named_parameters()]
    )
    async_delta = torch.cat([(trained[k] - initial[k]).flatten() for k in initial])
    assert sync_delta.norm() > 0, "the step changed nothing"
    # Same samples, same loss: the updates agree up to float summation order (a handful of
    # near-zero-gradient entries that Adam's normalisation amplifies).
    assert (async_delta - sync_delta).norm() / sync_delta.norm() < 1e-2
    assert torch.nn.functional.cosine_similarity(async_delta, sync_delta, dim=0) > 0.998


@pytest.mark.slow
def test_ppo_runs_in_the_loop_and_resumes_its_critic(narrow_model_dir, tmp_path):
    """algorithm=ppo trains through the loop (one episode per group: no group baseline), logs
    value_loss and explained_variance, and a resumed run continues from the saved critic
    (on the narrow tiny model: a policy and a critic, each fully fine-tuned)."""
    from areal_agents.trainer.loop import Trainer

    class Recording(Trainer):
        def _build(self):
            super()._build()
            assert self.critic is not None
            self.initial = {k: v.clone() for k, v in self.critic.params.items()}

        def _restore(self):
            found = super()._restore()
            assert self.critic is not None
            self.restored = {k: v.clone() for k, v in self.critic.params.items()}
            return found

    out = tmp_path / "run"
    overrides = [
        "env.id=areal/Calculator-v0",
        "env.kwargs={kind: arithmetic}",
        f"model.path={narrow_model_dir}",
        "model.dtype=float32",
        "algorithm=ppo",
        "rollout.group_size=1",
        "rollout.batch_size=2",
        "rollout.max_head_offpolicyness=1",
        "sampling.max_new_tokens=8",
        "critic.lr=1e-3",
        "train.save_every=1",
        "metrics.tensorboard=false",
        f"train.output_dir={out}",
    ]
    first = Recording(load_config(None, [*overrides, "train.steps=1"]), quiet=True)
    summary = asyncio.run(first.run())
    assert math.isfinite(summary["value_loss"]) and summary["value_loss"] > 0
    assert math.isfinite(summary["explained_variance"])
    assert first.critic is not None
    saved = {k: v.clone() for k, v in first.critic.params.items()}
    assert any(not torch.equal(saved[k], first.initial[k]) for k in saved), "critic unchanged"
    assert (out / "checkpoints" / "step-000001" / "critic" / "dcp" / ".metadata").exists()

    second = Recording(load_config(None, [*overrides, "train.steps=2"]), resume=True, quiet=True)
    asyncio.run(second.run())
    assert all(torch.equal(second.restored[k], saved[k]) for k in saved)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("value_loss" in r and "explained_variance" in r for r in rows)
    # the embedded engine's running totals ride along
    assert all(r["engine/output_tokens"] > 0 and r["engine/prefills"] >= 1 for r in rows)
    # and the rates of each step: tokens over wall time, tokens per decode step
    assert all(r["engine/output_tokens_per_s"] > 0 for r in rows)
    assert all(1 <= r["engine/decode_rows_mean"] <= 4 for r in rows)  # <= 4 episodes in flight
    assert second.critic is not None
    assert any(not torch.equal(second.critic.params[k], saved[k]) for k in saved)


def test_dapo_overlong_penalty_reaches_the_returns_by_hand():
    """L_max = 10, L_cache = 4: lengths 5, 8, 10 get 0, (6 - 8) / 4 = -0.5 and -1. One group
    of three one-turn episodes with final reward 1 each: returns [1, 0.5, 0] -> GRPO
    advantages (R - mean) / std = [1, 0, -1]; the recorded episodes keep their rewards."""
    from areal_agents.trainer.algorithms import OverlongSpec

    spec = dataclasses.replace(ALGORITHMS["dapo"], overlong=OverlongSpec(cache_len=4))
    eps = []
    for k, n in enumerate((5, 8, 10)):
        ep = Episode(f"e{k}", group_id="g0")
        ep.add(
            Completion(
                f"c{k}",
                [{"role": "user", "content": "q"}],
                [1, 2, 3],
                list(range(10, 10 + n)),
                [-0.5] * n,
                [0] * n,
                {"role": "assistant", "content": "a"},
                "length" if n == 10 else "stop",
            )
        )
        ep.final_reward = 1.0
        eps.append(ep)
    batch, stats = build_batch(eps, spec, 1.0, 10)
    assert [float(a[-1]) for a in batch.adv] == pytest.approx([1.0, 0.0, -1.0], abs=1e-4)
    assert stats["overlong_penalty_mean"] == pytest.approx(-0.5)
    assert stats["overlong_fraction"] == pytest.approx(2 / 3)
    assert [c.reward for ep in eps for c in ep.completions] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("lora", [False, True])
def test_kl_penalty_uses_the_starting_weights_as_reference(tiny_model_dir, lora):
    """ref_logprobs are the starting policy's (LoRA: adapter off; full: a frozen copy); with
    loss.kl_coef > 0 a training step reports KL 0 at first and > 0 after the policy moved."""
    lora_cfg = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    policy = Policy(
        str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        lr=5e-2,
        lora=lora_cfg if lora else None,
        reference=True,
    )
    eps = _episodes(policy)
    cfg = load_config(
        None, ["env.id=areal/Calculator-v0", "loss.kl_coef=0.1", "loss.proximal=loglinear"]
    )
    spec = cfg.algorithm_spec()
    assert spec.loss.kl_coef == 0.1
    start = policy.logprobs([eps[0].completions[0].prompt_ids], 1.0)
    kls = []
    for version in range(2):
        batch, _ = build_batch(eps, spec, 1.0, 16)
        batch.ref = policy.ref_logprobs(batch.seqs, 1.0, 64, batch.mask)
        stats = policy.train_step(
            batch.seqs, make_loss_fn(batch, spec, cfg, version), 1.0, 64, batch.mask
        )
        kls.append(stats["kl"] / stats["tokens"])
    assert kls[0] == pytest.approx(0.0, abs=1e-6) and kls[1] > 1e-6
    (ref,) = policy.ref_logprobs([eps[0].completions[0].prompt_ids], 1.0)
    (now,) = policy.logprobs([eps[0].completions[0].prompt_ids], 1.0)
    assert torch.allclose(ref, start[0], atol=1e-5) and not torch.allclose(now, ref, atol=1e-4)


def test_time_budget_stops_before_a_step_that_would_overrun() -> None:
    # 30-minute budget; the recent steps took 50, 70 and 60 s: the next is taken to last as
    # long as the longest, 70 s (the mean, 60 s, let a slow step end past the budget).
    recent = [50.0, 70.0, 60.0]
    assert not out_of_time_budget(1700.0, recent, 1800.0)  # 1700 + 70 = 1770 <= 1800
    assert not out_of_time_budget(1730.0, recent, 1800.0)  # ends exactly at the limit
    assert out_of_time_budget(1731.0, recent, 1800.0)  # would end at 1801 s
    assert out_of_time_budget(1735.0, recent, 1800.0)  # the mean (1795 s) would have gone on
    assert out_of_time_budget(1800.0, [], 1800.0)  # spent, whatever the step time
    assert not out_of_time_budget(10.0, [], 1800.0)  # no step measured yet


def test_entropy_bonus_alone_raises_the_policys_entropy(tiny_model_dir):
    """All rewards equal: zero advantages, no policy gradient; loss.entropy_coef > 0 then
    moves the policy towards higher entropy on the trained tokens, and 0 leaves it still."""
    policy = Policy(str(tiny_model_dir), dtype="float32", device="cpu", lr=2e-3)
    with torch.no_grad():  # a random model is near the maximum entropy: sharpen it first
        policy.model.get_output_embeddings().weight.mul_(3.0)
    eps = _episodes(policy)
    for ep in eps:
        ep.final_reward = 1.0
    for coef in (0.0, 0.5):
        cfg = load_config(
            None,
            [
                "env.id=areal/Calculator-v0",
                "algorithm=grpo",
                "loss.proximal=loglinear",
                f"loss.entropy_coef={coef}",
            ],
        )
        spec = cfg.algorithm_spec()
        assert spec.loss.entropy_coef == coef
        before = {k: v.clone() for k, v in policy.model.named_parameters()}
        ents = []
        for version in range(3):
            batch, _ = build_batch(eps, spec, 1.0, 16)
            stats = policy.train_step(
                batch.seqs,
                make_loss_fn(batch, spec, cfg, version),
                1.0,
                64,
                batch.mask,
                entropy_grad=coef > 0,
            )
            ents.append(stats["entropy_sum"] / stats["tokens"])
        moved = any(not torch.equal(v, before[k]) for k, v in policy.model.named_parameters())
        if coef == 0:
            assert not moved and ents[0] == pytest.approx(ents[-1])
        else:
            assert moved and ents[-1] > ents[0] + 1e-3, ents


def test_entropy_bonus_without_entropy_gradients_names_the_fix(tiny_model_dir):
    policy = Policy(str(tiny_model_dir), dtype="float32", device="cpu", lr=1e-3)
    cfg = load_config(
        None, ["env.id=areal/Calculator-v0", "loss.proximal=loglinear", "loss.entropy_coef=0.1"]
    )
    spec = cfg.algorithm_spec()
    batch, _ = build_batch(_episodes(policy), spec, 1.0, 16)
    with pytest.raises(ValueError, match="entropy_grad=True"):
        policy.train_step(batch.seqs, make_loss_fn(batch, spec, cfg, 0), 1.0, 64, batch.mask)


def test_agent_train_masks_the_other_agents_completions_out_of_the_loss():
    """agent.train = [billing]: the triage turn stays in the merged sample's prompt and in
    the returns, but its tokens carry no loss mask and no weight; the ledger lists it apart."""
    from areal_agents.trainer.algorithms import get_algorithm

    spec = get_algorithm("grpo")
    eps = []
    for k in range(2):
        ep = Episode(f"e{k}", group_id="g")
        prompt, out1, out2 = [101, 102, 103], [201, 202], [301, 302, 303]
        first = [{"role": "user", "content": "q"}]
        later = [*first, {"role": "assistant", "content": "a"}, {"role": "user", "content": "m"}]
        for cid, agent, msgs, p, o in (
            (f"t{k}", "triage", first, prompt, out1),
            (f"b{k}", "billing", later, [*prompt, *out1, 7, 8], out2),
        ):
            c = Completion(
                cid,
                msgs,
                p,
                o,
                [0.0] * len(o),
                [0] * len(o),
                {"role": "assistant", "content": "a"},
                "stop",
                agent=agent,
            )
            ep.add(c)
        ep.final_reward = float(k)
        eps.append(ep)
    full, _ = build_batch(eps, spec, 1.0, 64)
    masked, stats = build_batch(eps, spec, 1.0, 64, trained_agents=["billing"])
    assert stats["masked_completions"] == 2
    for f, m in zip(full.mask, masked.mask, strict=True):
        # shifted by one: [prompt 3][out1 2][7 8][out2 3] -> targets from index 1
        assert f.tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 1]
        assert m.tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1]
    for w in masked.weights:
        assert w[:6].abs().sum() == 0 and (w[6:] > 0).all()
    # the advantages are those of the full batch (returns are unchanged by the mask)
    for f, m in zip(full.adv, masked.adv, strict=True):
        assert torch.equal(f[6:], m[6:])
    # without agent.train every completion trains, whatever its agent
    assert "masked_completions" not in build_batch(eps, spec, 1.0, 64)[1]
