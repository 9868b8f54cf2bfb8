"""Turn-level advantages: GiGPO's step-level groups (anchor states, A = A_E + omega * A_S,
the share metric) and turn-level GAE (one value per turn boundary), with their config keys."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from areal_agents.errors import ConfigError
from areal_agents.trainer.advantage import (
    completion_returns,
    completion_state_keys,
    group_advantages,
    step_group_advantages,
    step_groups,
    turn_gae,
)
from areal_agents.trainer.algorithms import (
    AlgorithmSpec,
    CriticConfig,
    Estimator,
    get_algorithm,
    set_values,
)
from areal_agents.trainer.batch import add_gae, build_batch
from areal_agents.trainer.config import AdvantageConfig
from areal_agents.trainer.config_io import load_config
from areal_agents.trainer.step import make_value_loss_fn
from areal_agents.trajectory import Completion, Episode

S2, S3 = math.sqrt(2), math.sqrt(3)
SYSTEM = {"role": "system", "content": "You are a careful agent."}


def close(a: torch.Tensor, b: Any, tol: float = 1e-6) -> None:
    torch.testing.assert_close(a.double(), torch.tensor(b, dtype=torch.float64), rtol=0, atol=tol)


def _completion(
    cid: str,
    messages: list[dict[str, Any]],
    prompt: list[int],
    out: list[int],
    reward: float = 0.0,
) -> Completion:
    return Completion(
        cid,
        messages,
        prompt,
        out,
        [-0.5] * len(out),
        [0] * len(out),
        {"role": "assistant", "content": f"{cid} says"},
        "stop",
        reward=reward,
    )


def line(
    sid: str,
    gid: str,
    observations: list[list[dict[str, Any]]],
    final: float,
    *,
    rewards: list[float] | None = None,
    end_reason: str = "terminated",
) -> Episode:
    """An episode of ``len(observations) + 1`` turns in a line: turn 0's prompt is the
    task, turn k's is turn k - 1's prompt, its reply and ``observations[k - 1]`` (the env's
    tool results or user turn). The replies name the episode, so no two episodes share a
    history beyond the task; prompt ids do not extend each other (one sample per turn)."""
    ep = Episode(sid, group_id=gid, final_reward=final, end_reason=end_reason)
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": f"task of {gid}"}]
    rewards = rewards or [0.0] * (len(observations) + 1)
    for k in range(len(observations) + 1):
        c = ep.add(_completion(f"{sid}-{k}", list(messages), [1], [2], rewards[k]))
        if k < len(observations):
            messages = [*messages, c.message, *observations[k]]
    return ep


def tool(content: str, call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def three_episodes() -> list[Episode]:
    """One group of three two-turn episodes. Turn 0 of each starts from the task; turn 1 of
    e1 and e2 from the same tool result (different call ids and histories), e3's from
    another. gamma = 0.5, final rewards 1, 0, 1."""
    return [
        line("e1", "g", [[tool("x = 1", "call_a")]], 1.0),
        line("e2", "g", [[tool("x = 1", "call_b")]], 0.0),
        line("e3", "g", [[tool("x = 2", "call_c")]], 1.0),
    ]


_CRITIC_KEYS = {f.name for f in dataclasses.fields(CriticConfig)}


def _spec(name: str, **settings: Any) -> AlgorithmSpec:
    """The algorithm ``name`` with these ``advantage.*`` (and, for ppo, ``critic.*``) values."""
    spec = get_algorithm(name)
    critic = {k: settings.pop(k) for k in list(settings) if k in _CRITIC_KEYS}
    advantage = dataclasses.replace(spec.advantage, **settings)
    if spec.critic is None:
        return dataclasses.replace(spec, advantage=advantage)
    return dataclasses.replace(
        spec, advantage=advantage, critic=dataclasses.replace(spec.critic, **critic)
    )


# ------------------------------------------------------------------ step-level groups
def test_step_groups_by_hand():
    # gamma = 0.5: G(turn 1) = final reward, G(turn 0) = 0.5 * final.
    #   e1: G = 0.5, 1    e2: G = 0, 0    e3: G = 0.5, 1         (rows e1-0 e1-1 e2-0 ...)
    # Episode level (GRPO on R(e) = G(root) = 0.5, 0, 0.5): mean 1/3,
    #   std = sqrt(((1/6)^2 + (1/3)^2 + (1/6)^2) / 2) = sqrt(1/12) = 1 / (2 sqrt 3)
    #   A_E = (G - 1/3) * 2 sqrt 3:  G = 0.5 -> 1/sqrt 3,  G = 1 -> 4/sqrt 3,  G = 0 -> -2/sqrt 3
    # Step groups: S0 = the three turn 0s (the task): G = 0.5, 0, 0.5, the same numbers as
    #   the episode level: A_S = 1/sqrt 3, -2/sqrt 3, 1/sqrt 3.
    #   S1 = {e1-1, e2-1} ("x = 1"): G = 1, 0, mean 0.5, std sqrt(0.5): A_S = +-1/sqrt 2.
    #   S2 = {e3-1} ("x = 2") alone: A_S = 0.
    # omega = 0.5: A = A_E + 0.5 * A_S
    #   e1-0 = e3-0 = 1.5 / sqrt 3 = sqrt 3 / 2      e2-0 = -1.5 * 2 / sqrt 3 = -sqrt 3
    #   e1-1 = 4/sqrt 3 + 0.5/sqrt 2     e2-1 = -2/sqrt 3 - 0.5/sqrt 2     e3-1 = 4/sqrt 3
    # 5 of the 6 turns are in step groups of more than one.
    eps = three_episodes()
    rows = completion_returns(eps, gamma=0.5)
    keys = completion_state_keys(eps)
    steps = step_groups(rows.returns, rows.group_ids, keys, eps=0.0)
    close(steps.advantages, [1 / S3, 1 / S2, -2 / S3, -1 / S2, 1 / S3, 0.0])
    assert steps.sizes.tolist() == [3, 2, 3, 2, 3, 1]
    assert steps.share == pytest.approx(5 / 6)
    adv, _ = step_group_advantages(
        rows.returns, rows.group_ids, rows.episode_ids, keys, roots=rows.roots, omega=0.5, eps=0.0
    )
    close(
        adv,
        [S3 / 2, 4 / S3 + 0.5 / S2, -S3, -2 / S3 - 0.5 / S2, S3 / 2, 4 / S3],
    )


def test_step_scale_none_by_hand():
    # Same batch, step_scale none: A_S = G - mean_S G
    #   S0: 0.5 - 1/3 = 1/6, 0 - 1/3 = -1/3;  S1: 1 - 0.5 = 0.5, 0 - 0.5 = -0.5;  S2: 0
    eps = three_episodes()
    rows = completion_returns(eps, gamma=0.5)
    steps = step_groups(rows.returns, rows.group_ids, completion_state_keys(eps), scale="none")
    close(steps.advantages, [1 / 6, 0.5, -1 / 3, -0.5, 1 / 6, 0.0])


def test_step_groups_stay_within_their_group():
    # the same task text and state in two groups: each group's turns form their own step group
    eps = [line("a", "g1", [], 1.0), line("b", "g1", [], 0.0)]
    eps += [line("c", "g2", [], 1.0), line("d", "g2", [], 1.0)]
    for ep in eps:  # one state for all four
        ep.metadata["state_keys"] = {c.id: "start" for c in ep.completions}
    rows = completion_returns(eps)
    steps = step_groups(rows.returns, rows.group_ids, completion_state_keys(eps), eps=0.0)
    assert steps.sizes.tolist() == [2, 2, 2, 2]
    close(steps.advantages, [1 / S2, -1 / S2, 0.0, 0.0])  # g2's returns are equal: 0


def test_omega_zero_is_grpo_exactly():
    eps = three_episodes()
    rows = completion_returns(eps, gamma=0.5)
    keys = completion_state_keys(eps)
    grpo = group_advantages(rows.returns, rows.group_ids, rows.episode_ids, roots=rows.roots)
    for step_scale in ("std", "none"):
        adv, _ = step_group_advantages(
            rows.returns,
            rows.group_ids,
            rows.episode_ids,
            keys,
            roots=rows.roots,
            omega=0.0,
            step_scale=step_scale,
        )
        assert torch.equal(adv, grpo)
    # and through the batch, token by token
    plain, _ = build_batch(eps, get_algorithm("grpo"), 0.5, 16)
    zero, stats = build_batch(eps, _spec("grpo", estimator="step_group", omega=0.0), 0.5, 16)
    assert all(torch.equal(a, b) for a, b in zip(plain.adv, zero.adv, strict=True))
    assert stats["adv/step_group_share"] == pytest.approx(5 / 6)


def test_build_batch_puts_the_combined_advantage_on_the_tokens_and_reports_the_share():
    eps = three_episodes()
    eps[0].metadata["state_keys"] = {"e1-0": "start"}  # 1 of 6 turns anchored by the env
    spec = _spec("grpo", estimator="step_group", omega=0.5, eps=0.0)
    batch, stats = build_batch(eps, spec, 0.5, 16)
    # one sample per turn (no prompt extends another), one output token each
    got = [float(a[m.bool()][0]) for a, m in zip(batch.adv, batch.mask, strict=True)]
    # e1-0 now has a state of its own ("env:start"): A_S = 0, A = A_E = 1/sqrt 3; S0 keeps
    # e2-0 and e3-0: G = 0, 0.5, std 1/(2 sqrt 2): A_S = -1/sqrt 2, +1/sqrt 2
    want = [1 / S3, 4 / S3 + 0.5 / S2, -2 / S3 - 0.5 / S2, -2 / S3 - 0.5 / S2]
    want += [1 / S3 + 0.5 / S2, 4 / S3]
    close(torch.tensor(got), want)
    assert stats["adv/step_group_share"] == pytest.approx(4 / 6)
    assert stats["adv/env_state_share"] == pytest.approx(1 / 6)
    assert stats["adv_abs_max"] == pytest.approx(4 / S3 + 0.5 / S2)  # e1-1
    _, plain = build_batch(eps, get_algorithm("grpo"), 0.5, 16)
    assert not any(k.startswith("adv/") for k in plain)  # other estimators report no share


# ------------------------------------------------------------------ anchor states
def test_anchor_is_the_last_observation_not_the_history():
    keys = completion_state_keys(three_episodes())
    e1_0, e1_1, e2_0, e2_1, e3_0, e3_1 = keys
    assert e1_0 == e2_0 == e3_0  # the task: every episode starts there
    assert e1_1 == e2_1  # the same tool result after different replies and call ids
    assert e3_1 != e1_1 and e1_0 != e1_1
    assert all(k.startswith("obs:") for k in keys)


def test_anchor_hashes_the_trailing_tool_and_user_messages_by_role_and_text():
    parallel = [tool("a", "1"), tool("b", "2")]
    first = line("p", "g", [parallel], 0.0)
    other = line("q", "g", [[tool("c", "1"), tool("b", "2")]], 0.0)  # same last message
    text_parts = line("r", "g", [[tool("a", "9"), {**tool("", "8"), "content": [
        {"type": "text", "text": "b"}
    ]}]], 0.0)  # fmt: skip
    as_user = line(
        "s", "g", [[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]], 0.0
    )
    k = [completion_state_keys([ep])[1] for ep in (first, other, text_parts, as_user)]
    assert k[0] != k[1]  # parallel results: the whole observation, not just its last message
    assert k[0] == k[2]  # text parts join; call ids do not count
    assert k[0] != k[3]  # the role counts
    ends_with_reply = Episode("t", group_id="g")
    ends_with_reply.add(
        _completion("t-0", [SYSTEM, {"role": "assistant", "content": "hi"}], [1], [2])
    )
    assert completion_state_keys([ends_with_reply]) == ["none:t-0"]  # a state of its own


def test_the_env_state_key_wins_over_the_message_hash():
    eps = three_episodes()
    # e3's turn 1 saw another tool result, but the env says it is e1's state; e2's turn 1 saw
    # e1's text, but the env says it is another state
    eps[0].metadata["state_keys"] = {"e1-1": "s-17"}
    eps[1].metadata["state_keys"] = {"e2-1": "s-99"}
    eps[2].metadata["state_keys"] = {"e3-1": "s-17"}
    keys = completion_state_keys(eps)
    assert keys[1] == keys[5] == "env:s-17" and keys[3] == "env:s-99"
    assert keys[0] == keys[2] == keys[4] and keys[0].startswith("obs:")  # the rest: hashes


class _Corridor:
    """Three steps along a corridor. The observation is always "next", the state key the
    room: the message hash would merge rooms 1 and 2, the env's key keeps them apart."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.room = 0
        return [{"role": "user", "content": "walk"}], {"state_key": "room-0", "task_id": "t"}

    def step(self, message: dict[str, Any]):
        self.room += 1
        info = {"state_key": f"room-{self.room}"}
        return [{"role": "user", "content": "next"}], 0.0, self.room == 3, False, info

    def close(self) -> None:
        pass


