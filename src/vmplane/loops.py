"""The one shape of vmplane's background loops: a daemon thread that runs a pass every interval until
its stop event is set, and survives anything one pass meets (logged; the next pass tries again)."""

from __future__ import annotations

import logging
import threading
from typing import Callable


def every(interval_s: Callable[[], float], body: Callable[[], object], stop: threading.Event, name: str,
          log: logging.Logger) -> None:
    """Start the thread `vmplane-NAME`: wait `interval_s()` (read again each time: a setting may
    change), then run `body()`, until `stop` is set."""
    def loop():
        while not stop.wait(interval_s()):
            try:
                body()
            except Exception:       # the next pass tries again
                log.exception(name)

    threading.Thread(target=loop, name=f"vmplane-{name}", daemon=True).start()
