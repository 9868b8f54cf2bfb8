"""Rewards stay finite: a reward, a final reward, or an end's final reward that would make a
completion's reward, the final reward, the episode's reward or any return of the trajectory
leave the float range is a 400 naming the field, and nothing changes (in memory or in the
store). A store that already holds such a number (written by an older version) still reads
back through the HTTP API as JSON: the number as null, its path under ``non_finite``. A real
uvicorn on loopback, the instant FakeEngine, the real Qwen3 tokenizer."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from areal_agents.errors import UserError
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.proxy import Proxy
from areal_agents.serve.server import ProxyServer
from areal_agents.serve.session import SessionStore
from areal_agents.serve.store import EpisodeStore
from areal_agents.serve.store_schema import completions, sessions
from areal_agents.testing.fake_engine import FakeEngine

BIG = 1e308
"""Finite, but two of them add up to infinity."""


@pytest.fixture
def tok(qwen_chat_tokenizer: ChatTokenizer) -> ChatTokenizer:
    return qwen_chat_tokenizer


def _engine(tok: ChatTokenizer) -> FakeEngine:
    end = tok.token_id("<|im_end|>")
    assert end is not None
    return FakeEngine(lambda ids, p: [*ids[-5:-2], end])


@pytest.fixture
def server(tok: ChatTokenizer) -> Iterator[ProxyServer]:
    with ProxyServer.start(Proxy(_engine(tok), tok)) as srv:
        yield srv


def _strict(text: str) -> Any:
    """``text`` as JSON proper: ``NaN`` / ``Infinity`` (Python's extension) are refused."""

    def refuse(name: str) -> Any:
        raise AssertionError(f"not JSON: the answer holds {name}")

    return json.loads(text, parse_constant=refuse)


class Client:
    """One session of a proxy server, through its own key."""

    def __init__(self, srv: ProxyServer) -> None:
        self.url = srv.url
        made = httpx.post(f"{srv.url}/sessions").json()
        self.id, self.auth = made["id"], {"Authorization": f"Bearer {made['api_key']}"}

    def call(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"messages": messages, "max_tokens": 4}
        r = httpx.post(f"{self.url}/v1/chat/completions", json=body, headers=self.auth)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def post(self, route: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.url}/sessions/{self.id}/{route}", json=body, headers=self.auth)

    def summary(self) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/sessions/{self.id}", headers=self.auth)
        assert r.status_code == 200, r.text
        return dict(_strict(r.text))

    def trajectory(self, **params: Any) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/sessions/{self.id}/trajectory", params=params, headers=self.auth)
        assert r.status_code == 200, r.text
        return dict(_strict(r.text))


def _refused(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: "), error["message"]
    assert "float range" in error["message"], error["message"]


def _chain(c: Client) -> list[str]:
    """Two completions, the second continuing the first; their ids."""
    first = c.call([{"role": "user", "content": "hi"}])
    reply = first["choices"][0]["message"]
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": reply["content"]},
        {"role": "user", "content": "and then?"},
    ]
    second = c.call(history)
    ids = [first["choices"][0]["completion_id"], second["choices"][0]["completion_id"]]
    traj = c.trajectory()
    assert traj["completions"][1]["parent_id"] == ids[0]
    return ids


def _branches(c: Client) -> str:
    """A completion with two children (the same history continued twice); the parent's id."""
    first = c.call([{"role": "user", "content": "hi"}])
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "again"},
    ]
    c.call(history)
    c.call(history)
    parent = first["choices"][0]["completion_id"]
    assert [x["parent_id"] for x in c.trajectory()["completions"]] == [None, parent, parent]
    return str(parent)


# ---------------------------------------------------------------- refused when posted
def test_final_rewards_that_add_up_past_the_float_range_are_refused(server):
    c = Client(server)
    assert c.post("rewards", {"value": BIG, "final": True}).status_code == 200
    _refused(c.post("rewards", {"value": BIG, "final": True}), "value")
    assert c.summary()["final_reward"] == BIG
    traj = c.trajectory()
    assert traj["final_reward"] == BIG and "non_finite" not in traj
    _refused(c.post("end", {"final_reward": BIG}), "final_reward")
    summary = c.summary()
    assert summary["final_reward"] == BIG and summary["ended"] is False  # the end changed nothing
    assert c.post("end", {"final_reward": -BIG}).status_code == 200  # back to 0: finite
    assert c.summary()["final_reward"] == 0.0


def test_per_turn_rewards_that_add_up_past_the_float_range_are_refused(server):
    c = Client(server)
    first, second = _chain(c)
    assert c.post("rewards", {"value": -BIG, "completion_id": first}).status_code == 200
    _refused(c.post("rewards", {"value": -BIG, "completion_id": first}), "value")
    # Each completion's own sum finite, but the episode's sum (and the first's return) not:
    _refused(c.post("rewards", {"value": -BIG, "completion_id": second}), "value")
    _refused(c.post("rewards", {"value": -BIG}), "value")  # the latest completion: second
    traj = c.trajectory()
    assert [x["reward"] for x in traj["completions"]] == [-BIG, 0.0]
    assert [x["return"] for x in traj["completions"]] == [-BIG, 0.0]
    assert "non_finite" not in traj


