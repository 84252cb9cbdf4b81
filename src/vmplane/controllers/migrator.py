"""Live migrations: admission, the queue under the limits, the copy, the guest check.

Given the Plane (store, drivers, capacity) and its peers by the orchestrator. A migration never
touches the quota ledger: the VM is charged once, before, during and after (docs/design/migration.md,
"Migration-neutral ledger"). Only host claims move: the target is claimed at admission (with overhead,
under overcommit), the source claim is released after the guest answers on the target. Every state
change is persisted before it is acted on, following migration.TRANSITIONS.
"""

from __future__ import annotations

import builtins
import logging
import threading
import time
import uuid
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import select

from vmplane.controllers import clustercpu
from vmplane.controllers.diskmoves import DiskMoves
from vmplane.controllers.hostmonitor import probe
from vmplane.core import failpoints
from vmplane.core import migration as rules
from vmplane.core.driver import DriverError, MigrationParams
from vmplane.core.errors import Conflict, Invalid, NotFound
from vmplane.core.failover import Load
from vmplane.core.guestexec import judged
from vmplane.core.migration import Action, MigrationState, Outcome
from vmplane.core.model import UNREACHABLE_HOST_STATES, ClaimKind, HostState, PlacementRequest, Size, VmState
from vmplane.core.names import domain_name
from vmplane.core.placement import Placement, choose, fit_on
from vmplane.core.scope import Scope, migration_scope_problem
from vmplane.plane import metrics
from vmplane.plane.reserves import placement_rules
from vmplane.store import events, ownership
from vmplane.store import ledger as L
from vmplane.store import snapshots as SNAP
from vmplane.store import storageledger as SL
from vmplane.store.listing import Page, by_prefix, order_by, run_page
from vmplane.store.schema import utcnow

if TYPE_CHECKING:
    from vmplane.controllers.networking import Networking
    from vmplane.controllers.seeds import Seeds
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.migrator")
RECOVERY_WAIT_S = 30.0  # start-up, for all migrations together: copies libvirtd carries on (then the controller)
SETTLE_WAIT_S = 30.0  # after a copy error: for libvirtd's own job to end (then the controller)
CONTROLLER_WAIT_S = 2.0  # the settle controller and cancel, per pass
HUNG_GRACE_S = 120.0  # a copy thread this far past its deadline is taken for hung
RESUME_FIRST_S, RESUME_EVERY_S = 5.0, 60.0  # post-copy resume: retried after 5 s, doubling up to every 60 s
GUEST_PROBE_S = 5.0  # before the copy: whether the guest answers on the source at all (still booting?)
# after the copy, a guest that answered on the source must answer on the target within the first; one that had
# not answered yet (still booting) is given the second, the boot timeout (cluster settings, these defaults)
GUEST_TIMEOUT_KEY, GUEST_BOOT_TIMEOUT_KEY = "vmplane.migration.guest.timeout", "vmplane.migration.guest.boot.timeout"
_ACTIVE = [s.value for s in rules.ACTIVE]


class _PoweredOff:
    """A fenced host, as a migration's settle asks it: no domain, no migration job."""

    def __init__(self, host: str):
        self.host = host

    def migration_active(self, name: str) -> bool:
        return False

    def domain(self, name: str):
        return None


