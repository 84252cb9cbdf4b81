"""Lock-order checks on PostgreSQL: hold a row lock as another writer would, midway through its transaction,
and see what a vmplane transaction that waits behind it already holds."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from sqlalchemy import create_engine, text


@contextlib.contextmanager
def row_held(url: str, locking_select: str) -> Iterator[Probe]:
    """`locking_select` (a SELECT ... FOR UPDATE) run in a transaction kept open for the block; the block gets
    a Probe to wait for a transaction to queue behind it and to try other rows' locks. Rolled back after."""
    engine = create_engine(url)
    try:
        with engine.connect() as holder:
            holder.begin()
            holder.execute(text(locking_select))
            try:
                yield Probe(engine)
            finally:
                holder.rollback()
    finally:
        engine.dispose()


class Probe:
    def __init__(self, engine):
        self.engine = engine

    def wait_for_a_waiter(self, timeout_s: float = 20.0) -> None:
        """Until a session of this database waits for a lock (the vmplane transaction under test)."""
        deadline = time.monotonic() + timeout_s
        with self.engine.connect() as conn:
            while not conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND datname = current_database()"
                )
            ).scalar():
                conn.rollback()  # (the activity view is read once per transaction)
                assert time.monotonic() < deadline, "nothing waited for the held row"
                time.sleep(0.05)

    def lock_now(self, locking_select: str) -> None:
        """`locking_select` with NOWAIT: raises if another transaction (the waiting one) holds that row."""
        with self.engine.begin() as conn:
            conn.execute(text(f"{locking_select} NOWAIT"))
