"""VMs: create, start, stop, delete, and a command in the guest.

An admission (create, start) is one write transaction: lock the project row, pick a host from the
capacity mirror, lock that host's row and re-check it, apply the pure rules (quota.check_admission,
the placement filters), then write ledger, claim, VM and operation together. Driver work happens after
commit, inside an operation whose every step is persisted before it is acted on (starts.py runs the
starts); a failure gives back exactly what was charged and claimed (`fail_start_stop`, the failure hook
of starts and stops).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from sqlalchemy.engine import Connection, Row
from sqlalchemy.exc import IntegrityError

from vmplane.controllers.ha import check_ha
from vmplane.core import cloudinit as CI
from vmplane.core import failpoints
from vmplane.core.driver import DriverError
from vmplane.core.errors import AlreadyExists, Conflict, Invalid, VmplaneError
from vmplane.core.model import (
    UNREACHABLE_HOST_STATES,
    ClaimKind,
    OperationState,
    PlacementRequest,
    Size,
    Usage,
    VmState,
)
from vmplane.core.names import check_name, domain_name
from vmplane.core.offerings import size_for
from vmplane.core.placement import Placement
from vmplane.core.quota import check_admission, running_charge
from vmplane.core.scaling import ScalingFlags, cap_share, ceiling
from vmplane.core.scope import Scope
from vmplane.plane import metrics
from vmplane.plane.operations import Failed, FailureContext, Operations
from vmplane.plane.reserves import placement_rules
from vmplane.store import admission
from vmplane.store import backups as BK
from vmplane.store import ledger as L
from vmplane.store import networks as SN
from vmplane.store import seeds as SS
from vmplane.store import snapshots as SNAP
from vmplane.store import storageledger as SL
from vmplane.store.catalog import Outdated
from vmplane.store.groupstore import resolve_group

if TYPE_CHECKING:
    from vmplane.controllers.starts import Starts
    from vmplane.controllers.volumes import Volumes
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.orchestrator")

OUTDATED_TRIES = 3  # admissions of one create that may find its offering or template changed


@dataclass(frozen=True)
class Admitted:
    vm: str
    operation_id: str | None


@dataclass(frozen=True)
class StartFacts:
    """The offering, template and VM flags that decide how a VM is started."""

    offering_dynamic: bool
    template_dynamic: bool
    vm_dynamic: bool
    cpu_cap: bool
    cpu_speed_mhz: int


@dataclass(frozen=True)
class Claimed:
    """A start admitted in a transaction, to mirror in the index once it commits."""

    operation_id: str
    host: str
    vcpus: int
    memory_mib: int


class _Planned(Exception):
    """A dry run's admission, done and to be rolled back: its plan."""

    def __init__(self, plan: dict):
        super().__init__("dry run")
        self.plan = plan


def create_plan(
    name: str, project: str, size: Size, delta: Usage, placement: tuple[Placement, int] | None, pool
) -> dict:
    """What a create would do: where it runs (if started), its root disk's pool, what its project is charged."""
    chosen = placement[0] if placement else None
    reason = (
        f"{chosen.host} has room for {size.vcpus} vCPU(s) / {chosen.memory_mib} MiB (with overhead)"
        if chosen
        else "created stopped: no host is chosen until it starts"
    )
    return {
        "vm": name,
        "project": project,
        "dry_run": True,
        "vcpus": size.vcpus,
        "memory_mib": size.memory_mib,
        "host": chosen.host if chosen else None,
        "overhead_mib": chosen.overhead_mib if chosen else 0,
        "pool": pool.name if pool is not None else None,
        "charge": {
            "vms": delta.vms,
            "vcpus": delta.vcpus,
            "memory_mib": delta.memory_mib,
            "storage_mib": delta.storage_mib,
        },
        "reason": reason,
    }


