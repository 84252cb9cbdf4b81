"""The recovery of a failed host, as an operation (kind `recover`, its target the host): fence it, then
run its HA VMs again elsewhere (docs/design/ha.md).

Steps, persisted so that a control plane killed anywhere resumes them (`resume`):
  fencing     the host is powered off through its fence agents, tried in order, until one confirms it
              off (read back through the agent), or an operator says so (`host fence --confirm-off`).
              A failed attempt leaves the host `fencing` with the agents' words as its reason, and is
              retried with backoff: never skipped. A host that answers again before it is fenced is
              given back to the monitor (its VMs still run there): nothing is restarted.
  restarting  the host is `fenced`: nothing of it runs, unless it was powered on again since (repaired):
              each pass asks it, when it answers, what it runs, and a VM it runs is recorded running
              there and not restarted; the recovery then ends with the host `down` again, for the monitor
              to bring back (or HA to declare again). Its VMs without HA are stopped (their charge and
              claims released). Its HA VMs are restarted, highest `ha_priority` first, at most
              `vmplane.ha.max.parallel` at once, each by a `restart` operation of its own: the VM's
              running claim moves from the dead host to the chosen one in one transaction, its project's
              charge unchanged (never refused for quota, never charged twice). A restart that fails is
              tried again (`vmplane.ha.max.restart` attempts, with backoff); when the last one fails
              the VM is in the terminal `error` state at once, its charge released (no backoff is
              waited for after it: nothing is tried any more).
  done
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import func, select
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from vmplane.controllers import guestcheck
from vmplane.controllers.hostmonitor import probe
from vmplane.core import failpoints
from vmplane.core.domain import spec_of
from vmplane.core.errors import Interrupted, VmplaneError
from vmplane.core.migration import SETTLING
from vmplane.core.model import ClaimKind, HostState, OperationState, PlacementRequest, Size, VmState
from vmplane.core.names import DOMAIN_PREFIX
from vmplane.core.scope import Scope
from vmplane.hosts.fencing.base import Fenced, FenceError
from vmplane.plane import metrics
from vmplane.plane.carried import carrying
from vmplane.plane.reserves import placement_rules
from vmplane.store import ledger as L
from vmplane.store import netview
from vmplane.store.schema import utcnow

if TYPE_CHECKING:
    from vmplane.controllers.migrationsettle import MigrationSettle
    from vmplane.controllers.networking import Networking
    from vmplane.controllers.seeds import Seeds
    from vmplane.controllers.volumes import Volumes
    from vmplane.hosts.fencing.base import FenceAgent
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.ha")


def transient(exc: BaseException) -> bool:
    """(pure) A database error that passes by itself: the connection lost or refused, a lock or busy timeout,
    a serialisation failure. Not a constraint or a programming error."""
    return isinstance(exc, (OperationalError, InterfaceError)) or bool(getattr(exc, "connection_invalidated", False))


CAUSE = "ha"
FENCE_BACKOFF_S = (1, 2, 5, 10, 30)
RESTART_BACKOFF_S = (1, 3, 10, 30)
PRESENCE_TRIES = 3  # a failed restart asks its host this often whether the domain runs
ASK_S = 2.0  # a fenced host that answers again answers within this; else it is taken for off
# VMs an operation owns right now: their operation's end (or its failure path) settles them first
OWNED = [VmState.starting.value, VmState.stopping.value, VmState.scaling.value, VmState.migrating.value]
_SETTLED = [VmState.running.value, VmState.unknown.value]


def _recorded_on(host: str):
    """The VMs the store has running or unknown on `host`: (id, name, state)."""
    v, h = L.VMS.c, L.HOSTS.c
    return select(v.id, v.name, v.state).join(L.HOSTS, h.id == v.host_id).where(h.name == host, v.state.in_(_SETTLED))


# how libvirt and QEMU word a disk lock held elsewhere (virtlockd, sanlock's lockd, QEMU's image lock)
LOCK_WORDS = (
    "resource busy",
    'failed to get "write" lock',
    'failed to get shared "write" lock',
    "lockd",
    "lockspace",
    "is locked",
)


def lock_refusal(message: str | None) -> bool:
    """(pure) Whether a failed start's message says a disk lock is held elsewhere."""
    text = (message or "").lower()
    return any(word in text for word in LOCK_WORDS)


