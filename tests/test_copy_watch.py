"""The libvirt driver's copy watch (drivers/libvirt.py _CopyWatch) writes a copy's progress from a thread
of its own: a progress write that waits (a busy store) never holds back the next poll, whose switch to
post-copy is due at a set time; the write runs as the copy's owner and cause (fenced, and named)."""

from __future__ import annotations

import threading
import time

import libvirt

from vmplane.core.driver import MigrationParams
from vmplane.hosts.drivers.libvirt import _CopyWatch
from vmplane.store import events, ownership


class _Domain:
    """A domain whose job is in its first pass, and which records the switch to post-copy."""

    def __init__(self):
        self.switched_at: float | None = None

    def jobStats(self, _flags):  # noqa: N802 - libvirt's name
        return {
            "type": libvirt.VIR_DOMAIN_JOB_UNBOUNDED,
            "memory_total": 1 << 30,
            "memory_remaining": 1 << 29,
            "memory_processed": 1 << 29,
            "memory_iteration": 1,
        }

    def migrateStartPostCopy(self, _flags):  # noqa: N802 - libvirt's name
        self.switched_at = time.monotonic()


class _Driver:
    @staticmethod
    def _take_pending_abort(_name):
        return False


def test_a_progress_write_that_waits_does_not_delay_the_switch_to_post_copy_and_runs_as_the_copy():
    release, seen = threading.Event(), []

    def progress(percent: int, words: str) -> None:  # the store is busy: this write waits
        seen.append((percent, words, ownership.current(), events.current_cause()))
        release.wait(10)

    dom = _Domain()
    params = MigrationParams(postcopy=True, postcopy_after_s=0.2)
    with ownership.owned(41), events.acting_as("user ops"):
        watch = _CopyWatch(_Driver(), dom, "vmplane-x", params, progress, time.monotonic())
        t0 = time.monotonic()
        try:
            while dom.switched_at is None and time.monotonic() - t0 < 3:
                watch.poll()
                time.sleep(0.05)
        finally:
            release.set()
            watch.close()
    assert dom.switched_at is not None and dom.switched_at - t0 < 1.0, "the switch waited for the progress write"
    assert seen and seen[0][:2] == (50, "copied 512 of 1024 MiB, iteration 1, 512 MiB left")
    assert {(owner, cause) for *_, owner, cause in seen} == {(41, "user ops")}
    assert not watch._writer.is_alive()
