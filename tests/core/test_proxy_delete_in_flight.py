"""A model call still in flight when its session is deleted is answered 409 (``code:
"session_deleted"``) and not recorded, in memory or in the store, as a call in flight at
``POST /end`` is (tests/core/test_store.py). A real uvicorn on loopback, a FakeEngine that
takes 1 s per call (so the ``DELETE`` truly lands while the call is in the engine), the
real Qwen3 tokenizer, a SQLite store."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.proxy import Proxy
from areal_agents.serve.server import ProxyServer
from areal_agents.serve.store import EpisodeStore
from areal_agents.serve.store_schema import completions, responses, sessions
from areal_agents.testing.fake_engine import FakeEngine

ADMIN = "admin-key-48"
DELAY_S = 1.0


async def _in_engine(proxy: Proxy) -> None:
    """Return once the call has reached the engine (where it then spends ``DELAY_S``)."""
    for _ in range(500):
        if proxy.counters["chat_calls"]:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the call did not reach the engine in 5 s")


@pytest.fixture
def tok(qwen_chat_tokenizer: ChatTokenizer) -> ChatTokenizer:
    return qwen_chat_tokenizer


def _engine(tok: ChatTokenizer) -> FakeEngine:
    end = tok.token_id("<|im_end|>")
    assert end is not None
    return FakeEngine(lambda ids, p: [*ids[-5:-2], end], delay_s=DELAY_S)


def _stored(db: Path, session_id: str) -> tuple[int, float | None]:
    """(the completions and Responses conversations stored under ``session_id``, its
    ``deleted_at``), read directly."""
    engine = sa.create_engine(f"sqlite:///{db}")
    with engine.connect() as conn:
        n = sum(
            conn.execute(
                sa.select(sa.func.count()).where(table.c.session_id == session_id)
            ).scalar_one()
            for table in (completions, responses)
        )
        deleted_at = conn.execute(
            sa.select(sessions.c.deleted_at).where(sessions.c.id == session_id)
        ).scalar_one()
    engine.dispose()
    return int(n), deleted_at


CALLS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    "chat-stream": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "stream": True},
    ),
    "responses": ("/v1/responses", {"input": "hi"}),
}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("deleter", ["session key", "admin key"])
def test_a_call_in_flight_at_delete_is_a_409_and_not_recorded(tmp_path, tok, call, deleter):
    db = tmp_path / "episodes.db"
    store = EpisodeStore(db)
    proxy = Proxy(_engine(tok), tok, admin_key=ADMIN, store=store)
    route, body = CALLS[call]
    body = {**body, "max_tokens" if route.endswith("completions") else "max_output_tokens": 3}
    with ProxyServer.start(proxy) as srv:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        s = httpx.post(f"{srv.url}/sessions", headers=admin).json()
        auth = {"Authorization": f"Bearer {s['api_key']}"}

        async def race() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(timeout=10) as client:
                sent = asyncio.ensure_future(
                    client.post(f"{srv.url}{route}", json=body, headers=auth)
                )
                await _in_engine(proxy)
                who = auth if deleter == "session key" else admin
                deleted = await client.delete(f"{srv.url}/sessions/{s['id']}", headers=who)
                assert not sent.done(), "the call was not in flight at the DELETE"
                return await sent, deleted

        answer, deleted = asyncio.run(race())
        assert deleted.status_code == 200, deleted.text
        if call == "chat-stream":  # the stream's answer went out; its end is the error
            assert answer.status_code == 200
            assert "session_deleted" in answer.text and "[DONE]" not in answer.text
        else:
            assert answer.status_code == 409, answer.text
            error = answer.json()["error"]
            assert error["code"] == "session_deleted" and error["type"] == "conflict_error"
            assert "deleted" in error["message"] and "not recorded" in error["message"]
        assert proxy.counters["deleted_in_flight"] == 1
        assert proxy.counters["recorded_completions"] == 0
        # The session is gone for its key and for the admin key.
        r = httpx.get(f"{srv.url}/sessions/{s['id']}/trajectory", headers=auth)
        assert r.status_code == 401
        r = httpx.get(f"{srv.url}/sessions/{s['id']}", headers=admin)
        assert r.status_code == 404
    store.close()
    n, deleted_at = _stored(db, s["id"])
    assert n == 0, "the call was stored under the deleted session"
    assert deleted_at is not None


def test_a_call_in_flight_at_delete_without_a_store(tok):
    """Kept in memory only: the held session object must not take the call either."""
    proxy = Proxy(_engine(tok), tok)
    with ProxyServer.start(proxy) as srv:
        s = httpx.post(f"{srv.url}/sessions").json()
        auth = {"Authorization": f"Bearer {s['api_key']}"}
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

        async def race() -> httpx.Response:
            async with httpx.AsyncClient(timeout=10) as client:
                sent = asyncio.ensure_future(
                    client.post(f"{srv.url}/v1/chat/completions", json=body, headers=auth)
                )
                await _in_engine(proxy)
                r = await client.delete(f"{srv.url}/sessions/{s['id']}", headers=auth)
                assert r.status_code == 200
                return await sent

        answer = asyncio.run(race())
        assert answer.status_code == 409 and answer.json()["error"]["code"] == "session_deleted"
        assert proxy.counters["recorded_completions"] == 0
