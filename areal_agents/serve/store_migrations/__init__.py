"""Alembic migrations of the episode store (``areal_agents.serve.store``)."""
