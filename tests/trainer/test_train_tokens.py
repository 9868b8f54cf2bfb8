"""The trainer's per-token record (``train_tokens`` in the episode store): the values
``policy_loss`` hands out equal its docstring's formula, ``BatchLoss`` keeps each sample's
first pass, the rows map tokens back to completions (PPO's GAE advantages included), ranks'
records come back under the whole batch's indices, and a real run records every trained
completion of every step."""

from __future__ import annotations

import asyncio
import json
import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from areal_agents.serve.store import EpisodeStore
from areal_agents.trainer import batch as batch_module
from areal_agents.trainer.batch import Batch, build_batch
from areal_agents.trainer.config_io import load_config
from areal_agents.trainer.critic import Critic
from areal_agents.trainer.distributed import DistributedPolicy, _run
from areal_agents.trainer.loss import LossSpec, policy_loss
from areal_agents.trainer.policy import Policy
from areal_agents.trainer.step import (
    RECORDED,
    make_loss_fn,
    policy_updates,
    train_on_batch,
    train_token_rows,
)
from areal_agents.trajectory import Completion, Episode

# ----------------------------------------------------------------------------- the formula
LOGP = [[-1.0, -0.4, -2.0, -0.7], [-0.3, -1.2, -0.9, -0.5]]
PROX = [[-0.3071, -0.8055, -2.0, -0.35], [-0.5, -1.2, -0.4, -0.9]]
BEHAV = [[-0.5, -2.0, -1.9, -0.35], [-0.5, -0.2, -0.4, -1.2]]
ADV = [[-1.0, 2.0, 0.5, 1.0], [1.0, -1.0, -2.0, 0.5]]
MASK = [[1, 1, 1, 0], [1, 1, 1, 1]]


def _by_hand(correction: str, eps_low: float, eps_high: float, cap: float) -> dict[str, list]:
    """The per-token values of ``policy_loss``'s docstring, in plain floats."""
    out: dict[str, list] = {k: [] for k in ("ratio", "w", "low", "high", "over")}
    for lp_row, px_row, bh_row, a_row, m_row in zip(LOGP, PROX, BEHAV, ADV, MASK, strict=True):
        for lp, px, bh, a, m in zip(lp_row, px_row, bh_row, a_row, m_row, strict=True):
            r = math.exp(lp - px)
            w_raw = math.exp(px - bh)
            over = w_raw > cap and m == 1
            w = {"clip": min(w_raw, cap), "mask": 0.0 if w_raw > cap else w_raw, "none": 1.0}
            out["ratio"].append(r)
            out["w"].append(w[correction])
            out["low"].append(a < 0 and r < 1 - eps_low)
            out["high"].append(a > 0 and r > 1 + eps_high)
            out["over"].append(over)
    return out


@pytest.mark.parametrize("correction", ["clip", "mask", "none"])
def test_recorded_ratio_clip_flags_and_weights_are_the_docstring_formula(correction):
    spec = LossSpec(
        clip_low=0.2, clip_high=0.28, behaviour_cap=2.0, behaviour_correction=correction
    )
    t = {
        k: torch.tensor(v)
        for k, v in (("logp", LOGP), ("prox", PROX), ("behav", BEHAV), ("adv", ADV))
    }
    mask = torch.tensor(MASK, dtype=torch.float32)
    tokens: dict[str, torch.Tensor] = {}
    logp = t["logp"].clone().requires_grad_(True)
    loss, stats = policy_loss(logp, t["behav"], t["prox"], t["adv"], mask, spec, tokens=tokens)
    plain_loss, plain_stats = policy_loss(t["logp"], t["behav"], t["prox"], t["adv"], mask, spec)
    assert float(loss.detach()) == float(plain_loss) and stats == plain_stats  # no behaviour change
    want = _by_hand(correction, 0.2, 0.28, 2.0)
    flat = {k: v.flatten().tolist() for k, v in tokens.items()}
    assert flat["ratio"] == pytest.approx(want["ratio"], rel=1e-6)
    assert flat["behaviour_weight"] == pytest.approx(want["w"], rel=1e-6)
    assert flat["clipped_low"] == want["low"] and flat["clipped_high"] == want["high"]
    assert flat["clipped"] == [a or b for a, b in zip(want["low"], want["high"], strict=True)]
    assert flat["behaviour_clipped"] == want["over"]
    # the inputs come back as the loss used them, detached
    assert torch.equal(tokens["logp"], t["logp"]) and torch.equal(tokens["prox_logp"], t["prox"])
    assert torch.equal(tokens["advantage"], t["adv"])
    assert not any(v.requires_grad for v in tokens.values())
    # the example has every case: low and high clips, a w over the cap, and tokens of neither
    assert any(want["low"]) and any(want["high"]) and any(want["over"])
    assert not all(a or b for a, b in zip(want["low"], want["high"], strict=True))


