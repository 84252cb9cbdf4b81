"""Persistence: SQLAlchemy tables, the database handle, Alembic migrations."""

from vmplane.store.db import Database

__all__ = ["Database"]
