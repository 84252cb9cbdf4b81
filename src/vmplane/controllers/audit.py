"""Invariants of the ledger and the claims, checked against the store and the capacity index."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from sqlalchemy import func, select

from vmplane.controllers.storageaudit import storage_problems
from vmplane.core import guestagent as agent_rules
from vmplane.core.drift import MOVING_STATES, StoredVm, is_active, is_paused, size_drift
from vmplane.core.driver import DomainInfo, DriverError
from vmplane.core.model import CHARGED_STATES, VmState
from vmplane.core.names import DOMAIN_PREFIX, domain_name
from vmplane.core.placement import CapacityIndex
from vmplane.store import Database
from vmplane.store import guestagents as guest_agents
from vmplane.store import networks as SN
from vmplane.store.catalog import ledger_of, quota_of
from vmplane.store.reads import drift_view
from vmplane.store.schema import Claim, Host, Project, Vm

if TYPE_CHECKING:
    from vmplane.controllers.pools import Pools
    from vmplane.controllers.volumes import Volumes
    from vmplane.plane.context import Plane


def audit(db: Database, recomputed_usage, index: CapacityIndex | None = None) -> list[str]:
    """Every broken invariant, in words (empty when all hold):
    ledger == usage recomputed from the VMs, and within quota; host usage == sum of its claims
    (== the index); a charged VM has exactly one claim and a host; an uncharged VM holds nothing."""
    problems = []
    with db.read() as s:
        for p in s.scalars(select(Project)):
            ledger, again = ledger_of(p), recomputed_usage(s, p)
            if ledger != again:
                problems.append(f"project {p.name}: ledger {ledger} != recomputed {again}")
            for r in ("vcpus", "memory_mib", "vms"):
                if getattr(ledger, r) > getattr(quota_of(p), r):
                    problems.append(f"project {p.name}: {r} {getattr(ledger, r)} above quota")
        sums = {
            hid: (c, m)
            for hid, c, m in s.execute(
                select(Claim.host_id, func.sum(Claim.vcpus), func.sum(Claim.memory_mib)).group_by(Claim.host_id)
            )
        }
        for h in s.scalars(select(Host)).unique():
            c, m = sums.get(h.id, (0, 0))
            if (h.used_vcpus, h.used_memory_mib) != (c, m):
                problems.append(f"host {h.name}: used {h.used_vcpus}/{h.used_memory_mib} != claims {c}/{m}")
            if index is not None and h.name in index:
                ix = index.host(h.name)
                if (ix.used_vcpus, ix.used_memory_mib) != (h.used_vcpus, h.used_memory_mib):
                    problems.append(f"host {h.name}: index {ix.used_vcpus}/{ix.used_memory_mib} != store")
        claims = dict(s.execute(select(Claim.vm_id, func.count()).group_by(Claim.vm_id)).tuples().all())
        for vm_id, name, state, host_id, cv, cm in s.execute(
            select(Vm.id, Vm.name, Vm.state, Vm.host_id, Vm.charged_vcpus, Vm.charged_memory_mib)
        ):
            n = claims.get(vm_id, 0)
            if VmState(state) in CHARGED_STATES:
                if host_id is None or n != 1:
                    problems.append(f"vm {name}: {state} with {n} claims on host {host_id}")
            elif n or cv or cm:
                problems.append(f"vm {name}: {state} still holds {n} claims / a charge")
        problems.extend(overdue_operations(s.connection()))
    return problems


def overdue_operations(conn) -> list[str]:
    """Operations in flight past `vmplane.operation.deadline` that no thread of this process carries (review
    N5), each with what clears it (overdue.py: the process that owns it settles it with backoff)."""
    from vmplane.plane.overdue import problems as overdue_problems

    return overdue_problems(conn)


# VMs in these states are between two steps of an operation: where their domain is may change any moment.
def _migration_copies(vm: StoredVm, found: list[tuple[str, DomainInfo]]) -> bool:
    """Two copies of a VM that is being migrated, one on its source and one on its target: libvirt's incoming
    domain (paused until the switch-over) or, in post-copy, the paused source. Not a VM running twice."""
    if vm.migration is None or len(found) != 2 or {h for h, _ in found} != set(vm.migration):
        return False
    return any(is_paused(d) for _, d in found)


def unknown_on_answering_host(vm: StoredVm, seen: dict[str, list[DomainInfo] | None]) -> str | None:
    """An `unknown` VM whose host answers (review N3): the host monitor settles it within
    `vmplane.unknown.settle.interval` s unless another host of its zone runs it or can not be asked; until
    then it is charged, claimed and can be neither stopped, deleted nor migrated. One an operation owns is
    that operation's (an operation in flight too long is a finding of its own)."""
    if vm.state != VmState.unknown or vm.busy or vm.host is None or seen.get(vm.host) is None:
        return None
    return (
        f"vm {vm.name}: unknown on {vm.host}, which answers; `vmplane vm sync {vm.name}` settles it from what "
        f"the hosts run"
    )