async def test_the_runner_records_the_env_state_key_of_each_turns_prompt(tiny_model_dir: Path):
    from areal_agents.rollout.runner import Runner
    from areal_agents.serve.chat import ChatTokenizer
    from areal_agents.serve.proxy import Proxy
    from areal_agents.testing.fake_engine import FakeEngine

    tok = ChatTokenizer.from_dir(tiny_model_dir)
    end = tok.token_id("<|im_end|>")
    proxy = Proxy(FakeEngine(lambda ids, p: [*tok.encode("onward"), end]), tok)
    res = await Runner(proxy, max_turns=5).run_episode(_Corridor)
    assert res.end_reason == "terminated", res.error
    ep = res.episode
    ids = [c.id for c in ep.completions]
    assert ep.metadata["state_keys"] == dict(zip(ids, ["room-0", "room-1", "room-2"], strict=True))
    assert completion_state_keys([ep]) == ["env:room-0", "env:room-1", "env:room-2"]
    ep.metadata.pop("state_keys")  # without the env's keys, rooms 1 and 2 look the same
    hashed = completion_state_keys([ep])
    assert hashed[1] == hashed[2] != hashed[0]


# ------------------------------------------------------------------ turn-level GAE
def _one_turn(reward: float, end_reason: str = "terminated", final: float | None = 1.0) -> Episode:
    ep = Episode("one", group_id="g", final_reward=final, end_reason=end_reason)
    ep.add(_completion("c0", [{"role": "user", "content": "q"}], [1, 2, 3], [10, 11, 12], reward))
    return ep


