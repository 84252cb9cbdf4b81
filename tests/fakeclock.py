"""A clock only the test moves, for the sim modules that read `time` (the sim's copies, host failures, unplugs,
the sim fence agent): a duration the code computes from it is exact whatever the machine's load, and
nothing really waits. Installed per module (`module.time` replaced), so other threads and modules keep the
real clock; a test that patches a module whose threads run concurrently gets their sleeps too."""

from __future__ import annotations

import math
import threading


class FakeTime:
    """Stands in for the `time` module: `monotonic()` and `time()` read `now`; `sleep(s)` moves it by s
    (and returns at once). `slept` lists every sleep asked, in order."""

    def __init__(self, start: float = 1000.0):
        self.now = start
        self.slept: list[float] = []
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    perf_counter = monotonic

    def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))
        self.slept.append(seconds)

    def advance(self, seconds: float) -> None:
        """Move on by `seconds`, and always by at least one step of the float: a loop that sleeps what it
        has left (`deadline - now`, rounded to nothing) still gets there."""
        with self._lock:
            self.now = max(self.now + seconds, math.nextafter(self.now, math.inf))


def install(monkeypatch, *modules) -> FakeTime:
    """One FakeTime as the `time` of each module (undone with the monkeypatch)."""
    clock = FakeTime()
    for module in modules:
        monkeypatch.setattr(module, "time", clock)
    return clock
