"""The durable episode store: every session, completion, reward and end, in a database.

SQLite by default (one file, WAL mode), PostgreSQL when given a ``postgresql://`` URL; the
tables are reached through SQLAlchemy Core and versioned with Alembic (the migrations live in
``areal_agents/serve/store_migrations``; opening a store upgrades it to the latest schema).

Writes go through one writer thread that batches whatever is queued into one transaction
(group commit): :meth:`EpisodeStore.submit` queues a write and returns a future that is done
once the write is committed, and :meth:`EpisodeStore.flush` waits for everything queued so
far. The proxy awaits that before it answers, so nothing whose answer reached a client is
lost on ``kill -9``. Writes are ordered: they commit in the order they were submitted.

Long episodes cost O(tokens), not O(turns²): a completion is stored against a *base* (its
parent in the completion tree, or the session's previous completion, whichever shares
more): the base's prompt + output tokens shared with the new prompt are stored as a count,
and only the new suffix as tokens; the request messages likewise. Reading rebuilds each
prompt exactly (see :func:`~areal_agents.trajectory.prompt_base`).

Session keys are stored as their SHA-256 (keys are 192-bit random tokens, so a fast hash is
enough); a store never holds a key that could be replayed.

Tables: ``sessions`` (one row per session: ids, key hash, group, task, metadata, sampling,
times, end, final reward, errors, ``deleted_at``), ``completions`` (one row per model call,
keyed by session and sequence number; since revision 0003 with ``context_rewrite``,
``context_edits`` (JSON), ``segment`` and ``trained``, NULL in older rows: not rewritten,
segment 0, trained), ``responses`` (the Responses API's conversations, for
``previous_response_id``), ``worker_tasks`` (the worker API's tasks and their outcomes) and
``train_tokens`` (what the trainer did with each completion it trained, per step).

``train_tokens`` has one row per (session, completion, step): ``step`` is the 1-based
training step (as in ``metrics.jsonl``), ``version`` the policy version the step trained
from, ``ret`` the completion's discounted return the advantages came from, ``merged`` and
``merge_reason`` its merge decision (``Episode.samples``), and per output token, aligned 1:1
with the completion's ``output_ids`` and NaN (floats) or False (flags) where a token carried
no loss: ``advantages``, ``train_logprobs`` (the current policy's logprob in the loss),
``prox_logprobs`` (the proximal logprob the loss used), ``behaviour_weights`` (w = pi_prox /
pi_behav after the configured correction), ``clipped`` (the ratio clip was binding, low or
high) and ``behaviour_clipped`` (w was over its cap). :meth:`EpisodeStore.put_train_tokens`
writes them (a row written again for the same key replaces the old one) and
:meth:`EpisodeStore.train_tokens` reads a session's back, decoded.

Search: :meth:`EpisodeStore.fts_clause` selects the completions whose messages contain every
word of a query. On SQLite a contentless FTS5 table (``completions_fts``, rowid = the
completion's rowid, ``unicode61`` tokens, diacritics folded) holds the decoded text of each
completion's new request messages and its reply: content strings and text parts, tool-call
function names and arguments (JSON keys and values); a trigger fills it on every insert.
(SQLite's VACUUM keeps those rowids, copying each table whole, though its documentation
allows it to renumber a table without an INTEGER PRIMARY KEY; the store never vacuums.)
On PostgreSQL a GIN index on
``to_tsvector('simple', left(messages_suffix || ' ' || message, 262144))`` serves it: the text
is searched as stored, JSON with ASCII escapes, so words with non-ASCII characters (stored as
``\\uXXXX``) and JSON keys such as ``role`` are matched as they appear there, and only the
first 262,144 characters of each completion are indexed (a tsvector is at most 1 MB).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import queue
import sys
import threading
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from areal_agents.errors import ConfigError
from areal_agents.serve.session import hash_key
from areal_agents.trajectory import Completion, Episode, PromptBase, prompt_base

if TYPE_CHECKING:
    from areal_agents.serve.session import Session

__all__ = ["EpisodeStore", "hash_key", "store_url"]

SCHEMA_HEAD = "0003"
"""The Alembic revision this code reads and writes."""

metadata = sa.MetaData()

sessions = sa.Table(
    "sessions",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("key_hash", sa.String(64), nullable=True, index=True, unique=True),
    sa.Column("group_id", sa.Text, nullable=True, index=True),
    sa.Column("task_id", sa.Text, nullable=True, index=True),
    sa.Column("metadata", sa.Text, nullable=False),
    sa.Column("sampling", sa.Text, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False, index=True),
    sa.Column("last_active", sa.Float, nullable=False),
    sa.Column("ended", sa.Boolean, nullable=False),
    sa.Column("end_reason", sa.Text, nullable=True, index=True),
    sa.Column("ended_at", sa.Float, nullable=True),
    sa.Column("final_reward", sa.Float, nullable=True),
    sa.Column("errors", sa.Text, nullable=False),
    sa.Column("deleted_at", sa.Float, nullable=True),
)

completions = sa.Table(
    "completions",
    metadata,
    sa.Column("session_id", sa.String(64), primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True),
    sa.Column("id", sa.String(96), nullable=False),
    sa.Column("parent_id", sa.String(96), nullable=True),
    sa.Column("base_seq", sa.Integer, nullable=True),
    sa.Column("base_tokens", sa.Integer, nullable=False),
    sa.Column("base_messages", sa.Integer, nullable=False),
    sa.Column("prompt_suffix", sa.LargeBinary, nullable=False),
    sa.Column("messages_suffix", sa.Text, nullable=False),
    sa.Column("output_ids", sa.LargeBinary, nullable=False),
    sa.Column("output_logprobs", sa.LargeBinary, nullable=False),
    sa.Column("output_versions", sa.LargeBinary, nullable=False),
    sa.Column("message", sa.Text, nullable=False),
    sa.Column("finish_reason", sa.Text, nullable=False),
    sa.Column("tools", sa.Text, nullable=True),
    sa.Column("tools_as_previous", sa.Boolean, nullable=False),
    sa.Column("parse_errors", sa.Text, nullable=False),
    sa.Column("sampling", sa.Text, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("latency_s", sa.Float, nullable=False),
    sa.Column("queue_s", sa.Float, nullable=False),
    sa.Column("reward", sa.Float, nullable=False),
    sa.Column("agent", sa.Text, nullable=True),
    sa.Column("context_rewrite", sa.Text, nullable=True),
    sa.Column("context_edits", sa.Text, nullable=True),
    sa.Column("segment", sa.Integer, nullable=True),
    sa.Column("trained", sa.Boolean, nullable=True),
    sa.Index("ix_completions_id", "session_id", "id"),
    sa.Index("ix_completions_agent", "agent", "session_id"),
)

responses = sa.Table(
    "responses",
    metadata,
    sa.Column("session_id", sa.String(64), primary_key=True),
    sa.Column("response_id", sa.String(96), primary_key=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("conversation", sa.Text, nullable=False),
)

worker_tasks = sa.Table(
    "worker_tasks",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("session_id", sa.String(64), nullable=True),
    sa.Column("task_id", sa.Text, nullable=True),
    sa.Column("group_id", sa.Text, nullable=True),
    sa.Column("state", sa.Text, nullable=False),
    sa.Column("worker_id", sa.Text, nullable=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("handed_at", sa.Float, nullable=True),
    sa.Column("finished_at", sa.Float, nullable=True),
    sa.Column("message", sa.Text, nullable=True),
)


train_tokens = sa.Table(
    "train_tokens",
    metadata,
    sa.Column("session_id", sa.String(64), primary_key=True),
    sa.Column("completion_id", sa.String(96), primary_key=True),
    sa.Column("step", sa.Integer, primary_key=True, index=True),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("ret", sa.Float, nullable=False),
    sa.Column("merged", sa.Boolean, nullable=False),
    sa.Column("merge_reason", sa.Text, nullable=False),
    sa.Column("advantages", sa.LargeBinary, nullable=False),
    sa.Column("train_logprobs", sa.LargeBinary, nullable=False),
    sa.Column("prox_logprobs", sa.LargeBinary, nullable=False),
    sa.Column("behaviour_weights", sa.LargeBinary, nullable=False),
    sa.Column("clipped", sa.LargeBinary, nullable=False),
    sa.Column("behaviour_clipped", sa.LargeBinary, nullable=False),
)

TRAIN_FLOATS = ("advantages", "train_logprobs", "prox_logprobs", "behaviour_weights")
"""Per-token float arrays of a ``train_tokens`` row (packed as float64; NaN: no loss)."""
TRAIN_FLAGS = ("clipped", "behaviour_clipped")
"""Per-token flag arrays of a ``train_tokens`` row (packed as one signed byte each)."""
_TRAIN_SCALARS: dict[str, tuple[type, ...]] = {
    "session_id": (str,),
    "completion_id": (str,),
    "step": (int,),
    "version": (int,),
    "ret": (int, float),
    "merged": (bool,),
    "merge_reason": (str,),
}

PG_SEARCH_CHARS = 262144
"""Characters of each completion's text the PostgreSQL search index covers (migration
0002; the query must repeat the index's expression exactly to use it)."""
_PG_SEARCH_VECTOR: Any = sa.literal_column(
    "to_tsvector('simple', left(completions.messages_suffix || ' ' || completions.message, "
    f"{PG_SEARCH_CHARS}))"
)


