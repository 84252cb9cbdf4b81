"""Alembic environment: runs on the connection handed over by vmplane.store.migrate."""

from alembic import context
from sqlalchemy import create_engine

from vmplane.store.schema import Base

config = context.config
target_metadata = Base.metadata


def run() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        url = config.get_main_option("sqlalchemy.url")
        assert url is not None, "alembic.ini names no sqlalchemy.url"
        engine = create_engine(url)
        with engine.begin() as connection:
            context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
            with context.begin_transaction():
                context.run_migrations()
        return
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


run()