class Migrator:
    def __init__(self, plane: Plane, disk_moves: DiskMoves, networking: Networking, seeds: Seeds):
        self.plane = plane
        self.disk_moves = disk_moves
        self.networking = networking
        self.seeds = seeds
        self._pump_lock = threading.Lock()
        self._state_lock = threading.Lock()  # guards the sets below (this process's view of its copies)
        self._cancelled: set[str] = set()  # cancels asked (a copy honours them at any step)
        self._live: set[str] = set()  # migrations whose copy thread runs in this process
        self._calling: set[str] = set()  # ... whose driver migrate() is called or about to be
        self._settling: set[str] = set()  # being settled now (one settler at a time)
        self._timed_out: set[str] = set()  # aborted at their deadline
        self._resume_at: dict[str, tuple[float, float]] = {}  # post-copy resume: (not before, next delay)

    # -- reads ---------------------------------------------------------------------------------
    def get(self, migration_id: str) -> dict:
        with self.plane.db.read() as s:
            row = s.connection().execute(select(L.MIGRATIONS).where(L.MIGRATIONS.c.id == migration_id)).first()
        if row is None:
            raise NotFound(f"migration {migration_id} does not exist", field="migration")
        return dict(row._mapping)

    def list(
        self, vm: str | None = None, host: str | None = None, active_only: bool = False, limit: int = 200
    ) -> list[dict]:
        m = L.MIGRATIONS.c
        stmt = select(L.MIGRATIONS).order_by(m.created_at.desc()).limit(limit)
        if vm:
            stmt = stmt.where(m.vm_name == vm)
        if host:
            stmt = stmt.where((m.source == host) | (m.target == host))
        if active_only:
            stmt = stmt.where(m.state.in_(_ACTIVE))
        with self.plane.db.read() as s:
            return [dict(r._mapping) for r in s.connection().execute(stmt)]

    def find(self, prefix: str, project_id: int | None = None) -> dict:
        """By its id or a unique prefix of it (4+ characters), within one project when `project_id` is given."""
        m = L.MIGRATIONS.c
        with self.plane.db.read() as s:
            scope = [] if project_id is None else [m.project_id == project_id]
            return self.get(by_prefix(s, m.id, prefix, "migration", scope))

    def page(
        self,
        page: Page,
        vm: str | None = None,
        host: str | None = None,
        state: str | None = None,
        active_only: bool = False,
        project_id: int | None = None,
    ) -> tuple[builtins.list[dict], int]:
        """Migrations filtered, sorted and paged in SQL (newest first by default), and their total."""
        m = L.MIGRATIONS.c
        conds = [m.vm_name == vm] if vm else []
        if host:
            conds.append((m.source == host) | (m.target == host))
        if state:
            conds.append(m.state == state)
        if active_only:
            conds.append(m.state.in_(_ACTIVE))
        if project_id is not None:
            conds.append(m.project_id == project_id)
        fields = {
            "created_at": m.created_at,
            "started_at": m.started_at,
            "finished_at": m.finished_at,
            "vm": m.vm_name,
            "source": m.source,
            "target": m.target,
            "state": m.state,
            "progress": m.progress,
        }
        with self.plane.db.read() as s:
            return run_page(
                s,
                select(L.MIGRATIONS),
                m.id,
                conds,
                order_by(page.sort, fields, "-created_at", m.id),
                page,
                scalars=False,
            )

    # -- planning ------------------------------------------------------------------------------
    def plan(self, vm, to: str | None, index=None) -> Placement:
        """Where `vm` would go: the host asked for (any cluster of the VM's zone), or placement's choice
        among the others of its host's cluster; only hosts its disks can follow it to. `index`: another
        capacity index than the shared one (a drain's dry run plans on its own copy)."""
        index = self.plane.capacity.index if index is None else index
        source = self.plane.capacity.hosts[vm.host_name]
        zone = vm.zone_name or source.zone  # a VM placed before zones mattered: its host's zone
        with self.plane.db.read() as s:
            reach = self.disk_moves.reach(s.connection(), vm.id)
            # its group (itself left out) and the failover reserve, its claim freed on the source
            rules = placement_rules(
                self.plane,
                s.connection(),
                Scope(zone, source.cluster if to is None else None),
                action=f"migrating {vm.name} to {{host}}",
                vm_id=vm.id,
                ha=vm.ha_policy == "restart",
                release=(vm.host_name, Load(vm.vcpus, vm.memory_mib + vm.overhead_mib)),
            )
        request = PlacementRequest(
            Size(vm.vcpus, vm.memory_mib),
            exclude_hosts=frozenset({vm.host_name}),
            exclude_reason="the VM already runs here",
            zone=zone,
            storage_hosts=reach,
            storage_reason="its disks can not follow it here (no shared pool, and no "
            "local pool at the same path with room for the copy)",
            **rules,
        )
        if to is None:
            return choose(index, replace(request, cluster=source.cluster))
        if to == vm.host_name:
            raise Invalid(f"vm {vm.name} already runs on {to}; choose another host", field="to")
        if to not in self.plane.capacity.index:
            raise NotFound(f"host {to!r} does not exist", field="to")
        problem = migration_scope_problem(vm.name, zone, to, self.plane.capacity.hosts[to].zone)
        if problem:
            raise Invalid(problem, field="to")
        return fit_on(index, request, to)

    def _check_migratable(self, vm) -> None:
        if vm.state == VmState.migrating.value:
            raise Conflict(
                f"vm {vm.name} is already migrating (see `vmplane vm migrate {vm.name} --cancel`)", field="state"
            )
        if vm.state == VmState.unknown.value:
            raise Conflict(
                f"vm {vm.name} is unknown: its host {vm.host_name} does not answer; retry when it is back",
                field="state",
            )
        if vm.state != VmState.running.value:
            raise Conflict(f"vm {vm.name} is {vm.state}; only a running VM can be live-migrated", field="state")

    # -- admission -----------------------------------------------------------------------------
    def migrate(
        self,
        vm_name: str,
        to: str | None = None,
        dry_run: bool = False,
        params: dict | None = None,
        reason: str = "requested",
        for_scale: bool = False,
    ) -> dict:
        """Admit a live migration: claim the target (refused, naming host and resource, if it has no
        room), queue it, and let the pump start it within the limits. The ledger is not touched.
        `for_scale`: the move of a live scale in progress; the VM stays `scaling` throughout, so no
        other operation can be admitted on it meanwhile."""
        with self.plane.capacity.lock:
            with self.plane.db.transaction() as conn:
                self.plane.admissions.serialise(conn)  # before any row, as every admission
                vm = L.vm_row(conn, name=vm_name, lock=True)
                if not for_scale:
                    self._check_migratable(vm)
                elif vm.state != VmState.scaling.value:
                    raise Conflict(f"vm {vm_name} is {vm.state}, not scaling", field="state")
                problem = SNAP.busy_problem(conn, vm.id, vm_name) or SNAP.migration_problem(
                    conn, vm.id, SL.vm_volumes(conn, vm.id)
                )
                if problem:
                    raise Conflict(f"vm {vm_name} can not live-migrate now: {problem}", field="state")
                placement = self.plan(vm, to)
                problem = clustercpu.migration_problem(conn, vm, placement.host)
                if problem:
                    raise Conflict(f"vm {vm_name} can not live-migrate to {placement.host}: {problem}", field="to")
                if dry_run:
                    return {
                        "vm": vm_name,
                        "source": vm.host_name,
                        "target": placement.host,
                        "dry_run": True,
                        "claim_memory_mib": placement.memory_mib,
                        "claim_vcpus": vm.vcpus,
                        "reason": f"{placement.host} has room for {vm.vcpus} vCPU(s) / "
                        f"{placement.memory_mib} MiB (with overhead)",
                    }
                migration_id = self._admit(conn, vm, placement, params, reason)
            self.plane.capacity.add(placement.host, vm.vcpus, placement.memory_mib)
        failpoints.hit("migrate.admitted")
        self.pump()
        return self.get(migration_id)

    def _admit(self, conn, vm, placement: Placement, params: dict | None, reason: str) -> str:
        target = self.plane.capacity.hosts[placement.host]
        cap_vcpus, cap_memory = self.plane.capacity.index.capacity_of(placement.host)
        if not L.take_on_host(conn, target.id, vm.vcpus, placement.memory_mib, cap_vcpus, cap_memory):
            raise Conflict(f"{placement.host} was claimed by someone else meanwhile; retry", field="to")
        migration_id = str(uuid.uuid4())
        L.record_claim(conn, target.id, vm.id, migration_id, ClaimKind.migration_target, vm.vcpus, placement.memory_mib)
        self.disk_moves.admit(conn, vm.id, placement.host)  # copies' space on the target's pools
        source = self.plane.capacity.hosts[vm.host_name]
        conn.execute(
            L.MIGRATIONS.insert().values(
                id=migration_id,
                vm_id=vm.id,
                vm_name=vm.name,
                project_id=vm.project_id,
                source_host_id=source.id,
                target_host_id=target.id,
                source=vm.host_name,
                target=placement.host,
                cluster=source.cluster,
                state=MigrationState.queued.value,
                reason=reason,
                waiting_for="",
                progress=0,
                params=params,
                created_at=utcnow(),
            )
        )
        L.migration_created(conn, migration_id, reason)
        if vm.state == VmState.running.value:
            L.set_vm(conn, vm.id, note=f"to {placement.host}", state=VmState.migrating)
        return migration_id

    # -- the queue -----------------------------------------------------------------------------
    def _limits(self, cluster: str, zone: str, project_limit: int | None) -> rules.Limits:
        eff = self.plane.catalog.effective
        return rules.Limits(
            int(cast(int, eff("vmplane.migration.max.per.cluster", zone, cluster))),
            int(cast(int, eff("vmplane.migration.max.outbound.per.host", zone, cluster))),
            int(cast(int, eff("vmplane.migration.max.inbound.per.host", zone, cluster))),
            project_limit,
        )

    def pump(self) -> None:
        """Start the queued migrations the limits allow now (oldest first); say why the others wait."""
        with self._pump_lock:
            m, p = L.MIGRATIONS.c, L.PROJECTS.c
            with self.plane.db.read() as s:
                rows = (
                    s.connection()
                    .execute(
                        select(m.id, m.state, m.cluster, m.source, m.target, p.name, p.max_concurrent_migrations)
                        .join(L.PROJECTS, p.id == m.project_id)
                        .where(m.state.in_(_ACTIVE))
                        .order_by(m.created_at)
                    )
                    .all()
                )
                failed = _failed_hosts(s.connection()) if rows else {}
            slots = {r.id: rules.MigrationSlot(r.id, r.cluster, r.source, r.target, r.name) for r in rows}
            project_limit = {r.name: r.max_concurrent_migrations for r in rows}
            zone_of = {meta.cluster: meta.zone for meta in self.plane.capacity.hosts.values()}

            def limits_of(slot):
                return self._limits(slot.cluster, zone_of.get(slot.cluster), project_limit[slot.project])

            copying = [slots[r.id] for r in rows if r.state in (s.value for s in rules.COPYING)]
            queued = [slots[r.id] for r in rows if r.state == MigrationState.queued.value]
            lost = {x.id: why for x in queued if (why := rules.host_lost(x.source, x.target, failed))}
            queued = [x for x in queued if x.id not in lost]
            to_start = rules.startable(queued, copying, limits_of)
            started = {x.id for x in to_start}
            with self.plane.db.transaction() as conn:
                state, _actions = rules.transition(MigrationState.queued, "slot-free")
                # only if still queued: a cancel may have ended it since the read above
                to_start = [slot for slot in to_start if L.start_queued_migration(conn, slot.id, state, utcnow())]
                running = copying + to_start
                for slot in queued:
                    if slot.id not in started:
                        why = rules.blocking_limit(slot, running, limits_of(slot)) or ""
                        L.set_migration(conn, slot.id, waiting_for=why)
        with self._state_lock:
            self._live.update(slot.id for slot in to_start)
        if to_start:
            failpoints.hit("migrate.copying")
        for slot in to_start:
            self.plane.executor.submit(self._run_guarded, slot.id)
        for migration_id, why in lost.items():  # never started: each ends, its target claim given back
            try:
                self._finish(
                    migration_id, lambda current: "host-lost" if current == MigrationState.queued else None, reason=why
                )
            except Exception:  # this one at the next pump; the others go on
                log.exception("migration %s: ending it (%s)", migration_id, why)

    # -- the copy ------------------------------------------------------------------------------
    def _run_guarded(self, migration_id: str) -> None:
        """The copy, in an executor thread, under the cause of the request that asked for the migration."""
        with self.plane.db.read() as s:
            conn = s.connection()
            vm, owner = conn.execute(
                select(L.MIGRATIONS.c.vm_name, L.MIGRATIONS.c.owner).where(L.MIGRATIONS.c.id == migration_id)
            ).one()
            cause = events.cause_of(conn, "migration", migration_id, vm=vm)
        if owner is not None and owner != self.plane.membership.epoch:
            log.warning(
                "migration %s is owned by controller %s now, not by this one: not copied here", migration_id, owner
            )
            return
        # its writes land only while the process that started it holds its lease (ownership.py)
        with events.acting_as(cause or events.current_cause()), ownership.owned(owner):
            self._run_copy(migration_id)

    def _run_copy(self, migration_id: str) -> None:
        try:
            self._run(migration_id)
        except Exception as exc:  # whatever broke, where the VM is is asked of both hosts
            log.exception("migration %s", migration_id)
            self._settle_quietly(migration_id, f"internal error: {exc}")
        finally:
            with self._state_lock:
                self._live.discard(migration_id)
            self.pump()

    def _timeout_s(self, row: dict) -> int:
        zone = self.plane.capacity.hosts[row["source"]].zone if row["source"] in self.plane.capacity.hosts else None
        return int(cast(int, self.plane.catalog.effective("vmplane.migration.timeout", zone, row["cluster"])))

    def _params(self, row: dict, source_driver) -> MigrationParams:
        accel = getattr(source_driver, "accel", "qemu")
        asked = row.get("params") or {}
        base = MigrationParams() if asked.get("policy") == "hypervisor-default" else rules.policy(accel)
        overrides = {k: v for k, v in asked.items() if k in MigrationParams.__dataclass_fields__}
        return MigrationParams(**{**asdict(base), "timeout_s": self._timeout_s(row), **overrides})

    def _run(self, migration_id: str) -> None:
        row = self.get(migration_id)
        if row["state"] != MigrationState.copying.value:
            return  # ended meanwhile (a cancel, a settle)
        source, target = self.plane.drivers[row["source"]], self.plane.drivers[row["target"]]
        target.migration_address = self.plane.capacity.migration_address(row["target"])
        domain = domain_name(row["vm_name"])
        params = self._params(row, source)
        if self._ended_for_a_lost_host(migration_id, row):  # nothing prepared on a host that failed
            return
        try:  # the target holds the VM's networks and its NICs' filter before the copy (the row names it)
            self.networking.ensure_for(row["target"], row["vm_id"])
            self.seeds.disk_for(row["vm_id"], row["target"])  # its seed at the same path there (made, not copied)
        except DriverError as exc:
            why = f"the networks or the seed could not be set up on {row['target']}: {exc}"
            self._finish(migration_id, "copy-failed", reason=why)
            return
        try:
            params = self.disk_moves.prepare(row["vm_id"], row["target"], params)
        except DriverError as exc:  # no copy asked: the VM stays; the target's overlays are cleaned up
            self._finish(
                migration_id, "copy-failed", reason=f"the disks could not be prepared on {row['target']}: {exc}"
            )
            return
        policy_name = (row.get("params") or {}).get("policy") or f"vmplane ({getattr(source, 'accel', 'sim')})"
        with self.plane.db.transaction() as conn:
            L.set_migration(conn, migration_id, params={**asdict(params), "policy": policy_name})
        if self._ended_for_a_lost_host(migration_id, row):  # read again right before the copy
            return
        before = self._guest_before(migration_id, source, domain)
        self._cancel_requested(migration_id)  # a cancel another process took meanwhile
        if not self._enter_call(migration_id):  # a cancel came first: the copy is never asked for
            self._finish(migration_id, "copy-cancelled", reason="cancelled before the copy started")
            return
        timer = self._watchdog(migration_id, source, domain, params.timeout_s)
        try:
            stats = source.migrate(domain, target, params, self._progress(migration_id, source, domain))
        except Exception as exc:  # noqa: BLE001 - says nothing of where the domain is: both hosts are asked
            self._leave_call(migration_id, timer)
            self.settle(migration_id, why=str(exc), wait_s=SETTLE_WAIT_S)
            return
        self._leave_call(migration_id, timer)
        failpoints.hit("migrate.after-copy")
        stats_dict = {
            "total_ms": stats.total_ms,
            "downtime_ms": stats.downtime_ms,
            "bytes": stats.bytes_sent,
            **stats.extra,
            "guest_before": before,
        }
        self._finish(migration_id, "copied", stats=stats_dict)
        self._check_and_finish(migration_id, target, domain, stats_dict)

    def _guest_before(self, migration_id: str, source, domain: str) -> str:
        """Whether the guest answers on the source before the move ("answered", "not answering", or
        "not checked"), kept in the migration's stats: the check on the target compares with it (a guest
        migrated right after its start may still be booting: it is given the boot timeout there)."""
        answered, check = self._ask_guest(source, domain, GUEST_PROBE_S)
        before = "not checked" if answered is None else "answered" if answered else "not answering"
        if answered is False:
            log.info(
                "migration %s: the guest of %s does not answer on the source yet (%s)", migration_id, domain, check
            )
        with self.plane.db.transaction() as conn:
            L.set_migration(conn, migration_id, stats={"guest_before": before})
        return before

    def _cancel_requested(self, migration_id: str) -> bool:
        """Whether a cancel was persisted (by any process); noted in this process's cancels."""
        m = L.MIGRATIONS.c
        with self.plane.db.read() as s:
            asked = bool(s.connection().execute(select(m.cancel_requested).where(m.id == migration_id)).scalar())
        if asked:
            with self._state_lock:
                self._cancelled.add(migration_id)
        return asked

    def _ended_for_a_lost_host(self, migration_id: str, row: dict) -> bool:
        """True (the migration ended `failed`) if its source or target is recorded down, fencing or fenced: a
        host that failed since the pump started it (and may have been fenced and powered on again, empty,
        while its recovery runs) is not copied into or out of."""
        with self.plane.db.read() as s:
            lost = rules.host_lost(row["source"], row["target"], _failed_hosts(s.connection()))
        if lost:
            self._finish(migration_id, "copy-failed", reason=lost)
        return lost is not None

    def _enter_call(self, migration_id: str) -> bool:
        """Right before the driver call: False if a cancel came first; else from now on a cancel aborts
        through the driver (which keeps it until libvirt's job exists)."""
        with self._state_lock:
            if migration_id in self._cancelled:
                return False
            self._calling.add(migration_id)
            return True

    def _leave_call(self, migration_id: str, timer) -> None:
        if timer is not None:
            timer.cancel()
        with self._state_lock:
            self._calling.discard(migration_id)

    def _watchdog(self, migration_id: str, source, domain: str, timeout_s: float | None):
        """The deadline, for a driver that does not keep it itself (the sim): abort the copy then."""
        if not timeout_s or getattr(source, "handles_timeout", False):
            return None
        timer = threading.Timer(timeout_s, self._deadline_reached, (migration_id, source, domain, timeout_s))
        timer.daemon = True
        timer.start()
        return timer

    def _deadline_reached(self, migration_id: str, source, domain: str, timeout_s: float) -> None:
        with self._state_lock:
            if migration_id not in self._calling:
                return
            self._timed_out.add(migration_id)
        log.warning("migration %s: past its %g s deadline; aborting the copy", migration_id, timeout_s)
        try:
            source.abort_migration(domain)
        except DriverError as exc:
            log.error("migration %s: abort at the deadline failed: %s", migration_id, exc)

    def _progress(self, migration_id: str, source, domain: str):
        last, asked = [0.0], [0.0]

        def progress(percent: int, message: str) -> None:
            if percent < 100:
                failpoints.hit("migrate.mid-copy")
            if migration_id in self._cancelled and time.monotonic() - asked[0] >= 2.0:
                asked[0] = time.monotonic()  # a cancel is asked again while the copy runs
                self._abort_source(migration_id, source, domain)
            if time.monotonic() - last[0] >= 0.5 or percent >= 100:
                last[0] = time.monotonic()
                if self._write_progress(migration_id, percent, message) and migration_id not in self._cancelled:
                    with self._state_lock:  # a cancel another process took (N6): aborted from here
                        self._cancelled.add(migration_id)
                    asked[0] = time.monotonic()
                    self._abort_source(migration_id, source, domain)

        return progress

    def _write_progress(self, migration_id: str, percent: int, message: str) -> bool:
        """Write a copy's progress; True if a cancel was persisted meanwhile, by any process (the copying
        process polls it with each write: N6)."""
        m = L.MIGRATIONS.c
        with self.plane.db.transaction() as conn:
            cancel = bool(conn.execute(select(m.cancel_requested).where(m.id == migration_id)).scalar())
            L.set_migration(
                conn,
                migration_id,
                progress=percent,
                waiting_for="cancel asked: the copy is being aborted" if cancel else message,
            )
        return cancel

    def _abort_source(self, migration_id: str, source, domain: str) -> bool:
        try:
            source.abort_migration(domain)
            return True
        except DriverError as exc:  # not swallowed: said where the operator looks, and asked again
            log.error("migration %s: abort failed: %s", migration_id, exc)
            self._note(migration_id, f"cancel asked; the abort failed ({exc}); asked again")
            return False

    def _check_and_finish(self, migration_id: str, target, domain: str, stats: dict, reason_prefix: str = "") -> None:
        row = self.get(migration_id)
        before = stats.get("guest_before") or (row.get("stats") or {}).get("guest_before")
        healthy, check = self._check_guest(target, domain, before, self._guest_timeouts(row))
        failpoints.hit("migrate.checked")
        row = self.get(migration_id)
        self._finish(
            migration_id,
            "guest-healthy" if healthy else "guest-unhealthy",
            stats={**stats, "guest_before": before, "guest_check": check},
            reason=""
            if healthy
            else f"{reason_prefix}moved to {row['target']}, where it runs, but the guest is not healthy there: {check}",
        )

    def _guest_timeouts(self, row: dict) -> tuple[float, float]:
        """(the guest check's timeout, its boot timeout) in the migration's cluster."""
        zone = self.plane.capacity.hosts[row["source"]].zone if row["source"] in self.plane.capacity.hosts else None
        eff = self.plane.catalog.effective
        return (
            float(cast(float, eff(GUEST_TIMEOUT_KEY, zone, row["cluster"]))),
            float(cast(float, eff(GUEST_BOOT_TIMEOUT_KEY, zone, row["cluster"]))),
        )

    def _check_guest(self, target, domain: str, before: str | None, timeouts: tuple[float, float]) -> tuple[bool, str]:
        """Never call a migration good unchecked: the guest must answer on the target, without oopses,
        compared with its state before the move: a guest that had not answered on the source yet (still
        booting) is waited for up to the boot timeout, not failed after the check's own timeout."""
        booting = before == "not answering"
        healthy, check = self._ask_guest(target, domain, timeouts[1] if booting else timeouts[0])
        if healthy is None:
            return True, check
        if booting:
            check += "; it had not answered on the source before the move (still booting)"
        return healthy, check

    @staticmethod
    def _ask_guest(driver, domain: str, timeout_s: float) -> tuple[bool | None, str]:
        """The guest's health within `timeout_s` (the driver's `guest_health`: through its guest agent, or,
        without one, its domain runs and its vCPUs advance; never a shell on the serial console): (True/
        False, in words), or (None, why) for a host without a guest to ask."""
        health: Any = getattr(driver, "guest_health", None)  # optional capability of a driver (duck-typed)
        if health is None:
            return None, "not checked: this host has no guest to ask"
        t0 = time.monotonic()
        try:
            out = health(domain, timeout_s)
        except Exception as exc:  # noqa: BLE001 - any error is an answer: not healthy (the domain did move)
            return False, f"no answer within {timeout_s:g} s ({exc})"
        return judged(out, time.monotonic() - t0)

    # -- settling by asking both hosts ---------------------------------------------------------
    def orphaned(self, mig: dict) -> bool:
        """An active migration no copy thread of this process carries (after a restart), or whose
        thread is far past its deadline (a hung driver): the settle controller and cancel settle it."""
        if MigrationState(mig["state"]) not in rules.SETTLING:
            return False
        owner, controllers = mig.get("owner"), self.plane.membership
        if owner is not None and owner != controllers.epoch:
            return not controllers.is_live(owner)  # another live process copies it; a lapsed one does not
        with self._state_lock:
            if mig["id"] not in self._live:
                return True
        return self._elapsed_s(mig) > self._timeout_s(mig) + HUNG_GRACE_S

    def take_orphan(self, mig: dict) -> bool:
        """An orphaned migration (orphaned()), now owned by this process, which may settle it. A copy
        taken from another process whose lease lapsed is aborted on its source first (review N7): that
        process may still be inside libvirt's call, and its copy must not land after the settle."""
        if not (self.orphaned(mig) and self.plane.membership.claim_migration(mig["id"])):
            return False
        owner = mig.get("owner")
        if mig["state"] == MigrationState.copying.value and owner is not None and owner != self.plane.membership.epoch:
            self._abort_lapsed_copy(mig)
        return True

    def _abort_lapsed_copy(self, mig: dict) -> None:
        """Ask the source's hypervisor to abort a copy it still runs (the job is libvirtd's, not the lapsed
        process's); a source that is fenced, does not answer or runs no copy is left to the settle."""
        source = self._asked(mig["source"])
        if isinstance(source, _PoweredOff):
            return
        domain = domain_name(mig["vm_name"])
        try:
            running = source.migration_active(domain)
        except DriverError as exc:
            log.warning("migration %s: taken over; its source does not answer (%s)", mig["id"], exc)
            return
        if running:
            log.warning(
                "migration %s: taken over from lapsed controller %s while its copy runs; aborting it",
                mig["id"],
                mig.get("owner"),
            )
            if rules.past_deadline(self._elapsed_s(mig), self._timeout_s(mig)):
                with self._state_lock:  # its reason says so, as an abort at the deadline would
                    self._timed_out.add(mig["id"])
            self._abort_source(mig["id"], source, domain)

    @staticmethod
    def _elapsed_s(mig: dict) -> float:
        started = mig.get("started_at") or mig.get("created_at")
        return (utcnow() - started).total_seconds() if started else 0.0

    def settle(self, migration_id: str, why: str = "", wait_s: float = CONTROLLER_WAIT_S) -> str:
        """Settle a copying, checking or post-copy-failed migration by asking both hosts
        (docs/design/migration.md, "How a live migration ends"): wait (at most `wait_s`) while libvirt
        still copies, read the domain on both, then move the claims (it moved), release the target claim
        (it stayed), keep both (post-copy failed: resume is tried) or change nothing (a host does not
        answer, or both hold it: asked again later).
        Returns the migration's state after."""
        with self._state_lock:
            if migration_id in self._settling:
                return self.get(migration_id)["state"]
            self._settling.add(migration_id)
        try:
            return self._settle(migration_id, why, wait_s)
        finally:
            with self._state_lock:
                self._settling.discard(migration_id)

    def _settle_quietly(self, migration_id: str, why: str) -> None:
        try:
            self.settle(migration_id, why=why, wait_s=SETTLE_WAIT_S)
        except Exception:  # left active: the settle controller asks again
            log.exception("migration %s: settling after %s", migration_id, why)

    def _settle(self, migration_id: str, why: str, wait_s: float) -> str:
        row = self.get(migration_id)
        if MigrationState(row["state"]) not in rules.SETTLING:
            return row["state"]
        source, target = self._asked(row["source"]), self._asked(row["target"])
        domain = domain_name(row["vm_name"])
        try:
            if not self._copy_ended(row, source, domain, wait_s):
                self._note(migration_id, f"libvirt on {row['source']} still copies; settled once it ends")
                return row["state"]
            on_source, on_target = source.domain(domain), target.domain(domain)
        except DriverError as exc:  # unknown is not absent: nothing moves
            self._note(migration_id, f"{exc.host} does not answer ({exc}); both hosts are asked again")
            return row["state"]
        source_off = isinstance(source, _PoweredOff)
        outcome = rules.settle_outcome(on_source, on_target, source_off=source_off)
        if outcome == Outcome.unclear:
            if rules.incoming(on_target):
                self._note(
                    migration_id,
                    f"{row['source']} answers without the domain and {row['target']} holds only "
                    f"an incoming domain (paused, never resumed); asked again",
                )
            else:
                self._note(migration_id, f"both {row['source']} and {row['target']} hold the domain; asked again")
            return row["state"]
        if rules.incoming(on_target):  # a shell that never ran the guest (N1): removed, as libvirt would
            self._drop_incoming(row, target, domain, source_off)
            on_target = None
        return self._settle_to(row, outcome, why, on_source, on_target)

    def _drop_incoming(self, row: dict, target, domain: str, source_off: bool) -> None:
        """Destroy the target's incoming domain of a copy that ended before its switch-over. Best effort:
        libvirt destroys it too once it notices the source's job ended (or, for a source that lost its
        power, after its keepalive)."""
        log.warning(
            "migration %s: %s holds only an incoming domain of %s (paused, never resumed)%s; destroying it",
            row["id"],
            row["target"],
            row["vm_name"],
            f": {row['source']} is off" if source_off else "",
        )
        try:  # read again right before: only a domain that is still an incoming one is destroyed
            if rules.incoming(target.domain(domain)):
                target.stop(domain, timeout_s=0)
        except DriverError as exc:
            log.warning("migration %s: destroying the incoming domain on %s: %s", row["id"], row["target"], exc)

    def _asked(self, host: str):
        """Who answers for `host` when a migration is settled: its driver, or, for a fenced host that does
        not answer (confirmed off by its agent or an operator), the certainty that it runs and copies
        nothing. A fenced host powered on again is asked, as any other."""
        driver = self.plane.drivers[host]
        fenced = host in self.plane.capacity.index and self.plane.capacity.index.host(host).state == HostState.fenced
        if fenced and probe(driver) is not None:  # (one powered on again is asked what it runs now)
            return _PoweredOff(host)
        return driver

    def _copy_ended(self, row: dict, source, domain: str, wait_s: float) -> bool:
        """Wait while the source's libvirtd still migrates the domain (a p2p job goes on without us);
        past the deadline, abort it. False if it still runs after `wait_s`."""
        end = time.monotonic() + wait_s
        while source.migration_active(domain):
            info = source.domain(domain)
            if info is not None and info.reason == "postcopy-failed":
                return True  # libvirt keeps the failed job for a resume: nothing ends by waiting
            self._abort_past_deadline(row, source, domain)
            if time.monotonic() >= end or self.plane.closing.is_set():
                return False
            time.sleep(0.2)
        return True

    def _abort_past_deadline(self, row: dict, source, domain: str) -> None:
        timeout = self._timeout_s(row)
        with self._state_lock:
            if row["id"] in self._timed_out or not rules.past_deadline(self._elapsed_s(row), timeout):
                return
            self._timed_out.add(row["id"])
        log.warning("migration %s: past its %d s deadline; aborting the copy", row["id"], timeout)
        self._abort_source(row["id"], source, domain)

    def _why(self, migration_id: str, why: str) -> str:
        if migration_id in self._timed_out:
            return f"timed out (vmplane.migration.timeout): {why}" if why else "timed out (vmplane.migration.timeout)"
        return why

    def _settle_to(self, row: dict, outcome: Outcome, why: str, on_source, on_target) -> str:
        mid, source, target = row["id"], row["source"], row["target"]
        why = self._why(mid, why)
        reason = {
            Outcome.stayed: f"{why}; asked both hosts: the VM runs on {source}, {target} has none",
            Outcome.gone: f"{why}; asked both hosts: the domain is on neither {source} nor {target}",
            Outcome.postcopy_failed: f"post-copy failed ({why}): the guest is paused on "
            f"{_paused_on(row, on_source, on_target)}; both hosts stay claimed",
            Outcome.moved: "",
        }[outcome]
        cancelled = mid in self._cancelled or bool(row.get("cancel_requested"))
        if outcome == Outcome.stayed and cancelled:
            reason = "cancelled" + (f" ({why})" if why and why != "cancelled" else "")
        if outcome == Outcome.gone and on_source is not None:  # a shut-off definition: removed as a stop
            self._drop_definition(row, source)  # does (the VM is recorded stopped next)
        state = self._finish(mid, lambda current: rules.settle_event(current, outcome, cancelled), reason=reason)
        if outcome == Outcome.postcopy_failed:
            return self._try_resume(row, on_source, on_target)
        if outcome == Outcome.moved and state == MigrationState.checking:
            stats = {**(row.get("stats") or {}), "settled": why or "asked both hosts"}
            self._check_and_finish(
                mid,
                self.plane.drivers[target],
                domain_name(row["vm_name"]),
                stats,
                reason_prefix=f"{why}; " if why else "",
            )
        return self.get(mid)["state"]

    def _try_resume(self, row: dict, on_source, on_target) -> str:
        """libvirt's post-copy recovery (VIR_MIGRATE_POSTCOPY_RESUME, same parameters), at most every
        RESUME_EVERY_S (the first retries sooner); it needs both QEMUs. Settled as moved when it succeeds."""
        mid = row["id"]
        source, target = self.plane.drivers[row["source"]], self.plane.drivers[row["target"]]
        resume = getattr(source, "resume_postcopy", None)
        if resume is None:
            self._note(mid, f"{row['source']} can not resume a post-copy; an operator decides (README)")
            return MigrationState.postcopy_failed.value
        if not (on_source is not None and on_source.active and on_target is not None and on_target.active):
            self._note(
                mid,
                f"can not be resumed: the domain is gone from "
                f"{row['target'] if on_source is not None and on_source.active else row['source']}; "
                f"an operator decides (README)",
            )
            return MigrationState.postcopy_failed.value
        with self._state_lock:
            not_before, delay = self._resume_at.get(mid, (0.0, RESUME_FIRST_S))
            if time.monotonic() < not_before:
                return MigrationState.postcopy_failed.value
            self._resume_at[mid] = (time.monotonic() + delay, min(delay * 2, RESUME_EVERY_S))
        domain = domain_name(row["vm_name"])
        try:
            resume(domain, target, self._params(self.get(mid), source))
            on_source, on_target = source.domain(domain), target.domain(domain)
        except DriverError as exc:
            self._note(mid, f"resume failed ({exc}); tried again in {self._resume_at[mid][0] - time.monotonic():.0f} s")
            return MigrationState.postcopy_failed.value
        outcome = rules.settle_outcome(on_source, on_target)
        if outcome != Outcome.moved:
            self._note(mid, f"resumed, but the hosts say {outcome.value}; asked again")
            return MigrationState.postcopy_failed.value
        log.warning("migration %s: post-copy resumed; %s runs on %s", mid, row["vm_name"], row["target"])
        return self._settle_to(self.get(mid), Outcome.moved, "post-copy resumed", on_source, on_target)

    def _note(self, migration_id: str, text: str) -> None:
        """What an active migration waits for, shown in `migration show`/`list`."""
        with self.plane.db.transaction() as conn:
            m = L.MIGRATIONS.c
            conn.execute(
                L.MIGRATIONS.update().where(m.id == migration_id, m.state.in_(_ACTIVE)).values(waiting_for=text)
            )
        log.info("migration %s: %s", migration_id, text)

    def _finish(self, migration_id: str, event, reason: str = "", stats: dict | None = None) -> MigrationState:
        """Apply an event to a migration as the store has it now: persist the state, then move or
        release the claims; a cancel of a copy in progress aborts it (the copy's own end follows).
        `event` may be a function of the state found under the lock, returning the event or None
        (no change)."""
        freed: list = []
        with self.plane.capacity.lock:
            with self.plane.db.transaction() as conn:
                row = conn.execute(
                    select(L.MIGRATIONS).where(L.MIGRATIONS.c.id == migration_id).with_for_update()
                ).first()
                assert row is not None  # a migration's row is never deleted
                current = MigrationState(row.state)
                name = event(current) if callable(event) else event
                if name is None:
                    return current
                state, actions = rules.transition(current, name)
                if Action.abort_copy in actions:  # whichever process copies it sees this and aborts (N6)
                    L.set_migration(
                        conn, migration_id, cancel_requested=True, waiting_for="cancel asked: the copy is being aborted"
                    )
                else:
                    freed = self._apply(conn, row, state, actions, reason, stats, gone=name == "gone")
            self.plane.capacity.give_back(freed)
        if Action.abort_copy in actions:
            self._abort_live(row)
        elif state not in rules.ACTIVE:
            self._ended(row, state, actions, reason, stats)
        return state

    def _abort_live(self, row) -> None:
        with self._state_lock:
            self._cancelled.add(row.id)
            calling = row.id in self._calling
        if calling:  # else the copy thread sees the cancel before it calls the driver
            self._abort_source(row.id, self.plane.drivers[row.source], domain_name(row.vm_name))

    def _ended(self, row, state: MigrationState, actions, reason: str, stats: dict | None = None) -> None:
        with self._state_lock:
            self._cancelled.discard(row.id)
            self._timed_out.discard(row.id)
            self._resume_at.pop(row.id, None)
        metrics.MIGRATIONS.labels(state.value).inc()
        _observe(row, state, stats if stats is not None else row.stats)
        if state == MigrationState.succeeded or Action.release_target in actions:
            self.disk_moves.cleanup(row.vm_id)  # the copy that is not the VM's (kept after an unhealthy check)
        if state == MigrationState.failed:
            log.error("migration %s of %s failed: %s", row.id, row.vm_name, reason)
        if Action.move_claims in actions:
            log.info("migration %s: %s now runs on %s", row.id, row.vm_name, row.target)

    @staticmethod
    def _apply(
        conn, row, state: MigrationState, actions, reason: str, stats: dict | None, gone: bool = False
    ) -> builtins.list:
        if state in rules.ACTIVE:
            Migrator._apply_active(conn, row, state, reason, stats)
            return []
        fields = dict(state=state, finished_at=utcnow(), waiting_for="")
        if reason:
            fields["reason"] = reason
        if stats is not None:
            fields["stats"] = stats
        L.set_migration(conn, row.id, **fields)
        # a migrating VM runs again; a scaling one stays scaling: its scale is not over
        # its VM locked before the claims and the copied volumes (DiskMoves.swap): a VM's row, then its volumes
        vm = L.vm_row(conn, row.vm_id, lock=True)
        vm_state = {"state": VmState.running} if vm.state == VmState.migrating.value else {}
        freed: list = []
        if Action.release_target in actions:
            freed = L.release_claim(conn, row.vm_id, row.id)
            note = f"migration {state.value}" + (f": {reason}" if reason else "")
            if gone and vm_state:  # both hosts were just asked: it runs nowhere, so it is not recorded running
                freed += Migrator._settle_gone(conn, row, note)
            else:
                L.set_vm(conn, row.vm_id, note=note, **vm_state)
        if Action.move_claims in actions:
            freed = L.release_claim(conn, row.vm_id, None, kind=ClaimKind.running)
            L.promote_claim(conn, row.vm_id, row.id)
            DiskMoves.swap(conn, row.vm_id)  # its disks are the target's copies now
            L.set_vm(conn, row.vm_id, host_id=row.target_host_id, **vm_state)
            # a VM pinned to a cluster follows an explicit move to another cluster of its zone
            v, h = L.VMS.c, L.HOSTS.c
            conn.execute(
                L.VMS.update()
                .where(v.id == row.vm_id, v.cluster_id.is_not(None))
                .values(cluster_id=select(h.cluster_id).where(h.id == row.target_host_id).scalar_subquery())
            )
        return freed

    @staticmethod
    def _settle_gone(conn, row, note: str) -> builtins.list:
        """A migrating VM whose domain neither host holds (asked just now): on a source that answered, it
        is stopped, its charge and claims given back (what the sync would record, without a window in
        which the record says running); on a fenced source (known off, or asked if it answers again),
        unknown there, for its recovery (an HA VM is restarted elsewhere, another one stopped). A scaling
        VM is left to its scale, which settles it."""
        fenced = conn.execute(select(L.HOSTS.c.state).where(L.HOSTS.c.id == row.source_host_id)).scalar()
        if fenced == HostState.fenced.value:
            L.set_vm(
                conn, row.vm_id, note=f"{note}; its host {row.source} is fenced: it runs nowhere", state=VmState.unknown
            )
            return []
        L.lock_project(conn, row.project_id)
        return L.release_vm(conn, row.vm_id, note=f"{note}: charge and claim given back")

    def _drop_definition(self, row: dict, source: str) -> None:
        """A shut-off definition of a VM whose migration found it on neither host (not on a fenced source
        that does not answer: nothing is asked of it). Best effort: a definition left behind runs nothing."""
        driver = self._asked(source)
        if isinstance(driver, _PoweredOff):
            return
        try:  # never a stop: the outcome was read earlier, and a start may run the domain again since
            driver.undefine_if_shut_off(domain_name(row["vm_name"]))
        except DriverError as exc:
            log.warning("migration %s: removing the shut-off definition on %s: %s", row["id"], source, exc)

    @staticmethod
    def _apply_active(conn, row, state: MigrationState, reason: str, stats: dict | None) -> None:
        """A step that does not end the migration: claims stay as they are."""
        fields: dict = {"state": state}
        if stats is not None:
            fields["stats"] = stats
        if state == MigrationState.checking:
            fields.update(progress=100, waiting_for="checking the guest on the target")
        if state == MigrationState.postcopy_failed:
            fields.update(reason=reason, waiting_for="resuming the post-copy migration")
            # the VM stays `migrating` (or `scaling`): owned by this migration, not settled by the loops;
            # its state does not change, so its event is written here
            events.record(
                conn,
                "vm",
                row.vm_name,
                vm=row.vm_name,
                project_id=row.project_id,
                message=f"post-copy migration {row.id[:8]} to {row.target} failed: {reason}; vmplane "
                f"retries resuming it (`vmplane migration show {row.id[:8]}`)",
            )
        L.set_migration(conn, row.id, **fields)

    def cancel(self, vm_name: str) -> dict:
        """Cancel a migration: a queued one ends here; a copy is aborted (kept until libvirt's job
        exists); a copy with no live thread (after a restart, a hung driver) is aborted and settled by
        asking both hosts. One that switched over can not be cancelled."""
        active = self.list(vm=vm_name, active_only=True)
        if not active:
            raise Conflict(f"vm {vm_name} has no migration to cancel", field="vm")
        mig = active[0]
        if mig["state"] == MigrationState.postcopy_failed.value:
            raise Conflict(
                f"the migration of {vm_name} switched over to {mig['target']} and its post-copy failed: "
                f"the guest can only go on there; vmplane retries resuming it (see `vmplane migration "
                f'show {mig["id"][:8]}` and the README, "post-copy failed")',
                field="state",
            )
        if mig["state"] not in (MigrationState.queued.value, MigrationState.copying.value):
            raise Conflict(f"the migration of {vm_name} has switched over; it can not be cancelled", field="state")
        if mig["state"] == MigrationState.copying.value and self.orphaned(mig):
            return self._cancel_orphan(mig)
        # the transition is taken on the state found under the lock: queued ends here, copying is aborted
        self._finish(mig["id"], "cancel", reason="cancelled")
        self.pump()
        return self.get(mig["id"])

    def _cancel_orphan(self, mig: dict) -> dict:
        with self._state_lock:
            self._cancelled.add(mig["id"])
        with self.plane.db.transaction() as conn:  # kept for a settle that can not decide now (any process's)
            L.set_migration(conn, mig["id"], cancel_requested=True)
        source, domain = self.plane.drivers[mig["source"]], domain_name(mig["vm_name"])
        try:
            running = source.migration_active(domain)
        except DriverError:
            running = True  # unknown: asked to abort anyway (its error is said)
        if running:  # only a job that exists: an abort asked of no copy is not kept
            self._abort_source(mig["id"], source, domain)
        self.settle(mig["id"], why="cancelled", wait_s=CONTROLLER_WAIT_S)
        self.pump()
        return self.get(mig["id"])

    def recover(self) -> None:
        """After a restart: each migration that was copying, checking or post-copy-failed is settled by
        asking both hosts, waiting only briefly for a copy libvirtd still carries on; what can not be
        decided now (a host that does not answer, a copy still running) is left to the settle
        controller (migrationsettle), which asks again. Queued ones wait for the pump."""
        deadline = time.monotonic() + RECOVERY_WAIT_S  # for all of them: never 600 s per migration
        for mig in self.list(active_only=True):
            if mig["state"] == MigrationState.queued.value or not self.take_orphan(mig):
                continue  # another live control-plane process carries it
            try:
                self.settle(
                    mig["id"],
                    why="interrupted by a control-plane restart",
                    wait_s=max(0.5, deadline - time.monotonic()),
                )
            except Exception:  # this one is retried by the controller; the others go on
                log.exception("migration %s: settling at start-up", mig["id"])


