"""Volume moves and cold migrations (issue 32): `volume move VOL --pool P` and `vm migrate` of a stopped VM.

A move is recorded in steps around the hosts, as every storage change is:
1. admission, one transaction: the rules (core/volumemoves.py) pick the way (a live block copy while its VM
   runs, a copy by a host that sees both pools, a copy between two hosts' pools for a cold migration) or
   refuse naming the field; the target pool's space is claimed (compare-and-add: concurrent moves never
   overfill a pool); the volume is `moving` (move_pool_id, move_file, move_kind). The project's charge does
   not change: the volume keeps its size, and a copy in flight claims pool space only (as a migration's);
2. the copy, on the host(s);
3. read back: the volume switches to its new file only once its pool lists it (and, live, once its domain
   reads it); a copy not made is undone (its partial file deleted, the claim given back). A host that can not
   say leaves it `moving`, claimed, for the settle pass;
4. the old file (a "leftover", its space still taken on its pool) is deleted, confirmed by its pool; one that
   can not be deleted now is retried by the settle pass.

A crash at any step is settled by the next process that settles the volume's host (`settle`, every SETTLE_S,
forced at start-up): a live copy its domain reads already is finished (switched), any other is rolled back
(a stopped VM's and a detached volume's old file are intact: the copy is redone if asked again).

A cold migration moves a stopped VM's local disks to local pools of the target host (copied between the
two hosts), all switched in one transaction (a VM never has half its disks on each host), and records the
target as its host to come back to (`last_host`; nothing else of a stopped VM is kept on a host: its domain
is defined at each start, its cloud-init seed made there). The VM stays stopped.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Connection, Row

from vmplane.controllers.pools import view
from vmplane.controllers.volumes import disk_spec, domain_name, file_of, new_file_name
from vmplane.core import failpoints
from vmplane.core import volumemoves as rules
from vmplane.core.driver import DriverError, PoolSpec
from vmplane.core.errors import Conflict, InsufficientCapacity, Invalid, NotFound, VmplaneError
from vmplane.core.model import UNREACHABLE_HOST_STATES, VmState
from vmplane.core.scope import migration_scope_problem
from vmplane.hosts import images
from vmplane.plane.loops import settle_every
from vmplane.store import events
from vmplane.store import ledger as L
from vmplane.store import snapshots as SS
from vmplane.store import storageledger as SL
from vmplane.store import volumemoves as MV
from vmplane.store.schema import Volume, utcnow

if TYPE_CHECKING:
    from vmplane.controllers.pools import Pools
    from vmplane.controllers.volumes import Volumes
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.volumemoves")
_VO = Volume.__table__.c
SETTLE_S = 10.0  # between two settle passes
# a move younger than this may still be carried by another process's request (a big disk's copy takes minutes):
# left to it; a process's start-up pass takes its own hosts' at once
BUSY_S = 600.0
COPY_TIMEOUT_S = 3600.0


def _raise(refusal: rules.Refusal) -> None:
    kind = {"invalid": Invalid, "capacity": InsufficientCapacity}.get(refusal.kind, Conflict)
    raise kind(refusal.message, field=refusal.field)


class VolumeMoves:
    def __init__(self, plane: Plane, volumes: Volumes, pools: Pools):
        self.plane, self.volumes, self.pools = plane, volumes, pools
        self._stop = threading.Event()
        self._busy: set[str] = set()  # volumes a request of this process is moving now
        self._lock = threading.Lock()

    def start(self) -> None:
        settle_every(SETTLE_S, self.settle, self._stop, "volume-move-settle", log)

    def stop(self) -> None:
        self._stop.set()

    # -- volume move -----------------------------------------------------------------------------
    def move(self, name: str, pool: str, project_id: int | None = None) -> Row:
        """Move volume `name` to pool `pool`; returns its row once moved (read back)."""
        with self.plane.db.transaction() as conn:
            v, vm = self.volumes._locked(conn, name, project_id)
            target = SL.pool_row(conn, pool)
            plan = self._plan(conn, v, vm, target, across_hosts=False)
            file = self._admit(conn, v, target, plan.how, f"to pool {target.name} ({plan.how} copy)")
        failpoints.hit("volume.move-admitted")
        self._mark(name, True)
        try:
            error = self._copy(name)
            failpoints.hit("volume.move-copied")
            done = self._conclude(name, error, file=file)
        finally:
            self._mark(name, False)
        if done == "unknown":
            raise Conflict(
                f"volume {name}: its host did not say whether the copy to pool {pool} was made "
                f"({error or 'no answer'}); it stays moving, claimed on both pools, and is settled once the host "
                "answers",
                field="pool",
            )
        if done != "moved":
            raise Conflict(
                f"volume {name} was not moved to pool {pool}: {error or 'the copy is not there'}", field="pool"
            )
        self.delete_leftovers(volume=name)
        return self.volumes.row(name)

    def _plan(self, conn: Connection, v: Row, vm: Row | None, target: Row, across_hosts: bool) -> rules.MovePlan:
        source = SL.pool_row(conn, v.pool_name)
        others = None
        if vm is not None:
            busy = SS.busy_problem(conn, vm.id, vm.name)
            if busy:
                raise Conflict(busy, field="vm")
            rest = [d for d in SL.vm_volumes(conn, vm.id) if d.id != v.id]
            if rest:
                reach: set[str] | None = None
                for d in rest:
                    hosts = set(self.pools.hosts_of(SL.pool_row(conn, d.move_pool_name or d.pool_name)))
                    reach = hosts if reach is None else reach & hosts
                others = frozenset(reach or ())
        plan = rules.plan_move(
            rules.MoveRequest(
                volume=v.name,
                state=v.state,
                size_mib=v.size_mib,
                source=view(source),
                target=view(target),
                source_hosts=frozenset(self.pools.hosts_of(source)),
                target_hosts=frozenset(self.pools.hosts_of(target)),
                overlays=SS.extra_files(conn, v.id) + (1 if v.base_file else 0),  # a linked clone's base too
                copying=v.copy_pool_name,
                vm=vm.name if vm is not None else None,
                vm_state=vm.state if vm is not None else None,
                vm_host=vm.host_name if vm is not None else None,
                ha=vm is not None and vm.ha_policy == "restart",
                others_reach=others,
                across_hosts=across_hosts,
            )
        )
        if isinstance(plan, rules.Refusal):
            _raise(plan)
        assert isinstance(plan, rules.MovePlan)
        return plan

    def _admit(self, conn: Connection, v: Row, target: Row, kind: str, note: str) -> str:
        """Claim the target pool's space (refused when it has no room: concurrent moves never overfill it) and
        record the volume `moving`."""
        if not SL.take_on_pool(conn, target.id, v.size_mib):
            raise InsufficientCapacity(
                f"pool {target.name} has no room for volume {v.name} ({v.size_mib} MiB) any more "
                "(another request took it); retry",
                field="pool",
            )
        file = new_file_name(v.name, "qcow2")
        MV.begin(conn, v, target.id, file, kind, note)
        return file

    def _mark(self, name: str, busy: bool) -> None:
        with self._lock:
            (self._busy.add if busy else self._busy.discard)(name)

    # -- the copy --------------------------------------------------------------------------------
    def _copy(self, name: str) -> Exception | None:
        """Ask the host(s) to copy a `moving` volume to its target; the error, if the request failed (what was
        made is read back next, whatever the request answered)."""
        v = self.volumes.row(name)
        target = self.pools.row(v.move_pool_name)
        source = self.pools.row(v.pool_name)
        dest = f"{target.path}/{v.move_file}"
        try:
            if v.move_kind == rules.LIVE:
                vm = self._vm_of(v)
                if vm is None or vm.state != VmState.running.value or not vm.host_name:
                    raise Conflict(f"vm {v.vm_name} is not running any more", field="vm")
                driver = self.plane.drivers[vm.host_name]
                driver.define_pool(PoolSpec(target.name, target.path))
                driver.copy_disk(domain_name(vm.name), v.device or "vda", dest, COPY_TIMEOUT_S)
            elif v.move_kind == rules.COLD:
                hosts = set(self.pools.hosts_of(source)) & set(self.pools.hosts_of(target))
                driver = self._first_answering(sorted(hosts), [source, target])
                driver.clone_volume(target.name, v.move_file, disk_spec(v).path)
            else:
                src = self._first_answering(self.pools.hosts_of(source), [source])
                dst = self._first_answering(self.pools.hosts_of(target), [target])
                self._backing_there(v, src, dst, source)
                dst.copy_volume_from(target.name, v.move_file, src, source.name, file_of(v))
        except (DriverError, Conflict) as exc:
            return exc
        return None

    def _first_answering(self, hosts: list[str], pools: list[Row]):
        errors = []
        for host in hosts:
            driver = self.plane.drivers.get(host)
            if driver is None:
                continue
            try:
                for p in pools:
                    driver.define_pool(PoolSpec(p.name, p.path))
                return driver
            except DriverError as exc:
                errors.append(str(exc))
        raise Conflict(f"no host answers for pool(s) {', '.join(p.name for p in pools)}: {'; '.join(errors)}")

    def _backing_there(self, v: Row, src, dst, source: Row) -> None:
        """A copy between hosts carries the file as it is: an overlay's template image must be on the target
        host at the path the overlay names."""
        if v.template is None:
            return
        t = self.plane.catalog.template(v.template)
        assert t.disk_image is not None and t.disk_format is not None  # a disk's template has an image
        there = images.ensure_on_host(dst, t.disk_image, t.disk_format)
        info = src.volume(source.name, file_of(v))
        if info is not None and info.backing and info.backing != there:
            raise Conflict(
                f"volume {v.name} is an overlay on {info.backing} on {src.host}; {dst.host} has its image at {there}",
                field="to",
            )

    # -- read back: switch, undo, or wait ----------------------------------------------------------
    def _conclude(self, name: str, error: Exception | None, settling: bool = False, file: str | None = None) -> str:
        """Settle a `moving` volume from what its hosts say now: "moved" (switched to its new file), "undone"
        (it stays where it was), or "unknown" (a host did not answer: it stays moving and claimed)."""
        v = self.volumes.row(name)
        if v.state != "moving" or (file is not None and v.move_file != file):  # settled meanwhile (another process)
            return "moved" if file is not None and v.file_name == file else "undone"
        outcome = self._outcome(v, error, settling)
        if outcome == "copied":
            self._switch([name], f"moved to pool {v.move_pool_name} (read back)")
            return "moved"
        if outcome == "not copied":
            self._undo(v, f"not moved to {v.move_pool_name}" + (f": {error}" if error else " (settled)"))
            return "undone"
        return "unknown"

    def _outcome(self, v: Row, error: Exception | None, settling: bool) -> str:
        target = self.pools.row(v.move_pool_name)
        try:
            if v.move_kind == rules.LIVE:
                vm = self._vm_of(v)
                if vm is None or vm.state in (VmState.stopped.value, VmState.error.value):
                    return "not copied"  # no domain any more: its old file is its disk (see volume-moves.md)
                if vm.state != VmState.running.value or not vm.host_name:
                    return "unknown"  # (stopping, unknown: asked again once it settled)
                driver = self.plane.drivers[vm.host_name]
                reads = driver.domain_disks(domain_name(vm.name)).get(v.device or "vda")
                if reads != f"{target.path}/{v.move_file}":  # a job a crash or an error left (still mirroring)
                    driver.abort_disk_copy(domain_name(vm.name), v.device or "vda")
                reads = driver.domain_disks(domain_name(vm.name)).get(v.device or "vda")
                if reads == f"{target.path}/{v.move_file}":
                    return "copied" if self._listed(target, v) else "unknown"
                if reads == disk_spec(v).path:
                    return "not copied"
                return "unknown"
            if error is not None or settling:
                return "not copied"  # the old file is intact (nothing writes it): a copy not trusted is redone
            return "copied" if self._listed(target, v) else "not copied"
        except (DriverError, Conflict) as exc:
            log.info("volume %s: its move can not be settled now (%s)", v.name, exc)
            return "unknown"

    def _listed(self, target: Row, v: Row) -> bool:
        info = self.pools.driver_for(target).volume(target.name, v.move_file)
        return info is not None and info.capacity_mib >= v.size_mib

    def _switch(self, names: list[str], note: str) -> None:
        """In one transaction: each volume is its new file (the VM first, then its volumes, locked)."""
        with self.plane.db.transaction() as conn:
            rows = [SL.volume_row(conn, n) for n in names]
            vm_ids = sorted({r.vm_id for r in rows if r.vm_id is not None})
            for vm_id in vm_ids:
                L.vm_row(conn, vm_id=vm_id, lock=True)
            for n in names:
                now = SL.volume_row(conn, n, lock=True)
                if now.state != "moving":
                    raise Conflict(f"volume {n} changed while it was moved ({now.state})", field="volume")
                MV.switch(conn, now, note, standalone=now.move_kind != rules.ACROSS)

    def _undo(self, v: Row, note: str) -> None:
        """Delete the copy (partial or whole) on the target, confirmed; the volume stays where it was. A copy
        the pool does not confirm gone stays a leftover (its space taken until the settle pass deletes it)."""
        target = self.pools.row(v.move_pool_name)
        try:
            driver = self.pools.driver_for(target)
            driver.delete_volume(target.name, v.move_file)
            gone = driver.volume(target.name, v.move_file) is None
        except (DriverError, Conflict) as exc:
            log.info("volume %s: the copy %s on %s not deleted yet (%s)", v.name, v.move_file, target.name, exc)
            gone = False
        with self.plane.db.transaction() as conn:
            _locked_vm(conn, v)
            now = SL.volume_row(conn, v.name, lock=True)
            if now.state == "moving" and now.move_file == v.move_file:
                MV.undo(conn, now, note, partial_left=not gone)

    def _vm_of(self, v: Row) -> Row | None:
        if v.vm_id is None:
            return None
        with self.plane.db.read() as s:
            try:
                return L.vm_row(s.connection(), vm_id=v.vm_id)
            except NotFound:
                return None

    # -- leftovers and the settle pass ---------------------------------------------------------------
    def delete_leftovers(self, volume: str | None = None) -> list[str]:
        """Delete leftover files (of `volume` only when given), each confirmed gone by its pool before its row
        and space go; one a pool does not confirm stays for the next pass. Returns the files deleted."""
        with self.plane.db.read() as s:
            rows = [r for r in MV.leftovers(s.connection()) if volume is None or r.volume == volume]
        done = []
        for r in rows:
            pool = self.pools.row(r.pool_name)
            hosts = self.pools.hosts_of(pool)
            if volume is None and not any(self.plane.membership.settles(h) for h in hosts):
                continue
            try:
                driver = self.pools.driver_for(pool)
                driver.delete_volume(pool.name, r.file)
                if driver.volume(pool.name, r.file) is not None:
                    continue
            except (DriverError, Conflict) as exc:
                log.info("leftover %s of volume %s on pool %s not deleted yet: %s", r.file, r.volume, pool.name, exc)
                continue
            with self.plane.db.transaction() as conn:
                if MV.drop_leftover(conn, r.id):
                    events.record(
                        conn,
                        "volume",
                        r.volume,
                        message=f"{r.file} ({r.why}) deleted from pool {pool.name} (confirmed)",
                    )
            done.append(r.file)
        return done

    def settle(self, force: bool = False) -> list[str]:
        """Moves a crash (or a host that did not answer) left `moving`: finished or rolled back from what the
        hosts say; then the leftover files are deleted. `force`: moves younger than BUSY_S too (start-up)."""
        with self.plane.db.read() as s:
            conn = s.connection()
            moving = SL.volume_rows(conn, _VO.state == "moving")
        now = utcnow()
        settled = []
        for v in moving:
            with self._lock:
                if v.name in self._busy:
                    continue
            if not force and (now - v.updated_at).total_seconds() < BUSY_S:
                continue
            if not self._settles(v):
                continue
            try:
                outcome = self._conclude(v.name, None, settling=True)
            except VmplaneError as exc:
                log.info("volume %s: its move is not settled now (%s)", v.name, exc)
                continue
            if outcome != "unknown":
                settled.append(v.name)
        self.delete_leftovers()
        return settled

    def _settles(self, v: Row) -> bool:
        vm = self._vm_of(v) if v.move_kind == rules.LIVE else None
        if vm is not None and vm.host_name:
            return self.plane.membership.settles(vm.host_name)
        hosts = self.pools.hosts_of(self.pools.row(v.pool_name))
        return any(self.plane.membership.settles(h) for h in hosts)

    # -- cold migration --------------------------------------------------------------------------
    def migrate_stopped(
        self, vm_name: str, to: str | None = None, dry_run: bool = False, project_id: int | None = None
    ) -> dict[str, Any]:
        """Migrate a stopped VM to host `to` (None: the first host of its cluster its disks can follow it
        to): its local disks are copied to local pools of `to` and switched together; it stays stopped."""
        with self.plane.db.transaction() as conn:
            vm = L.vm_row(conn, name=vm_name, lock=True)
            if project_id is not None and vm.project_id != project_id:
                raise NotFound(f"vm {vm_name!r} does not exist", field="vm")
            if vm.state != VmState.stopped.value:
                raise Conflict(
                    f"vm {vm_name} is {vm.state}; a cold migration moves a stopped VM (a running one live-migrates)",
                    field="state",
                )
            busy = SS.busy_problem(conn, vm.id, vm_name)
            if busy:
                raise Conflict(busy, field="vm")
            disks = SL.vm_volumes(conn, vm.id)
            for d in disks:
                if d.state != "attached" or d.copy_pool_id is not None:
                    raise Conflict(
                        f"vm {vm_name}'s volume {d.name} is {d.state}"
                        + (" and being copied" if d.copy_pool_id else "")
                        + "; migrate it once the volume is settled",
                        field="vm",
                    )
            source = self.plane.capacity.hosts_by_id().get(vm.last_host_id) if vm.last_host_id else None
            targets = [to] if to is not None else self._candidates(vm, source)
            refusal: rules.Refusal | None = None
            follows: list[rules.DiskFollow] = []
            chosen = None
            pools = self.pools.views(conn)
            by_name = {p.name: p for p in pools}
            for host in targets:
                self._check_target(vm, host, source)
                cluster = self.plane.capacity.hosts[host].cluster
                plan = rules.plan_cold_migration(
                    vm_name, [(d.name, d.size_mib, by_name[d.pool_name]) for d in disks], pools, host, cluster
                )
                if isinstance(plan, rules.Refusal):
                    refusal = refusal or plan
                    continue
                follows, chosen = plan, host
                break
            if chosen is None:
                if refusal is not None:
                    _raise(refusal)
                raise Conflict(f"vm {vm_name}: no other host of its cluster to migrate it to", field="to")
            assert chosen is not None
            moved = [f for f in follows if f.target is not None]
            named = {d.name: d for d in disks}
            chains = [f.volume for f in moved if SS.extra_files(conn, named[f.volume].id) or named[f.volume].base_file]
            if chains:
                raise Conflict(
                    f"vm {vm_name}'s disk(s) {', '.join(chains)} are chains of files on a local pool (snapshot "
                    "overlays, or a linked clone's overlay on another disk's file): delete its snapshots (a linked "
                    "clone: clone it --full) before migrating it to another host",
                    field="vm",
                )
            result = {
                "vm": vm_name,
                "source": source,
                "target": chosen,
                "state": "planned" if dry_run else "succeeded",
                "dry_run": dry_run,
                "disks": {f.volume: f.target or f.source for f in follows},
                "copied": sorted(f.volume for f in moved),
            }
            if dry_run:
                return result
            for f in moved:
                d = SL.volume_row(conn, f.volume, lock=True)
                target = SL.pool_row(conn, f.target or "")
                both = set(self.pools.hosts_of(SL.pool_row(conn, d.pool_name))) & set(self.pools.hosts_of(target))
                kind = rules.COLD if both else rules.ACROSS
                self._admit(conn, d, target, kind, f"to pool {target.name} on {chosen} (vm {vm_name} migrated cold)")
        names = [f.volume for f in moved]
        for n in names:
            self._mark(n, True)
        try:
            self._copy_all(vm_name, chosen, names)
        finally:
            for n in names:
                self._mark(n, False)
        with self.plane.db.transaction() as conn:
            row = L.vm_row(conn, name=vm_name, lock=True)
            L.set_vm(conn, row.id, last_host_id=self.plane.capacity.hosts[chosen].id)
            events.record(
                conn,
                "vm",
                vm_name,
                old_state=row.state,
                new_state=row.state,
                message=f"migrated cold to {chosen}" + (f" (disks copied: {', '.join(names)})" if names else ""),
                vm=vm_name,
                project_id=row.project_id,
            )
        for n in names:
            self.delete_leftovers(volume=n)
        return result

    def _copy_all(self, vm: str, to: str, names: list[str]) -> None:
        """Copy each disk, then switch them all in one transaction; any copy not made undoes them all."""
        errors: dict[str, Exception | None] = {}
        for n in names:
            errors[n] = self._copy(n)
        failpoints.hit("volume.move-copied")
        bad = {n: e for n, e in errors.items() if self._outcome(self.volumes.row(n), e, False) != "copied"}
        if not bad:
            self._switch(names, f"moved to {to}'s pool with vm {vm} (read back)")
            return
        for n in names:
            self._undo(self.volumes.row(n), f"vm {vm} not migrated to {to}: " + "; ".join(map(str, bad.values())))
        raise Conflict(
            f"vm {vm} was not migrated to {to}: "
            + "; ".join(f"{n}: {e or 'its copy is not on the pool'}" for n, e in bad.items())
            + "; it stays where it was, its disks too",
            field="to",
        )

    def _candidates(self, vm: Row, source: str | None) -> list[str]:
        cluster = vm.cluster_name or (self.plane.capacity.hosts[source].cluster if source else None)
        return sorted(h for h, meta in self.plane.capacity.hosts.items() if meta.cluster == cluster and h != source)

    def _check_target(self, vm: Row, to: str, source: str | None) -> None:
        if to not in self.plane.capacity.hosts:
            raise NotFound(f"host {to!r} does not exist", field="to")
        if to == source:
            raise Invalid(f"vm {vm.name} is on {to} already; choose another host", field="to")
        meta = self.plane.capacity.hosts[to]
        problem = migration_scope_problem(vm.name, vm.zone_name, to, meta.zone)
        if problem:
            raise Invalid(problem, field="to")
        if to in self.plane.capacity.index and self.plane.capacity.index.host(to).state in UNREACHABLE_HOST_STATES:
            raise Conflict(f"host {to} is {self.plane.capacity.index.host(to).state.value}", field="to")


def _locked_vm(conn: Connection, v: Row) -> None:
    """Lock the volume's VM first (the order every VM transaction takes: review of Volumes._locked)."""
    if v.vm_id is not None:
        try:
            L.vm_row(conn, vm_id=v.vm_id, lock=True)
        except NotFound:
            pass