def within_lock_window(first: float, now: float, window_s: float) -> bool:
    """(pure) Whether a restart first refused on a lock at `first` is still waited for at `now`."""
    return now - first < window_s


def _backoff(table: tuple[int, ...], attempt: int) -> float:
    return float(table[min(attempt, len(table) - 1)])


class HostRecovery:
    def __init__(
        self,
        plane: Plane,
        agent: Callable[[dict, Any], FenceAgent],
        volumes: Volumes,
        migration_settle: MigrationSettle,
        networking: Networking,
        seeds: Seeds,
    ):
        self.plane = plane
        self.networking = networking
        self.seeds = seeds
        self.agent = agent  # a host's fence agent (HaController.agent)
        self.volumes, self.migration_settle = volumes, migration_settle
        self._running: set[str] = set()  # restart operations being run in this process
        self._runs_lock = threading.Lock()

    # -- the operation ---------------------------------------------------------------------------
    def begin(self, conn, host: str, reason: str) -> str:
        """In the caller's transaction: the recovery operation of `host` (already `fencing`)."""
        return L.new_operation(
            conn,
            "recover",
            host,
            None,
            None,
            step="fencing",
            message=reason,
            result={"attempts": {}, "restarted": {}, "failed": {}},
        )

    def run(self, op_id: str) -> None:
        """The operation's body (Operations.run): from its persisted step to its end. A transient
        database error (a failover, a busy SQLite) does not end it: the body runs again from its persisted
        step after a backoff (it is written to be resumed anywhere), until the process closes."""
        errors = 0
        while True:
            try:
                return self._run_from_step(op_id)
            except DBAPIError as exc:
                if not transient(exc):
                    raise
                wait = _backoff(RESTART_BACKOFF_S, errors)
                errors += 1
                log.error(
                    "recovery %s: the database failed (%s); going on from its step in %g s",
                    op_id[:8],
                    type(exc.orig or exc).__name__,
                    wait,
                )
                self._wait(wait)

    def _run_from_step(self, op_id: str) -> None:
        with self.plane.db.read() as s:
            op = L.operation_row(s.connection(), op_id)
        if op.state not in ("pending", "running"):
            return
        host = op.target
        if op.step == "fencing" and not self._fence(op_id, host):
            return
        self._resume_restarts(op_id)
        self._restart_all(op_id, host)

    def _resume_restarts(self, op_id: str) -> None:
        """This recovery's restart operations left in flight (the error that interrupted it came between
        their claim and their end), that no thread carries: driven to their end first."""
        op = L.OPERATIONS.c
        with self.plane.db.read() as s:
            rows = (
                s.connection()
                .execute(select(op.id, op.result).where(op.kind == "restart", op.state.in_(["pending", "running"])))
                .all()
            )
        for row in rows:
            if (row.result or {}).get("recovery") == op_id:
                self.run_restart(row.id)

    resume = run

    def _op(self, op_id: str):
        with self.plane.db.read() as s:
            return L.operation_row(s.connection(), op_id)

    def _host(self, host: str):
        with self.plane.db.read() as s:
            return s.connection().execute(select(L.HOSTS).where(L.HOSTS.c.name == host)).first()

    def _wait(self, seconds: float) -> None:
        if self.plane.closing.wait(seconds):
            raise Interrupted()

    # -- fencing ---------------------------------------------------------------------------------
    def _answers(self, host: str) -> bool:
        driver = self.plane.drivers.get(host)
        return driver is not None and probe(driver) is None

    def _fence(self, op_id: str, host: str) -> bool:
        """Until the host is confirmed off: True. False when the recovery ends without it (the host
        answers again, or was brought back)."""
        attempt = 0
        while True:
            if self.plane.closing.is_set():
                raise Interrupted()
            row = self._host(host)
            if row is None:
                self._end(op_id, OperationState.failed, f"host {host} was removed")
                return False
            if row.state == HostState.fenced.value:  # an operator confirmed it off meanwhile
                return self._fenced(op_id, host, None)
            if row.state != HostState.fencing.value:
                self._end(op_id, OperationState.failed, f"host {host} is {row.state} again; nothing was restarted")
                return False
            if self._answers(host):
                self._give_back(op_id, host)
                return False
            fenced, errors = self._try_agents(host, row)
            if fenced is not None:
                return self._fenced(op_id, host, fenced)
            attempt += 1
            wait = _backoff(FENCE_BACKOFF_S, attempt - 1)
            reason = (
                f"fencing failed (attempt {attempt}): {'; '.join(errors)}; retrying in {wait:g} s (or confirm "
                f"it off: vmplane host fence {host} --confirm-off)"
            )
            with self.plane.db.transaction() as conn:
                L.set_host_state(conn, host, HostState.fencing, state_reason=reason)
                L.set_operation(conn, op_id, state=OperationState.running, message=reason)
            log.error("host %s: %s", host, reason)
            self._wait(wait)

    def _try_agents(self, host: str, row) -> tuple[Fenced | None, list[str]]:
        configs = row.fence_agents or []
        if not configs:
            return None, ["no fence agent is configured (vmplane host fence-agents)"]
        errors: list[str] = []
        for config in configs:
            try:
                agent = self.agent(config, row)
                return agent.power_off(host), errors
            except (FenceError, ValueError, OSError) as exc:
                errors.append(str(exc))
        return None, errors

    def _fenced(self, op_id: str, host: str, fenced: Fenced | None) -> bool:
        failpoints.hit("ha.before-fenced")
        how = (
            f"fenced by its {fenced.agent} agent: {fenced.detail} ({fenced.seconds:.1f} s)"
            if fenced
            else "confirmed off by an operator"
        )
        with self.plane.capacity.lock:
            with self.plane.db.transaction() as conn:
                L.set_host_state(conn, host, HostState.fenced, how, state_reason=how)
                L.set_operation(
                    conn,
                    op_id,
                    state=OperationState.running,
                    step="restarting",
                    progress=30,
                    message=f"{host} {how}; restarting its HA VMs",
                )
            self.plane.capacity.set_state(host, HostState.fenced)
        metrics.OPERATIONS.labels("fence", "succeeded").inc()
        log.warning("host %s %s", host, how)
        failpoints.hit("ha.fenced")
        return True

    def _give_back(self, op_id: str, host: str) -> None:
        """It answers again before it was fenced: a blip longer than the grace. Down again, so that the
        monitor brings it back and settles its VMs from what it runs; nothing was restarted."""
        with self.plane.capacity.lock:
            with self.plane.db.transaction() as conn:
                # its silence starts again from now: the old down_since would let HA declare it again at
                # once, before the monitor brings it back (and fence it if one probe fails meanwhile)
                L.set_host_state(
                    conn,
                    host,
                    HostState.down,
                    "it answers again before it was fenced",
                    state_reason="it answers again; the monitor brings it back",
                    down_since=utcnow(),
                )
                L.set_operation(
                    conn,
                    op_id,
                    state=OperationState.failed,
                    step="done",
                    progress=100,
                    message=f"{host} answers again before it was fenced; nothing was restarted",
                )
            self.plane.capacity.set_state(host, HostState.down)
        log.warning("host %s answers again before it was fenced; recovery ends", host)

    # -- restarting ------------------------------------------------------------------------------
    def _restart_all(self, op_id: str, host: str) -> None:
        rounds = 0  # passes that left an HA VM to restart: the backoff between attempts
        while True:
            if self.plane.closing.is_set():
                raise Interrupted()
            row = self._host(host)
            if row is None or row.state != HostState.fenced.value:  # repaired (and maybe failed again,
                self._end(
                    op_id,
                    OperationState.failed,  # not fenced): its VMs are not ours
                    f"{host} is {row.state if row else 'removed'}, no longer fenced: its VMs are left to "
                    f"the monitor (and a new recovery if it fails again)",
                )
                return
            left, owned = self._pass(op_id, host)
            if not left and not owned:
                break
            if owned:  # a migration into or out of the fenced host: settled now that it is off
                self.migration_settle.run_once()
            # a pass that only waited for an owned VM does not lengthen the backoff of the next attempt
            self._wait(_backoff(RESTART_BACKOFF_S, rounds) if left else 0.5)
            rounds += bool(left)
        result = self._op(op_id).result or {}
        restarted, failed = result.get("restarted", {}), result.get("failed", {})
        words = ", ".join(f"{vm} on {h}" for vm, h in restarted.items()) or "none"
        message = f"restarted {len(restarted)} VM(s): {words}" + (
            f"; {len(failed)} in error: {', '.join(f'{vm} ({why})' for vm, why in failed.items())}" if failed else ""
        )
        kept = self._kept_on(host)
        if kept:
            message += (
                f"; {kept} VM(s) run on {host} again (powered on since its fence): it is down again, for the "
                f"monitor to bring back"
            )
        self._end(op_id, OperationState.succeeded, message)

    def _kept_on(self, host: str) -> int:
        """After the last pass: the VMs still recorded on the fenced host (it answered again and runs them).
        The host goes back to `down`: the monitor brings it back when it answers, and HA declares and fences
        it again if it fails again (a fenced host is never declared again: its VMs would be stranded)."""
        with self.plane.capacity.lock:
            with self.plane.db.transaction() as conn:
                kept = conn.execute(select(func.count()).select_from(_recorded_on(host).subquery())).scalar() or 0
                if not kept:
                    return 0
                L.set_host_state(
                    conn,
                    host,
                    HostState.down,
                    f"it runs {kept} of its VMs again since its fence",
                    state_reason="powered on again since its fence; the monitor brings it back",
                    down_since=utcnow(),
                )
            self.plane.capacity.set_state(host, HostState.down)
        return kept

    def _pass(self, op_id: str, host: str) -> tuple[list[str], int]:
        """One round: VMs without HA stopped, HA VMs restarted (in parallel, by priority). Returns the
        HA VMs still to restart and how many of the host's VMs an operation still owns, migrations into
        the host included (their VMs are recorded on their source, but only the fence lets them be
        settled: the recovery settles them before it ends, as those out of it)."""
        v, h = L.VMS.c, L.HOSTS.c
        on_host = _recorded_on(host)
        with self.plane.db.read() as s:
            before = set(s.connection().execute(on_host).all())
        runs = self._runs_there(host) if before else set()
        with self.plane.db.transaction() as conn:
            for r in conn.execute(on_host.with_for_update()).all():
                if r not in before:  # recorded there after the host was asked (a settle): the next pass
                    continue
                if r.name in runs and r.state == VmState.unknown.value:
                    L.set_vm(
                        conn,
                        r.id,
                        f"its fenced host {host} answers again and runs it: not restarted",
                        state=VmState.running,
                    )
                elif r.name not in runs and r.state == VmState.running.value:  # put back to running there by an
                    L.set_vm(
                        conn,
                        r.id,
                        f"its host {host} is fenced: it runs nowhere",  # operation's failure path
                        state=VmState.unknown,
                    )  # (a scale whose migration failed)
        with self.plane.db.read() as s:
            conn = s.connection()
            rows = conn.execute(
                select(v.name, v.state, v.ha_policy, v.cluster_id)
                .join(L.HOSTS, h.id == v.host_id)
                .where(h.name == host)
                .order_by(v.ha_priority.desc(), v.name)
            ).all()
            m = L.MIGRATIONS.c
            incoming = (
                conn.execute(
                    select(func.count())
                    .select_from(L.MIGRATIONS)
                    .where(m.target == host, m.state.in_([st.value for st in SETTLING]))
                ).scalar()
                or 0
            )
        owned = sum(1 for r in rows if r.state in OWNED) + incoming
        unknown = [r for r in rows if r.state == VmState.unknown.value]
        for r in unknown:
            if r.ha_policy != "restart":
                self._stop_unprotected(r.name, host)
        queue = [r.name for r in unknown if r.ha_policy == "restart"]
        if not queue:
            return [], owned
        cluster = self.plane.capacity.hosts[host].cluster
        parallel = int(
            cast(
                int,
                self.plane.catalog.effective("vmplane.ha.max.parallel", self.plane.capacity.hosts[host].zone, cluster),
            )
        )
        with ThreadPoolExecutor(min(parallel, len(queue)), thread_name_prefix="vmplane-ha") as pool:
            done = list(pool.map(lambda vm: self._restart(op_id, vm, host), queue))  # submitted in order
        return [vm for vm, ok in zip(queue, done) if not ok], owned

    def _runs_there(self, host: str) -> set[str]:
        """The VMs whose domain runs on the fenced `host`, if it answers again (powered on while its
        recovery runs: its old guests are gone, but what runs there now is not restarted elsewhere).
        Empty when it does not answer: confirmed off by its fence, it runs nothing."""
        driver = self.plane.drivers.get(host)
        if driver is None:
            return set()
        pool = ThreadPoolExecutor(1, thread_name_prefix="vmplane-ha-ask")
        try:  # a call to a host that is off may wait for a connection timeout: not the recovery
            domains = pool.submit(driver.domains).result(timeout=ASK_S)
        except Exception:  # noqa: BLE001 - it does not answer (in time): off, as its fence confirmed
            return set()
        finally:
            pool.shutdown(wait=False)
        return {d.name.removeprefix(DOMAIN_PREFIX) for d in domains if d.active and d.name.startswith(DOMAIN_PREFIX)}

    def _stop_unprotected(self, vm: str, host: str) -> None:
        self._release(
            vm, host, f"its host {host} failed and was fenced; it has no HA policy: stopped, its charge released"
        )

    def _release(self, vm: str, host: str, note: str, then=None) -> bool:
        """Give back all `vm` holds, if it is still unknown on the fenced `host` (else False); `then(conn,
        row)` runs in the same transaction."""
        with self.plane.capacity.lock:
            with self.plane.db.transaction() as conn:
                row = L.vm_row(conn, name=vm, lock=True)
                if row.state != VmState.unknown.value or row.host_name != host:
                    return False
                L.lock_project(conn, row.project_id)
                freed = L.release_vm(conn, row.id, note=note)
                if then is not None:
                    then(conn, row)
            self.plane.capacity.give_back(freed)
        return True

    def _attempt(self, op_id: str, vm: str, max_restart: int) -> int | None:
        """Count one more attempt for `vm` in the operation's result; None once it has used them all."""
        with self.plane.db.transaction() as conn:
            op = L.operation_row(conn, op_id, lock=True)
            result = dict(op.result or {})
            attempts = dict(result.get("attempts", {}))
            n = attempts.get(vm, 0)
            if n >= max_restart:
                return None
            attempts[vm] = n + 1
            L.set_operation(conn, op_id, result={**result, "attempts": attempts})
            return n + 1

    def _restart(self, op_id: str, vm: str, host: str) -> bool:
        """One attempt to run `vm` (unknown on the fenced `host`) elsewhere; True when it needs no more.
        When the last allowed attempt fails, the VM is in error at once (no backoff to wait for first)."""
        meta = self.plane.capacity.hosts[host]
        max_restart = int(cast(int, self.plane.catalog.effective("vmplane.ha.max.restart", meta.zone, meta.cluster)))
        attempt = self._attempt(op_id, vm, max_restart)
        if attempt is None:  # counted used up before (a recovery resumed after a restart)
            self._give_up(op_id, vm, host, f"not restarted after {max_restart} attempt(s)")
            return True
        try:
            restart_op = self._claim_elsewhere(op_id, vm, host, attempt)
        except VmplaneError as exc:
            self._note(op_id, vm, f"attempt {attempt}: {exc.message}")
            return self._last(op_id, vm, host, attempt, max_restart)
        if restart_op is None:
            return True  # no longer unknown on the host: someone else settled it
        try:
            done = self.run_restart(restart_op)
        except Exception as exc:
            if isinstance(exc, DBAPIError) and transient(exc):
                raise  # the recovery goes on from its step, this restart first
            done = self._settle_restart(restart_op, exc) is not False
        if not done and lock_refusal(self._op(restart_op).message) and self._lock_wait(op_id, vm, meta):
            return False  # the fenced host's lock is not released yet: not an attempt spent
        return done or self._last(op_id, vm, host, attempt, max_restart)

    def _lock_wait(self, op_id: str, vm: str, meta) -> bool:
        """A restart of `vm` refused on a disk lock: True (its attempt given back, tried again after the
        backoff) while within `vmplane.ha.lock.release.window` of its first lock refusal; False after."""
        window = float(
            cast(float, self.plane.catalog.effective("vmplane.ha.lock.release.window", meta.zone, meta.cluster))
        )
        now = time.time()
        with self.plane.db.transaction() as conn:
            op = L.operation_row(conn, op_id, lock=True)
            result = dict(op.result or {})
            locked = dict(result.get("locked", {}))
            first = locked.setdefault(vm, now)
            if not within_lock_window(first, now, window):
                return False
            attempts = dict(result.get("attempts", {}))
            attempts[vm] = max(attempts.get(vm, 1) - 1, 0)
            L.set_operation(conn, op_id, result={**result, "attempts": attempts, "locked": locked})
        log.warning(
            "vm %s: its disk is still locked by its failed host; tried again (lock release window %g s, %.0f s left)",
            vm,
            window,
            first + window - now,
        )
        return True

    def _last(self, op_id: str, vm: str, host: str, attempt: int, max_restart: int) -> bool:
        """After a failed attempt: False (tried again after the backoff), or, when it was the last one,
        the VM given up (in error, its charge released) and True."""
        if attempt < max_restart:
            return False
        self._give_up(op_id, vm, host, f"not restarted after {max_restart} attempt(s)")
        return True

    def _claim_elsewhere(self, op_id: str, vm: str, host: str, attempt: int) -> str | None:
        plane = self.plane
        with plane.capacity.lock:
            with plane.db.transaction() as conn:
                # the admissions' lock first, as a start's: its group check (hard anti-affinity) and its
                # claim can not interleave with another process's admission
                plane.admissions.serialise(conn)
                row = L.vm_row(conn, name=vm, lock=True)
                if row.state != VmState.unknown.value or row.host_name != host:
                    return None
                size = Size(row.vcpus, row.memory_mib)
                cluster = plane.capacity.hosts[host].cluster
                rules = placement_rules(
                    plane,
                    conn,
                    Scope(plane.capacity.hosts[host].zone, cluster),
                    vm_id=row.id,
                    ha=True,
                    action=f"restarting {vm} on {{host}}",
                    keep_reserve=False,
                )
                request = PlacementRequest(
                    size,
                    exclude_hosts=frozenset({host}),
                    cluster=cluster,
                    exclude_reason=f"the failed host {host}",
                    storage_hosts=self.volumes.storage_hosts(conn, row.id),
                    storage_reason="can not open the VM's disks (their pools are not on it)",
                    **rules,
                )
                placement, host_id = plane.capacity.take_placement(conn, request)
                restart_op = L.new_operation(
                    conn,
                    "restart",
                    vm,
                    row.id,
                    row.project_id,
                    step="claimed",
                    message=f"attempt {attempt}: claimed {size.vcpus} vCPU(s) / "
                    f"{placement.memory_mib} MiB on {placement.host}",
                    result={"from": host, "host": placement.host, "recovery": op_id, "attempt": attempt},
                )
                freed = L.move_running_claim(
                    conn, row.id, host_id, restart_op, size.vcpus, placement.memory_mib, taken=True
                )
                L.set_vm(
                    conn,
                    row.id,
                    note=f"HA restart after {host} failed (attempt {attempt})",
                    state=VmState.starting,
                    host_id=host_id,
                    overhead_mib=placement.overhead_mib,
                )
            plane.capacity.give_back(freed)
            plane.capacity.add(placement.host, size.vcpus, placement.memory_mib)
        failpoints.hit("ha.claimed")
        return restart_op

    # -- one restart: its own operation ----------------------------------------------------------
    def run_restart(self, op_id: str) -> bool:
        """Start the VM's domain on the host its restart claimed (also the body that resumes it):
        True once it runs or its state is settled otherwise; False to try again (claim moved back).
        One run at a time in this process (carried: overdue.py); another one already running it: True."""
        with self._runs_lock:
            if op_id in self._running:
                return True  # its other run settles it (its VM is `starting`: the recovery waits for it)
            self._running.add(op_id)
        try:
            with carrying(op_id):
                return self._run_restart(op_id)
        finally:
            with self._runs_lock:
                self._running.discard(op_id)

    def fail_restart(self, op_id: str, exc: Exception) -> bool:
        """Operations.fail of an HA restart (its `take_failure` hook: its body raised, or it was left in
        flight): its host is asked and the VM settled as `_restart_failed` does (running there, unknown, or
        back to the fenced host for its recovery to try again), never left `starting`. False for an
        operation of another kind."""
        return self._settle_restart(op_id, exc) is not None

    def _settle_restart(self, op_id: str, exc: Exception) -> bool | None:
        """None: not a restart. Else as `_restart_failed`: False when the VM went back to its fenced host to
        be tried again."""
        with self.plane.db.read() as s:
            conn = s.connection()
            op = L.operation_row(conn, op_id)
            if op.kind != "restart":
                return None
            if op.state not in ("pending", "running") or op.vm_id is None:
                return True
            vm = L.vm_row(conn, op.vm_id)
        return self._restart_failed(op_id, op, vm, exc)

    def _run_restart(self, op_id: str) -> bool:
        plane = self.plane
        vm = plane.ops.begin_step(op_id, "starting-domain")
        if vm is None:
            return True
        op = self._op(op_id)
        try:
            if vm.state != VmState.starting.value:
                raise VmplaneError(f"vm {vm.name} is {vm.state}, not starting")
            driver = plane.drivers[vm.host_name]
            with plane.db.read() as s:
                nics = netview.nic_specs(s.connection(), vm.id)
            seed = self.seeds.disk_for(vm.id, vm.host_name)
            disks = tuple(self.volumes.disks_of(vm.id)) + ((seed,) if seed else ())
            spec = replace(spec_of(vm), disks=disks, nics=nics)
            if nics:
                self.networking.ensure(vm.host_name)
            failpoints.hit("ha.before-domain")
            current = driver.domain(spec.name)
            if current is None or not current.active:
                driver.start(spec)
        except Exception as exc:  # noqa: BLE001 - every failure is settled by asking the host
            return self._restart_failed(op_id, op, vm, exc)
        with plane.db.transaction() as conn:
            L.set_vm(
                conn,
                vm.id,
                note=f"restarted by HA after {op.result['from']} failed",
                state=VmState.running,
                cpu_model=spec.cpu_model,
            )
            L.set_operation(
                conn,
                op_id,
                state=OperationState.succeeded,
                step="done",
                progress=100,
                message=f"running on {vm.host_name}",
            )
            self._record(conn, op.result.get("recovery"), "restarted", vm.name, vm.host_name)
        metrics.OPERATIONS.labels("restart", "succeeded").inc()
        log.warning("vm %s restarted on %s (its host %s failed)", vm.name, vm.host_name, op.result["from"])
        guestcheck.after_restart(plane, vm.name, vm.host_name)  # an event says whether its guest came up
        return True

    def _presence(self, host: str, domain: str) -> str:
        """Whether a failed restart's domain runs on `host`: "running", "gone" or "unknown". A transient
        error (a reconnect, the driver's quick-call lock) is asked again, PRESENCE_TRIES times a second
        apart, before the answer is "unknown": an HA VM left unknown on its new host is settled later
        (the monitor's unknown pass), never restarted by this recovery (review N3, scenario B)."""
        for attempt in range(PRESENCE_TRIES):
            if attempt:
                time.sleep(1.0)
            try:
                info = self.plane.drivers[host].domain(domain)
            except Exception as exc:  # noqa: BLE001 - unknown is not absent
                log.info("restart of %s: %s can not tell whether it runs (%s)", domain, host, exc)
                continue
            return "running" if info is not None and info.active else "gone"
        return "unknown"

    def _restart_failed(self, op_id: str, op, vm, exc: Exception) -> bool:
        plane = self.plane
        reason = exc.message if isinstance(exc, VmplaneError) else str(exc) or type(exc).__name__
        presence = self._presence(vm.host_name, DOMAIN_PREFIX + vm.name)
        dead = op.result["from"]
        with plane.capacity.lock:
            with plane.db.transaction() as conn:
                row = L.vm_row(conn, vm.id, lock=True)
                freed: list = []
                if row.state != VmState.starting.value:
                    pass
                elif presence == "running":
                    L.set_vm(
                        conn,
                        vm.id,
                        note=f"its restart reported {reason}, but it runs on {vm.host_name}",
                        state=VmState.running,
                    )
                    self._record(conn, op.result.get("recovery"), "restarted", vm.name, vm.host_name)
                elif presence == "unknown":
                    L.set_vm(
                        conn,
                        vm.id,
                        note=f"its restart failed and {vm.host_name} can not tell whether it runs: {reason}",
                        state=VmState.unknown,
                    )
                else:  # confirmed not running there: back to the fenced host, tried again
                    dead_id = plane.capacity.hosts[dead].id
                    claim = conn.execute(
                        select(L.CLAIMS.c.vcpus, L.CLAIMS.c.memory_mib).where(
                            L.CLAIMS.c.vm_id == vm.id, L.CLAIMS.c.kind == ClaimKind.running.value
                        )
                    ).first()
                    assert claim is not None  # a VM starting holds its running claim
                    freed = L.move_running_claim(conn, vm.id, dead_id, None, claim.vcpus, claim.memory_mib, taken=False)
                    L.set_vm(
                        conn,
                        vm.id,
                        note=f"HA restart on {vm.host_name} failed: {reason}",
                        state=VmState.unknown,
                        host_id=dead_id,
                    )
                    plane.capacity.add(dead, claim.vcpus, claim.memory_mib)
                L.set_operation(
                    conn,
                    op_id,
                    state=OperationState.failed,
                    step="done",
                    progress=100,
                    message=f"restart on {vm.host_name} failed: {reason}",
                )
            plane.capacity.give_back(freed)
        metrics.OPERATIONS.labels("restart", "failed").inc()
        self._note(
            op.result.get("recovery"), vm.name, f"attempt {op.result.get('attempt')} on {vm.host_name}: {reason}"
        )
        log.error(
            "vm %s: HA restart on %s failed (%s); its domain is %s there", vm.name, vm.host_name, reason, presence
        )
        return presence != "gone"

    def _give_up(self, op_id: str, vm: str, host: str, why: str) -> None:
        with self.plane.db.read() as s:
            last = ((L.operation_row(s.connection(), op_id).result or {}).get("notes", {})).get(vm, "")
        why += f"; last: {last}" if last else ""

        def in_error(conn, row) -> None:
            L.set_vm(conn, row.id, note="HA gave up", state=VmState.error)
            self._record(conn, op_id, "failed", vm, why)

        if self._release(vm, host, f"its host {host} failed; {why}", in_error):
            log.error("vm %s: %s; it is in error", vm, why)

    # -- bookkeeping -----------------------------------------------------------------------------
    @staticmethod
    def _record(conn, op_id: str | None, key: str, vm: str, value: str) -> None:
        if op_id is None:
            return
        op = L.operation_row(conn, op_id, lock=True)
        result = dict(op.result or {})
        result[key] = {**result.get(key, {}), vm: value}
        L.set_operation(conn, op_id, result=result)

    def _note(self, op_id: str | None, vm: str, note: str) -> None:
        with self.plane.db.transaction() as conn:
            self._record(conn, op_id, "notes", vm, note)

    def _end(self, op_id: str, state: OperationState, message: str) -> None:
        with self.plane.db.transaction() as conn:
            L.set_operation(conn, op_id, state=state, step="done", progress=100, message=message)
        metrics.OPERATIONS.labels("recover", state.value).inc()
        log.warning("recovery %s: %s", op_id[:8], message)