def _failed_hosts(conn) -> dict[str, str]:
    """The hosts the store has as down, fencing or fenced: name -> state."""
    h = L.HOSTS.c
    return dict(
        conn.execute(select(h.name, h.state).where(h.state.in_([st.value for st in UNREACHABLE_HOST_STATES]))).all()
    )


def _observe(row, state: MigrationState, stats: dict | None) -> None:
    """Duration (copy start to end), and downtime and bytes where the copy reported them (its stats)."""
    if row.started_at is not None:
        metrics.MIGRATION_SECONDS.labels(state.value).observe(max((utcnow() - row.started_at).total_seconds(), 0.0))
    stats = stats or {}
    if isinstance(stats.get("downtime_ms"), (int, float)):
        metrics.MIGRATION_DOWNTIME_SECONDS.observe(stats["downtime_ms"] / 1000)
    if isinstance(stats.get("bytes"), (int, float)):
        metrics.MIGRATION_BYTES.observe(stats["bytes"])


def _paused_on(row: dict, on_source, on_target) -> str:
    """Where a failed post-copy left the guest, in words."""
    where = [
        f"{host} ({info.state}, {info.reason})"
        for host, info in ((row["source"], on_source), (row["target"], on_target))
        if info is not None and info.active
    ]
    return " and ".join(where) or "neither host"
