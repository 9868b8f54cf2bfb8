"""Schema revision 0002 of the episode store: the upgrade of a 0001 store (search backfilled),
full-text search over the messages, and the trainer's ``train_tokens`` rows, on SQLite and
PostgreSQL (``store_url`` fixture, tests/conftest.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import sqlalchemy as sa

from areal_agents.serve import store as store_module
from areal_agents.serve import store_rows, store_schema
from areal_agents.serve.session import Session
from areal_agents.serve.store import EpisodeStore, fts5_match, search_words
from areal_agents.serve.store_schema import SCHEMA_HEAD, completions, sessions
from areal_agents.trajectory import Completion, Episode

HOSTILE = [
    '"foo',
    "a OR",
    "-",
    "*",
    "NOT",
    "AND OR NOT",
    "(",
    ")",
    '""',
    "^",
    "col:alpha",
    "NEAR(alpha beta)",
    "alpha*",
    "'; DROP TABLE sessions; --",
    "a & b | !c",
    "",
    "   ",
    "\x00",
    "\ud800",
]


def _completion(cid: str, messages: list, message: dict, parent: str | None = None) -> Completion:
    return Completion(
        cid,
        messages,
        [1, 2, 3],
        [4, 5],
        [-0.5, -0.25],
        [0, 0],
        message,
        "stop",
        parent_id=parent,
    )


def _put_episode(store: EpisodeStore, sid: str, cs: list[Completion], group: str = "g") -> None:
    session = Session(sid, "", Episode(sid, group_id=group), created_at=1.0)
    store.put_session(session)
    for i, c in enumerate(cs):
        session.episode.add(c)
        store.put_completion(session, c, i, cs[:i])
    store.flush_sync()


def _matches(store: EpisodeStore, query: str) -> set[str]:
    with store.engine.connect() as conn:
        return {r[0] for r in conn.execute(store.fts_clause(query))}


def _tool_call(name: str, arguments: dict) -> dict:
    return {
        "id": "call-1",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def test_a_0001_store_with_rows_upgrades_and_old_words_are_found(store_url: str) -> None:
    """A store made by revision 0001 holding a session: opening it upgrades it (to 0003) with
    the old row in the search index, an empty train_tokens table and the new indexes."""
    from alembic import command
    from alembic.config import Config

    engine = store_schema.make_engine(store_schema.store_url(store_url))
    cfg = Config()
    cfg.set_main_option(
        "script_location", str(Path(store_module.__file__).with_name("store_migrations"))
    )
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0001")
    c = _completion(
        "c-old",
        [{"role": "user", "content": "Where is the lighthouse keeper?"}],
        {"role": "assistant", "content": "Gone fishing."},
    )
    session = Session("s-old", "", Episode("s-old", group_id="g"), created_at=1.0)
    session.episode.add(c)
    with engine.begin() as conn:
        assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar() == "0001"
        conn.execute(sessions.insert(), store_rows.session_row(session))
        row = store_rows.completion_row(session, 0, c, [])
        for later in ("context_rewrite", "context_edits", "segment", "trained"):  # 0003
            del row[later]
        conn.execute(completions.insert(), row)
    engine.dispose()

    store = EpisodeStore(store_url)
    with store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar() == "0003"
        names = {ix["name"] for ix in sa.inspect(conn).get_indexes("sessions")}
        agent_ix = {ix["name"] for ix in sa.inspect(conn).get_indexes("completions")}
    assert SCHEMA_HEAD == "0003"
    assert {"ix_sessions_created_at", "ix_sessions_end_reason", "ix_sessions_task_id"} <= names
    assert "ix_completions_agent" in agent_ix
    assert _matches(store, "lighthouse") == {"s-old"}
    assert _matches(store, "fishing") == {"s-old"}  # the reply
    assert _matches(store, "keeper lighthouse") == {"s-old"}
    assert _matches(store, "lighthouse submarine") == set()
    assert store.train_tokens("s-old") == []
    loaded = store.load("s-old")
    assert loaded is not None and loaded.episode.completions[0].message == c.message
    # new rows after the upgrade are indexed as they are written
    _put_episode(
        store, "s-new", [_completion("c-new", [{"role": "user", "content": "new tide"}], {})]
    )
    assert _matches(store, "tide") == {"s-new"}
    store.close()


def test_search_finds_content_tool_calls_and_non_ascii_text(store_url: str) -> None:
    store = EpisodeStore(store_url)
    sqlite = store.engine.dialect.name == "sqlite"
    first = _completion(
        "a0",
        [
            {"role": "system", "content": "You are a calculator."},
            {"role": "user", "content": [{"type": "text", "text": "Multiply pelican numbers"}]},
        ],
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [_tool_call("multiply", {"factor": "zebra"})],
        },
    )
    second = _completion(
        "a1",
        [
            *first.messages,
            first.message,
            {"role": "tool", "tool_call_id": "call-1", "content": "walrus result"},
        ],
        {"role": "assistant", "content": "Grüße aus Zürich, 東京 too, calculator"},
        parent="a0",
    )
    _put_episode(store, "s-a", [first, second])
    other = _completion(
        "b0",
        [{"role": "user", "content": "unrelated question"}],
        {"role": "assistant", "content": "ok"},
    )
    _put_episode(store, "s-b", [other], group="h")
    odd = _completion(  # a lone surrogate (stored escaped, decoded to invalid UTF-8)
        "c0",
        [{"role": "user", "content": "broken \udc80 surrogate marmot"}],
        {"role": "assistant", "content": "fine"},
    )
    _put_episode(store, "s-c", [odd], group="h")
    junk = {  # rows no proxy writes: text that is not JSON, entries that are not messages
        **store_rows.completion_row(Session("s-c", "", Episode("s-c")), 1, odd, []),
        "id": "c1",
        "messages_suffix": '["not a message", 7, {"content": 3}, {"content": "okapi"}]',
        "message": '{"tool_calls": ["junk", {"function": "x"}, {"function": {"arguments": 5}}]}',
    }
    store.submit((completions.insert(), junk)).result(30)
    store.submit(
        (
            completions.insert(),
            {**junk, "id": "c2", "seq": 2, "messages_suffix": "[{", "message": "no"},
        )
    ).result(30)

    assert _matches(store, "pelican") == {"s-a"}  # a content part's text
    assert _matches(store, "walrus") == {"s-a"}  # a tool result
    assert _matches(store, "multiply") == {"s-a"}  # the tool call's name
    assert _matches(store, "factor") == {"s-a"}  # and its arguments: keys and values
    assert _matches(store, "zebra") == {"s-a"}
    assert _matches(store, "PELICAN zebra") == {"s-a"}  # case-insensitive, every word
    assert _matches(store, "pelican unrelated") == set()
    assert _matches(store, "question") == {"s-b"}
    assert _matches(store, "marmot") == {"s-c"}
    assert _matches(store, "okapi") == {"s-c"}
    # one row per matching completion, in the new text each stores (a prompt's repeat of
    # earlier messages is not searched twice)
    with store.engine.connect() as conn:
        assert len(conn.execute(store.fts_clause("calculator")).all()) == 2
        grouped = sa.select(sessions.c.id).where(
            sessions.c.id.in_(store.fts_clause("unrelated marmot ok")), sessions.c.group_id == "h"
        )
        assert conn.execute(grouped).all() == []
        grouped = sa.select(sessions.c.id).where(
            sessions.c.id.in_(store.fts_clause("marmot")), sessions.c.group_id == "h"
        )
        assert [r[0] for r in conn.execute(grouped)] == ["s-c"]
    if sqlite:  # JSON escapes decoded: non-ASCII words as typed, diacritics folded
        assert _matches(store, "Zürich") == {"s-a"}
        assert _matches(store, "zurich grüße") == {"s-a"}
        assert _matches(store, "東京") == {"s-a"}
    else:  # searched as stored (ASCII JSON): the ASCII words of that reply are found
        assert _matches(store, "aus too") == {"s-a"}
    for query in HOSTILE:
        assert isinstance(_matches(store, query), set), query
    assert _matches(store, '"pelican') == {"s-a"}
    assert _matches(store, "pelican OR") == set()  # OR is a word here, not an operator
    assert _matches(store, "-") == set() and _matches(store, "*") == set()
    assert _matches(store, "") == set()
    assert store.session_ids() == ["s-a", "s-b", "s-c"]  # nothing was dropped
    store.close()


def test_search_words_are_quoted_for_fts5() -> None:
    assert search_words(' a OR  "foo - * x-y ') == ["a", "OR", '"foo', "x-y"]
    assert fts5_match(["a", "OR", '"foo']) == '"a" "OR" """foo"'
    with pytest.raises(TypeError, match="query: expected a string"):
        search_words(None)  # type: ignore[arg-type]


