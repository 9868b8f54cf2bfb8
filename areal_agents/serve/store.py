"""The durable episode store: every session, completion, reward and end, in a database.

:class:`EpisodeStore` is the proxy's record of its sessions. Its schema (tables, database
engine, Alembic migrations) is :mod:`areal_agents.serve.store_schema`; how a session or a
completion becomes a row and back is :mod:`areal_agents.serve.store_rows`; its writes go
through the writer thread of :mod:`areal_agents.serve.store_writer` (group commit, in
order: await :meth:`EpisodeStore.flush` before answering a client, and nothing whose
answer reached a client is lost on ``kill -9``). Reads run in the caller's thread.

Session keys are stored as their SHA-256 (keys are 192-bit random tokens, so a fast hash is
enough); a store never holds a key that could be replayed.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from areal_agents.errors import ConfigError
from areal_agents.serve.session import Session, hash_key
from areal_agents.serve.store_rows import (
    checked_train_row,
    completion_row,
    decoded_train_row,
    dumps,
    packed_train_row,
    rebuild,
    session_row,
)
from areal_agents.serve.store_schema import (
    PG_SEARCH_VECTOR,
    completions,
    make_engine,
    migrate,
    responses,
    sessions,
    store_url,
    train_tokens,
    upsert,
    worker_tasks,
)
from areal_agents.serve.store_writer import Lazy, StoreWriter
from areal_agents.trajectory import Completion, Episode, PromptBase

__all__ = ["EpisodeStore"]

ACTIVE_EVERY_S = 5.0
"""A session's ``last_active`` reaches the store at most this often from its model calls
(rewards, ends and reads of other processes' sessions write it at once)."""


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


class EpisodeStore(StoreWriter):
    """A database of sessions and their episodes (see the module docstring); its writes
    (:meth:`submit`, :meth:`flush`, :meth:`close`) are :class:`StoreWriter`'s.

    Example::

        store = EpisodeStore("runs/demo/episodes.db")        # or "postgresql://..."
        proxy = Proxy(engine, tokenizer, store=store)          # records write through
        ...
        store.close()
    """

    def __init__(self, url: str | Path, *, batch_size: int = 512) -> None:
        self.url = store_url(url)
        engine = make_engine(self.url)
        migrate(engine)
        super().__init__(engine, batch_size)

    def __repr__(self) -> str:
        return f"EpisodeStore({self.engine.url.render_as_string(hide_password=True)!r})"

    # ------------------------------------------------------------------ what is written
    def put_session(self, session: Session) -> concurrent.futures.Future[Any]:
        return self.submit((INSERT_SESSION, session_row(session)))

    def put_header(self, session: Session) -> concurrent.futures.Future[Any]:
        """Write the session's episode header (end, reasons, errors, final reward, task)."""
        row = session_row(session)
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
            Lazy(lambda: (INSERT_COMPLETION, completion_row(session, seq, completion, earlier)))
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
            "errors": dumps(episode.errors),
            "metadata": dumps(episode.metadata),
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
            "conversation": dumps(conversation),
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
        checked = [checked_train_row(i, row) for i, row in enumerate(rows)]
        stmt = upsert(self.engine.dialect.name, train_tokens)

        def op(conn: Connection) -> int:
            if checked:
                conn.execute(stmt, [packed_train_row(r) for r in checked])
            return len(checked)

        return self.submit(op)

    def close_open(self, reason: str) -> int:
        """End every open session as ``reason`` (a trainer's restart: its groups are gone),
        and every worker task still ``queued`` or ``running`` with them: its state becomes
        ``lost`` and its message starts with ``reason``. Returns how many sessions ended."""
        now = time.time()
        with self.engine.begin() as conn:
            res = conn.execute(
                sessions.update()
                .where(sessions.c.ended.is_(False), sessions.c.deleted_at.is_(None))
                .values(ended=True, end_reason=reason, ended_at=now)
            )
            conn.execute(
                worker_tasks.update()
                .where(worker_tasks.c.state.in_(("queued", "running")))
                .values(
                    state="lost",
                    finished_at=now,
                    message=f"{reason}: the trainer that handed out this task stopped before "
                    f"its result came; its session ended as {reason}",
                )
            )
        return int(res.rowcount or 0)

    def group_counts(self) -> dict[str | None, int]:
        """Sessions per ``group_id`` (None: sessions without a group), deleted ones included:
        every episode the store ever recorded, by group (a trainer's accounting of what it
        generated)."""
        q = sa.select(sessions.c.group_id, sa.func.count()).group_by(sessions.c.group_id)
        with self.engine.connect() as conn:
            return {row[0]: int(row[1]) for row in conn.execute(q)}

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
            completions=list(rebuild(rows, bases)),
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
        return [decoded_train_row(r) for r in rows]

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
            return select.where(PG_SEARCH_VECTOR.op("@@")(tsquery))
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
