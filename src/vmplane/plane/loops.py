"""The one shape of vmplane's background loops: a daemon thread that runs a pass every interval until
its stop event is set, and survives anything one pass meets (logged; the next pass tries again)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from vmplane.store.ownership import owned


def every(
    interval_s: Callable[[], float],
    body: Callable[[], object],
    stop: threading.Event,
    name: str,
    log: logging.Logger,
    when: Callable[[], bool] | None = None,
    owner: Callable[[], int | None] | None = None,
) -> None:
    """Start the thread `vmplane-NAME`: wait `interval_s()` (read again each time: a setting may
    change), then run `body()`, until `stop` is set. With `when`, a pass runs only while it says so
    (this process holds the lease for the work); with `owner`, under that controller's fencing token, so
    that nothing it writes lands once the lease has lapsed."""
    last = 1.0  # the interval, as last read

    def wait() -> bool:
        nonlocal last
        try:
            last = interval_s()
        except Exception:  # a setting that can not be read now (the database busy): the last one
            log.exception("%s: reading its interval", name)
        return stop.wait(last)

    def loop():
        while not wait():
            try:
                if when is not None and not when():
                    continue
                with owned(owner() if owner is not None else None):
                    body()
            except Exception:  # the next pass tries again
                log.exception(name)

    threading.Thread(target=loop, name=f"vmplane-{name}", daemon=True).start()


def settle_every(
    interval_s: float, settle: Callable[..., object], stop: threading.Event, name: str, log: logging.Logger
) -> None:
    """`settle(force=...)` every `interval_s`: its first pass with force=True (at start-up, the steps left in
    flight, however young, are a process's that is gone), the next ones without."""
    first = [True]

    def once() -> None:
        force, first[0] = first[0], False
        settle(force=force)

    every(lambda: interval_s, once, stop, name, log)