def search_words(query: str) -> list[str]:
    """The words of a search query: its whitespace-separated parts that hold at least one
    letter or digit (the others could match nothing: the tokenizers drop them)."""
    if not isinstance(query, str):
        raise TypeError(f"query: expected a string, got {type(query).__name__}")
    return [w for w in query.split() if any(ch.isalnum() for ch in w)]


def fts5_match(words: Sequence[str]) -> str:
    """An FTS5 MATCH expression for ``words``: each one a quoted string (``"`` doubled inside),
    so that no input is read as an operator (``OR``, ``NOT``, ``-``, ``*``, ``:``, ``^``,
    parentheses); juxtaposed strings must all match. A word with separators inside
    (``foo-bar``) is a phrase: its tokens adjacent, in order."""
    return " ".join('"' + w.replace('"', '""') + '"' for w in words)


def store_url(spec: str | Path) -> str:
    """A SQLAlchemy URL for ``spec``: a URL as given, or a file path (SQLite)."""
    text = str(spec)
    if "://" in text:
        if text.startswith("postgres://"):
            text = "postgresql://" + text[len("postgres://") :]
        if text.startswith("postgresql://"):  # psycopg 3, not the psycopg2 default
            text = "postgresql+psycopg://" + text[len("postgresql://") :]
        if not text.startswith(("sqlite", "postgresql")):
            raise ConfigError(
                f"store {spec!r}: expected a file path (SQLite) or a sqlite:/// or "
                "postgresql:// URL"
            )
        return text
    path = Path(text).expanduser().resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


