"""The durable episode store: every session, completion, reward and end, in a database.

SQLite by default (one file, WAL mode), PostgreSQL when given a ``postgresql://`` URL; the
tables are reached through SQLAlchemy Core and versioned with Alembic (the migrations live in
``areal_agents/store_migrations``; opening a store upgrades it to the latest schema).

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
keyed by session and sequence number), ``responses`` (the Responses API's conversations, for
``previous_response_id``) and ``worker_tasks`` (the worker API's tasks and their outcomes).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import queue
import sys
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from .errors import ConfigError
from .session import hash_key
from .trajectory import Completion, Episode, PromptBase, prompt_base

if TYPE_CHECKING:
    from .session import Session

__all__ = ["EpisodeStore", "hash_key", "store_url"]

SCHEMA_HEAD = "0001"
"""The Alembic revision this code reads and writes."""

metadata = sa.MetaData()

sessions = sa.Table(
    "sessions",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("key_hash", sa.String(64), nullable=True, index=True, unique=True),
    sa.Column("group_id", sa.Text, nullable=True, index=True),
    sa.Column("task_id", sa.Text, nullable=True),
    sa.Column("metadata", sa.Text, nullable=False),
    sa.Column("sampling", sa.Text, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("last_active", sa.Float, nullable=False),
    sa.Column("ended", sa.Boolean, nullable=False),
    sa.Column("end_reason", sa.Text, nullable=True),
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
        from .session import Session

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

    def tasks(self) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(worker_tasks).order_by(worker_tasks.c.created_at))
            return [dict(r) for r in rows.mappings()]

    def size(self) -> dict[str, int]:
        """Rows per table and stored token bytes (for benchmarks)."""
        with self.engine.connect() as conn:
            out = {
                t.name: int(conn.execute(sa.select(sa.func.count()).select_from(t)).scalar() or 0)
                for t in (sessions, completions, responses, worker_tasks)
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
    }


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
            if r["base_tokens"]:
                prompt = [*(base.prompt_ids + base.output_ids)[: r["base_tokens"]], *prompt]
            if r["base_messages"]:
                messages = [*[*base.messages, base.message][: r["base_messages"]], *messages]
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
