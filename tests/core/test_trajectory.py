"""Discounted returns along the completion tree and sample merging, by hand-computed values."""

from __future__ import annotations

import pytest

from areal_agents.trajectory import Completion, Episode, find_parent


def comp(cid, messages, reply, prompt, output, reward=0.0):
    return Completion(
        id=cid,
        messages=messages,
        prompt_ids=prompt,
        output_ids=output,
        output_logprobs=[-0.1] * len(output),
        output_versions=[0] * len(output),
        message={"role": "assistant", "content": reply},
        finish_reason="stop",
        reward=reward,
    )


U1 = {"role": "user", "content": "q"}


def test_returns_on_a_tree_with_a_branch():
    # root a -> b -> {c, d}   (b's reply was continued twice: two branches)
    ep = Episode("s")
    a = ep.add(comp("a", [U1], "A", [1, 2], [3], reward=0.5))
    hist_b = [U1, {"role": "assistant", "content": "A"}, {"role": "user", "content": "more"}]
    b = ep.add(comp("b", hist_b, "B", [1, 2, 3, 9], [4], reward=0.0))
    hist_c = [*hist_b, {"role": "assistant", "content": "B"}, {"role": "user", "content": "x"}]
    hist_d = [*hist_b, {"role": "assistant", "content": "B"}, {"role": "user", "content": "y"}]
    c = ep.add(comp("c", hist_c, "C", [1, 2, 3, 9, 4, 7], [5], reward=1.0))
    d = ep.add(comp("d", hist_d, "D", [1, 2, 3, 9, 4, 8], [6], reward=0.0))
    assert (a.parent_id, b.parent_id, c.parent_id, d.parent_id) == (None, "a", "b", "b")
    ep.final_reward = 2.0
    g = ep.returns(gamma=0.5)
    # leaves get the final reward: G(c) = 1 + 2 = 3, G(d) = 0 + 2 = 2
    # G(b) = 0 + 0.5 * mean(3, 2) = 1.25 ; G(a) = 0.5 + 0.5 * 1.25 = 1.125
    assert g == pytest.approx({"a": 1.125, "b": 1.25, "c": 3.0, "d": 2.0})
    samples, merges = ep.samples(gamma=0.5)
    # a+b merge (b only child, exact prefix); c and d do not (b has two children)
    assert [m["reason"] for m in merges] == [
        "root",
        "token_prefix",
        "parent_has_several_children",
        "parent_has_several_children",
    ]
    assert len(samples) == 3
    assert samples[0].input_ids == [1, 2, 3, 9, 4]
    assert samples[0].loss_mask == [0, 0, 1, 0, 1]
    assert samples[0].token_completion == [-1, -1, 0, -1, 1]
    assert samples[0].returns == pytest.approx([1.125, 1.25])


def test_gamma_one_final_reward_only_gives_every_completion_the_episode_return():
    ep = Episode("s")
    ep.add(comp("a", [U1], "A", [1], [2]))
    ep.add(comp("b", [U1, {"role": "assistant", "content": "A"}, U1], "B", [1, 2, 5], [3]))
    ep.final_reward = 0.7
    assert ep.returns(1.0) == pytest.approx({"a": 0.7, "b": 0.7})


def test_token_mismatch_is_recorded_not_merged():
    ep = Episode("s")
    ep.add(comp("a", [U1], "A", [1, 2], [3]))
    ep.add(comp("b", [U1, {"role": "assistant", "content": "A"}, U1], "B", [1, 2, 4, 4], [5]))
    samples, merges = ep.samples()
    assert merges[1] == {"merged": False, "reason": "token_mismatch", "position": 2}
    assert len(samples) == 2
    assert ep.to_dict()["metrics"]["merge_mismatches"] == 1


def test_parent_matching_ignores_tool_call_ids_and_argument_formatting():
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"x": 1, "y": 2}'},
    }
    a = comp("a", [U1], None, [1], [2])
    a.message = {"role": "assistant", "content": None, "tool_calls": [call]}
    echoed = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "other",
                "type": "function",
                "function": {"name": "f", "arguments": '{"y":2,"x":1}'},
            }
        ],
    }
    msgs = [U1, echoed, {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    assert find_parent([a], msgs) == "a"
    assert find_parent([a], [U1]) is None