def placement_problems(vms: list[StoredVm], seen: dict[str, list[DomainInfo] | None], prefix: str) -> list[str]:
    """Compare the store with what the hosts run (`seen[host]` None: the host did not answer).
    A running VM runs on its host and nowhere else, at the recorded memory, vCPUs, CPU cap and state
    (drift.size_drift); a stopped one runs nowhere; no host runs a vmplane domain the store does not know.
    VMs in the middle of an operation are only checked for running twice (the two copies of a migration
    in flight are not), and for being in a moving state with nothing in flight (stuck)."""
    where: dict[str, list[tuple[str, DomainInfo]]] = {}
    for host, domains in seen.items():
        for d in domains or ():
            if is_active(d) and d.name.startswith(prefix):
                where.setdefault(d.name, []).append((host, d))
    problems = []
    known = set()
    for vm in vms:
        known.add(vm.domain)
        found = where.get(vm.domain, [])
        hosts = sorted(h for h, _ in found)
        if len(found) > 1 and not _migration_copies(vm, found):
            problems.append(f"vm {vm.name}: runs {len(found)} times, on {', '.join(hosts)}")
            continue
        if vm.state in MOVING_STATES:
            if not vm.busy:
                problems.append(
                    f"vm {vm.name}: {vm.state.value} in the store, but no operation or migration of it is in flight"
                )
            continue
        if problem := unknown_on_answering_host(vm, seen):
            problems.append(problem)
        if vm.state == VmState.running:
            if vm.host is None or seen.get(vm.host) is None:
                continue  # its host did not answer: the monitor's business
            if not found:
                problems.append(f"vm {vm.name}: running on {vm.host} in the store, but no host runs it")
            elif hosts[0] != vm.host:
                problems.append(f"vm {vm.name}: the store says {vm.host}, but it runs on {hosts[0]}")
            else:
                problems.extend(
                    str(d)
                    for d in size_drift(vm.name, vm.host, vm.vcpus, vm.memory_mib, vm.cpu_cap_percent, found[0][1])
                )
        elif vm.state in (VmState.stopped, VmState.error) and found:
            problems.append(f"vm {vm.name}: {vm.state.value} in the store, but it runs on {hosts[0]}")
    for domain in sorted(set(where) - known):
        on = ", ".join(sorted(h for h, _ in where[domain]))
        if domain.startswith(prefix + "probe-"):  # the libvirt driver's accelerator probe (PROBE_PREFIX)
            problems.append(
                f"domain {domain}: a leftover accelerator probe (no VM) runs on {on}, holding memory "
                f"without a claim; destroy it there (virsh destroy {domain})"
            )
        else:
            problems.append(f"domain {domain}: runs on {on} but the store has no such VM")
    return problems


