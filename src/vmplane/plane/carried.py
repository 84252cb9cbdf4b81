"""Which operations this process's threads carry now: an operation's thread (or its failure path) holds
it while it runs, so that the overdue loop (overdue.py) leaves it alone and a rerun does not run it twice.
One registry per process: every thread of every controller runs its operations through it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_carried: dict[str, int] = {}  # op id -> threads of this process that carry it now
_carried_lock = threading.Lock()


@contextlib.contextmanager
def carrying(op_id: str, alone: bool = False) -> Iterator[bool]:
    """While the block runs, `op_id` is carried by this thread. `alone`: only if no other thread carries
    it (yields False then, and registers nothing: the caller leaves it to that thread)."""
    with _carried_lock:
        if alone and _carried.get(op_id):
            taken = False
        else:
            _carried[op_id] = _carried.get(op_id, 0) + 1
            taken = True
    try:
        yield taken
    finally:
        if taken:
            with _carried_lock:
                left = _carried.get(op_id, 1) - 1
                if left:
                    _carried[op_id] = left
                else:
                    _carried.pop(op_id, None)


def carried() -> frozenset[str]:
    with _carried_lock:
        return frozenset(_carried)
