"""The durable episode store: exact round trips, O(tokens) storage, restart, expiry, in-flight
ends and disconnects, on SQLite and PostgreSQL (``store_url`` fixture, tests/conftest.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from areal_agents.engines.launch import free_port
from areal_agents.errors import BackendError
from areal_agents.serve.api_error import ApiError
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.proxy import Proxy
from areal_agents.serve.server import ProxyServer
from areal_agents.serve.session import SessionStore
from areal_agents.serve.store import EpisodeStore
from areal_agents.testing.fake_engine import FakeEngine
from areal_agents.trajectory import (
    Completion,
    build_samples,
    episode_from_dict,
    merge_decisions,
)

HERE = Path(__file__).parent


@pytest.fixture
def tok(qwen_chat_tokenizer: ChatTokenizer) -> ChatTokenizer:
    return qwen_chat_tokenizer


def _echo(tok: ChatTokenizer):
    end = tok.token_id("<|im_end|>")
    return lambda ids, p: [*ids[-5:-2], end]


CALC = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "evaluate",
            "parameters": {"type": "object", "properties": {"e": {"type": "string"}}},
        },
    }
]


def _same_episode(a, b) -> None:
    assert [dataclasses.asdict(c) for c in a.completions] == [
        dataclasses.asdict(c) for c in b.completions
    ]
    for name in ("session_id", "final_reward", "group_id", "task_id", "ended", "end_reason"):
        assert getattr(a, name) == getattr(b, name), name
    assert a.errors == b.errors and a.metadata == b.metadata


def test_episodes_round_trip_exactly(store_url: str, tok: ChatTokenizer) -> None:
    """Chains, parallel samples (n=2), a branch, tools, every kind of reward, an end with an
    error: what a new store object reads back equals what the proxy held, field by field."""
    store = EpisodeStore(store_url)
    proxy = Proxy(FakeEngine(_echo(tok)), tok, store=store)

    async def record() -> list:
        s1 = proxy.sessions.create(group_id="g1", task_id="t1", metadata={"k": ["v", 1]})
        s2 = proxy.sessions.create(group_id="g1", task_id="t1")
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
        for _ in range(4):  # a chain: each request extends the previous one
            body = await proxy.complete(s1, {"messages": msgs, "tools": CALC, "max_tokens": 4})
            msgs = [*msgs, body["choices"][0]["message"], {"role": "user", "content": "more"}]
        await proxy.complete(s1, {"messages": msgs[:3], "max_tokens": 4, "n": 2})  # a branch
        proxy.sessions.add_reward(s1, 0.25, completion_id=s1.episode.completions[1].id)
        proxy.sessions.add_reward(s1, 0.5)  # the latest
        proxy.sessions.add_reward(s1, 1.0, final=True)
        proxy.sessions.end(s1, reason="truncated", error={"kind": "x", "message": "é ü 中"})
        await proxy.complete(s2, {"messages": msgs[:2], "max_tokens": 3})
        await store.flush()
        return [s1, s2]

    held = asyncio.run(record())
    store.close()
    again = EpisodeStore(store_url)
    try:
        for s in held:
            loaded = again.load(s.id)
            assert loaded is not None and loaded.key_hash == s.key_hash
            assert loaded.api_key == ""  # keys are never stored, only their hash
            _same_episode(loaded.episode, s.episode)
        assert len(held[0].episode.completions) == 6
        for s in held:  # the decisions delta reads make without samples: the same
            assert merge_decisions(s.episode) == build_samples(s.episode)[1]
        assert {m["reason"] for m in merge_decisions(held[0].episode)} >= {
            "root",
            "token_prefix",
            "parent_has_several_children",
        }
        assert again.session_ids() == [s.id for s in held]
        assert again.session_ids(ended=False) == [held[1].id]
    finally:
        again.close()


def _turn_completion(i: int, prompt: list[int], messages: list[dict]) -> Completion:
    out = [1000 + i, 1001 + i, 151645]
    return Completion(
        id=f"c{i}",
        messages=list(messages),
        prompt_ids=list(prompt),
        output_ids=out,
        output_logprobs=[-0.1, -0.2, -0.3],
        output_versions=[0, 0, 0],
        message={"role": "assistant", "content": f"turn {i}"},
        finish_reason="stop",
    )


def _long_episode(store: EpisodeStore | None, turns: int):
    sessions = SessionStore(store)
    session = sessions.create()
    prompt, messages = list(range(100, 140)), [{"role": "user", "content": "start"}]
    for i in range(turns):
        c = sessions.record(session, _turn_completion(i, prompt, messages))
        messages = [*messages, c.message, {"role": "tool", "tool_call_id": "x", "content": "ok"}]
        prompt = [*prompt, *c.output_ids, *range(200, 220)]  # a tool result of 20 tokens
    return session


def test_long_episodes_are_stored_and_read_in_linear_size(store_url: str) -> None:
    """Stored bytes and the delta trajectory grow linearly with the turns (a quadratic store
    would grow 16x from 100 to 400 turns, a linear one 4x), and read back exactly."""
    sizes, reads = {}, {}
    store = EpisodeStore(store_url)
    for turns in (100, 400):
        before = store.size()["delta_bytes"]
        session = _long_episode(store, turns)
        store.flush_sync()
        sizes[turns] = store.size()["delta_bytes"] - before
        loaded = store.load(session.id)
        assert loaded is not None
        _same_episode(loaded.episode, session.episode)
        delta = session.episode.to_dict(prompts="delta")
        reads[turns] = len(str(delta))
        _same_episode(episode_from_dict(delta), session.episode)
    store.close()
    assert 3.0 < sizes[400] / sizes[100] < 5.0, sizes
    assert 3.0 < reads[400] / reads[100] < 5.0, reads
    full = len(str(session.episode.to_dict()))
    assert full > 20 * reads[400]  # what the full form costs at 400 turns


def test_paged_trajectory_reads_concatenate_to_the_whole(tok: ChatTokenizer) -> None:
    session = _long_episode(None, 9)
    pages, offset = [], 0
    while offset is not None:
        page = session.episode.to_dict(prompts="delta", offset=offset, limit=4)
        assert page["samples"] is None
        pages.extend(page["completions"])
        offset = page["next_offset"]
    whole = session.episode.to_dict(prompts="delta")
    assert pages == whole["completions"]
    _same_episode(episode_from_dict({**whole, "completions": pages}), session.episode)


def _serve(store: str, port: int, *extra: str, real: bool = False) -> subprocess.Popen:
    if real:
        cmd = [sys.executable, "-m", "areal_agents.cli.main", "serve", "--port", str(port)]
        cmd += ["--store", store, "--max-batch-size", "4", *extra]
    else:
        cmd = [sys.executable, str(HERE / "fake_proxy_server.py"), "--port", str(port)]
        cmd += ["--store", store, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_healthy(proc: subprocess.Popen, port: int, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"no /health within {timeout} s")


def test_serve_restarted_on_its_store_keeps_every_session(tmp_path: Path) -> None:
    """`areal-agent serve --store` (the default model): record, kill -9, restart; the keys
    still work, the trajectories are complete, rewards can be posted and calls go on."""
    import openai

    db = str(tmp_path / "serve.db")
    port = free_port()
    proc = _serve(db, port, real=True)
    try:
        _wait_healthy(proc, port, 240)
        url = f"http://127.0.0.1:{port}"
        made = [httpx.post(f"{url}/sessions", json={"task_id": f"t{i}"}).json() for i in (0, 1)]
        before = {}
        for s in made:
            client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"])
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
            auth = {"Authorization": f"Bearer {s['api_key']}"}
            before[s["id"]] = httpx.get(f"{url}/sessions/{s['id']}/trajectory", headers=auth)
        a, b = made
        auth_a = {"Authorization": f"Bearer {a['api_key']}"}
        r = httpx.post(f"{url}/sessions/{a['id']}/rewards", json={"value": 0.5}, headers=auth_a)
        assert r.status_code == 200
        auth_b = {"Authorization": f"Bearer {b['api_key']}"}
        httpx.post(f"{url}/sessions/{b['id']}/end", json={"final_reward": 1}, headers=auth_b)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    proc = _serve(db, port, real=True)
    try:
        _wait_healthy(proc, port, 240)
        ta = httpx.get(f"{url}/sessions/{a['id']}/trajectory", headers=auth_a).json()
        old = before[a["id"]].json()
        assert [c["output_ids"] for c in ta["completions"]] == [
            c["output_ids"] for c in old["completions"]
        ]
        assert ta["completions"][0]["prompt_ids"] == old["completions"][0]["prompt_ids"]
        assert ta["completions"][0]["reward"] == 0.5 and not ta["ended"]
        tb = httpx.get(f"{url}/sessions/{b['id']}/trajectory", headers=auth_b).json()
        assert tb["ended"] and tb["final_reward"] == 1.0
        r = httpx.post(
            f"{url}/sessions/{a['id']}/rewards", json={"final": True, "value": 2}, headers=auth_a
        )
        assert r.status_code == 200, r.text
        client = openai.OpenAI(base_url=a["base_url"], api_key=a["api_key"])
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Again"}], max_tokens=4
        )
        ta = httpx.get(f"{url}/sessions/{a['id']}/trajectory", headers=auth_a).json()
        assert len(ta["completions"]) == 2 and ta["final_reward"] == 2.0
        # a garbage key and a deleted session's key get the same 401
        bad = httpx.get(f"{url}/sessions/{a['id']}", headers={"Authorization": "Bearer sk-x"})
        httpx.delete(f"{url}/sessions/{b['id']}", headers=auth_b)
        gone = httpx.get(f"{url}/sessions/{b['id']}", headers=auth_b)
        assert bad.status_code == gone.status_code == 401
        assert bad.json()["error"]["message"] == gone.json()["error"]["message"]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_idle_sessions_expire_and_stay_in_the_store(store_url: str, tok) -> None:
    store = EpisodeStore(store_url)
    idle_s = 1.0
    proxy = Proxy(FakeEngine(_echo(tok)), tok, store=store, session_idle_s=idle_s)
    with ProxyServer.start(proxy) as srv:
        idle = httpx.post(f"{srv.url}/sessions").json()
        busy = httpx.post(f"{srv.url}/sessions").json()
        auth = {"Authorization": f"Bearer {busy['api_key']}"}
        start = last = time.monotonic()
        checked = 0
        while time.monotonic() - start < 1.5 * idle_s:  # the busy one is read every 0.1 s
            time.sleep(0.1)
            summary = httpx.get(f"{srv.url}/sessions/{busy['id']}", headers=auth).json()
            now = time.monotonic()
            if now - last >= idle_s:  # a loaded machine paused this loop past the limit
                break
            assert summary["ended"] is False
            checked, last = checked + 1, now
        assert checked >= 3
        time.sleep(max(0.0, start + 1.5 * idle_s - time.monotonic()))
        auth = {"Authorization": f"Bearer {idle['api_key']}"}
        summary = httpx.get(f"{srv.url}/sessions/{idle['id']}", headers=auth).json()
        assert summary["ended"] and summary["end_reason"] == "expired"
        assert proxy.counters["sessions_expired"] >= 1
    store.close()
    kept = EpisodeStore(store_url)
    loaded = kept.load(idle["id"])
    assert loaded is not None and loaded.episode.end_reason == "expired"
    kept.close()


def test_a_call_in_flight_at_end_is_a_409_and_not_recorded(tmp_path: Path, tok) -> None:
    proxy = Proxy(FakeEngine(_echo(tok), delay_s=0.6), tok)
    with ProxyServer.start(proxy) as srv:
        s = httpx.post(f"{srv.url}/sessions").json()
        auth = {"Authorization": f"Bearer {s['api_key']}"}
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

        async def race() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(timeout=10) as client:
                call = asyncio.ensure_future(
                    client.post(f"{srv.url}/v1/chat/completions", json=body, headers=auth)
                )
                await asyncio.sleep(0.2)
                end = await client.post(f"{srv.url}/sessions/{s['id']}/end", headers=auth)
                return await call, end

        call, end = asyncio.run(race())
        assert end.status_code == 200
        assert call.status_code == 409 and call.json()["error"]["code"] == "session_ended"
        traj = httpx.get(f"{srv.url}/sessions/{s['id']}/trajectory", headers=auth).json()
        assert traj["completions"] == []
        assert proxy.counters["ended_in_flight"] == 1


def test_a_client_that_disconnects_aborts_its_generation(tok) -> None:
    engine = FakeEngine(_echo(tok), delay_s=1.5)
    proxy = Proxy(engine, tok)
    with ProxyServer.start(proxy) as srv:
        s = httpx.post(f"{srv.url}/sessions").json()
        auth = {"Authorization": f"Bearer {s['api_key']}"}
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        for stream in (False, True):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(
                    f"{srv.url}/v1/chat/completions",
                    json={**body, "stream": stream},
                    headers=auth,
                    timeout=0.4,
                )
        time.sleep(2.0)
        assert engine.calls == 0, "the generations were cancelled, not finished"
        assert proxy.counters["abandoned_calls"] == 2
        traj = httpx.get(f"{srv.url}/sessions/{s['id']}/trajectory", headers=auth).json()
        assert traj["completions"] == []


def test_an_engine_failure_is_recorded_once(tok) -> None:
    from areal_agents.envs.registry import make
    from areal_agents.rollout.runner import Runner

    class Failing(FakeEngine):
        async def generate(self, prompt_ids, params, *, route_key=None):
            raise BackendError("the GPU fell off")

    proxy = Proxy(Failing(), tok)
    with pytest.raises(ApiError):
        asyncio.run(
            proxy.complete(
                proxy.sessions.create(), {"messages": [{"role": "user", "content": "x"}]}
            )
        )
    result = asyncio.run(Runner(proxy).run_episode(lambda: make("areal/Calculator-v0"), seed=0))
    assert result.end_reason == "backend_error"
    assert [e["kind"] for e in result.episode.errors] == ["backend_error"]


def test_admin_key_gets_404_for_an_unknown_session(tok) -> None:
    proxy = Proxy(FakeEngine(_echo(tok)), tok, admin_key="adm")
    with ProxyServer.start(proxy) as srv:
        r = httpx.get(f"{srv.url}/sessions/sess-nope", headers={"Authorization": "Bearer adm"})
        assert r.status_code == 404


def test_responses_chains_survive_a_restart(store_url: str) -> None:
    db = store_url
    port = free_port()
    proc = _serve(db, port)
    try:
        _wait_healthy(proc, port, 60)
        url = f"http://127.0.0.1:{port}"
        s = httpx.post(f"{url}/sessions").json()
        auth = {"Authorization": f"Bearer {s['api_key']}"}
        first = httpx.post(
            f"{url}/v1/responses", json={"input": "hello", "max_output_tokens": 4}, headers=auth
        )
        assert first.status_code == 200, first.text
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    proc = _serve(db, port)
    try:
        _wait_healthy(proc, port, 60)
        nxt = httpx.post(
            f"{url}/v1/responses",
            json={
                "input": "again",
                "previous_response_id": first.json()["id"],
                "max_output_tokens": 4,
            },
            headers=auth,
        )
        assert nxt.status_code == 200, nxt.text
        traj = httpx.get(f"{url}/sessions/{s['id']}/trajectory", headers=auth).json()
        assert len(traj["completions"]) == 2
        assert traj["completions"][1]["parent_id"] == traj["completions"][0]["id"]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
