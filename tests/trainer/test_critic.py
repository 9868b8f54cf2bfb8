"""PPO's critic: reward placement along the completion tree, GAE over it, the value model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from areal_agents.errors import ConfigError
from areal_agents.trainer.advantage import tree_gae
from areal_agents.trainer.critic import Critic, GaeInputs, gae_inputs
from areal_agents.trajectory import Completion, Episode

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def _completion(cid: str, messages: list[dict], prompt: list[int], out: list[int], reward: float):
    return Completion(
        cid,
        messages,
        prompt,
        out,
        [-0.5] * len(out),
        [0] * len(out),
        {"role": "assistant", "content": cid},
        "stop",
        reward=reward,
    )


def tree_episode(end_reason: str = "terminated") -> Episode:
    """c0 -> (c1, c2): two children, so neither merges; c1 -> c3, which extends c1's tokens
    exactly and merges. Samples: [c0], [c1, c3], [c2]."""
    ep = Episode("e", group_id="g", final_reward=1.0, end_reason=end_reason)
    user = [{"role": "user", "content": "q"}]
    c0 = ep.add(_completion("c0", user, [1, 2, 3], [10, 11], 0.1))
    after0 = [*user, c0.message]
    c1 = ep.add(
        _completion(
            "c1",
            [*after0, {"role": "user", "content": "a"}],
            [1, 2, 3, 10, 11, 4],
            [20, 21, 22],
            0.2,
        )
    )
    ep.add(
        _completion(
            "c2", [*after0, {"role": "user", "content": "b"}], [1, 2, 3, 10, 11, 5], [30], 0.0
        )
    )
    ep.add(
        _completion(
            "c3",
            [*c1.messages, c1.message, {"role": "user", "content": "c"}],
            [1, 2, 3, 10, 11, 4, 20, 21, 22, 6, 7],
            [40, 41],
            0.3,
        )
    )
    return ep


def test_rewards_sit_on_each_completions_last_token_and_gamma_between_turns():
    ep = tree_episode()
    samples, _ = ep.samples(0.9)
    assert [s.completion_ids for s in samples] == [["c0"], ["c1", "c3"], ["c2"]]
    got = gae_inputs(ep, samples, 0.9)
    # sample 1 over tokens 1..n-1: prompt 1,2,3,10,11,4 | c1 20,21,22 | gap 6,7 | c3 40,41
    # aligned index t is token t + 1: c1's last token (22) is t = 7, c3's last (41) t = 11
    r1 = [0.0] * 12
    r1[7], r1[11] = 0.2, 0.3 + 1.0  # c3 is a leaf: the final reward joins its own
    d1 = [1.0] * 12
    d1[7] = d1[11] = 0.9
    assert got.rewards[1].tolist() == pytest.approx(r1)
    assert got.discounts[1].tolist() == pytest.approx(d1)
    assert got.rewards[0].tolist() == pytest.approx([0, 0, 0, 0.1])  # not a leaf
    assert got.rewards[2].tolist() == pytest.approx([0] * 5 + [1.0])
    assert got.children == [[1, 2], [], []]
    assert got.truncated == [False, False, False]
    cut = gae_inputs(tree_episode("truncated"), samples, 0.9)
    assert cut.truncated == [False, True, True]  # only leaves bootstrap


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_gae_with_lambda_one_gives_every_token_its_completions_return(gamma):
    # G(c3) = 0.3 + 1 = 1.3, G(c1) = 0.2 + g 1.3, G(c2) = 0 + 1, G(c0) = 0.1 + g mean(G1, G2)
    # (with gamma 0.9: G1 = 1.37, G0 = 0.1 + 0.9 * 1.185 = 1.1665), whatever the values are
    ep = tree_episode()
    samples, _ = ep.samples(gamma)
    g = gae_inputs(ep, samples, gamma)
    gen = torch.Generator().manual_seed(0)
    masks = [torch.tensor(s.loss_mask[1:], dtype=torch.float32) for s in samples]
    values = [torch.randn(m.numel(), generator=gen) for m in masks]
    _, ret = tree_gae(g.rewards, values, masks, g.discounts, g.children, 1.0)
    want = ep.returns(gamma)
    if gamma == 0.9:
        assert want == pytest.approx({"c0": 1.1665, "c1": 1.37, "c2": 1.0, "c3": 1.3})
    for s, r in zip(samples, ret, strict=True):
        for t, k in enumerate(s.token_completion[1:]):
            if k >= 0:
                assert r[t].item() == pytest.approx(want[s.completion_ids[k]], abs=1e-5)


def test_gae_inputs_extend_shifts_links():
    a, b = GaeInputs(), GaeInputs()
    a.children, a.rewards, a.discounts, a.truncated = [[1], []], [torch.zeros(1)] * 2, [], []
    b.children, b.rewards = [[1, 2], [], []], [torch.zeros(1)] * 3
    a.extend(b)
    assert a.children == [[1], [], [3, 4], [], []]


# ---------------------------------------------------------------------------- the model
@pytest.fixture(scope="module")
def critic(tiny_model_dir: Path) -> Critic:
    return Critic(str(tiny_model_dir), dtype="float32", device="cpu", lr=1e-3)


def test_values_are_per_token_packed_and_match_one_forward(critic):
    seqs = [list(range(10, 30)), list(range(40, 47)), list(range(5, 18))]
    packed = critic.values(seqs, micro_batch_tokens=64)
    for seq, v in zip(seqs, packed, strict=True):
        (alone,) = critic.values([seq])
        assert v.shape == (len(seq) - 1,) and v.dtype == torch.float32
        torch.testing.assert_close(v, alone, atol=1e-5, rtol=0)
    with torch.no_grad():
        hidden = critic.model["backbone"](torch.tensor([seqs[0]])).last_hidden_state[0]
        want = critic.model["head"](hidden).squeeze(-1)[:-1]
    torch.testing.assert_close(packed[0], want, atol=1e-5, rtol=0)
    assert packed[0].abs().max() < 1.0  # the head starts small


def _step(c: Critic, seqs: list[list[int]], target: float) -> dict[str, float]:
    def loss_fn(items, values):
        loss = sum(((v - target) ** 2).mean() for v in values) / len(seqs)
        return loss, {"value_loss": float(loss.detach())}

    return c.train_step(seqs, loss_fn, micro_batch_tokens=16)


def test_lora_critic_trains_adapters_and_head_and_round_trips(tiny_model_dir, tmp_path):
    c = Critic(str(tiny_model_dir), dtype="float32", device="cpu", lora=LORA, lr=1e-2)
    assert set(c.params) and all("lora_" in n or n.startswith("head.") for n in c.params)
    base = {n: p.clone() for n, p in c.model.named_parameters() if not p.requires_grad}
    seqs = [list(range(10, 25)), list(range(30, 40))]
    before = {n: p.clone() for n, p in c.params.items()}
    for _ in range(3):
        out = _step(c, seqs, 1.0)
    assert torch.isfinite(torch.tensor(out["value_grad_norm"]))
    assert all(torch.equal(p, base[n]) for n, p in c.model.named_parameters() if n in base)
    changed = {n for n, p in c.params.items() if not torch.equal(p, before[n])}
    assert "head.weight" in changed and any("lora_B" in n for n in changed)
    c.save(tmp_path / "critic")
    torch.manual_seed(123)
    fresh = Critic(str(tiny_model_dir), dtype="float32", device="cpu", lora=LORA, lr=1e-2)
    assert not torch.equal(fresh.params["head.weight"], c.params["head.weight"])
    fresh.load(tmp_path / "critic")
    for n, p in c.params.items():
        assert torch.equal(fresh.params[n], p), n
    state, loaded = c.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
    assert torch.equal(state[0]["exp_avg"], loaded[0]["exp_avg"])
    torch.testing.assert_close(fresh.values(seqs)[0], c.values(seqs)[0])


def test_a_critic_checkpoint_of_another_shape_or_none_is_refused(critic, tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="has no critic"):
        critic.load(tmp_path / "nothing")
    lora = Critic(str(tiny_model_dir), dtype="float32", device="cpu", lora=LORA)
    lora.save(tmp_path / "lora")
    with pytest.raises(ConfigError, match="does not fit this run's critic"):
        critic.load(tmp_path / "lora")


def test_full_critic_learns_a_target(critic):
    seqs = [list(range(10, 25)), list(range(30, 40))]
    err = [float(sum(((v - 2.0) ** 2).mean() for v in critic.values(seqs)))]
    for _ in range(5):
        _step(critic, seqs, 2.0)
        err.append(float(sum(((v - 2.0) ** 2).mean() for v in critic.values(seqs))))
    assert err[-1] < 0.5 * err[0], err
    assert critic.model.training  # values() leaves the mode as it was


@pytest.mark.gpu
def test_critic_on_cuda_gives_the_cpu_values_and_trains(tiny_model_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    seqs = [list(range(10, 25)), list(range(30, 40))]
    torch.manual_seed(0)
    cpu = Critic(str(tiny_model_dir), dtype="float32", device="cpu")
    torch.manual_seed(0)
    gpu = Critic(str(tiny_model_dir), dtype="float32", device="cuda")
    for a, b in zip(cpu.values(seqs), gpu.values(seqs), strict=True):
        assert b.device.type == "cpu"
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    out = _step(gpu, seqs, 1.0)
    assert torch.isfinite(torch.tensor([out["value_loss"], out["value_grad_norm"]])).all()