class Vms:
    def __init__(self, plane: Plane, volumes: Volumes, starts: Starts):
        self.plane = plane
        self.volumes, self.starts = volumes, starts

    # -- VMs: admission ------------------------------------------------------------------------
    def create_vm(
        self,
        name: str,
        project: str,
        offering: str,
        template: str,
        vcpus: int | None = None,
        memory_mib: int | None = None,
        dynamically_scalable: bool = True,
        start: bool = False,
        zone: str | None = None,
        cluster: str | None = None,
        root_disk_mib: int | None = None,
        pool: str | None = None,
        ha_policy: str | None = None,
        ha_priority: int = 0,
        group: str | None = None,
        *,
        networks: Sequence[tuple[str, str | None]] = (),
        secgroups: Sequence[str] = (),
        hostname: str | None = None,
        ssh_keys: Sequence[str] = (),
        user_data: bytes | None = None,
        project_keys: bool = True,
        dry_run: bool = False,
        _tries: int = OUTDATED_TRIES,
    ) -> Admitted | dict:
        """Create a VM (charging one `vms`, and its root disk's storage when its template has a disk
        image) in a zone (and a cluster when given), and with `start` admit its start in the same
        transaction: either all of it is committed or nothing is. The root disk is then made on its
        pool (read back) before the start runs; a pool that refuses it undoes the whole create.
        `ha_policy` (restart or off; None: the offering's) says what happens when its host fails; `group`
        is its placement group (of its project). `dry_run`: the whole admission runs and is rolled back;
        the answer is its plan (host, pool, charge), or the refusal the create would meet."""
        check_name(name)
        keys = [CI.check_ssh_key(k) for k in ssh_keys]  # the seed's rules (core/cloudinit), before anything
        host_name_asked = CI.check_hostname(hostname) if hostname is not None else None
        user_data = CI.check_user_data(user_data) if user_data is not None else None
        o, t = self.plane.catalog.for_new_vm(offering, template)
        ha_chosen = check_ha(ha_policy or o.ha_policy, ha_priority)
        size = size_for(self.plane.catalog.data_of(o), vcpus, memory_mib)
        disk_mib = self.volumes.root_size(t, o, root_disk_mib) if t.disk_image else None
        if disk_mib is None and (root_disk_mib is not None or pool is not None):
            raise Invalid(f"template {template} has no disk image: its VMs have no root disk", field="root_disk_mib")

        def admit(conn: Connection) -> tuple[int, str | None, Claimed | None]:
            self.plane.catalog.check_new_vm(conn, o, t)
            at = zone if zone or cluster or not networks else SN.zone_of_network(conn, networks[0][0])
            scope, zone_id, cluster_id = admission.scope_of(conn, at, cluster)
            p = L.lock_project(conn, name=project)
            base = Usage(vms=1, storage_mib=disk_mib or 0)
            reach = self.volumes.reach_for_new(conn, disk_mib, pool, scope.cluster) if disk_mib else None
            group_id = resolve_group(conn, group, p.id) if group else None
            rules = (
                placement_rules(
                    self.plane,
                    conn,
                    scope,
                    action=f"starting {name} on {{host}}",
                    group_id=group_id,
                    ha=ha_chosen == "restart",
                )
                if start
                else None
            )
            new_disk = (  # said of each host where it can not go
                f"does not open pool {pool} (asked for the new VM's root disk)"
                if pool
                else f"has no pool with room for the new VM's {disk_mib} MiB root disk (no local pool of "
                "its own, no shared pool of its cluster)"
            )
            placement, delta = self._admit(conn, p, size, base, start, scope, reach, rules, new_disk)
            seed_keys = keys + (
                [k.key for k in SS.project_keys(conn, p.id) if k.key not in keys] if project_keys else []
            )
            L.add_to_ledger(conn, p.id, delta)
            facts = StartFacts(
                o.dynamic_scaling, t.dynamically_scalable, dynamically_scalable, o.cpu_cap, o.cpu_speed_mhz
            )
            fields = dict(
                name=name,
                project_id=p.id,
                offering_id=o.id,
                template_id=t.id,
                vcpus=size.vcpus,
                memory_mib=size.memory_mib,
                dynamically_scalable=dynamically_scalable,
                zone_id=zone_id,
                cluster_id=cluster_id,
                ha_policy=ha_chosen,
                ha_priority=ha_priority,
                group_id=group_id,
                hostname=host_name_asked,
                ssh_keys=seed_keys or None,
                user_data=user_data,
                **self._started_fields(size, placement, delta, facts),
            )
            host = placement[0].host if placement else None
            try:
                vm_id = L.insert_vm(conn, host_name=host, **fields)
            except IntegrityError:
                raise AlreadyExists(f"vm {name!r} already exists", field="name") from None
            if networks:
                SN.add_vm_nics(conn, vm_id, p.id, zone_id, networks, secgroups)
            if disk_mib:
                meta = self.plane.capacity.hosts.get(host) if host else None
                zone_clusters = None if meta else admission.clusters_of(conn, scope)  # not placed: its scope's
                chosen = self.volumes.root_pool(
                    conn, disk_mib, pool, host, meta.cluster if meta else scope.cluster, zone_clusters
                )
                if ha_chosen == "restart" and chosen.kind != "shared":
                    raise Invalid(
                        f"--ha restart needs its root disk on a shared pool: {chosen.name} is a "
                        f"{chosen.kind} pool, and the disk would be lost with its host; use "
                        f"--pool with a shared pool",
                        field="ha_policy",
                    )
                self.volumes.add_root(conn, vm_id, name, p.id, t.id, disk_mib, chosen)
            claimed = self._claim(conn, vm_id, name, p.id, size, placement) if placement else None
            if dry_run:  # everything checked: roll it all back (nothing mirrored yet) and answer the plan
                raise _Planned(create_plan(name, p.name, size, delta, placement, chosen if disk_mib else None))
            return vm_id, host, self._mirror(claimed)

        try:
            vm_id, host, claimed = self.plane.admissions.run(admit)
        except _Planned as planned:
            return planned.plan
        except Outdated:  # the offering or template was deleted (or made again) meanwhile: read again
            if _tries <= 1:
                raise Conflict(
                    f"offering {offering} or template {template} changed {OUTDATED_TRIES} times while "
                    f"vm {name} was admitted; nothing was created: try again",
                    field="offering",
                ) from None
            return self.create_vm(
                name,
                project,
                offering,
                template,
                vcpus,
                memory_mib,
                dynamically_scalable,
                start,
                zone,
                cluster,
                root_disk_mib,
                pool,
                ha_policy,
                ha_priority,
                group,
                networks=networks,
                secgroups=secgroups,
                hostname=hostname,
                ssh_keys=ssh_keys,
                user_data=user_data,
                project_keys=project_keys,
                dry_run=dry_run,
                _tries=_tries - 1,
            )
        if disk_mib:
            try:
                self._make_root_or_undo(name, vm_id, host, claimed)
            except VmplaneError:  # undone: the index gives back what admit() mirrored
                if claimed:
                    self.plane.capacity.give_back([(claimed.host, claimed.vcpus, claimed.memory_mib)])
                raise
        return self._launch(name, claimed)

    def _make_root_or_undo(self, name: str, vm_id: int, host: str | None, claimed: Claimed | None) -> None:
        """Make the new VM's root disk; if its pool refuses, undo the create: the start's claim and charge
        go, and the VM goes too unless its disk is left `creating` (a host that could not say whether
        it made it: the VM then stays, stopped, and the disk is resolved later)."""
        try:
            self.volumes.make_root(name, host)
        except VmplaneError:
            with self.plane.db.transaction() as conn:
                vm = L.vm_row(conn, vm_id=vm_id, lock=True)
                L.lock_project(conn, vm.project_id)
                if claimed:
                    L.set_operation(
                        conn,
                        claimed.operation_id,
                        state=OperationState.failed,
                        step="done",
                        message="its root disk could not be created",
                    )
                L.release_vm(conn, vm_id)  # the index never had the claim (_launch did not run)
                if not SL.vm_volumes(conn, vm_id):
                    L.add_to_ledger(conn, vm.project_id, Usage(vms=-1))
                    L.delete_vm(conn, vm_id, note="its root disk could not be created")
            raise

    def start_vm(self, name: str) -> Admitted:
        def admit(conn: Connection) -> Claimed:
            vm = L.vm_row(conn, name=name, lock=True)
            if vm.state not in (VmState.stopped.value, VmState.error.value):  # neither holds anything
                raise Conflict(f"vm {name} is {vm.state}; only a stopped VM can be started", field="state")
            p = L.lock_project(conn, vm.project_id)
            size = Size(vm.vcpus, vm.memory_mib)
            self.volumes.check_ready(conn, vm.id, name)
            reach = self.volumes.storage_hosts(conn, vm.id)
            scope = Scope(vm.zone_name, vm.cluster_name)
            rules = placement_rules(
                self.plane,
                conn,
                scope,
                action=f"starting {name} on {{host}}",
                vm_id=vm.id,
                ha=vm.ha_policy == "restart",
            )
            placement, delta = self._admit(conn, p, size, Usage(), True, scope, reach, rules)
            assert placement is not None  # a start is placed, or refused
            L.add_to_ledger(conn, p.id, delta)
            facts = StartFacts(
                vm.offering_dynamic,
                vm.template_dynamic,
                vm.dynamically_scalable,
                vm.offering_cpu_cap,
                vm.offering_cpu_mhz,
            )
            fields = self._started_fields(size, placement, delta, facts)
            if vm.zone_id is None:  # placed before zones mattered: it joins its host's zone
                fields["zone_id"] = self.plane.capacity.hosts[placement[0].host].zone_id
            L.set_vm(conn, vm.id, **fields)
            claimed = self._claim(conn, vm.id, name, p.id, size, placement)
            self._mirror(claimed)
            return claimed

        return self._launch(name, self.plane.admissions.run(admit))

    def _admit(
        self,
        conn: Connection,
        p: Row,
        size: Size,
        base: Usage,
        start: bool,
        scope: Scope = Scope(None, None),
        reach: frozenset[str] | None = None,
        rules: dict | None = None,
        storage_reason: str = "can not open the VM's disks (their pools are not on it)",
    ) -> tuple[tuple[Placement, int] | None, Usage]:
        """Quota and placement for `base` (+ a start): returns the locked host and the ledger delta.
        `rules`: the group and failover-reserve fields of the placement (reserves.placement_rules).
        Quota is checked before placement (without overhead) so that a quota refusal is reported as
        one even when no host has room; the exact check follows once the host (and its cluster's
        overhead ratio) is known, before its capacity is taken: a refusal writes nothing."""
        quota, ledger = L.quota_row(p), L.ledger_row(p)
        if not start:
            check_admission(p.name, quota, ledger, base)
            return None, base
        t0 = time.perf_counter()
        try:
            check_admission(p.name, quota, ledger, base + running_charge(size, 0, False))
            placement = self._place(
                conn,
                size,
                scope,
                reach,
                rules,
                storage_reason,
                check=lambda chosen: check_admission(
                    p.name, quota, ledger, base + running_charge(size, chosen.overhead_mib, p.count_overhead)
                ),
            )
            delta = base + running_charge(size, placement[0].overhead_mib, p.count_overhead)
        except VmplaneError as exc:
            metrics.ADMISSIONS.labels(exc.code).inc()
            raise
        metrics.ADMISSIONS.labels("admitted").inc()
        metrics.ADMISSION_SECONDS.observe(time.perf_counter() - t0)
        return placement, delta

    def _started_fields(
        self, size: Size, placement: tuple[Placement, int] | None, delta: Usage, facts: StartFacts
    ) -> dict:
        """The VM's row once admitted: host, charge, the live-scaling ceiling and the CPU cap share."""
        if placement is None:
            return dict(state=VmState.stopped.value, overhead_mib=0, charged_vcpus=0, charged_memory_mib=0)
        chosen, host_id = placement
        meta = self.plane.capacity.hosts[chosen.host]
        eff = self.plane.catalog.effective
        flags = ScalingFlags(
            bool(eff("enable.dynamic.scale.vm", meta.zone, meta.cluster)),
            facts.offering_dynamic,
            facts.template_dynamic,
            facts.vm_dynamic,
        )
        top = ceiling(
            flags,
            size,
            int(cast(int, eff("kvm.cpu.dynamic.scaling.capacity", meta.zone, meta.cluster))),
            int(cast(int, eff("kvm.memory.dynamic.scaling.capacity", meta.zone, meta.cluster))),
            meta.cores,
            meta.memory_mib,
        )
        share = cap_share(facts.cpu_speed_mhz, meta.cpu_mhz) if facts.cpu_cap else None
        return dict(
            state=VmState.starting.value,
            host_id=host_id,
            overhead_mib=chosen.overhead_mib,
            boot_memory_mib=size.memory_mib,
            charged_vcpus=delta.vcpus,
            charged_memory_mib=delta.memory_mib,
            max_vcpus=top.vcpus,
            max_memory_mib=top.memory_mib,
            cpu_cap_percent=share * 100 if share else None,
            prepared=flags.prepared,
        )

    def _place(
        self,
        conn: Connection,
        size: Size,
        scope: Scope,
        reach: frozenset[str] | None = None,
        rules: dict | None = None,
        storage_reason: str = "can not open the VM's disks (their pools are not on it)",
        check: Callable[[Placement], None] | None = None,
    ) -> tuple[Placement, int]:
        """Pick a host within the VM's zone (and cluster) and take its capacity (take_placement)."""
        request = PlacementRequest(
            size,
            zone=scope.zone,
            cluster=scope.cluster,
            storage_hosts=reach,
            storage_reason=storage_reason,
            **(rules or {}),
        )
        return self.plane.capacity.take_placement(conn, request, check)

    @staticmethod
    def _claim(
        conn: Connection, vm_id: int, name: str, project_id: int, size: Size, placement: tuple[Placement, int]
    ) -> Claimed:
        chosen, host_id = placement
        op_id = L.new_operation(
            conn,
            "start",
            name,
            vm_id,
            project_id,
            step="claimed",
            message=f"claimed {size.vcpus} vCPU(s) / {chosen.memory_mib} MiB on {chosen.host}",
            result={"host": chosen.host},
        )
        L.record_claim(conn, host_id, vm_id, op_id, ClaimKind.running, size.vcpus, chosen.memory_mib)
        return Claimed(op_id, chosen.host, size.vcpus, chosen.memory_mib)

    def _mirror(self, claimed: Claimed | None) -> Claimed | None:
        """In the admission transaction, its last step: mirror the claim in the index, so that the next
        admission of the batch places against it (the batcher rebuilds the index if the commit fails)."""
        if claimed is not None:
            self.plane.capacity.add(claimed.host, claimed.vcpus, claimed.memory_mib)
        return claimed

    def _launch(self, name: str, claimed: Claimed | None) -> Admitted:
        """After commit: hand the admitted start to an operation (the index already has its claim)."""
        if claimed is None:
            return Admitted(name, None)
        failpoints.hit("start.admitted")
        self.starts.submit(claimed.operation_id)
        return Admitted(name, claimed.operation_id)

    # -- VMs: stop and delete ------------------------------------------------------------------
    def stop_vm(self, name: str, force: bool = False) -> Admitted:
        """Stop a running VM: the guest is asked to power off for `vmplane.vm.shutdown.timeout`
        seconds, then forced off; `force` skips the wait."""
        with self.plane.db.transaction() as conn:
            vm = L.vm_row(conn, name=name, lock=True)
            if vm.state != VmState.running.value:
                raise Conflict(f"vm {name} is {vm.state}; only a running VM can be stopped", field="state")
            moving = [v.name for v in SL.vm_volumes(conn, vm.id) if v.state == "moving"]
            if moving:  # a live block copy: stopped midway, which file has the guest's last writes is not known
                raise Conflict(
                    f"vm {name}'s volume {moving[0]} is being moved live; stop it once it moved", field="state"
                )
            op_id = L.new_operation(conn, "stop", name, vm.id, vm.project_id, step="stopping", result={"force": force})
            L.set_vm(conn, vm.id, state=VmState.stopping)
        failpoints.hit("stop.admitted")
        self.plane.ops.submit(op_id, self.run_stop)
        return Admitted(name, op_id)

    def delete_vm(self, name: str, keep_disk: bool = False) -> None:
        """Delete a stopped (or error) VM once its hosts confirm no domain of it is left
        (`_no_domain_left`: a shut-off definition is removed; a running one, or a host that can not be
        asked, refuses the delete with nothing changed). Its root disk is deleted (kept as a volume
        with `keep_disk`) and its volumes detached: they outlive it."""
        with self.plane.db.read() as s:
            vm = L.vm_row(s.connection(), name=name)
        if vm.state not in (VmState.stopped.value, VmState.error.value):
            raise Conflict(f"vm {name} is {vm.state}; stop it before deleting it", field="state")
        self._no_domain_left(vm)
        with self.plane.db.transaction() as conn:
            now = L.vm_row(conn, name=name, lock=True)
            if now.state not in (VmState.stopped.value, VmState.error.value):
                raise Conflict(f"vm {name} is {now.state}; stop it before deleting it", field="state")
            if (now.state, now.host_id, now.updated_at) != (vm.state, vm.host_id, vm.updated_at):
                raise Conflict(f"vm {name} changed while its hosts were asked; delete it again", field="state")
            L.lock_project(conn, vm.project_id)
            self.volumes.check_settled(conn, vm.id, name)
            clones = None if keep_disk else SNAP.clones_problem(conn, f"vm {name}", vm_id=vm.id)
            if clones:
                raise Conflict(clones, field="vm")
            doomed = self.volumes.release_disks(conn, vm.id, keep_disk)
            freed = L.release_vm(conn, vm.id)
            L.add_to_ledger(conn, vm.project_id, Usage(vms=-1))
            SNAP.forget_vm(conn, vm.id)  # its snapshots' metadata; their files go with the disks
            BK.forget_vm(conn, vm.id)  # its backups stay, untied from its id; its schedule goes
            L.delete_vm(conn, vm.id)
        self.plane.capacity.give_back(freed)
        self.volumes.delete_files(doomed)  # charged until each pool confirms its file gone

    def _hosts_to_ask(self, vm: Row) -> list[str]:
        """Where a domain of `vm` can be: its host, the host it last ran on, and every host of its cluster
        (else of its zone; else every host, for a VM that never ran and has no scope)."""
        by_id = self.plane.capacity.hosts_by_id()
        own = [by_id[i] for i in (vm.host_id, vm.last_host_id) if i is not None and i in by_id]
        cluster_id = vm.cluster_id or next((self.plane.capacity.hosts[h].cluster_id for h in own), None)
        zone_id = vm.zone_id or next((self.plane.capacity.hosts[h].zone_id for h in own), None)
        if cluster_id is not None:
            others = [h for h, meta in self.plane.capacity.hosts.items() if meta.cluster_id == cluster_id]
        elif zone_id is not None:
            others = [h for h, meta in self.plane.capacity.hosts.items() if meta.zone_id == zone_id]
        else:
            others = list(self.plane.capacity.hosts)
        return list(dict.fromkeys(own + sorted(others)))

    def _no_domain_left(self, vm: Row) -> None:
        """Before a delete: make sure no `vmplane-NAME` domain is left on the hosts it may be on
        (`_hosts_to_ask`). A shut-off definition is removed (and must then be confirmed gone); a running
        one refuses the delete (409 naming the host). Its own or last host must answer; any other host of
        its cluster that is not recorded down must answer too: a host that can not be asked refuses the
        delete (409, "can not tell"), since unknown is not absent. Nothing in the record changes here."""
        domain = domain_name(vm.name)
        mine = {self.plane.capacity.hosts_by_id().get(i) for i in (vm.host_id, vm.last_host_id)} - {None}
        for host in self._hosts_to_ask(vm):
            driver = self.plane.drivers.get(host)
            if driver is None:
                continue
            if (
                host not in mine
                and host in self.plane.capacity.index
                and self.plane.capacity.index.host(host).state in UNREACHABLE_HOST_STATES
            ):
                continue  # not reachable and not where it ran: the monitor reports it when back
            try:
                info = driver.domain(domain)
                if info is not None and not info.active:  # a leftover definition: removed, then confirmed
                    driver.stop(domain, timeout_s=0)
                    info = driver.domain(domain)
            except DriverError as exc:
                raise Conflict(
                    f"vm {vm.name} can not be deleted now: vmplane can not tell whether {host} still "
                    f"has its domain {domain} ({exc}); nothing changed, retry when {host} answers",
                    field="host",
                ) from None
            if info is not None and info.active:
                raise Conflict(
                    f"vm {vm.name} can not be deleted: its domain {domain} is {info.state} on {host} "
                    f"although the VM is recorded {vm.state}; stop it there (or `vmplane vm sync "
                    f"{vm.name}`), then delete it",
                    field="host",
                )
            if info is not None:
                raise Conflict(
                    f"vm {vm.name} can not be deleted now: {host} still has its shut-off domain "
                    f"{domain} after removing it; nothing changed, retry",
                    field="host",
                )

    def run_stop(self, op_id: str) -> None:
        vm = self.plane.ops.begin_step(op_id, "stopping-domain")
        if vm is None:
            return
        with self.plane.db.transaction() as conn:
            force = bool((L.operation_row(conn, op_id).result or {}).get("force"))
        meta = self.plane.capacity.hosts[vm.host_name]
        timeout = (
            0
            if force
            else int(cast(int, self.plane.catalog.effective("vmplane.vm.shutdown.timeout", meta.zone, meta.cluster)))
        )
        failpoints.hit("stop.before-domain")
        how = self.plane.drivers[vm.host_name].stop(domain_name(vm.name), timeout_s=timeout)
        failpoints.hit("stop.after-domain")
        with self.plane.db.transaction() as conn:
            L.lock_project(conn, vm.project_id)
            freed = L.release_vm(conn, vm.id)
            L.set_operation(
                conn,
                op_id,
                state=OperationState.succeeded,
                step="done",
                progress=100,
                message=f"stopped on {vm.host_name}" + (f": {how}" if how else ""),
            )
        metrics.OPERATIONS.labels("stop", "succeeded").inc()
        self.plane.capacity.give_back(freed)

    def fail_start_stop(self, ctx: FailureContext) -> Failed:
        """The failure hook of a start or a stop (Operations.fail): the VM is settled from what its host says
        (asked before the transaction: `before_fail`), never put back unasked."""
        conn, op, vm, reason, presence = ctx.conn, ctx.op, ctx.vm, ctx.reason, ctx.before
        freed: list = []
        if vm is None:
            return Failed(freed=freed)  # no VM: nothing held, nothing to settle
        settling = (op.kind == "start" and vm.state == VmState.starting.value) or (
            op.kind == "stop" and vm.state == VmState.stopping.value
        )
        if ctx.host_down:
            Operations.held_unknown(conn, op, vm, reason)
        elif settling and presence == "unknown":
            # its host can not say whether the domain is there: kept charged and claimed, unknown
            L.set_vm(
                conn,
                vm.id,
                note=f"{op.kind} failed and {vm.host_name} can not tell whether the domain exists: {reason}",
                state=VmState.unknown,
            )
        elif settling and presence == "running":
            L.set_vm(
                conn,
                vm.id,
                note=f"{op.kind} failed, but the domain runs on {vm.host_name}: {reason}",
                state=VmState.running,
            )
        elif op.kind == "start" and vm.state == VmState.starting.value:
            L.lock_project(conn, vm.project_id)  # the host confirmed: no domain runs
            freed = L.release_vm(conn, vm.id, note=f"start failed: {reason}")
        elif settling and presence in ("gone", "defined"):
            L.lock_project(conn, vm.project_id)  # a stop that failed after the domain went
            freed = L.release_vm(
                conn, vm.id, note=f"stop reported an error, but the domain is not running on {vm.host_name}: {reason}"
            )
        elif op.kind == "stop" and vm.state == VmState.stopping.value:
            # the domain still runs; the stop can be retried
            L.set_vm(conn, vm.id, note=f"stop failed: {reason}", state=VmState.running)
        return Failed(freed=freed)

    def domain_presence(self, op_id: str, _op: object = None) -> str | None:
        """For a failed start or stop: whether the VM's domain is on its host, asked now. "gone" only when
        the host says it has no such domain; "running" (a QEMU exists), "defined" (not running), or
        "unknown" when the host can not be asked. None for other operations."""
        with self.plane.db.read() as s:
            conn = s.connection()
            op = L.operation_row(conn, op_id)
            if op.kind not in ("start", "stop") or op.vm_id is None:
                return None
            vm = L.vm_row(conn, op.vm_id)
        driver = self.plane.drivers.get(vm.host_name) if vm.host_name else None
        if driver is None:
            return None
        try:
            info = driver.domain(domain_name(vm.name))
        except Exception as exc:  # noqa: BLE001 - unknown is not absent
            log.warning("vm %s: can not tell whether its domain is on %s: %s", vm.name, vm.host_name, exc)
            return "unknown"
        if info is None:
            return "gone"
        return "running" if info.active else "defined"

    def exec_in_guest(self, name: str, command: str, timeout_s: float = 30.0) -> tuple[str, int]:
        """Run one shell line in a running VM's guest (through its guest agent, else its serial console);
        (output, exit code)."""
        if not command.strip():
            raise Invalid("command is empty", field="command")
        deadline = time.monotonic() + timeout_s
        while True:  # a VM that is starting is waited for, within the timeout
            with self.plane.db.read() as s:
                vm = L.vm_row(s.connection(), name=name)
            if vm.state != VmState.starting.value or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if vm.state == VmState.unknown.value:
            raise Conflict(
                f"vm {name} is unknown: its host {vm.host_name} does not answer; retry when it is back", field="state"
            )
        if vm.state not in (VmState.running.value, VmState.scaling.value):
            raise Conflict(f"vm {name} is {vm.state}; commands run in a running VM", field="state")
        driver = self.plane.drivers[vm.host_name]
        run = getattr(driver, "guest_run", None)
        if run is None:
            raise Conflict(
                f"vm {name} runs on {vm.host_name}, a {driver.kind} host without a guest to run "
                f"commands in; use a libvirt host",
                field="host",
            )
        try:
            return run(domain_name(name), command, max(deadline - time.monotonic(), 1.0))
        except DriverError as exc:
            raise Conflict(str(exc), field="command") from None
