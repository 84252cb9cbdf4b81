"""The storage settle controller: volumes left between two steps (creating, attaching, detaching,
deleting: a crash or a silent host between asking a host and recording its answer) are finished or
undone by asking again (`Volumes.resolve`; a deleted volume whose migration copy waits for its host
stays `deleting` until that copy is confirmed gone), and the second copies migrations leave behind are
deleted once no migration carries them (`DiskMoves.cleanup`). One job, in its own thread, every
CHECK_INTERVAL_S seconds; run once by start-up recovery too."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from vmplane.plane.loops import every
from vmplane.store.events import acting_as

if TYPE_CHECKING:
    from vmplane.controllers.diskmoves import DiskMoves
    from vmplane.controllers.volumes import Volumes
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.storagesettle")
CAUSE = "storage-settle"
CHECK_INTERVAL_S = 10.0
MIN_AGE_S = 60.0  # a younger step may still be carried by the request that started it


class StorageSettle:
    def __init__(self, plane: Plane, volumes: Volumes, disk_moves: DiskMoves, interval_s: float = CHECK_INTERVAL_S):
        self.plane = plane
        self.volumes, self.disk_moves = volumes, disk_moves
        self.interval_s = interval_s
        self._stop = threading.Event()

    def start(self) -> None:
        every(
            lambda: self.interval_s,
            self.run_once,
            self._stop,
            "storage-settle",
            log,
            when=self.plane.membership.coordinates,
            owner=lambda: self.plane.membership.epoch,
        )

    def stop(self) -> None:
        self._stop.set()

    def run_once(self, min_age_s: float = MIN_AGE_S) -> list[str]:
        """One pass: the volumes it settled or cleaned (start-up recovery passes min_age_s=0: no request
        of this process carries anything yet)."""
        with acting_as(CAUSE):
            return self.volumes.resolve(min_age_s) + self.volumes.adopt_unplugged() + self.disk_moves.cleanup()
