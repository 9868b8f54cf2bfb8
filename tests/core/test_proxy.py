"""The recording proxy: a real uvicorn on loopback, the official openai client, a tiny Qwen3."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from areal_agents.engines.embedded import EmbeddedEngine
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.proxy import Proxy
from areal_agents.serve.server import ProxyServer
from areal_agents.testing.fake_engine import FakeEngine

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path):
    tok = ChatTokenizer.from_dir(tiny_model_dir)
    engine = EmbeddedEngine.from_pretrained(tiny_model_dir, dtype="float32", decode=tok.decode)
    proxy = Proxy(engine, tok, default_max_tokens=16)
    with ProxyServer.start(proxy) as srv:
        yield srv
    asyncio.run(engine.close())


def new_session(srv: ProxyServer, **body) -> dict:
    r = httpx.post(f"{srv.url}/sessions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def trajectory(srv: ProxyServer, sess: dict, gamma: float = 1.0) -> dict:
    r = httpx.get(
        f"{srv.url}/sessions/{sess['id']}/trajectory",
        params={"gamma": gamma},
        headers={"Authorization": f"Bearer {sess['api_key']}"},
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_sync_client_recorded_ids_match_template_and_reply(server, tiny_model_dir):
    sess = new_session(server)
    client = openai.OpenAI(base_url=sess["base_url"], api_key=sess["api_key"])
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    reply = client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, max_tokens=12, temperature=0, logprobs=True
    )
    comp = trajectory(server, sess)["completions"][0]
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = hf.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert comp["prompt_ids"] == list(expected)
    choice = reply.choices[0]
    out = comp["output_ids"][:-1] if choice.finish_reason == "stop" else comp["output_ids"]
    text = hf.decode(out)
    if choice.message.tool_calls:
        assert "<tool_call>" in text
    else:
        assert text == choice.message.content
    assert len(choice.logprobs.content) == len(out)
    assert [round(t.logprob, 5) for t in choice.logprobs.content] == [
        round(x, 5) for x in comp["output_logprobs"][: len(out)]
    ]
    assert reply.usage.completion_tokens == len(comp["output_ids"])


async def test_async_client_concurrent_sessions_are_isolated(server):
    sessions = [new_session(server) for _ in range(4)]

    async def call(sess: dict, i: int):
        client = openai.AsyncOpenAI(base_url=sess["base_url"], api_key=sess["api_key"])
        return await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": f"count to {i}"}],
            max_tokens=6,
            seed=i,
        )

    replies = await asyncio.gather(*[call(s, i) for i, s in enumerate(sessions)])
    for i, (sess, reply) in enumerate(zip(sessions, replies, strict=True)):
        traj = trajectory(server, sess)
        assert len(traj["completions"]) == 1
        assert traj["completions"][0]["messages"][0]["content"] == f"count to {i}"
        assert traj["completions"][0]["id"] == reply.id


def test_streaming_client_gets_same_text_as_recorded(server):
    sess = new_session(server)
    client = openai.OpenAI(base_url=sess["base_url"], api_key=sess["api_key"])
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    comp = trajectory(server, sess)["completions"][0]
    assert finish == [comp["finish_reason"]]
    tok = server.proxy.tokenizer
    out = comp["output_ids"][:-1] if comp["finish_reason"] == "stop" else comp["output_ids"]
    assert tok.decode(out) == text == comp["message"]["content"]


def test_n_choices_are_sibling_completions(server):
    sess = new_session(server)
    client = openai.OpenAI(base_url=sess["base_url"], api_key=sess["api_key"])
    reply = client.chat.completions.create(
        model="m", n=3, max_tokens=4, seed=1, messages=[{"role": "user", "content": "x"}]
    )
    assert len(reply.choices) == 3
    traj = trajectory(server, sess)
    assert [c["parent_id"] for c in traj["completions"]] == [None] * 3
    assert len(traj["samples"]) == 3


# ---------------------------------------------------------------- scripted tool round trip
@pytest.fixture(scope="module")
def scripted(tiny_model_dir: Path):
    """A fake engine that answers with exact token ids of scripted texts, real tokenizer."""
    tok = ChatTokenizer.from_dir(tiny_model_dir)
    replies: list[str] = []
    end = tok.token_id("<|im_end|>")

    def script(prompt_ids, params):
        return [*tok.encode(replies.pop(0)), end]

    proxy = Proxy(FakeEngine(script), tok, admin_key="admin-secret")
    with ProxyServer.start(proxy) as srv:
        yield srv, replies


def test_tool_round_trip_links_parent_and_merges_into_one_sample(scripted):
    srv, replies = scripted
    call_text = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
    )
    replies.extend([call_text, "The answer is 42."])
    admin = {"Authorization": "Bearer admin-secret"}
    sess = httpx.post(f"{srv.url}/sessions", json={"task_id": "t1"}, headers=admin).json()
    client = openai.OpenAI(base_url=sess["base_url"], api_key=sess["api_key"])
    messages = [{"role": "user", "content": "What is 6*7?"}]
    first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    call = msg.tool_calls[0]
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "6*7"}
    messages += [
        msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "42"},
    ]
    second = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == "The answer is 42."

    auth = {"Authorization": f"Bearer {sess['api_key']}"}
    r = httpx.post(
        f"{srv.url}/sessions/{sess['id']}/rewards",
        json={"value": 0.1, "tool_call_id": call.id},
        headers=auth,
    )
    assert r.json()["completion_id"] == first.id
    httpx.post(f"{srv.url}/sessions/{sess['id']}/end", json={"final_reward": 1.0}, headers=auth)
    traj = httpx.get(f"{srv.url}/sessions/{sess['id']}/trajectory?gamma=0.5", headers=auth).json()
    c1, c2 = traj["completions"]
    assert c2["parent_id"] == c1["id"]
    assert c2["merge"] == {"merged": True, "reason": "token_prefix"}
    assert traj["metrics"]["merge_rate"] == 1.0
    (sample,) = traj["samples"]
    assert sample["completion_ids"] == [c1["id"], c2["id"]]
    assert sample["input_ids"] == c2["prompt_ids"] + c2["output_ids"]
    # Only the two outputs are trained on; tool result and template glue are masked.
    assert sum(sample["loss_mask"]) == len(c1["output_ids"]) + len(c2["output_ids"])
    # returns: G2 = 1.0 (final, leaf); G1 = 0.1 + 0.5 * 1.0
    assert c2["return"] == pytest.approx(1.0)
    assert c1["return"] == pytest.approx(0.6)
    assert sample["returns"] == pytest.approx([0.6, 1.0])


# ---------------------------------------------------------------- bad input
def test_bad_input_gets_clear_4xx_never_500(scripted):
    srv, _ = scripted
    admin = {"Authorization": "Bearer admin-secret"}
    url = srv.url
    assert httpx.post(f"{url}/sessions", json={}).status_code == 401
    a = httpx.post(f"{url}/sessions", json={}, headers=admin).json()
    b = httpx.post(f"{url}/sessions", json={}, headers=admin).json()
    ka, kb = ({"Authorization": f"Bearer {s['api_key']}"} for s in (a, b))
    chat = f"{url}/v1/chat/completions"
    good = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    cases = [
        (httpx.post(chat, json=good), 401, "missing API key"),
        (httpx.post(chat, json=good, headers={"Authorization": "Bearer nope"}), 401, "invalid"),
        (httpx.post(chat, content=b"{not json", headers=ka), 400, "not valid JSON"),
        (httpx.post(chat, json=[1], headers=ka), 400, "expected a JSON object"),
        (httpx.post(chat, json={"model": "m"}, headers=ka), 400, "messages"),
        (httpx.post(chat, json={**good, "messages": []}, headers=ka), 400, "messages"),
        (
            httpx.post(
                chat, json={**good, "messages": [{"role": "wizard", "content": "x"}]}, headers=ka
            ),
            400,
            "role",
        ),
        (
            httpx.post(
                chat, json={**good, "messages": [{"role": "tool", "content": "x"}]}, headers=ka
            ),
            400,
            "tool_call_id",
        ),
        (httpx.post(chat, json={**good, "temperature": -1}, headers=ka), 400, "temperature"),
        (httpx.post(chat, json={**good, "n": 0}, headers=ka), 400, "n"),
        (
            httpx.post(
                chat,
                json={**good, "tool_choice": {"type": "function", "function": {"name": "zz"}}},
                headers=ka,
            ),
            400,
            "not in tools",
        ),
        (httpx.get(f"{url}/sessions/{a['id']}/trajectory"), 401, "missing API key"),
        (httpx.get(f"{url}/sessions/{a['id']}/trajectory", headers=kb), 403, "another session"),
        # a session key learns nothing about other sessions: 403 whether or not they exist
        (httpx.get(f"{url}/sessions/sess-nope/trajectory", headers=ka), 403, "another session"),
        (
            httpx.get(
                f"{url}/sessions/{a['id']}/trajectory", headers={"Authorization": "Bearer x"}
            ),
            401,
            "invalid API key",
        ),
        (
            httpx.get(
                f"{url}/sessions/sess-nope/trajectory", headers={"Authorization": "Bearer x"}
            ),
            401,
            "invalid API key",
        ),
        (
            httpx.post(f"{url}/sessions/{a['id']}/rewards", json={"value": "x"}, headers=ka),
            400,
            "value",
        ),
        (
            httpx.post(f"{url}/sessions/{a['id']}/rewards", json={"value": 1}, headers=ka),
            404,
            "has no",
        ),
        (
            httpx.post(
                f"{url}/sessions/{a['id']}/rewards",
                json={"value": 1, "completion_id": "c"},
                headers=kb,
            ),
            403,
            "another session",
        ),
        (httpx.post(f"{url}/sessions/{b['id']}/end", json={"bogus": 1}, headers=kb), 400, "bogus"),
        (httpx.get(f"{url}/sessions/{a['id']}/trajectory?gamma=2", headers=ka), 400, "gamma"),
    ]
    for response, status, words in cases:
        assert response.status_code == status, (response.request.url, response.text)
        assert words in response.json()["error"]["message"], response.text
    # nothing above touched session a or b
    for s, k in ((a, ka), (b, kb)):
        traj = httpx.get(f"{url}/sessions/{s['id']}/trajectory", headers=k).json()
        assert traj["completions"] == [] and traj["final_reward"] is None
    # an ended session refuses further calls
    httpx.post(f"{url}/sessions/{b['id']}/end", json={}, headers=kb)
    r = httpx.post(chat, json=good, headers=kb)
    assert r.status_code == 409 and "has ended" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/metrics").json().get("internal_error", 0) == 0


def test_unparsable_tool_call_stays_content_and_is_recorded(scripted):
    srv, replies = scripted
    replies.append('<tool_call>{"name": "calculator", "arguments": {"expression": }</tool_call>')
    sess = httpx.post(
        f"{srv.url}/sessions", json={}, headers={"Authorization": "Bearer admin-secret"}
    ).json()
    client = openai.OpenAI(base_url=sess["base_url"], api_key=sess["api_key"])
    reply = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "2+2"}], tools=TOOLS
    )
    assert reply.choices[0].finish_reason == "stop"
    assert "<tool_call>" in reply.choices[0].message.content
    comp = trajectory(srv, sess)["completions"][0]
    assert comp["parse_errors"] and "invalid JSON" in comp["parse_errors"][0]