class Audit:
    """`vmplane audit`: the ledger and claims, the store against what every host runs, and storage."""

    def __init__(self, plane: Plane, volumes: Volumes, pools: Pools):
        self.plane = plane
        self.volumes, self.pools = volumes, pools

    def audit(self) -> list[str]:
        """Broken invariants in words: the ledger and claims (audit), then the store against what every
        host runs (placement_problems), then storage (storageaudit)."""
        plane = self.plane
        with plane.capacity.lock:
            problems = audit(plane.db, plane.catalog.recomputed_usage, plane.capacity.index)
        return problems + self.audit_hosts() + self.audit_storage() + self.audit_nics() + self.audit_guest_addresses()

    def audit_guest_addresses(self) -> list[str]:
        """Each running VM's NICs in the record against the addresses its guest holds, as its agent reports
        them now (core/guestagent.drift): a guest that set an address by hand, or lacks its own. Only VMs
        whose agent answered last time are asked; one that does not answer now is no finding."""

        def scan() -> list[str]:
            with self.plane.db.read() as s:
                conn = s.connection()
                running = [(h, vm) for h, vms in sorted(guest_agents.running(conn).items()) for vm in vms if vm.nics]
                views = guest_agents.views(conn, [vm.vm_id for _h, vm in running])
            found = []
            for host, vm in running:
                view, driver = views.get(vm.vm_id), self.plane.drivers.get(host)
                if driver is None or view is None or view.state != "connected":
                    continue
                try:
                    reported = driver.agent_interfaces(domain_name(vm.name), timeout_s=2.0)
                except DriverError:
                    continue
                found += [f"vm {vm.name}: {words}" for words in agent_rules.drift(vm.nics, reported)]
            return found

        return _found_twice(scan)

    def audit_nics(self) -> list[str]:
        """Each running VM's NICs in the record against its domain's, read back (a NIC plugged or removed
        behind vmplane's back), reported when a second pass finds it again. A NIC between two steps
        (attaching, detaching) is the settle pass's, not a finding."""

        def scan() -> list[str]:
            with self.plane.db.read() as s:
                recorded = SN.running_nics(s.connection())
            found = []
            for (vm, host), nics in sorted(recorded.items()):
                driver = self.plane.drivers.get(host)
                if driver is None:
                    continue
                try:
                    held = set(driver.domain_nics(domain_name(vm)))
                except DriverError:
                    continue  # the host does not answer: the host audit says so
                settled = {mac for mac, state in nics.items() if state == "attached"}
                between = set(nics) - settled
                found += [f"vm {vm}: NIC {mac} is in the record but not in its domain on {host}"
                          for mac in sorted(settled - held)]  # fmt: skip
                found += [f"vm {vm}: its domain on {host} has NIC {mac}, which the record does not have"
                          for mac in sorted(held - settled - between)]  # fmt: skip
            return found

        return _found_twice(scan)

    def audit_storage(self) -> list[str]:
        """Storage findings, reported when a second pass finds them again (as for the hosts)."""
        return _found_twice(lambda: storage_problems(self.plane, self.volumes, self.pools))

    def audit_hosts(self) -> list[str]:
        """The store against what every host runs. The hosts are scanned, then the store is read, with no
        lock between: an operation that ends in between shows as a finding that is already gone. So a
        finding is reported only if a second pass (a fresh scan and a fresh read) finds it again."""

        def scan() -> list[str]:
            seen: dict[str, list | None] = {}
            for name, driver in list(self.plane.drivers.items()):
                try:
                    seen[name] = driver.domains()
                except DriverError:
                    seen[name] = None
            with self.plane.db.read() as s:
                vms = drift_view(s.connection(), domain_name)
            return placement_problems(vms, seen, DOMAIN_PREFIX)

        return _found_twice(scan)


def _found_twice(scan: Callable[[], list[str]]) -> list[str]:
    """The findings of `scan` that a second, fresh scan finds again (one that went in between was a step
    caught half-way, not a problem); the second scan runs only when the first found something."""
    first = scan()
    if not first:
        return first
    again = set(scan())
    return [problem for problem in first if problem in again]