def _ppo_turns(**advantage: Any) -> AlgorithmSpec:
    return _spec("ppo", estimator="turn_gae", whiten=False, **advantage)


def test_one_turn_turn_gae_is_r_minus_the_prompt_value_on_every_token():
    # sample [1, 2, 3, 10, 11, 12]; tokens 1..5 are [2, 3, 10, 11, 12], the outputs at 2..4.
    # V(prompt) = values[2] (the state after 1 2 3, where 10 is sampled) = 0.3; r = 1.
    # A = r - V(prompt) = 0.7 on all three output tokens, whatever the later values are.
    batch, _ = build_batch([_one_turn(0.0)], _ppo_turns(lam=0.95), 1.0, 16)
    values = [torch.tensor([0.9, 0.8, 0.3, 0.5, -0.2])]
    stats = add_gae(batch, values, _ppo_turns(lam=0.95))
    close(batch.adv[0], [0.0, 0.0, 0.7, 0.7, 0.7])
    assert batch.returns is not None and batch.value_mask is not None
    close(batch.returns[0], [0.0, 0.0, 1.0, 1.0, 1.0])
    assert batch.value_mask[0].tolist() == [False, False, True, False, False]
    assert stats["value_mean"] == pytest.approx(0.3) and stats["return_mean"] == pytest.approx(1)
    # token-level GAE on the same values gives each token its own advantage
    token, _ = build_batch([_one_turn(0.0)], _spec("ppo", whiten=False, lam=0.95), 1.0, 16)
    add_gae(token, values, _spec("ppo", whiten=False, lam=0.95))
    assert not torch.allclose(token.adv[0][2:], torch.full((3,), 0.7))


