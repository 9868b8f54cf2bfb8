"""Conversations that outgrow the model's context: the proxy's context policies
(``areal_agents.serve.context``) on the real Qwen3 chat tokenizer, with a scripted engine that
records every generation it makes, so that what is trained can be checked against what was
sampled, token by token."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from areal_agents.engines.protocol import GenerateResult, SamplingParams
from areal_agents.errors import ConfigError
from areal_agents.serve.api_error import ApiError
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.context import (
    SUMMARY_INSTRUCTION,
    SUMMARY_PREFIX,
    ContextPolicy,
    truncation_marker,
    turn_bounds,
)
from areal_agents.serve.proxy import Proxy
from areal_agents.serve.server import ProxyServer
from areal_agents.serve.session import Session
from areal_agents.serve.store import EpisodeStore
from areal_agents.testing.fake_engine import FakeEngine
from areal_agents.trajectory import Completion, Episode, episode_from_dict

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]
SYSTEM = {"role": "system", "content": "You read files until you know the answer."}
TASK = {"role": "user", "content": "Which file mentions the lighthouse?"}
SUMMARY = "Summary: the files read so far do not mention the lighthouse; read on."


class Recorder(FakeEngine):
    """A scripted engine that calls the ``read`` tool on the next file, or, asked for a
    summary, writes :data:`SUMMARY`; every generation is kept in ``generations`` (prompt, output,
    logprobs, temperature), and each token gets a logprob of its own."""

    def __init__(self, tok: ChatTokenizer, max_context: int) -> None:
        super().__init__(self._answer, max_context=max_context)
        self.tok = tok
        self.generations: list[dict[str, Any]] = []

    def _answer(self, ids: list[int], params: SamplingParams) -> list[int]:
        end = self.tok.eos_token_ids[0]
        tail = self.tok.decode(ids[-80:])
        if "Answer with the summary only." in tail:
            return [*self.tok.encode(SUMMARY), end]
        n = self.tok.decode(ids).count("<tool_response>")
        call = {"name": "read", "arguments": {"path": f"file-{n}.txt"}}
        return [*self.tok.encode(f"<tool_call>\n{json.dumps(call)}\n</tool_call>"), end]

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, route_key: str | None = None
    ) -> GenerateResult:
        result = await super().generate(prompt_ids, params, route_key=route_key)
        k = len(self.generations)
        result.output_logprobs = [
            -0.01 * (k + 1) - 0.001 * i for i in range(len(result.output_ids))
        ]
        self.generations.append(
            {
                "prompt": list(prompt_ids),
                "output": list(result.output_ids),
                "logprobs": list(result.output_logprobs),
                "temperature": params.temperature,
            }
        )
        return result


def tool_result(n: int) -> str:
    return f"file-{n}.txt:\n" + " ".join(f"line {k} of file {n} says nothing." for k in range(22))


async def run_episode(proxy: Proxy, session: Session, turns: int) -> list[dict[str, Any]]:
    """An agent's loop: ``turns`` model calls, each answered with a long tool result; the
    conversation the client holds grows without bound."""
    messages: list[dict[str, Any]] = [SYSTEM, TASK]
    for n in range(turns):
        body = await proxy.complete(
            session, {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 64}
        )
        reply = body["choices"][0]["message"]
        assert reply.get("tool_calls"), (n, reply)
        messages = [*messages, reply]
        for call in reply["tool_calls"]:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": tool_result(n)})
    return messages


@pytest.fixture
def tok(qwen_chat_tokenizer: ChatTokenizer) -> ChatTokenizer:
    return qwen_chat_tokenizer


def context_proxy(tok: ChatTokenizer, policy: dict[str, Any], max_context: int = 1536, **kw: Any):
    engine = Recorder(tok, max_context)
    return engine, Proxy(engine, tok, context_policy=policy, **kw)


def check_recorded_as_sampled(ep: Episode, engine: Recorder, tok: ChatTokenizer) -> None:
    """Every completion holds the prompt the engine got and the output it sampled (the
    engine's calls and the episode's completions are in the same order); its prompt is the
    rendering of its ``sent_messages``; and every trained token of ``ep.samples()`` is a
    token the engine sampled, with exactly the logprob the engine gave it, each sampled
    token of a trained completion trained once."""
    assert len(engine.generations) == len(ep.completions)
    by_id = {c.id: call for c, call in zip(ep.completions, engine.generations, strict=True)}
    for c in ep.completions:
        call = by_id[c.id]
        assert c.prompt_ids == call["prompt"]
        assert (c.output_ids, c.output_logprobs) == (call["output"], call["logprobs"])
        tools = None if c.context_rewrite == "summary_call" else TOOLS
        assert c.prompt_ids == tok.encode(tok.render(c.sent_messages, tools=tools))
    samples, _ = ep.samples()
    trained: dict[str, list[tuple[int, float]]] = {}
    for s in samples:
        assert s.input_ids[: len(ep.by_id(s.completion_ids[0]).prompt_ids)] == (
            ep.by_id(s.completion_ids[0]).prompt_ids
        )
        for pos, (mask, k) in enumerate(zip(s.loss_mask, s.token_completion, strict=True)):
            if mask:
                trained.setdefault(s.completion_ids[k], []).append(
                    (s.input_ids[pos], s.logprobs[pos])
                )
    for c in ep.completions:
        expected = list(zip(by_id[c.id]["output"], by_id[c.id]["logprobs"], strict=True))
        assert trained.get(c.id, []) == (expected if c.trained else [])


def merge_reasons(ep: Episode) -> list[str]:
    return [m["reason"] for m in ep.samples()[1]]


async def test_truncated_tool_results_keep_a_long_episode_going(tok):
    engine, proxy = context_proxy(
        tok, {"policy": "truncate_tool_results", "reserve_tokens": 96, "keep_last_turns": 2}
    )
    session = proxy.sessions.create()
    messages = await run_episode(proxy, session, turns=14)
    ep = session.episode
    assert len(ep.completions) == 14 and proxy.counters["context_overflow"] == 0
    assert tok.encode(tok.render(messages, tools=TOOLS)).__len__() > 2 * proxy.max_context
    first = next(i for i, c in enumerate(ep.completions) if c.context_rewrite)
    assert 2 <= first <= 8  # the first turns fit as they are
    assert all(c.context_rewrite is None and c.segment == 0 for c in ep.completions[:first])
    for c in ep.completions[first:]:
        assert c.context_rewrite == "truncated" and c.segment > 0
        assert len(c.prompt_ids) + 96 <= proxy.max_context
    # the tree follows the client's conversation across rewrites: a chain
    assert [c.parent_id for c in ep.completions] == [None] + [c.id for c in ep.completions[:-1]]
    segments = [c.segment for c in ep.completions]
    assert segments == sorted(segments) and segments[-1] >= 2
    reasons = merge_reasons(ep)
    assert reasons[first] == "context_rewrite"
    assert "token_mismatch" not in reasons
    assert all(
        r == ("token_prefix" if ep.completions[i].segment == ep.completions[i - 1].segment
              else "context_rewrite")
        for i, r in enumerate(reasons) if i
    )  # fmt: skip
    samples, _ = ep.samples()
    owners = [s.completion_ids[0] for s in samples]
    assert ep.completions[first].id in owners  # a sample of its own
    assert len(samples) == len(set(segments))
    check_recorded_as_sampled(ep, engine, tok)
    for c in ep.completions[first:]:
        head, kept = turn_bounds(c.messages, 2)
        assert c.context_edits
        for e in c.context_edits:  # tool results before the last two turns, marked
            assert head <= e["start"] < kept and e["end"] == e["start"] + 1
            original = c.messages[e["start"]]
            assert original["role"] == "tool"
            marker = truncation_marker(len(original["content"]))
            assert e["messages"] == [{**original, "content": marker}]
        assert c.sent_messages[:2] == [SYSTEM, TASK]
        assert c.sent_messages[kept:] == c.messages[kept:]
        # the fewest results truncated: one fewer would not leave the reserve free
        fewer = dataclasses.replace(c, context_edits=c.context_edits[:-1]).sent_messages
        assert len(tok.encode(tok.render(fewer, tools=TOOLS))) + 96 > proxy.max_context
    counters = proxy.counters
    assert counters["context_rewrites"] == counters["context_truncated"] == 14 - first


@pytest.mark.parametrize("trained", [False, True])
async def test_summaries_keep_a_long_episode_going(tok, trained):
    policy = {
        "policy": "summarize",
        "reserve_tokens": 96,
        "keep_last_turns": 2,
        "summary_max_tokens": 40,
        "summary_trained": trained,
    }
    engine, proxy = context_proxy(tok, policy)
    session = proxy.sessions.create()
    await run_episode(proxy, session, turns=14)
    ep = session.episode
    calls = [c for c in ep.completions if c.context_rewrite == "summary_call"]
    turns = [c for c in ep.completions if c.context_rewrite != "summary_call"]
    assert len(turns) == 14 and len(calls) >= 2
    assert proxy.counters["context_summary_calls"] == len(calls)
    assert proxy.counters["context_summarized"] == sum(
        c.context_rewrite == "summarized" for c in turns
    )
    kids = ep.children()
    for call in calls:
        i = ep.completions.index(call)
        served = ep.completions[i + 1]  # recorded just before the call it was made for
        assert call.parent_id is None and kids[call.id] == []
        assert call.trained is trained and call.message["content"] == SUMMARY
        assert call.messages[-1] == {"role": "user", "content": SUMMARY_INSTRUCTION}
        assert call.messages[:2] == [SYSTEM, TASK]
        assert call.segment == served.segment
        assert engine.generations[i]["temperature"] == (1.0 if trained else 0.0)
        assert call.sampling["max_new_tokens"] <= 40
        assert served.context_rewrite == "summarized"
        summary = served.sent_messages[2]
        assert summary == {"role": "user", "content": f"{SUMMARY_PREFIX}\n\n{SUMMARY}"}
        _, kept = turn_bounds(served.messages, 2)
        assert served.sent_messages[3:] == served.messages[kept:]
    # the second summary is written from the first and the turns after it
    assert calls[1].messages[2]["content"].startswith(SUMMARY_PREFIX)
    assert [c.parent_id for c in turns] == [None] + [c.id for c in turns[:-1]]
    summarized = [c for c in turns if c.context_rewrite == "summarized"]
    assert len(summarized) > len(calls)  # a summary is reused while it fits
    reasons = dict(zip([c.id for c in ep.completions], merge_reasons(ep), strict=True))
    reused = [c for c in summarized if ep.completions[ep.completions.index(c) - 1] in turns]
    assert reused and all(reasons[c.id] == "token_prefix" for c in reused)
    assert all(reasons[c.id] == ("root" if trained else "not_trained") for c in calls)
    samples, _ = ep.samples()
    in_samples = {cid for s in samples for cid in s.completion_ids}
    assert all((c.id in in_samples) is trained for c in calls)
    check_recorded_as_sampled(ep, engine, tok)
    # the trainer's returns take the episode's return from its own root only
    from areal_agents.trainer.advantage import completion_returns

    ep.group_id = "g"
    rows = completion_returns([ep])
    assert rows.roots.tolist() == [c is turns[0] for c in ep.completions]


async def test_returns_run_across_segments(tok):
    """gamma = 0.5 on a chain of five turns that a summary cuts after the third."""
    policy = {
        "policy": "summarize",
        "reserve_tokens": 96,
        "keep_last_turns": 1,
        "summary_max_tokens": 40,
    }
    _, proxy = context_proxy(tok, policy, max_context=880)
    session = proxy.sessions.create()
    await run_episode(proxy, session, turns=5)
    ep = session.episode
    kinds = [c.context_rewrite for c in ep.completions]
    assert kinds == [None, None, None, "summary_call", "summarized", "summarized"], kinds
    a, b, c, s, d, e = ep.completions
    assert [x.segment for x in ep.completions] == [0, 0, 0, 1, 1, 1]
    assert (b.parent_id, c.parent_id, d.parent_id, e.parent_id) == (a.id, b.id, c.id, d.id)
    assert s.parent_id is None
    proxy.sessions.add_reward(session, 0.5, completion_id=a.id)
    proxy.sessions.add_reward(session, 0.25, completion_id=d.id)
    proxy.sessions.end(session, final_reward=2.0)
    # G(e) = 2 (the leaf gets the final reward); G(d) = 0.25 + 0.5 * 2 = 1.25;
    # G(c) = 0.5 * 1.25 = 0.625; G(b) = 0.5 * 0.625 = 0.3125;
    # G(a) = 0.5 + 0.5 * 0.3125 = 0.65625; the summary call is a leaf of its own: G(s) = 2
    g = ep.returns(gamma=0.5)
    assert g == {a.id: 0.65625, b.id: 0.3125, c.id: 0.625, s.id: 2.0, d.id: 1.25, e.id: 2.0}
    samples, merges = ep.samples(gamma=0.5)
    assert [m["reason"] for m in merges] == [
        "root", "token_prefix", "token_prefix", "not_trained", "context_rewrite", "token_prefix",
    ]  # fmt: skip
    assert [x.completion_ids for x in samples] == [[a.id, b.id, c.id], [d.id, e.id]]
    assert samples[0].returns == [0.65625, 0.3125, 0.625]
    assert samples[1].returns == [1.25, 2.0]
    assert samples[1].input_ids[: len(d.prompt_ids)] == d.prompt_ids
    data = ep.to_dict(0.5)
    assert [x["return"] for x in data["completions"]] == [0.65625, 0.3125, 0.625, 2.0, 1.25, 2.0]
    assert data["metrics"]["samples"] == 2 and data["metrics"]["merge_rate"] == 0.75


async def test_fail_is_the_default_and_answers_context_length_exceeded(tok):
    engine = Recorder(tok, 600)
    proxy = Proxy(engine, tok)
    assert proxy.context_policy == ContextPolicy() and proxy.context_policy.policy == "fail"
    session = proxy.sessions.create()
    with pytest.raises(ApiError) as err:
        await run_episode(proxy, session, turns=8)
    assert err.value.status == 400 and err.value.code == "context_length_exceeded"
    assert "600" in err.value.message and proxy.counters["context_overflow"] == 1
    assert proxy.counters["context_rewrites"] == 0
    assert all(c.context_rewrite is None for c in session.episode.completions)
    # what cannot be made to fit is the same 400 under a rewriting policy: the last turns
    # are never truncated
    engine, proxy = context_proxy(
        tok, {"policy": "truncate_tool_results", "keep_last_turns": 1, "reserve_tokens": 16}, 300
    )
    long = [
        SYSTEM,
        TASK,
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "x " * 400},
    ]
    with pytest.raises(ApiError) as err:
        await proxy.complete(proxy.sessions.create(), {"model": "m", "messages": long})
    assert err.value.code == "context_length_exceeded" and "keep_last_turns" in err.value.message
    assert proxy.counters["context_overflow"] == 1 and engine.generations == []


async def test_the_runner_ends_an_overflowing_episode_as_context_overflow(tok):
    from areal_agents.rollout.runner import Runner

    class Reader:
        """A tiny env: every action is answered with a long tool result."""

        def reset(self, seed=None, options=None):
            return [SYSTEM, TASK], {"tools": TOOLS}

        def step(self, action):
            calls = action.get("tool_calls") or []
            return (
                [
                    {"role": "tool", "tool_call_id": c["id"], "content": tool_result(0)}
                    for c in calls
                ],
                0.0,
                False,
                False,
                {},
            )

    result = await Runner(Proxy(Recorder(tok, 700), tok), max_turns=10).run_episode(Reader)
    assert result.end_reason == "context_overflow"
    _, proxy = context_proxy(tok, {"policy": "truncate_tool_results", "reserve_tokens": 64})
    result = await Runner(proxy, max_turns=10).run_episode(Reader)
    assert result.end_reason == "truncated" and result.turns == 10
    assert proxy.counters["context_rewrites"] > 0


def test_config_and_policy_errors_name_the_fix(tok):
    from areal_agents.trainer.config_io import load_config

    def problems(*overrides: str) -> list[str]:
        with pytest.raises(ConfigError) as err:
            load_config(None, ["env.id=areal/Calculator-v0", *overrides])
        return list(err.value.problems)

    assert problems("context.policy=summarise") == [
        "context.policy: expected one of 'fail', 'truncate_tool_results', 'summarize', got "
        "'summarise'; did you mean 'summarize'?"
    ]
    assert problems("context.policy=summarize", "context.keep_last_turns=-1") == [
        "context.keep_last_turns: must be an integer >= 0 (0 = no turn kept whole), got -1"
    ]
    assert problems("context.summary_trained=true", "context.policy=truncate_tool_results") == [
        "context.summary_trained: set, but context.policy=truncate_tool_results does not use "
        "it; set context.policy=summarize or remove context.summary_trained"
    ]
    assert problems("context.reserve_tokens=64") == [
        "context.reserve_tokens: set, but context.policy=fail does not use it; set "
        "context.policy=truncate_tool_results|summarize or remove context.reserve_tokens"
    ]
    found = problems(
        "context.policy=summarize",
        "model.max_context=400",
        "sampling.max_new_tokens=64",
        "train.micro_batch_tokens=1024",
    )
    assert found == [
        "context.reserve_tokens: must be below model.max_context=400, got 512; lower it or "
        "raise model.max_context",
        "context.summary_max_tokens: must be below model.max_context=400, got 512; lower it "
        "or raise model.max_context",
    ]
    assert (
        "use scheduler=local or context.policy=fail"
        in problems("context.policy=truncate_tool_results", "scheduler=ray")[0]
    )
    cfg = load_config(None, ["env.id=areal/Calculator-v0", "context.policy=summarize"])
    assert cfg.context == ContextPolicy(policy="summarize")  # the section is the proxy's policy

    with pytest.raises(ValueError, match="policy: must be one of fail, truncate_tool_results"):
        ContextPolicy(policy="drop")
    with pytest.raises(ValueError, match="summary_max_tokens: must be an integer >= 1, got 0"):
        ContextPolicy(summary_max_tokens=0)
    with pytest.raises(ValueError, match="unknown keys \\['reserve'\\]"):
        ContextPolicy.of({"reserve": 10})
    engine = FakeEngine(max_context=256)
    with pytest.raises(
        ValueError, match="reserve_tokens: must be below the model's context of 256"
    ):
        Proxy(engine, tok, context_policy="truncate_tool_results")
    Proxy(engine, tok, context_policy={"policy": "truncate_tool_results", "reserve_tokens": 64})


REWRITE_FIELDS = ("context_rewrite", "context_edits", "segment", "trained", "parent_id")


def _fields(ep: Episode) -> list[tuple[Any, ...]]:
    return [
        (c.id, *(getattr(c, f) for f in REWRITE_FIELDS), c.messages, c.sent_messages, c.prompt_ids)
        for c in ep.completions
    ]


async def test_store_and_trajectory_reads_keep_the_rewrites(tok, tmp_path: Path):
    store = EpisodeStore(tmp_path / "episodes.db")
    policy = {"policy": "summarize", "reserve_tokens": 96, "summary_max_tokens": 40}
    _, proxy = context_proxy(tok, policy, store=store)
    session = proxy.sessions.create()
    await run_episode(proxy, session, turns=10)
    proxy.sessions.end(session, final_reward=1.0)
    await proxy._sync_store()
    ep = session.episode
    kinds = {c.context_rewrite for c in ep.completions}
    assert {"summary_call", "summarized", None} <= kinds
    loaded = store.load(session.id)
    assert loaded is not None
    assert _fields(loaded.episode) == _fields(ep)
    assert [s.__dict__ for s in loaded.episode.samples(0.9)[0]] == [
        s.__dict__ for s in ep.samples(0.9)[0]
    ]
    for prompts in ("full", "delta"):
        back = episode_from_dict(json.loads(json.dumps(ep.to_dict(0.9, prompts=prompts))))
        assert _fields(back) == _fields(ep)
    store.close()
    # the viewer shows the episode, marking the rewritten calls
    from fastapi.testclient import TestClient

    from areal_agents.view.app import create_app

    client = TestClient(create_app([tmp_path]))
    page = client.get(f"/runs/{tmp_path.name}/episodes/{session.id}")
    assert page.status_code == 200
    assert "context summary call · segment 1" in page.text
    assert "context summarized · segment 1" in page.text
    served = next(c for c in ep.completions if c.context_rewrite == "summarized")
    tokens = client.get(f"/runs/{tmp_path.name}/episodes/{session.id}/tokens/{served.id}")
    assert tokens.status_code == 200


def test_records_from_before_the_rewrite_columns_still_load(tmp_path: Path):
    """A completion row of schema 0002 (no rewrite columns) reads as not rewritten, segment
    0, trained; so does a trajectory dict without the fields."""
    import sqlalchemy as sa
    from alembic import command
    from alembic.config import Config

    from areal_agents.serve import store as store_module
    from areal_agents.serve import store_rows, store_schema

    path = tmp_path / "old.db"
    engine = store_schema.make_engine(store_schema.store_url(path))
    cfg = Config()
    cfg.set_main_option(
        "script_location", str(Path(store_module.__file__).with_name("store_migrations"))
    )
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0002")
    c = Completion(
        "c-old", [TASK], [1, 2], [3], [-0.5], [0], {"role": "assistant", "content": "x"}, "stop"
    )
    session = Session("s-old", "", Episode("s-old", group_id="g"), created_at=1.0)
    session.episode.add(c)
    row = store_rows.completion_row(session, 0, c, [])
    for name in ("context_rewrite", "context_edits", "segment", "trained"):
        del row[name]
    with engine.begin() as conn:
        conn.execute(store_schema.sessions.insert(), store_rows.session_row(session))
        conn.execute(store_schema.completions.insert(), row)
    engine.dispose()
    store = EpisodeStore(path)
    with store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar() == "0003"
    loaded = store.load("s-old")
    assert loaded is not None
    (old,) = loaded.episode.completions
    assert (old.context_rewrite, old.context_edits, old.segment, old.trained) == (
        None,
        None,
        0,
        True,
    )
    assert old.sent_messages == [TASK]
    store.close()
    data = session.episode.to_dict()
    for d in data["completions"]:
        for name in ("context_rewrite", "context_edits", "segment", "trained"):
            del d[name]
    (back,) = episode_from_dict(data).completions
    assert (back.context_rewrite, back.segment, back.trained) == (None, 0, True)


def test_over_http_the_trajectory_shows_the_rewrites(tok):
    """An agent calling over HTTP gets the same policy: its trajectory carries the new
    fields, and its reply is the model's."""
    _, proxy = context_proxy(tok, {"policy": "truncate_tool_results", "reserve_tokens": 96})
    with ProxyServer.start(proxy) as srv:
        sess = httpx.post(f"{srv.url}/sessions").json()
        headers = {"Authorization": f"Bearer {sess['api_key']}"}
        messages: list[dict[str, Any]] = [SYSTEM, TASK]
        for n in range(10):
            r = httpx.post(
                f"{srv.url}/v1/chat/completions",
                json={"model": "m", "messages": messages, "tools": TOOLS},
                headers=headers,
            )
            assert r.status_code == 200, r.text
            reply = r.json()["choices"][0]["message"]
            messages += [
                reply,
                {
                    "role": "tool",
                    "tool_call_id": reply["tool_calls"][0]["id"],
                    "content": tool_result(n),
                },
            ]
        traj = httpx.get(f"{srv.url}/sessions/{sess['id']}/trajectory", headers=headers).json()
        metrics = httpx.get(f"{srv.url}/metrics").json()
    rewritten = [c for c in traj["completions"] if c["context_rewrite"] == "truncated"]
    assert rewritten and all(c["segment"] >= 1 and c["context_edits"] for c in rewritten)
    assert metrics["context_rewrites"] == len(rewritten)
    assert {c["merge"]["reason"] for c in rewritten} <= {"context_rewrite", "token_prefix"}
