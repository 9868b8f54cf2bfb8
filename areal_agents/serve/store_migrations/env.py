"""Alembic environment of the episode store: runs on the connection the store passes in
(``config.attributes["connection"]``), or on ``sqlalchemy.url`` from the alembic command."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

connection = context.config.attributes.get("connection")
if connection is not None:
    context.configure(connection=connection, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    engine = sa.create_engine(context.config.get_main_option("sqlalchemy.url") or "")
    with engine.begin() as conn:
        context.configure(connection=conn, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