def test_turn_gae_two_turns_in_one_sample_by_hand():
    # c0: prompt [1 2 3], output [10 11], reward 0.1; c1 extends it exactly (merged):
    # prompt [1 2 3 10 11 4], output [20 21 22], reward 0.2 + final 1.0.
    # tokens 1..8 = [2 3 10 11 4 20 21 22]: c0 at 2..3, c1 at 5..7; V(c0) = v[2] = 0.4,
    # V(c1) = v[5] = 0.6 (the 5.0s inside the turns are never read). gamma 0.9, lam 0.5:
    #   delta(c1) = 1.2 - 0.6 = 0.6                 A(c1) = 0.6     R(c1) = 1.2
    #   delta(c0) = 0.1 + 0.9 * 0.6 - 0.4 = 0.24    A(c0) = 0.24 + 0.9 * 0.5 * 0.6 = 0.51
    #                                               R(c0) = 0.51 + 0.4 = 0.91
    ep = Episode("two", group_id="g", final_reward=1.0, end_reason="terminated")
    user = [{"role": "user", "content": "q"}]
    c0 = ep.add(_completion("c0", user, [1, 2, 3], [10, 11], 0.1))
    msgs = [*user, c0.message, {"role": "user", "content": "more"}]
    ep.add(_completion("c1", msgs, [1, 2, 3, 10, 11, 4], [20, 21, 22], 0.2))
    spec = _ppo_turns(lam=0.5)
    batch, _ = build_batch([ep], spec, 0.9, 16)
    assert len(batch.seqs) == 1  # merged
    add_gae(batch, [torch.tensor([5.0, 5.0, 0.4, 5.0, 5.0, 0.6, 5.0, 5.0])], spec)
    close(batch.adv[0], [0, 0, 0.51, 0.51, 0, 0.6, 0.6, 0.6])
    assert batch.returns is not None and batch.value_mask is not None
    close(batch.returns[0], [0, 0, 0.91, 0.91, 0, 1.2, 1.2, 1.2])
    assert torch.nonzero(batch.value_mask[0]).flatten().tolist() == [2, 5]
    # the value loss sees the boundaries only, each with its turn's summed loss weight
    loss = make_value_loss_fn(batch, spec)
    assert loss.masks[0].tolist() == [0, 0, 1, 0, 0, 1, 0, 0]
    w = batch.weights[0]
    close(loss.weights[0], [0, 0, float(w[2:4].sum()), 0, 0, float(w[5:8].sum()), 0, 0])
    assert float(loss.weights[0].sum()) == pytest.approx(float(w.sum()))