def test_a_final_reward_whose_returns_would_overflow_is_refused(server):
    """The rewards' sum stays finite, but the parent's return averages its two children's
    (each the final reward), a sum of two: past the float range. Refused at the end."""
    c = Client(server)
    _branches(c)
    _refused(c.post("end", {"final_reward": BIG}), "final_reward")
    _refused(c.post("rewards", {"value": BIG, "final": True}), "value")
    summary = c.summary()
    assert summary["ended"] is False and summary["final_reward"] is None
    half = BIG / 2
    assert c.post("end", {"final_reward": half}).status_code == 200
    traj = c.trajectory(gamma=0.5)
    assert [x["return"] for x in traj["completions"]] == [half / 2, half, half]
    assert "non_finite" not in traj


def test_refused_rewards_leave_the_store_unchanged(tok, tmp_path):
    x = 0.6e308  # two add up (1.2e308), three do not (past 1.79e308)
    store = EpisodeStore(tmp_path / "episodes.db")
    with ProxyServer.start(Proxy(_engine(tok), tok, store=store)) as srv:
        c = Client(srv)
        (first, _) = _chain(c)
        assert c.post("rewards", {"value": x, "completion_id": first}).status_code == 200
        assert c.post("rewards", {"value": x, "final": True}).status_code == 200
        _refused(c.post("rewards", {"value": x, "completion_id": first}), "value")
        _refused(c.post("rewards", {"value": x, "final": True}), "value")
        _refused(c.post("end", {"final_reward": x}), "final_reward")
    store.close()
    again = EpisodeStore(tmp_path / "episodes.db")
    loaded = again.load(c.id)
    again.close()
    assert loaded is not None
    ep = loaded.episode
    assert ep.final_reward == x and not ep.ended
    assert [r.reward for r in ep.completions] == [x, 0.0]


def test_in_process_rewards_are_checked_too():
    store = SessionStore()
    session = store.create()
    store.add_reward(session, BIG, final=True)
    with pytest.raises(UserError, match="final_reward"):
        store.end(session, final_reward=BIG)
    with pytest.raises(UserError, match="value"):
        store.add_reward(session, math.inf, final=True)
    assert session.episode.final_reward == BIG and not session.closed


# ---------------------------------------------------------------- a store that holds one
def test_a_stored_non_finite_sum_reads_back_as_json_after_a_restart(tok, store_url):
    store = EpisodeStore(store_url)
    with ProxyServer.start(Proxy(_engine(tok), tok, store=store)) as srv:
        c = Client(srv)
        first, second = _chain(c)
    store.close()
    # What an older version stored: two finite final rewards added up to infinity, and
    # per-turn rewards, each finite, whose return is not.
    writer = EpisodeStore(store_url)
    with writer.engine.begin() as conn:
        conn.execute(sessions.update().where(sessions.c.id == c.id).values(final_reward=math.inf))
        for cid in (first, second):
            row = (completions.c.session_id == c.id) & (completions.c.id == cid)
            conn.execute(completions.update().where(row).values(reward=BIG))
    writer.close()

    store = EpisodeStore(store_url)
    with ProxyServer.start(Proxy(_engine(tok), tok, store=store)) as srv:  # a restart
        c.url = srv.url
        summary = c.summary()
        assert summary["final_reward"] is None
        assert summary["non_finite"] == {"final_reward": "Infinity"}
        traj = c.trajectory()
        assert traj["final_reward"] is None
        assert [x["reward"] for x in traj["completions"]] == [BIG, BIG]
        assert [x["return"] for x in traj["completions"]] == [None, None]
        flagged = traj["non_finite"]
        assert set(flagged.values()) == {"Infinity"}
        want = {"final_reward", "completions.0.return", "completions.1.return"}
        assert want <= set(flagged), flagged
        assert any(p.startswith("samples.0.returns.") for p in flagged), flagged
        delta = c.trajectory(prompts="delta", offset=1, limit=1)
        assert delta["non_finite"] == {
            "final_reward": "Infinity",
            "completions.0.return": "Infinity",
        }
        # More reward cannot be added to it; the session still answers.
        _refused(c.post("rewards", {"value": 1.0, "completion_id": first}), "value")
        assert c.post("end", {}).status_code == 200
        assert c.summary()["ended"] is True
    store.close()


def test_encoding_leaves_the_data_alone():
    from areal_agents.serve.routes import encode_json

    data: dict[str, Any] = {"a": [1.0, math.nan, {"b": -math.inf}], "c": "x", "d": (math.inf,)}
    out = _strict(encode_json(data).decode())
    assert out == {
        "a": [1.0, None, {"b": None}],
        "c": "x",
        "d": [None],
        "non_finite": {"a.1": "NaN", "a.2.b": "-Infinity", "d.0": "Infinity"},
    }
    assert math.isnan(data["a"][1]) and data["a"][2] == {"b": -math.inf}
    assert "non_finite" not in data
    assert _strict(encode_json({"a": 1.0}).decode()) == {"a": 1.0}