# ------------------------------------------------------------------ encoding
_LITTLE = sys.byteorder == "little"


def _pack(kind: str, values: list[int] | list[float]) -> bytes:
    arr = array(kind, values)
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


def _unpack(kind: str, raw: bytes) -> list[Any]:
    arr = array(kind)
    arr.frombytes(raw)
    if not _LITTLE:
        arr.byteswap()
    return arr.tolist()


def _dumps(value: Any) -> str:
    # ensure_ascii: whatever a client sent (lone surrogates included) stores and reads back.
    return json.dumps(value, ensure_ascii=True, separators=(",", ":"))


Write = tuple[Any, dict[str, Any]]
"""A statement and its parameters; consecutive writes of one statement run as one
``executemany``."""
Op = Any
"""A :data:`Write`, a ``_Lazy`` write, or a callable run with the connection."""

_WHERE_ID: Any = sa.bindparam("w_id")
_WHERE_SESSION: Any = sa.bindparam("w_session")
INSERT_SESSION = sessions.insert()
UPDATE_SESSION = sessions.update().where(sessions.c.id == _WHERE_ID)
"""SET clause from the parameters given (``w_id``: the session)."""
INSERT_COMPLETION = completions.insert()
UPDATE_REWARD = (
    completions.update()
    .where(completions.c.session_id == _WHERE_SESSION, completions.c.id == _WHERE_ID)
    .values(reward=sa.bindparam("reward"))
)
INSERT_RESPONSE = responses.insert()