def tree() -> Episode:
    """c0 -> (c1, c2); c1 -> c3, which extends c1 exactly and merges: samples [c0], [c1 c3],
    [c2], the first continuing into the other two."""
    ep = Episode("tree", group_id="g", final_reward=1.0, end_reason="terminated")
    user = [{"role": "user", "content": "q"}]
    c0 = ep.add(_completion("c0", user, [1, 2, 3], [10, 11], 0.1))
    after = [*user, c0.message]
    c1 = ep.add(
        _completion("c1", [*after, {"role": "user", "content": "a"}], [1, 2, 3, 10, 11, 4],
                    [20, 21, 22], 0.2)
    )  # fmt: skip
    ep.add(_completion("c2", [*after, {"role": "user", "content": "b"}], [1, 2, 3, 10, 11, 5],
                       [30], 0.0))  # fmt: skip
    ep.add(
        _completion("c3", [*c1.messages, c1.message, {"role": "user", "content": "c"}],
                    [1, 2, 3, 10, 11, 4, 20, 21, 22, 6, 7], [40, 41], 0.3)
    )  # fmt: skip
    return ep


def test_turn_gae_with_lambda_one_returns_the_tree_returns_at_every_boundary():
    # lam = 1: R(c) = r(c) + gamma * mean R(next), whatever the values: Episode.returns.
    # G(c3) = 0.3 + 1 = 1.3, G(c1) = 0.2 + 0.9 * 1.3 = 1.37, G(c2) = 0 + 1 = 1,
    # G(c0) = 0.1 + 0.9 * (1.37 + 1) / 2 = 1.1665
    ep = tree()
    spec = _ppo_turns(lam=1.0)
    batch, _ = build_batch([ep], spec, 0.9, 16)
    assert [[r.id for r in s] for s in batch.sample_completions] == [["c0"], ["c1", "c3"], ["c2"]]
    torch.manual_seed(0)
    values = [torch.randn(len(s) - 1) for s in batch.seqs]
    add_gae(batch, values, spec)
    assert batch.returns is not None and batch.value_mask is not None
    got = {
        refs[int(seg[t])].id: float(ret[t])
        for refs, seg, ret, b in zip(
            batch.sample_completions, batch.segments, batch.returns, batch.value_mask, strict=True
        )
        for t in torch.nonzero(b).flatten().tolist()
    }
    assert got == pytest.approx({"c0": 1.1665, "c1": 1.37, "c2": 1.0, "c3": 1.3})
    assert got == pytest.approx(ep.returns(0.9))