def _row(sid: str, cid: str, step: int, n: int, **changes: object) -> dict:
    row = {
        "session_id": sid,
        "completion_id": cid,
        "step": step,
        "version": step - 1,
        "ret": 0.5,
        "merged": step % 2 == 0,
        "merge_reason": "token_prefix" if step % 2 == 0 else "root",
        "advantages": [math.nan] + [0.25 * k for k in range(1, n)],
        "train_logprobs": [math.nan] + [-0.1 * k for k in range(1, n)],
        "prox_logprobs": [math.nan] + [-0.2 * k for k in range(1, n)],
        "behaviour_weights": [math.nan] + [1.0 + k for k in range(1, n)],
        "clipped": [False] + [k % 2 == 1 for k in range(1, n)],
        "behaviour_clipped": [False] + [k == n - 1 for k in range(1, n)],
    }
    row.update(changes)
    return row


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        (math.isnan(x) and math.isnan(y)) if isinstance(x, float) and math.isnan(x) else x == y
        for x, y in zip(a, b, strict=True)
    )


def test_train_tokens_round_trip_replace_and_check(store_url: str) -> None:
    store = EpisodeStore(store_url)
    _put_episode(
        store,
        "s1",
        [
            _completion(
                "k0", [{"role": "user", "content": "x"}], {"role": "assistant", "content": "y"}
            ),
            _completion("k1", [{"role": "user", "content": "x"}], {}, parent="k0"),
        ],
    )
    rows = [
        _row("s1", "k1", 2, 3),
        _row("s1", "k0", 2, 4),
        _row("s1", "k0", 1, 4),
        _row("s2", "z", 1, 1),
    ]
    assert store.put_train_tokens(rows).result(30) == 4
    got = store.train_tokens("s1")
    assert [(r["step"], r["completion_id"]) for r in got] == [(1, "k0"), (2, "k0"), (2, "k1")]
    for r in got:
        want = next(
            w for w in rows if (w["completion_id"], w["step"]) == (r["completion_id"], r["step"])
        )
        assert set(r) == set(want)
        for key, value in want.items():
            if isinstance(value, list):
                assert _same(r[key], value), key
                assert all(type(v) is (bool if key.endswith("clipped") else float) for v in r[key])
            else:
                assert r[key] == value and type(r[key]) is type(value), key
    assert len(store.train_tokens("s2")) == 1 and store.train_tokens("nobody") == []
    # the same key again replaces the row
    store.put_train_tokens([_row("s1", "k0", 1, 2, ret=-1.0, merged=True)]).result(30)
    again = [r for r in store.train_tokens("s1") if r["step"] == 1]
    assert len(again) == 1 and again[0]["ret"] == -1.0 and len(again[0]["advantages"]) == 2
    assert store.put_train_tokens([]).result(30) == 0
    assert store.size()["train_tokens"] == 4

    bad = [
        ({"session_id": "s"}, "missing"),
        (_row("s", "c", 1, 3, extra=1), "unknown"),
        (_row("s", "c", 0, 3), "step must be >= 1"),
        (_row("s", "c", 1, 3, version=-1), "version >= 0"),
        ({**_row("s", "c", 1, 3), "step": True}, "step must be int"),
        (_row("s", "c", 1, 3, merged=1), "merged must be bool"),
        (_row("s", "c", 1, 3, ret=math.inf), "ret must be finite"),
        (_row("s", "c", 1, 3, clipped=[True]), "differ in length"),
        (_row("s", "c", 1, 3, advantages=["a", 1.0, 2.0]), "advantages must hold numbers"),
        (_row("s", "c", 1, 3, clipped=[2, 0, 0]), "clipped must hold booleans"),
        ("row", "expected a dict"),
    ]
    for row, message in bad:
        with pytest.raises(ValueError, match=message):
            store.put_train_tokens([_row("s", "ok", 1, 3), row])  # type: ignore[list-item]
    assert store.train_tokens("s") == []  # a call with a bad row writes nothing
    store.close()


