"""The periodic full sync: every host's domains against the record (the safety net for missed events).

Every `vmplane.host.sync.interval` seconds (global, default 30) each host that is not down is asked
for all its domains. A `running` VM recorded there whose domain is absent or shut off is settled
(settle.settle_vm: stopped, charge and claim given back, cause `sync`) only when the host answered;
the VM is then asked for once more before anything changes. A `running` VM whose domain has less than
the record (a late DIMM unplug, a scale whose read-back failed) is adopted at the host's size
(adopt.sync_vm): the charge and the claim only go down; a domain with more is reported by the audit.
A `vmplane-` domain running where the record says the VM is stopped, on another host, or that no VM has,
is reported (logged and an event), never killed: it is an operator's call. VMs an operation owns are
skipped, as the events loop does.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, cast

from sqlalchemy import select

from vmplane.core.driver import DriverError
from vmplane.core.model import UNREACHABLE_HOST_STATES, VmState
from vmplane.core.names import domain_name
from vmplane.plane.loops import every
from vmplane.plane.settle import OWNED_STATES, settle_vm
from vmplane.store import ledger as L
from vmplane.store.events import acting_as, record

if TYPE_CHECKING:
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.hostsync")
CAUSE = "sync"
PROBE_PREFIX = "probe-"  # vmplane-probe-*: the driver's short-lived accelerator probe


class HostSync:
    def __init__(self, plane: Plane):
        self.plane = plane
        self._stop = threading.Event()
        self._reported: set[tuple[str, str, str]] = set()  # reported once, until resolved

    def start(self) -> None:
        every(
            lambda: float(cast(float, self.plane.catalog.effective("vmplane.host.sync.interval"))),
            self.sync,
            self._stop,
            "host-sync",
            log,
            owner=lambda: self.plane.membership.epoch,
        )

    def stop(self) -> None:
        self._stop.set()

    def _records(self) -> dict[str, tuple[str, str | None, object]]:
        v, h = L.VMS.c, L.HOSTS.c
        with self.plane.db.read() as s:
            rows = (
                s.connection()
                .execute(select(v.name, v.state, h.name, v.updated_at).outerjoin(L.HOSTS, h.id == v.host_id))
                .all()
            )
        return {name: (state, host, updated) for name, state, host, updated in rows}

    def sync(self) -> list[str]:
        """One pass over every host that is not down; returns what was settled or reported, in words."""
        findings: list[str] = []
        reported: set[tuple[str, str, str]] = set()
        with acting_as(CAUSE):
            before = None
            for host, driver in list(self.plane.drivers.items()):
                if (
                    host not in self.plane.capacity.index
                    or self.plane.capacity.index.host(host).state in UNREACHABLE_HOST_STATES
                    or not self.plane.membership.owns_host(host)
                ):
                    continue
                # the record, read once per pass before the first host is asked (read per host, 20 hosts of
                # 10,000 VMs cost 2 s of CPU a pass in the API's process). Older for the later hosts, but
                # nothing acts on it alone: settle_vm and sync_vm read the VM again and ask its host afresh,
                # and a finding is re-read (`after`) before it is reported
                before = before if before is not None else self._records()
                findings += self._sync_host(host, driver, reported, before)
        self._reported = reported
        return findings

    def _sync_host(self, host: str, driver, reported: set, before: dict) -> list[str]:
        try:
            domains = driver.domains()
        except DriverError as exc:
            log.info("sync: %s does not answer (%s); the monitor decides", host, exc)
            return []
        running = {d.name for d in domains if d.active}  # paused too: its QEMU holds memory
        findings = []
        for name, (state, vm_host, _) in before.items():
            if vm_host == host and state == VmState.running.value and domain_name(name) not in running:
                new = settle_vm(self.plane, name, host, CAUSE, f"sync: {host} does not run it")
                if new:
                    findings.append(f"{name}: not running on {host}; recorded {new}")
        findings += self._adopt_shrunk(host, before, {d.name: d for d in domains if d.active})
        prefix = domain_name("")
        after = None
        for domain in sorted(running):
            if not domain.startswith(prefix):
                continue
            name = domain[len(prefix) :]
            seen = before.get(name)
            if seen is not None and (seen[0] in OWNED_STATES or seen[0] == VmState.unknown.value):
                continue  # an operation (or the monitor) owns it
            if seen is not None and seen[0] == VmState.running.value and seen[1] == host:
                continue
            if seen is None and name.startswith(PROBE_PREFIX):
                continue
            after = after if after is not None else self._records()
            if after.get(name) != seen:
                continue  # the record changed meanwhile: the next pass looks again
            if seen is None:
                problem = f"{host} runs {domain}, which no VM of the record has"
            elif seen[0] == VmState.running.value:
                problem = f"{host} runs {domain}, but vm {name} is recorded running on {seen[1]}"
            else:
                problem = f"{host} runs {domain}, but vm {name} is recorded {seen[0]}"
            key = (host, domain, problem)
            reported.add(key)
            if key in self._reported:
                continue
            self._report(name if seen is not None else None, host, problem)
            findings.append(problem)
        return findings

    def _adopt_shrunk(self, host: str, before: dict, active: dict) -> list[str]:
        """A `running` VM whose domain has less than the record (a DIMM unplug the guest completed after
        the scale gave up, a scale whose read-back failed and kept the larger size): the record, the
        charge and the claim follow the host (adopt.sync_vm, which re-checks that nothing owns the VM).
        A domain with more than the record is only reported (`vmplane audit`; `vm sync` adopts it)."""
        from vmplane.controllers.adopt import sync_vm
        from vmplane.core.drift import host_size, size_drift
        from vmplane.core.errors import VmplaneError

        v, h = L.VMS.c, L.HOSTS.c
        with self.plane.db.read() as s:
            sizes = {
                r.name: r
                for r in s.connection().execute(
                    select(v.name, v.vcpus, v.memory_mib, v.cpu_cap_percent)
                    .join(L.HOSTS, h.id == v.host_id)
                    .where(h.name == host, v.state == VmState.running.value)
                )
            }
        found = []
        for name, (state, vm_host, _) in before.items():
            d, vm = active.get(domain_name(name)), sizes.get(name)
            if vm_host != host or state != VmState.running.value or d is None or vm is None:
                continue
            size = host_size(d)
            drift = [
                x for x in size_drift(name, host, vm.vcpus, vm.memory_mib, vm.cpu_cap_percent, d) if x.field != "state"
            ]
            if not drift or size.vcpus > vm.vcpus or size.memory_mib > vm.memory_mib:
                continue
            try:
                result = sync_vm(self.plane, name)
            except VmplaneError as exc:  # owned or changed meanwhile: the next pass looks again
                log.info("sync: %s not adopted (%s)", name, exc)
                continue
            if not result["in_sync"]:
                found.append(f"{name}: adopted what {host} runs ({result['message']})")
        return found

    def _report(self, vm: str | None, host: str, problem: str) -> None:
        log.error("sync: %s (not killed: an operator decides)", problem)
        with self.plane.db.transaction() as conn:
            project_id = None
            if vm is not None:
                project_id = conn.execute(select(L.VMS.c.project_id).where(L.VMS.c.name == vm)).scalar()
            record(
                conn,
                "vm" if vm else "host",
                vm or host,
                message=f"{problem}; not killed: an operator decides",
                vm=vm,
                host=host,
                project_id=project_id,
                cause=CAUSE,
            )