def test_sequence_level_ratio_is_the_geometric_mean_of_each_row():
    """GSPO: r and w of every token of a row are exp(mean over its valid tokens)."""
    spec = LossSpec(ratio_level="sequence", behaviour_cap=100.0)
    tokens: dict[str, torch.Tensor] = {}
    logp, prox, behav = torch.tensor(LOGP), torch.tensor(PROX), torch.tensor(BEHAV)
    mask = torch.tensor(MASK, dtype=torch.float32)
    policy_loss(logp, behav, prox, torch.tensor(ADV), mask, spec, tokens=tokens)
    for b in range(2):
        n = int(mask[b].sum())
        mean_r = sum(LOGP[b][k] - PROX[b][k] for k in range(n)) / n
        mean_w = sum(PROX[b][k] - BEHAV[b][k] for k in range(n)) / n
        valid = mask[b] > 0
        assert tokens["ratio"][b][valid].tolist() == pytest.approx([math.exp(mean_r)] * n)
        assert tokens["behaviour_weight"][b][valid].tolist() == pytest.approx(
            [math.exp(mean_w)] * n
        )


# ----------------------------------------------------------------------------- batches
def _completion(cid, prompt, out, agent=None, messages=None):
    return Completion(
        cid,
        messages or [{"role": "user", "content": "q"}],
        prompt,
        out,
        [-0.5 - 0.1 * k for k in range(len(out))],
        [0] * len(out),
        {"role": "assistant", "content": "a"},
        "stop",
        agent=agent,
    )


def _hand_episodes() -> list[Episode]:
    """One group: an episode of two merged turns (the second by another agent), one of two
    turns that do not merge, and one whose first completion has an empty prompt."""
    later = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "m"},
    ]
    a = Episode("ea", group_id="g")
    a.add(_completion("a0", [101, 102, 103], [201, 202], agent="main"))
    a.add(_completion("a1", [101, 102, 103, 201, 202, 7, 8], [301, 302, 303], "main", later))
    a.final_reward = 1.0
    b = Episode("eb", group_id="g")
    b.add(_completion("b0", [101, 102, 103], [211, 212, 213], agent="main"))
    b.add(_completion("b1", [101, 102, 999, 5], [311], agent="helper", messages=later))
    b.final_reward = 0.0
    c = Episode("ec", group_id="g")
    c.add(_completion("c0", [], [221, 222, 223, 224], agent="main"))
    c.final_reward = 0.5
    return [a, b, c]


def _cfg(*overrides: str) -> Any:
    return load_config(None, ["env.id=x", "sampling.max_new_tokens=16", *overrides])


def _call(loss_fn: Any, items: list[int], logps: list[torch.Tensor]) -> Any:
    """``loss_fn`` on ``items`` with ``logps`` (no entropies: zeros)."""
    return loss_fn(items, logps, [torch.zeros_like(lp) for lp in logps])


def _fake_logps(batch: Batch, scale: float) -> list[torch.Tensor]:
    return [-scale * (1 + torch.arange(len(m), dtype=torch.float32) / 10) for m in batch.mask]


