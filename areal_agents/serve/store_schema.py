"""The episode store's schema: its tables, its database engine and its migrations.

SQLite by default (one file, WAL mode), PostgreSQL when given a ``postgresql://`` URL
(:func:`store_url`, :func:`make_engine`); the tables are reached through SQLAlchemy Core and
versioned with Alembic (the migrations live in ``areal_agents/serve/store_migrations``;
:func:`migrate` upgrades a database to :data:`SCHEMA_HEAD`, as opening a store does).

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
high) and ``behaviour_clipped`` (w was over its cap).
:meth:`~areal_agents.serve.store.EpisodeStore.put_train_tokens` writes them (a row written
again for the same key replaces the old one) and
:meth:`~areal_agents.serve.store.EpisodeStore.train_tokens` reads a session's back, decoded.

Search (:meth:`~areal_agents.serve.store.EpisodeStore.fts_clause`): on SQLite a contentless
FTS5 table (``completions_fts``, rowid = the completion's rowid, ``unicode61`` tokens,
diacritics folded) holds the decoded text of each completion's new request messages and its
reply: content strings and text parts, tool-call function names and arguments (JSON keys and
values); a trigger fills it on every insert. (SQLite's VACUUM keeps those rowids, copying
each table whole, though its documentation allows it to renumber a table without an INTEGER
PRIMARY KEY; the store never vacuums.) On PostgreSQL a GIN index on
``to_tsvector('simple', left(messages_suffix || ' ' || message, 262144))`` serves it: the text
is searched as stored, JSON with ASCII escapes, so words with non-ASCII characters (stored as
``\\uXXXX``) and JSON keys such as ``role`` are matched as they appear there, and only the
first 262,144 characters of each completion are indexed (a tsvector is at most 1 MB).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine

from areal_agents.errors import ConfigError

SCHEMA_HEAD = "0003"
"""The Alembic revision this code reads and writes."""

MIGRATIONS = Path(__file__).with_name("store_migrations")
"""The Alembic script directory of the store's migrations."""

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
TRAIN_SCALARS: dict[str, tuple[type, ...]] = {
    "session_id": (str,),
    "completion_id": (str,),
    "step": (int,),
    "version": (int,),
    "ret": (int, float),
    "merged": (bool,),
    "merge_reason": (str,),
}
"""The other columns of a ``train_tokens`` row and the Python types each accepts."""

PG_SEARCH_CHARS = 262144
"""Characters of each completion's text the PostgreSQL search index covers (migration
0002; the query must repeat the index's expression exactly to use it)."""
PG_SEARCH_VECTOR: Any = sa.literal_column(
    "to_tsvector('simple', left(completions.messages_suffix || ' ' || completions.message, "
    f"{PG_SEARCH_CHARS}))"
)
"""The expression of the PostgreSQL search index (migration 0002), as a query repeats it."""


def upsert(dialect: str, table: sa.Table) -> Any:
    """INSERT into ``table`` that replaces the row of an existing primary key (SQLite and
    PostgreSQL both say ``ON CONFLICT (key) DO UPDATE``)."""
    stmt: Any = (postgresql if dialect == "postgresql" else sqlite).insert(table)
    keys = [c.name for c in table.primary_key.columns]
    return stmt.on_conflict_do_update(
        index_elements=keys,
        set_={c.name: stmt.excluded[c.name] for c in table.columns if c.name not in keys},
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


def make_engine(url: str) -> Engine:
    """The SQLAlchemy engine of a store URL (SQLite: WAL mode, a 30 s busy timeout)."""
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


def migrate(engine: Engine) -> None:
    """Bring the store's schema to :data:`SCHEMA_HEAD` with Alembic."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
    except sa.exc.OperationalError as exc:
        raise ConfigError(
            f"cannot open the episode store {engine.url.render_as_string(hide_password=True)}:"
            f" {exc.orig}"
        ) from None
