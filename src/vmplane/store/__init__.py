"""Persistence: SQLAlchemy tables, the database handle, Alembic migrations."""

from .db import Database

__all__ = ["Database"]
