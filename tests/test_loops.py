"""The background loops' one shape (loops.every): a pass that fails, or an interval that can not be read
(a setting read while the database is busy), never ends the loop."""

import logging
import threading
import time

from vmplane.plane.loops import every


def test_a_loop_goes_on_after_a_failed_pass_and_an_interval_it_could_not_read():
    reads, passes, stop = [], [], threading.Event()

    def interval() -> float:
        reads.append(1)
        if len(reads) in (2, 3):
            raise RuntimeError("database is locked")
        return 0.01

    def body() -> None:
        passes.append(1)
        if len(passes) == 1:
            raise RuntimeError("a pass that fails")

    every(interval, body, stop, "test-loop", logging.getLogger("test"))
    deadline = time.monotonic() + 10
    while len(passes) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    assert len(passes) >= 5 and len(reads) >= 5