class EpisodeStore:
    """A database of sessions and their episodes (see the module docstring).

    Example::

        store = EpisodeStore("runs/demo/episodes.db")        # or "postgresql://..."
        proxy = Proxy(engine, tokenizer, store=store)          # records write through
        ...
        store.close()
    """

    def __init__(self, url: str | Path, *, batch_size: int = 512) -> None:
        self.url = store_url(url)
        self.batch_size = batch_size
        self.engine: Engine = _make_engine(self.url)
        _migrate(self.engine)
        self.counters: dict[str, int] = {"writes": 0, "commits": 0, "write_errors": 0}
        self._queue: queue.SimpleQueue[tuple[Op, concurrent.futures.Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._last: concurrent.futures.Future[Any] | None = None
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="episode-store", daemon=True)
        self._writer.start()

    def __repr__(self) -> str:
        return f"EpisodeStore({self.engine.url.render_as_string(hide_password=True)!r})"

    # ------------------------------------------------------------------ writing
    def submit(self, op: Op) -> concurrent.futures.Future[Any]:
        """Queue ``op(connection)`` to run in the writer's next transaction."""
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put((op, fut))
        self._last = fut
        return fut

    async def flush(self) -> None:
        """Wait until everything submitted so far is committed (raises if it failed)."""
        last = self._last
        if last is None or (last.done() and last.exception() is None):
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def wake(fut: concurrent.futures.Future[Any]) -> None:  # in the writer's thread
            loop.call_soon_threadsafe(_copy_outcome, fut, done)

        last.add_done_callback(wake)  # a waiter that is cancelled never cancels the write
        await done

    def flush_sync(self, timeout: float | None = 60.0) -> None:
        last = self._last
        if last is not None:
            last.result(timeout)

    def close(self) -> None:
        """Commit what is queued and stop the writer; reads still work."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join(timeout=60)
        self.engine.dispose()

    def _write_loop(self) -> None:
        self._conn: Connection | None = None  # the writer's own connection, kept open
        try:
            self._write_until_closed()
        finally:
            if self._conn is not None:
                self._conn.close()

    def _connection(self) -> Connection:
        if self._conn is None or self._conn.closed or self._conn.invalidated:
            self._conn = self.engine.connect()
        return self._conn

    def _write_until_closed(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            stop = False
            while len(batch) < self.batch_size:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            self._commit(batch)
            if stop:
                return

    def _commit(self, batch: list[tuple[Op, concurrent.futures.Future[Any]]]) -> None:
        try:
            conn = self._connection()
            with conn.begin():
                results = _run(conn, [op for op, _ in batch])
        except Exception:  # one bad write must not take its batch with it: one by one
            for op, fut in batch:
                try:
                    conn = self._connection()
                    with conn.begin():
                        (result,) = _run(conn, [op])
                except Exception as exc:
                    self.counters["write_errors"] += 1
                    _settle(fut, exc=exc)
                else:
                    _settle(fut, result)
                self.counters["commits"] += 1
            return
        self.counters["commits"] += 1
        self.counters["writes"] += len(batch)
        for (_, fut), result in zip(batch, results, strict=True):
            _settle(fut, result)

    # ------------------------------------------------------------------ what is written
    def put_session(self, session: Session) -> concurrent.futures.Future[Any]:
        return self.submit((INSERT_SESSION, _session_row(session)))

    def put_header(self, session: Session) -> concurrent.futures.Future[Any]:
        """Write the session's episode header (end, reasons, errors, final reward, task)."""
        row = _session_row(session)
        for name in ("id", "key_hash", "created_at"):
            del row[name]
        return self.submit((UPDATE_SESSION, {"w_id": session.id, **row}))

    def put_completion(
        self, session: Session, completion: Completion, seq: int, earlier: list[Completion]
    ) -> concurrent.futures.Future[Any]:
        """Write ``completion`` (number ``seq`` of its session; ``earlier``: the completions
        before it, for its base). The delta against the base is computed in the writer."""
        sid = session.id
        fut = self.submit(
            _Lazy(lambda: (INSERT_COMPLETION, _completion_row(session, seq, completion, earlier)))
        )
        now = time.time()
        if now - session.stored_active > ACTIVE_EVERY_S:  # idle time is coarse in the store
            session.stored_active = now
            fut = self.submit((UPDATE_SESSION, {"w_id": sid, "last_active": now}))
        return fut

    def put_reward(
        self, session: Session, completion_id: str | None
    ) -> concurrent.futures.Future[Any]:
        """Write the current reward of ``completion_id`` (None: the final reward)."""
        sid, now = session.id, time.time()
        session.stored_active = now
        if completion_id is None:
            final = session.episode.final_reward
            return self.submit(
                (UPDATE_SESSION, {"w_id": sid, "final_reward": final, "last_active": now})
            )
        target = session.episode.by_id(completion_id)
        value = target.reward if target is not None else 0.0
        self.submit((UPDATE_REWARD, {"w_session": sid, "w_id": completion_id, "reward": value}))
        return self.submit((UPDATE_SESSION, {"w_id": sid, "last_active": now}))

    def put_rescored(self, episode: Episode) -> concurrent.futures.Future[Any]:
        """Write an ended episode's rewards again, after it was scored outside its session
        (a judge): every completion's reward, the final reward, the end reason, errors and
        metadata."""
        sid = episode.session_id
        for c in episode.completions:
            self.submit((UPDATE_REWARD, {"w_session": sid, "w_id": c.id, "reward": c.reward}))
        row = {
            "w_id": sid,
            "final_reward": episode.final_reward,
            "end_reason": episode.end_reason,
            "errors": _dumps(episode.errors),
            "metadata": _dumps(episode.metadata),
        }
        return self.submit((UPDATE_SESSION, row))

    def put_deleted(self, session_id: str) -> concurrent.futures.Future[Any]:
        """Mark a session deleted: its key stops working, its records stay."""
        return self.submit(
            (UPDATE_SESSION, {"w_id": session_id, "deleted_at": time.time(), "key_hash": None})
        )

    def put_response(
        self, session_id: str, response_id: str, conversation: list[dict[str, Any]]
    ) -> concurrent.futures.Future[Any]:
        row = {
            "session_id": session_id,
            "response_id": response_id,
            "created_at": time.time(),
            "conversation": _dumps(conversation),
        }
        return self.submit((INSERT_RESPONSE, row))

    def put_task(self, wtask_id: str, /, **values: Any) -> concurrent.futures.Future[Any]:
        """Insert or update the row of worker task ``wtask_id`` (its ``state``, times, the
        episode's ``session_id``, ``task_id`` and ``group_id`` as they become known)."""
        created = values.pop("created_at", None)

        def op(conn: Connection) -> None:
            done = conn.execute(
                worker_tasks.update().where(worker_tasks.c.id == wtask_id).values(**values)
            )
            if done.rowcount == 0:
                row = {"id": wtask_id, "created_at": created or time.time(), **values}
                conn.execute(worker_tasks.insert(), row)

        return self.submit(op)

    def put_train_tokens(self, rows: list[dict[str, Any]]) -> concurrent.futures.Future[Any]:
        """Write ``train_tokens`` rows (see the module docstring; each a dict of every column,
        the arrays as sequences of floats / bools of one length) in one statement of the
        writer's next transaction; a row whose (session_id, completion_id, step) is stored
        already replaces it. The rows are checked here (``ValueError`` naming the row and
        the problem) and packed in the writer thread. The future's result: rows written."""
        checked = [_checked_train_row(i, row) for i, row in enumerate(rows)]
        upsert = _upsert(self.engine.dialect.name, train_tokens)

        def op(conn: Connection) -> int:
            if checked:
                conn.execute(upsert, [_packed_train_row(r) for r in checked])
            return len(checked)

        return self.submit(op)

    def close_open(self, reason: str) -> int:
        """End every open session (a trainer's restart: its groups are gone); how many."""
        with self.engine.begin() as conn:
            res = conn.execute(
                sessions.update()
                .where(sessions.c.ended.is_(False), sessions.c.deleted_at.is_(None))
                .values(ended=True, end_reason=reason, ended_at=time.time())
            )
        return int(res.rowcount or 0)

    def expire(self, idle_s: float, now: float | None = None) -> list[str]:
        """End open sessions idle for ``idle_s`` as ``expired`` (kept, not deleted); their ids.

        Runs in the caller's thread, not the writer's: call it off the event loop."""
        cutoff = (now or time.time()) - idle_s
        stale = sa.and_(
            sessions.c.ended.is_(False),
            sessions.c.deleted_at.is_(None),
            sessions.c.last_active < cutoff,
        )
        with self.engine.begin() as conn:
            ids = [r[0] for r in conn.execute(sa.select(sessions.c.id).where(stale))]
            if ids:
                conn.execute(
                    sessions.update()
                    .where(stale, sessions.c.id.in_(ids))
                    .values(ended=True, end_reason="expired", ended_at=time.time())
                )
        return ids

    # ------------------------------------------------------------------ reading
    def session_id_for_key(self, api_key: str) -> str | None:
        """The live (not deleted) session whose key is ``api_key``, or None."""
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(sessions.c.id).where(
                    sessions.c.key_hash == hash_key(api_key), sessions.c.deleted_at.is_(None)
                )
            ).first()
        return None if row is None else str(row[0])

    def load(self, session_id: str) -> Session | None:
        """The session ``session_id`` with its whole episode, rebuilt exactly; None when
        there is none (or it was deleted)."""
        from areal_agents.serve.session import Session

        with self.engine.connect() as conn:
            head = (
                conn.execute(
                    sa.select(sessions).where(
                        sessions.c.id == session_id, sessions.c.deleted_at.is_(None)
                    )
                )
                .mappings()
                .first()
            )
            if head is None:
                return None
            rows = (
                conn.execute(
                    sa.select(completions)
                    .where(completions.c.session_id == session_id)
                    .order_by(completions.c.seq)
                )
                .mappings()
                .all()
            )
        bases: dict[str, PromptBase] = {}
        episode = Episode(
            session_id,
            completions=list(_rebuild(rows, bases)),
            final_reward=head["final_reward"],
            group_id=head["group_id"],
            task_id=head["task_id"],
            ended=bool(head["ended"]),
            end_reason=head["end_reason"],
            errors=json.loads(head["errors"]),
            metadata=json.loads(head["metadata"]),
        )
        episode.bases = bases
        return Session(
            session_id,
            "",
            episode,
            created_at=head["created_at"],
            sampling=json.loads(head["sampling"]),
            key_hash=head["key_hash"] or "",
            last_active=head["last_active"],
        )

    def response(self, session_id: str, response_id: str) -> list[dict[str, Any]] | None:
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(responses.c.conversation).where(
                    responses.c.session_id == session_id, responses.c.response_id == response_id
                )
            ).first()
        return None if row is None else json.loads(row[0])

    def session_ids(self, *, ended: bool | None = None) -> list[str]:
        """Ids of the stored (not deleted) sessions, oldest first."""
        q = sa.select(sessions.c.id).where(sessions.c.deleted_at.is_(None))
        if ended is not None:
            q = q.where(sessions.c.ended.is_(ended))
        with self.engine.connect() as conn:
            return [r[0] for r in conn.execute(q.order_by(sessions.c.created_at))]

    def train_tokens(self, session_id: str) -> list[dict[str, Any]]:
        """The ``train_tokens`` rows of ``session_id``, decoded (arrays as lists of floats and
        bools), by step and then in the order the session made its completions."""
        seq = (
            sa.select(completions.c.seq)
            .where(
                completions.c.session_id == train_tokens.c.session_id,
                completions.c.id == train_tokens.c.completion_id,
            )
            .limit(1)
            .scalar_subquery()
        )
        q = (
            sa.select(train_tokens)
            .where(train_tokens.c.session_id == session_id)
            .order_by(train_tokens.c.step, seq, train_tokens.c.completion_id)
        )
        with self.engine.connect() as conn:
            rows = conn.execute(q).mappings().all()
        out = []
        for r in rows:
            row = dict(r)
            row["merged"] = bool(row["merged"])
            for name in TRAIN_FLOATS:
                row[name] = _unpack("d", row[name])
            for name in TRAIN_FLAGS:
                row[name] = [bool(v) for v in _unpack("b", row[name])]
            out.append(row)
        return out

    def fts_clause(self, query: str) -> sa.Select[Any]:
        """A SELECT of ``completions.session_id``, one row per completion whose messages hold
        every word of ``query`` (case-insensitive, in any order; see the module docstring
        for what is searched on each database), to combine with other filters, e.g.::

            q = sa.select(sessions.c.id).where(sessions.c.id.in_(store.fts_clause("tax")))

        The words are taken as plain text, never as search syntax or SQL: quotes,
        ``OR``/``AND``/``NOT``, ``-``, ``*`` and the like are searched for (or, holding no
        letter or digit, dropped: :func:`search_words`). A query without words matches
        nothing."""
        words = search_words(query)
        select = sa.select(completions.c.session_id)
        if not words:
            return select.where(sa.false())
        dialect = self.engine.dialect.name
        if dialect == "sqlite":
            hits: Any = (
                sa.select(sa.literal_column("rowid"))
                .select_from(sa.table("completions_fts"))
                .where(sa.literal_column("completions_fts").match(fts5_match(words)))
            )
            return select.where(sa.literal_column("completions.rowid").in_(hits))
        if dialect == "postgresql":
            tsquery = sa.func.plainto_tsquery(sa.literal_column("'simple'"), " ".join(words))
            return select.where(_PG_SEARCH_VECTOR.op("@@")(tsquery))
        raise ConfigError(f"search: the episode store has no full-text search on {dialect}")

    def tasks(self) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(worker_tasks).order_by(worker_tasks.c.created_at))
            return [dict(r) for r in rows.mappings()]

    def size(self) -> dict[str, int]:
        """Rows per table and stored token bytes (for benchmarks)."""
        with self.engine.connect() as conn:
            out = {
                t.name: int(conn.execute(sa.select(sa.func.count()).select_from(t)).scalar() or 0)
                for t in (sessions, completions, responses, worker_tasks, train_tokens)
            }
            size = sa.func.coalesce(sa.func.sum(sa.func.length(completions.c.prompt_suffix)), 0)
            text = sa.func.coalesce(sa.func.sum(sa.func.length(completions.c.messages_suffix)), 0)
            stored = conn.execute(sa.select(size + text)).scalar()
        out["delta_bytes"] = int(stored or 0)
        return out