def test_the_loss_keeps_each_samples_first_pass_and_rows_map_tokens_to_completions():
    cfg = _cfg("loss.proximal=loglinear", "algorithm=grpo")
    spec = cfg.algorithm_spec()
    batch, _ = build_batch(_hand_episodes(), spec, 1.0, 16, trained_agents=["main"])
    assert [[r.id for r in rs] for rs in batch.sample_completions] == [
        ["a0", "a1"],
        ["b0"],
        ["b1"],
        ["c0"],
    ]
    assert [r.merged for rs in batch.sample_completions for r in rs] == [
        False,
        True,
        False,
        False,
        False,
    ]
    assert batch.sample_completions[0][1].merge_reason == "token_prefix"
    assert batch.sample_completions[2][0].merge_reason == "token_mismatch"
    loss_fn = make_loss_fn(batch, spec, cfg, 3, record=True)
    first, second = _fake_logps(batch, 1.0), _fake_logps(batch, 2.0)
    n = len(batch.seqs)
    _call(loss_fn, [0, 2], [first[0], first[2]])
    _call(loss_fn, [0, 1, 3], [second[0], second[1], second[3]])  # 0 again
    assert sorted(loss_fn.records) == list(range(n))
    assert torch.equal(loss_fn.records[0].values[RECORDED.index("logp")], first[0])
    assert torch.equal(loss_fn.records[1].values[RECORDED.index("logp")], second[1])
    # a loss without record keeps nothing and computes the same
    plain = make_loss_fn(batch, spec, cfg, 3)
    got, stats = _call(plain, [0, 1], [first[0], second[1]])
    assert plain.records == {}
    again, stats_again = _call(
        make_loss_fn(batch, spec, cfg, 3, record=True), [0, 1], [first[0], second[1]]
    )
    assert float(got) == float(again) and stats == stats_again

    rows = train_token_rows([loss_fn.records[i] for i in range(n)], 4, 3)
    by_id = {r["completion_id"]: r for r in rows}
    assert sorted(by_id) == ["a0", "a1", "b0", "c0"]  # b1 (agent "helper") is not trained
    assert all(r["step"] == 4 and r["version"] == 3 for r in rows)
    lengths = {"a0": 2, "a1": 3, "b0": 3, "c0": 4}
    for cid, row in by_id.items():
        for name in ("advantages", "train_logprobs", "prox_logprobs", "behaviour_weights"):
            assert len(row[name]) == lengths[cid], (cid, name)
        assert len(row["clipped"]) == len(row["behaviour_clipped"]) == lengths[cid]
    # a0, a1 share sample 0: [101 102 103 | 201 202 | 7 8 | 301 302 303], targets from index 1
    adv0 = batch.adv[0].tolist()
    assert by_id["a0"]["advantages"] == pytest.approx(adv0[2:4])
    assert by_id["a1"]["advantages"] == pytest.approx(adv0[6:9])
    assert by_id["a0"]["train_logprobs"] == pytest.approx(first[0][2:4].tolist())
    assert by_id["a1"]["train_logprobs"] == pytest.approx(first[0][6:9].tolist())
    # c0 has no prompt: its first output is sample position 0, which has no logprob
    c0 = by_id["c0"]
    assert math.isnan(c0["advantages"][0]) and math.isnan(c0["train_logprobs"][0])
    assert c0["clipped"][0] is False and c0["behaviour_clipped"][0] is False
    assert c0["train_logprobs"][1:] == pytest.approx(second[3].tolist())
    # the returns and advantages: GRPO over the group's three episodes (returns 1, 0, 0.5)
    assert [by_id[c]["ret"] for c in ("a0", "a1", "b0", "c0")] == [1.0, 1.0, 0.0, 0.5]
    assert by_id["a0"]["advantages"][0] > 0 > by_id["b0"]["advantages"][0]
    assert by_id["c0"]["advantages"][1] == pytest.approx(0.0, abs=1e-6)
    # the proximal logprob and w as the loss used them (log-linear, versions 0 -> 4)
    behav0 = batch.behav[0][2:4]
    alpha = (3 - 0) / (4 - 0)
    prox = behav0 + alpha * (first[0][2:4] - behav0)
    assert by_id["a0"]["prox_logprobs"] == pytest.approx(prox.tolist(), rel=1e-5)
    assert by_id["a0"]["behaviour_weights"] == pytest.approx(
        torch.exp(prox - behav0).tolist(), rel=1e-5
    )
    assert json.dumps(rows, allow_nan=True)  # plain Python values


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path) -> Policy:
    return Policy(str(tiny_model_dir), dtype="float32", device="cpu", lr=1e-2)