def test_turn_gae_truncated_leaf_bootstraps_from_its_own_value():
    # truncated, no final reward, r = 0.2, V(prompt) = 0.3, gamma 0.9:
    # A = 0.2 + 0.9 * 0.3 - 0.3 = 0.17
    spec = _ppo_turns(lam=0.9)
    batch, _ = build_batch([_one_turn(0.2, "truncated", None)], spec, 0.9, 16)
    add_gae(batch, [torch.tensor([0.0, 0.0, 0.3, 7.0, 7.0])], spec)
    close(batch.adv[0], [0.0, 0.0, 0.17, 0.17, 0.17])


def test_turn_gae_passes_over_a_sample_without_sampled_tokens():
    # sample 0: one turn (V 0.5, r 0) continuing into sample 1, which has no sampled tokens
    # and continues into sample 2: one turn (V 0.2, r 1, terminal). gamma 1, lam 1:
    # A(2) = 1 - 0.2 = 0.8; sample 1 passes (V 0.2, A 0.8) on: A(0) = 0 + 0.2 - 0.5 + 0.8 = 0.5
    adv, ret, bounds = turn_gae(
        [torch.zeros(2), torch.zeros(1), torch.tensor([0.0, 1.0])],
        [torch.tensor([0.5, 9.0]), torch.tensor([9.0]), torch.tensor([0.2, 9.0])],
        [torch.ones(2), torch.zeros(1), torch.ones(2)],
        [torch.ones(2), torch.ones(1), torch.ones(2)],
        [torch.tensor([0, 0]), torch.tensor([-1]), torch.tensor([0, 0])],
        [[1], [2], []],
        1.0,
    )
    close(adv[0], [0.5, 0.5])
    close(adv[1], [0.0])
    close(adv[2], [0.8, 0.8])
    close(ret[0], [1.0, 1.0])
    assert [b.tolist() for b in bounds] == [[True, False], [False], [True, False]]


# ------------------------------------------------------------------ config
def test_advantage_section_reaches_the_algorithm_spec():

    cfg = load_config(
        None,
        [
            "env.id=x",
            "advantage.estimator=step_group",
            "advantage.omega=0.25",
            "advantage.step_scale=none",
        ],
    )
    adv = cfg.algorithm_spec().advantage
    assert (adv.estimator, adv.omega, adv.step_scale) == ("step_group", 0.25, "none")
    assert (adv.baseline, adv.scale) == ("mean", "std")  # GRPO's episode level stays
    default = load_config(None, ["env.id=x", "advantage.estimator=step_group"]).algorithm_spec()
    assert (default.advantage.omega, default.advantage.step_scale) == (1.0, "std")
    ppo = load_config(
        None,
        ["env.id=x", "algorithm=ppo", "rollout.group_size=1", "advantage.estimator=turn_gae"],
    ).algorithm_spec()
    assert ppo.advantage.estimator == "turn_gae" and ppo.needs_critic
    assert load_config(None, ["env.id=x"]).algorithm_spec().advantage.estimator == "group"
    assert set_values(AdvantageConfig()) == {}


def test_advantage_keys_that_would_do_nothing_or_misfit_are_refused():
    def problems(*overrides: str) -> list[str]:
        with pytest.raises(ConfigError) as info:
            load_config(None, ["env.id=x", *overrides])
        return info.value.problems

    (p,) = problems("advantage.estimator=turn_gae")
    assert p.startswith("advantage.estimator: 'turn_gae' takes its advantages from a critic")
    assert "set algorithm=ppo" in p
    (p,) = problems("algorithm=ppo", "rollout.group_size=1", "advantage.estimator=group")
    assert "set advantage.estimator=gae|turn_gae" in p
    (p,) = problems("advantage.omega=0.5")
    assert p.startswith("advantage.omega: only advantage.estimator=step_group uses it")
    (p,) = problems("algorithm=ppo", "rollout.group_size=1", "advantage.step_scale=none")
    assert p.startswith("advantage.step_scale: only advantage.estimator=step_group uses it")
    (p,) = problems(
        "algorithm=reinforce_pp", "rollout.group_size=1", "advantage.estimator=step_group"
    )
    assert p.startswith("rollout.group_size: advantage.estimator=step_group compares")
    got = problems("advantage.estimator=step_group", "advantage.omega=-1", "advantage.step_scale=z")
    assert "advantage.omega: must be >= 0, got -1.0" in got
    assert any(g.startswith("advantage.step_scale: expected one of 'std', 'none'") for g in got)
    assert any("did you mean" in g for g in problems("advantage.estimater=step_group"))


