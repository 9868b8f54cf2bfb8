"""Alembic migrations of the episode store (its tables: ``areal_agents.serve.store_schema``)."""