def _policy_episodes(policy: Policy, n_groups: int = 2, size: int = 2) -> list[Episode]:
    """Groups of one- and two-turn episodes with the policy's logprobs plus noise."""
    g = torch.Generator().manual_seed(1)
    eps = []
    for gi in range(n_groups):
        for k in range(size):
            ep = Episode(f"e{gi}-{k}", group_id=f"g{gi}")
            prompt = list(range(100 + gi, 110 + gi))
            out = torch.randint(200, 300, (4 + k + gi,), generator=g).tolist()
            turns = [(prompt, out)] + ([([*prompt, *out, 7], [301, 302])] if k == 1 else [])
            for t, (p, o) in enumerate(turns):
                (lp,) = policy.logprobs([p + o], 1.0)
                noisy = lp[-len(o) :] + 0.3 * torch.randn(len(o), generator=g)
                ep.add(
                    Completion(
                        f"c{gi}{k}{t}",
                        [{"role": "user", "content": "q"}],
                        p,
                        o,
                        noisy.tolist(),
                        [0] * len(o),
                        {"role": "assistant", "content": "a"},
                        "stop",
                    )
                )
            ep.final_reward = float((k + gi) % 2)
            eps.append(ep)
    return eps


def _tokens_of(batch: Batch, values: list[torch.Tensor], cid: str) -> list[float]:
    """``values`` (per sample, over tokens 1..n-1) at the tokens of completion ``cid``."""
    for i, refs in enumerate(batch.sample_completions):
        for k, ref in enumerate(refs):
            if ref.id == cid:
                return values[i][batch.completions[i] == k].tolist()
    raise KeyError(cid)


def test_ppo_records_its_per_token_gae_advantages(tiny_model_dir, policy):
    cfg = _cfg("algorithm=ppo", "loss.proximal=recompute", "train.micro_batch_tokens=48")
    spec = cfg.algorithm_spec()
    trained = Policy(str(tiny_model_dir), dtype="float32", device="cpu", lr=1e-3)
    critic = Critic(str(tiny_model_dir), dtype="float32", device="cpu", lr=1e-3)
    batch, _ = build_batch(_policy_episodes(policy), spec, 1.0, 16)
    records = train_on_batch(trained, critic, batch, spec, cfg, 0, record=True).records
    assert len(records) == len(batch.seqs)
    rows = train_token_rows(records, 1, 0)
    assert len(rows) == sum(len(rs) for rs in batch.sample_completions)
    varied = 0
    for row in rows:
        want = _tokens_of(batch, batch.adv, row["completion_id"])  # GAE's, after add_gae
        assert row["advantages"] == pytest.approx(want, abs=1e-6)
        assert row["prox_logprobs"] == pytest.approx(
            _tokens_of(batch, batch.prox, row["completion_id"]), abs=1e-6
        )
        varied += len(set(round(a, 6) for a in row["advantages"])) > 1
    assert varied, "GAE gives per-token advantages"
    # on fresh data the current policy is the proximal one: ratio 1, nothing clipped
    for row in rows:
        assert row["train_logprobs"] == pytest.approx(row["prox_logprobs"], abs=1e-4)
        assert not any(row["clipped"])


class _InProcessRanks:
    """``Ranks``' interface over policies in this process, one per rank: rank r > 0 gets its
    arguments and returns its results through pickle, as the real channel does."""

    def __init__(self, policies: list[Policy]) -> None:
        self.size, self.seed = len(policies), 0
        self.objects = [{"policy": p} for p in policies]

    def call(self, target, method, args=(), *, per_rank=False, gather=False):
        each = list(args) if per_rank else [args] * self.size
        results = []
        for r, a in enumerate(each):
            if r > 0:
                a = pickle.loads(pickle.dumps(a))
            res = _run(self.objects[r], target, method, a)
            results.append(res if r == 0 else pickle.loads(pickle.dumps(res)))
        return results if gather else results[0]