def test_eval_out_records_its_episodes_in_an_episode_store(tiny_model_dir, tmp_path, capsys):
    """``eval --out DIR`` writes DIR/episodes.db beside episodes.jsonl, every episode with
    its env, success and turns on its metadata; a second eval into DIR replaces it."""
    from areal_agents.cli.main import main

    out = tmp_path / "eval"
    argv = [
        "eval",
        "--env",
        "areal/Calculator-v0",
        "--env-kwargs",
        '{"kind": "arithmetic"}',
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--episodes",
        "2",
        "--k",
        "2",
        "--max-tokens",
        "4",
        "--max-turns",
        "2",
        "--out",
        str(out),
    ]
    for _ in range(2):
        assert main(argv) == 0
        assert f"episodes recorded in {out / 'episodes.db'}" in capsys.readouterr().out
        lines = [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines()]
        store = EpisodeStore(out / "episodes.db")
        try:
            assert sorted(store.session_ids(ended=True)) == sorted(r["session_id"] for r in lines)
            for line in lines:
                loaded = store.load(line["session_id"])
                assert loaded is not None
                meta = loaded.episode.metadata
                assert meta["env"] == "areal/Calculator-v0"
                assert meta["turns"] == line["result"]["turns"]
                assert meta["success"] == line["result"]["success"]
                assert len(loaded.episode.completions) == len(line["completions"])
        finally:
            store.close()