# ------------------------------------------------------------------ helpers
ACTIVE_EVERY_S = 5.0
"""A session's ``last_active`` reaches the store at most this often from its model calls
(rewards, ends and reads of other processes' sessions write it at once)."""


class _Lazy:
    """A write whose parameters are computed in the writer thread (off the event loop)."""

    def __init__(self, make: Callable[[], Write]) -> None:
        self.make = make


def _run(conn: Connection, ops: list[Op]) -> list[Any]:
    """Run ``ops`` in order on ``conn``; consecutive writes of one statement as one
    ``executemany``."""
    results: list[Any] = [None] * len(ops)
    group: list[dict[str, Any]] = []
    stmt: Any = None
    for i, op in enumerate(ops):
        if isinstance(op, _Lazy):
            op = op.make()
        if isinstance(op, tuple):
            # one executemany needs one statement and the same parameter names (an UPDATE
            # takes its SET clause from them)
            if stmt is not None and (op[0] is not stmt or op[1].keys() != group[0].keys()):
                conn.execute(stmt, group)
                group = []
            stmt = op[0]
            group.append(op[1])
            continue
        if stmt is not None:
            conn.execute(stmt, group)
            stmt, group = None, []
        results[i] = op(conn)
    if stmt is not None:
        conn.execute(stmt, group)
    return results


