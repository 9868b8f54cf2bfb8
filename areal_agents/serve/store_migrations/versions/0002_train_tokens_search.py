"""Train-time token records, full-text search over the messages, indexes for browsing.

* ``train_tokens``: one row per (completion, training step) the trainer trained, with the
  per-token values of its loss (see ``areal_agents.serve.store_schema``).
* Search: on SQLite, a contentless FTS5 table ``completions_fts`` keyed by the completions'
  rowid, filled by a trigger on every new completion with the decoded text of its new
  request messages and its reply (content strings, text parts, tool-call names and
  arguments), and backfilled here for the rows already stored. On PostgreSQL, a GIN index
  on ``to_tsvector('simple', left(messages_suffix || ' ' || message, 262144))``: the stored
  JSON text as it is, cut where a tsvector could pass its 1 MB limit.
* Indexes on ``sessions`` (created_at, end_reason, task_id) and ``completions`` (agent) for
  filtering many sessions.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

PG_SEARCH_CHARS = 262144
"""Characters of each completion's text the PostgreSQL index covers (a tsvector is at most
1 MB; text of distinct words takes about 1.3 bytes of tsvector per character)."""


def _messages(suffix: str, message: str) -> str:
    """The JSON objects among the messages of ``suffix`` (a JSON array) and ``message``
    (one JSON object), one row each, as column ``m``; anything not valid JSON is skipped,
    so that no stored text can make a write fail."""
    return (
        "SELECT value AS m FROM json_each("
        f"CASE WHEN json_valid({suffix}) THEN {suffix} ELSE '[]' END) WHERE type = 'object' "
        f"UNION ALL SELECT {message} WHERE "
        f"(CASE WHEN json_valid({message}) THEN json_type({message}) END) = 'object'"
    )


def search_text(suffix: str, message: str) -> str:
    """A SQLite expression: the searchable text of a completion whose ``messages_suffix``
    and ``message`` are the SQL expressions ``suffix`` and ``message``. Per message: its
    ``content`` when a string, the ``text`` of its content parts, and of each tool call the
    function name and the arguments (decoded when they are JSON: keys and values), joined
    by spaces; JSON escapes are decoded by SQLite's JSON functions."""
    msgs = _messages(suffix, message)
    args = (
        "SELECT json_extract(tc.value, '$.function.arguments') AS a "
        f"FROM ({msgs}) AS ms, json_each(ms.m, '$.tool_calls') AS tc WHERE tc.type = 'object'"
    )
    decoded = (
        "SELECT group_concat("
        "CASE WHEN typeof(x.key) = 'text' THEN x.key || ' ' ELSE '' END "
        "|| coalesce(x.atom, ''), ' ') FROM json_tree(args.a) AS x"
    )
    pieces = " UNION ALL ".join(
        [
            f"SELECT json_extract(ms.m, '$.content') AS p FROM ({msgs}) AS ms "
            "WHERE json_type(ms.m, '$.content') = 'text'",
            f"SELECT json_extract(part.value, '$.text') FROM ({msgs}) AS ms, "
            "json_each(ms.m, '$.content') AS part "
            "WHERE json_type(ms.m, '$.content') = 'array' AND part.type = 'object'",
            f"SELECT json_extract(tc.value, '$.function.name') FROM ({msgs}) AS ms, "
            "json_each(ms.m, '$.tool_calls') AS tc WHERE tc.type = 'object'",
            f"SELECT CASE WHEN json_valid(args.a) THEN ({decoded}) ELSE args.a END "
            f"FROM ({args}) AS args",
        ]
    )
    return f"(SELECT coalesce(group_concat(p, ' '), '') FROM ({pieces}))"


def upgrade() -> None:
    op.create_table(
        "train_tokens",
        sa.Column("session_id", sa.String(64), nullable=False),
        sa.Column("completion_id", sa.String(96), nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
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
        sa.PrimaryKeyConstraint("session_id", "completion_id", "step"),
    )
    op.create_index("ix_train_tokens_step", "train_tokens", ["step"])
    op.create_index("ix_sessions_created_at", "sessions", ["created_at"])
    op.create_index("ix_sessions_end_reason", "sessions", ["end_reason"])
    op.create_index("ix_sessions_task_id", "sessions", ["task_id"])
    op.create_index("ix_completions_agent", "completions", ["agent", "session_id"])
    dialect = op.get_bind().dialect.name
    if dialect == "sqlite":
        op.execute(
            "CREATE VIRTUAL TABLE completions_fts USING fts5("
            "body, content='', tokenize='unicode61 remove_diacritics 2')"
        )
        new = search_text("new.messages_suffix", "new.message")
        op.execute(
            "CREATE TRIGGER completions_fts_insert AFTER INSERT ON completions BEGIN "
            f"INSERT INTO completions_fts(rowid, body) VALUES (new.rowid, {new}); END"
        )
        old = search_text("old.messages_suffix", "old.message")
        op.execute(  # a contentless table forgets a row only when told its text again
            "CREATE TRIGGER completions_fts_delete AFTER DELETE ON completions BEGIN "
            "INSERT INTO completions_fts(completions_fts, rowid, body) "
            f"VALUES ('delete', old.rowid, {old}); END"
        )
        rows = search_text("c.messages_suffix", "c.message")
        op.execute(
            f"INSERT INTO completions_fts(rowid, body) SELECT c.rowid, {rows} FROM completions AS c"
        )
    elif dialect == "postgresql":
        op.execute(
            "CREATE INDEX ix_completions_fts ON completions USING gin (to_tsvector('simple', "
            f"left(messages_suffix || ' ' || message, {PG_SEARCH_CHARS})))"
        )


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS completions_fts_delete")
        op.execute("DROP TRIGGER IF EXISTS completions_fts_insert")
        op.execute("DROP TABLE IF EXISTS completions_fts")
    elif dialect == "postgresql":
        op.execute("DROP INDEX IF EXISTS ix_completions_fts")
    op.drop_index("ix_completions_agent", "completions")
    op.drop_index("ix_sessions_task_id", "sessions")
    op.drop_index("ix_sessions_end_reason", "sessions")
    op.drop_index("ix_sessions_created_at", "sessions")
    op.drop_index("ix_train_tokens_step", "train_tokens")
    op.drop_table("train_tokens")
