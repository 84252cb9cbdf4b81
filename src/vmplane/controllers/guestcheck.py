"""The guest check after an HA restart (issue 30): once a VM runs again on another host, its guest is asked
whether it came up (through its guest agent, waited for while the guest boots; without an agent, its domain
runs and its vCPUs advance), never through a shell on the serial console, and the answer is an event of the
VM. It changes nothing in the record: the restart already is what the host confirmed; the check says whether
the guest inside is well."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from vmplane.core.guestexec import judged
from vmplane.core.names import domain_name
from vmplane.store import events

if TYPE_CHECKING:
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.guestcheck")
AGENT_WAIT_S = 60.0  # a restarted guest boots: its agent is waited for this long before the check without it
CHECK_S = 30.0  # the check itself


def after_restart(plane: Plane, vm: str, host: str) -> threading.Thread:
    """Check the guest of `vm`, restarted on `host`, in a thread of its own (a boot takes a while); returns it."""
    thread = threading.Thread(target=_check, args=(plane, vm, host), name=f"vmplane-guestcheck-{vm}", daemon=True)
    thread.start()
    return thread


def _check(plane: Plane, vm: str, host: str) -> None:
    driver: Any = plane.drivers.get(host)
    health = getattr(driver, "guest_health", None)  # optional capability of a driver (duck-typed)
    if health is None:
        return
    domain, t0 = domain_name(vm), time.monotonic()
    ping = getattr(driver, "agent_ping", None)
    agent = False
    try:
        while ping is not None and not plane.closing.is_set():
            if ping(domain, 2.0):
                agent = True
                break
            if time.monotonic() - t0 > AGENT_WAIT_S:
                break
            time.sleep(1.0)
        healthy, words = judged(health(domain, CHECK_S), time.monotonic() - t0)
    except Exception as exc:  # noqa: BLE001 - any error is an answer: the guest is not known well
        healthy, words = False, f"no answer ({exc})"
    if not agent and healthy:
        words += f" (no guest agent answered within {AGENT_WAIT_S:g} s)"
    if plane.closing.is_set():
        return
    verdict = "healthy" if healthy else "NOT healthy"
    try:
        with plane.db.transaction() as conn:
            events.record(
                conn,
                "vm",
                vm,
                message=f"guest check after its HA restart on {host}: {verdict}: {words}",
                vm=vm,
                host=host,
            )
    except Exception:  # the store went away (shutdown): the check is lost, nothing else
        log.exception("guest check of %s", vm)