def _completion_row(
    session: Session, seq: int, completion: Completion, earlier: list[Completion]
) -> dict[str, Any]:
    base = prompt_base(earlier, completion)
    session.episode.bases[completion.id] = base  # for delta reads of the live session
    sid = session.id
    prev = earlier[-1] if earlier else None
    same_tools = prev is not None and prev.tools == completion.tools
    return {
        "session_id": sid,
        "seq": seq,
        "id": completion.id,
        "parent_id": completion.parent_id,
        "base_seq": base.index,
        "base_tokens": base.tokens,
        "base_messages": base.messages,
        "prompt_suffix": _pack("i", completion.prompt_ids[base.tokens :]),
        "messages_suffix": _dumps(completion.messages[base.messages :]),
        "output_ids": _pack("i", completion.output_ids),
        "output_logprobs": _pack("d", completion.output_logprobs),
        "output_versions": _pack("i", completion.output_versions),
        "message": _dumps(completion.message),
        "finish_reason": completion.finish_reason,
        "tools": None if same_tools else _dumps(completion.tools),
        "tools_as_previous": same_tools,
        "parse_errors": _dumps(completion.parse_errors),
        "sampling": _dumps(completion.sampling),
        "created_at": completion.created_at,
        "latency_s": completion.latency_s,
        "queue_s": completion.queue_s,
        "reward": completion.reward,
        "agent": completion.agent,
        "context_rewrite": completion.context_rewrite,
        "context_edits": None
        if completion.context_edits is None
        else _dumps(completion.context_edits),
        "segment": completion.segment,
        "trained": completion.trained,
    }


