"""The migration settle controller: active migrations no copy thread of this process carries are
settled by asking both hosts, again and again until they end.

Which ones: `copying`, `checking` or `postcopy-failed` migrations left by a restart (start-up
recovery only waits briefly for a copy libvirtd still carries on), whose hosts did not answer, whose
copy thread is far past its deadline (a hung driver), or whose post-copy failed (libvirt's resume is
tried at most every minute). The step is `Migrator.settle` (one rule, shared with the live path,
`recover()` and `cancel`): nothing moves unless both hosts answered. One job, in its own thread,
every CHECK_INTERVAL_S seconds; started and stopped with the host loops (Orchestrator.start_monitor).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from vmplane.plane.loops import every
from vmplane.store.events import acting_as

if TYPE_CHECKING:
    from vmplane.controllers.migrator import Migrator
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.migrationsettle")
CAUSE = "migration-settle"
CHECK_INTERVAL_S = 5.0


class MigrationSettle:
    def __init__(self, plane: Plane, migrator: Migrator, interval_s: float = CHECK_INTERVAL_S):
        self.plane = plane
        self.migrator = migrator
        self.interval_s = interval_s
        self._stop = threading.Event()

    def start(self) -> None:
        every(
            lambda: self.interval_s,
            self.run_once,
            self._stop,
            "migration-settle",
            log,
            when=self.plane.membership.coordinates,
            owner=lambda: self.plane.membership.epoch,
        )

    def stop(self) -> None:
        self._stop.set()

    def run_once(self) -> dict[str, str]:
        """One pass: {migration id: state after} for each migration it tried to settle."""
        migrator = self.migrator
        done: dict[str, str] = {}
        with acting_as(CAUSE):
            for mig in migrator.list(active_only=True):
                if self._stop.is_set() or self.plane.closing.is_set():
                    break
                if not migrator.take_orphan(mig):
                    continue
                try:
                    done[mig["id"]] = migrator.settle(mig["id"], why=self._why(mig))
                except Exception:  # this one again at the next pass; the others go on
                    log.exception("migration %s: settle", mig["id"])
        migrator.pump()  # a slot may have freed; a queued migration whose host failed meanwhile ends
        return done

    @staticmethod
    def _why(mig: dict) -> str:
        if mig["state"] == "postcopy-failed":
            return "post-copy failed"
        return "no copy thread carries it (a restart, or a hung driver)"