def test_records_of_trainer_ranks_come_back_under_the_batch_indices(tiny_model_dir, policy):
    """The batch split over 2 ranks by groups: the records rank 0 gathers are, sample for
    sample, those of one process (the same weights before the step)."""
    cfg = _cfg("algorithm=grpo", "loss.proximal=loglinear", "train.micro_batch_tokens=48")
    spec = cfg.algorithm_spec()
    episodes = _policy_episodes(policy, n_groups=3)
    model = str(tiny_model_dir)

    def fresh() -> Policy:
        return Policy(model, dtype="float32", device="cpu", lr=1e-3)

    batch, _ = build_batch(episodes, spec, 1.0, 16)
    one = policy_updates(fresh(), batch, spec, cfg, 0, record=True).records
    ranks = _InProcessRanks([fresh(), fresh()])
    sharded = DistributedPolicy(ranks, ranks.objects[0]["policy"])
    loss_fn = make_loss_fn(batch, spec, cfg, 0, record=True)
    sharded.train_step(batch.seqs, loss_fn, batch.temps, 48, batch.mask)
    assert sorted(loss_fn.records) == list(range(len(batch.seqs)))
    assert len(ranks.objects[1]["policy"].optimizer.state) > 0, "rank 1 trained a part"
    for i, want in enumerate(one):
        got = loss_fn.records[i]
        assert got.session_id == want.session_id == batch.episode_ids[i]
        assert [r.id for r in got.completions] == [r.id for r in want.completions]
        assert torch.allclose(got.values, want.values, atol=1e-5)
    # and a step that does not record runs the plain train_step on the ranks
    plain = make_loss_fn(batch, spec, cfg, 0)
    stats = sharded.train_step(batch.seqs, plain, batch.temps, 48, batch.mask)
    assert plain.records == {} and math.isfinite(stats["grad_norm"])


# ----------------------------------------------------------------------------- a real run
@pytest.mark.slow
def test_a_training_run_records_every_trained_completion_of_every_step(
    tiny_model_dir, tmp_path, monkeypatch, parity_env
):
    from areal_agents.trainer import loop

    built: list[Batch] = []

    def capture(*args: Any, **kwargs: Any) -> Any:
        batch, stats = batch_module.build_batch(*args, **kwargs)
        built.append(batch)
        return batch, stats

    monkeypatch.setattr(loop, "build_batch", capture)
    out = tmp_path / "run"
    cfg = load_config(
        None,
        [
            "env.id=test/Parity-v0",
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            "rollout.group_size=3",
            "rollout.batch_size=2",
            "rollout.max_head_offpolicyness=1",
            "sampling.max_new_tokens=8",
            "train.steps=2",
            "metrics.tensorboard=false",
            f"train.output_dir={out}",
        ],
    )
    asyncio.run(loop.Trainer(cfg, quiet=True).run())
    assert len(built) == 2
    ledger = [json.loads(x) for x in (out / "groups.jsonl").read_text().splitlines()]
    store = EpisodeStore(out / "episodes.db")
    try:
        trained = {(r["step"], sid) for r in ledger for sid in r["sessions"]}
        want = {(r["step"], cid) for r in ledger for cid in r["completions"]}
        got: set[tuple[int, str]] = set()
        for _, sid in sorted(trained):
            episode = store.load(sid)
            assert episode is not None
            meta = episode.episode.metadata
            assert meta["env"] == "test/Parity-v0" and meta["turns"] == 1
            assert meta["success"] in (True, False)
            outputs = {c.id: len(c.output_ids) for c in episode.episode.completions}
            for row in store.train_tokens(sid):
                got.add((row["step"], row["completion_id"]))
                assert row["version"] == row["step"] - 1
                n = outputs[row["completion_id"]]
                assert all(len(row[k]) == n for k in ("advantages", "train_logprobs", "clipped"))
                batch = built[row["step"] - 1]
                used = _tokens_of(batch, batch.adv, row["completion_id"])
                assert row["advantages"] == pytest.approx(used, abs=1e-6)
                assert not any(math.isnan(x) for x in row["train_logprobs"])
        assert got == want and len(got) == 12  # 2 steps x 2 groups x 3 one-turn episodes
    finally:
        store.close()


def test_rows_need_records_of_matching_lengths():
    """A record whose completion claims fewer outputs than it has tokens is refused."""
    cfg = _cfg("loss.proximal=loglinear")
    spec = cfg.algorithm_spec()
    batch, _ = build_batch(_hand_episodes()[:1], spec, 1.0, 16)
    loss_fn = make_loss_fn(batch, spec, cfg, 0, record=True)
    _call(loss_fn, [0], _fake_logps(batch, 1.0))
    rec = loss_fn.records[0]
    rec.completions = [
        batch_module.CompletionRef("a0", 0.0, False, "root", 1),
        *rec.completions[1:],
    ]
    with pytest.raises(ValueError, match="2 recorded tokens for 1 output tokens"):
        train_token_rows([rec], 1, 0)