def _upsert(dialect: str, table: sa.Table) -> Any:
    """INSERT into ``table`` that replaces the row of an existing primary key (SQLite and
    PostgreSQL both say ``ON CONFLICT (key) DO UPDATE``)."""
    from sqlalchemy.dialects import postgresql, sqlite

    stmt: Any = (postgresql if dialect == "postgresql" else sqlite).insert(table)
    keys = [c.name for c in table.primary_key.columns]
    return stmt.on_conflict_do_update(
        index_elements=keys,
        set_={c.name: stmt.excluded[c.name] for c in table.columns if c.name not in keys},
    )


def _checked_train_row(i: int, row: Any) -> dict[str, Any]:
    """``row`` (number ``i`` of a ``put_train_tokens`` call) if it is a complete, well-typed
    ``train_tokens`` row; else ``ValueError`` saying what is wrong."""
    if not isinstance(row, dict):
        raise ValueError(f"train_tokens row {i}: expected a dict, got {type(row).__name__}")
    want = {*_TRAIN_SCALARS, *TRAIN_FLOATS, *TRAIN_FLAGS}
    missing, extra = sorted(want - row.keys()), sorted(row.keys() - want)
    if missing or extra:
        raise ValueError(f"train_tokens row {i}: missing {missing}, unknown {extra}")
    for name, kinds in _TRAIN_SCALARS.items():
        value = row[name]
        ok = isinstance(value, kinds) and (name == "merged" or not isinstance(value, bool))
        if not ok:
            want_kind = " or ".join(k.__name__ for k in kinds)
            raise ValueError(f"train_tokens row {i}: {name} must be {want_kind}, got {value!r}")
    if row["step"] < 1 or row["version"] < 0:
        raise ValueError(
            f"train_tokens row {i}: step must be >= 1 and version >= 0, got step "
            f"{row['step']}, version {row['version']}"
        )
    lengths = {name: len(row[name]) for name in (*TRAIN_FLOATS, *TRAIN_FLAGS)}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"train_tokens row {i}: the per-token arrays differ in length: {lengths}")
    for name in TRAIN_FLOATS:
        if not all(isinstance(v, int | float) for v in row[name]):
            raise ValueError(f"train_tokens row {i}: {name} must hold numbers")
    for name in TRAIN_FLAGS:
        if not all(isinstance(v, bool | int) and v in (0, 1) for v in row[name]):
            raise ValueError(f"train_tokens row {i}: {name} must hold booleans")
    if not math.isfinite(row["ret"]):
        raise ValueError(f"train_tokens row {i}: ret must be finite, got {row['ret']}")
    return row


