"""Context rewrites: what the proxy sent when a conversation outgrew the model's context.

Four nullable columns on ``completions`` (see ``areal_agents.serve.context``): ``context_rewrite``
(``truncated``, ``summarized``, ``summary_call`` or NULL), ``context_edits`` (JSON: the edits
that made the messages sent from the client's messages), ``segment`` (the completion's
context segment) and ``trained`` (false: no loss). Rows written before hold NULL in each,
read as not rewritten, segment 0, trained.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

COLUMNS = (
    ("context_rewrite", sa.Text),
    ("context_edits", sa.Text),
    ("segment", sa.Integer),
    ("trained", sa.Boolean),
)


def upgrade() -> None:
    for name, kind in COLUMNS:
        op.add_column("completions", sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("completions") as batch:
        for name, _ in reversed(COLUMNS):
            batch.drop_column(name)