def test_config_estimators_are_the_spec_estimators():
    from typing import get_args, get_type_hints

    from areal_agents.trainer.algorithms import CRITIC_ESTIMATORS

    hint = get_type_hints(AdvantageConfig)["estimator"]  # Literal[...] | None
    literal = next(a for a in get_args(hint) if a is not type(None))
    assert set(get_args(literal)) == set(get_args(Estimator))
    grpo = get_algorithm("grpo").advantage
    critic = {e for e in get_args(Estimator) if dataclasses.replace(grpo, estimator=e).needs_critic}
    assert critic == CRITIC_ESTIMATORS


# ------------------------------------------------------------------ a real step
def _two_turn_group(policy: Any) -> list[Episode]:
    """A group of two episodes of two merged turns each, sampled-looking: the behaviour
    logprobs are the policy's own. Turn 1 of both starts from the same user message."""
    eps = []
    for k in range(2):
        ep = Episode(f"ep{k}", group_id="g", final_reward=float(k), end_reason="terminated")
        user = [{"role": "user", "content": "q"}]
        prompt, out = [5, 6, 7], [100 + k, 110 + k]
        (lp,) = policy.logprobs([prompt + out], 1.0)
        c0 = ep.add(
            Completion(f"c{k}", user, prompt, out, lp[-2:].tolist(), [0, 0],
                       {"role": "assistant", "content": f"a{k}"}, "stop")
        )  # fmt: skip
        prompt2, out2 = [*prompt, *out, 8], [200 + k, 210 + k, 220]
        (lp2,) = policy.logprobs([prompt2 + out2], 1.0)
        ep.add(
            Completion(f"d{k}", [*user, c0.message, {"role": "user", "content": "go on"}],
                       prompt2, out2, lp2[-3:].tolist(), [0] * 3,
                       {"role": "assistant", "content": "b"}, "stop", reward=0.1)
        )  # fmt: skip
        eps.append(ep)
    return eps


def test_both_estimators_train_a_step_of_real_models(tiny_model_dir: Path):
    from areal_agents.trainer.critic import Critic
    from areal_agents.trainer.policy import Policy
    from areal_agents.trainer.step import train_on_batch

    policy = Policy(str(tiny_model_dir), dtype="float32", device="cpu", lr=1e-2)
    critic = Critic(str(tiny_model_dir), dtype="float32", device="cpu", lr=1e-3)
    base = ["env.id=areal/Calculator-v0", "rollout.gamma=0.9", "sampling.max_new_tokens=16"]
    for name, estimator in (("grpo", "step_group"), ("ppo", "turn_gae")):
        group = "rollout.group_size=2" if name == "grpo" else "rollout.group_size=1"
        cfg = load_config(
            None, [*base, f"algorithm={name}", group, f"advantage.estimator={estimator}"]
        )
        spec = cfg.algorithm_spec()
        batch, bstats = build_batch(_two_turn_group(policy), spec, 0.9, 16)
        assert len(batch.seqs) == 2  # each episode's turns merged into one sample
        model = critic if spec.needs_critic else None
        before = {k: v.clone() for k, v in critic.params.items()}
        done = train_on_batch(policy, model, batch, spec, cfg, 0)
        stats, bstats = done.stats, {**bstats, **done.batch_stats}
        assert math.isfinite(stats["grad_norm"]) and math.isfinite(stats["loss"])
        if name == "grpo":
            # both turn 0s start from the task, both turn 1s from "go on": every turn is in a
            # step group of two
            assert bstats["adv/step_group_share"] == 1.0
        else:
            assert bstats["value_loss"] > 0 and math.isfinite(bstats["explained_variance"])
            assert batch.value_mask is not None
            assert [int(b.sum()) for b in batch.value_mask] == [2, 2]  # two turns each
            assert any(not torch.equal(v, before[k]) for k, v in critic.params.items())