def _packed_train_row(row: dict[str, Any]) -> dict[str, Any]:
    out = {name: row[name] for name in _TRAIN_SCALARS}
    out["ret"] = float(out["ret"])
    for name in TRAIN_FLOATS:
        out[name] = _pack("d", [float(v) for v in row[name]])
    for name in TRAIN_FLAGS:
        out[name] = _pack("b", [int(bool(v)) for v in row[name]])
    return out


def _copy_outcome(source: concurrent.futures.Future[Any], target: asyncio.Future[None]) -> None:
    if target.done():  # its waiter was cancelled
        return
    exc = source.exception()
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(None)


def _settle(
    fut: concurrent.futures.Future[Any], result: Any = None, exc: BaseException | None = None
) -> None:
    """Resolve a write's future; one whose waiter gave up (cancelled) is left alone."""
    if not fut.set_running_or_notify_cancel():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _session_row(session: Session) -> dict[str, Any]:
    ep = session.episode
    return {
        "id": session.id,
        "key_hash": session.key_hash or None,
        "group_id": ep.group_id,
        "task_id": ep.task_id,
        "metadata": _dumps(ep.metadata),
        "sampling": _dumps(session.sampling),
        "created_at": session.created_at,
        "last_active": session.last_active,
        "ended": ep.ended,
        "end_reason": ep.end_reason,
        "ended_at": time.time() if ep.ended else None,
        "final_reward": ep.final_reward,
        "errors": _dumps(ep.errors),
    }


def _rebuild(rows: Any, bases: dict[str, PromptBase]) -> Iterator[Completion]:
    """Completions from their stored rows (in sequence order), prompts rebuilt exactly;
    ``bases`` gets each one's :class:`PromptBase`."""
    built: list[Completion] = []
    for r in rows:
        prompt = _unpack("i", r["prompt_suffix"])
        messages = json.loads(r["messages_suffix"])
        if r["base_seq"] is not None:
            base = built[r["base_seq"]]
            if k := r["base_tokens"]:  # one copy of the shared prefix (long episodes)
                bp = base.prompt_ids
                head = bp[:k] if k <= len(bp) else bp + base.output_ids[: k - len(bp)]
                head.extend(prompt)
                prompt = head
            if m := r["base_messages"]:
                bm = base.messages
                carried = bm[:m] if m <= len(bm) else [*bm, base.message]
                messages = carried + messages
        tools = built[-1].tools if r["tools_as_previous"] and built else None
        if not r["tools_as_previous"]:
            tools = json.loads(r["tools"]) if r["tools"] is not None else None
        c = Completion(
            id=r["id"],
            messages=messages,
            prompt_ids=prompt,
            output_ids=_unpack("i", r["output_ids"]),
            output_logprobs=_unpack("d", r["output_logprobs"]),
            output_versions=_unpack("i", r["output_versions"]),
            message=json.loads(r["message"]),
            finish_reason=r["finish_reason"],
            tools=tools,
            parse_errors=json.loads(r["parse_errors"]),
            sampling=json.loads(r["sampling"]),
            created_at=r["created_at"],
            latency_s=r["latency_s"],
            queue_s=r["queue_s"],
            parent_id=r["parent_id"],
            reward=r["reward"],
            agent=r["agent"],
            # rows written before revision 0003 hold NULL: not rewritten, trained
            context_rewrite=r["context_rewrite"],
            context_edits=None if r["context_edits"] is None else json.loads(r["context_edits"]),
            segment=r["segment"] or 0,
            trained=r["trained"] is not False,
        )
        built.append(c)
        bases[c.id] = PromptBase(r["base_seq"], r["base_tokens"], r["base_messages"])
        yield c


def _make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = sa.create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 30}, pool_size=8
        )

        @sa.event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")  # durable against a killed process
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    try:
        return sa.create_engine(url, pool_size=8, pool_pre_ping=True)
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"store {url.split('@')[-1]!r}: PostgreSQL needs psycopg: pip install "
            "'areal-agents[postgres]'"
        ) from exc


def _migrate(engine: Engine) -> None:
    """Bring the store's schema to :data:`SCHEMA_HEAD` with Alembic."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).with_name("store_migrations")))
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
    except sa.exc.OperationalError as exc:
        raise ConfigError(
            f"cannot open the episode store {engine.url.render_as_string(hide_password=True)}:"
            f" {exc.orig}"
        ) from None
