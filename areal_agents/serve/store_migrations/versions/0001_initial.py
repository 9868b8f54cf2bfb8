"""The first schema: sessions, completions (stored as deltas), responses, worker tasks.

Revision ID: 0001
Revises: none
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("key_hash", sa.String(64), nullable=True),
        sa.Column("group_id", sa.Text, nullable=True),
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
    op.create_index("ix_sessions_key_hash", "sessions", ["key_hash"], unique=True)
    op.create_index("ix_sessions_group_id", "sessions", ["group_id"])
    op.create_table(
        "completions",
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
    op.create_index("ix_completions_id", "completions", ["session_id", "id"])
    op.create_table(
        "responses",
        sa.Column("session_id", sa.String(64), primary_key=True),
        sa.Column("response_id", sa.String(96), primary_key=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("conversation", sa.Text, nullable=False),
    )
    op.create_table(
        "worker_tasks",
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


def downgrade() -> None:
    for table in ("worker_tasks", "responses", "completions", "sessions"):
        op.drop_table(table)
