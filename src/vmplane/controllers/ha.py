"""High availability: which down host has failed (docs/design/ha.md).

The host monitor marks a host `down` the first time its hypervisor does not answer (hostmonitor.py).
That alone restarts nothing: a blip must not. Every second this controller looks at the down hosts; one
that has not answered for `vmplane.ha.grace` seconds (cluster setting) is declared failed: it becomes
`fencing` and a recovery operation (harecovery.py) powers it off and restarts its HA VMs elsewhere.

The second signal. Not answering vmplane is not the same as being dead: a libvirtd that crashed, or a
network cut between the control plane and the host, leaves its guests running. So each failed host is
also asked through a path that does not go through its libvirtd (liveness.py: a local host's own
processes and the heartbeat it writes to shared storage; a sim host's power), and what it says is in the
host's reason and the event log: "dead" (nothing of it runs: a power failure) or "alive but unreachable"
(its guests may run: it must be fenced before they run anywhere else). Either way it is fenced first.
And when every host of a cluster stops answering at once, the likely failure is the control plane's own
network: nothing is declared failed (as Kubernetes' node lifecycle controller stops evicting in a full
disruption); an operator can still fence a host by hand.

Only a host that holds an HA VM (it runs there, or a migration's claim is there) is declared failed: a
host with none is left down, its VMs `unknown`, until it answers (powering it off would only end VMs
nobody asked to protect). A host that is only an HA VM's migration target is fenced too: until then that
migration can not be settled (unknown is not absent), and its VM stays `migrating` on its source.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, cast

from sqlalchemy import select

from vmplane.controllers.harecovery import CAUSE, HostRecovery
from vmplane.core.errors import Conflict, Invalid, NotFound
from vmplane.core.model import HostState, OperationState, VmState
from vmplane.plane.loops import every
from vmplane.store import ledger as L
from vmplane.store.events import acting_as
from vmplane.store.schema import utcnow

if TYPE_CHECKING:
    from vmplane.controllers.migrationsettle import MigrationSettle
    from vmplane.controllers.networking import Networking
    from vmplane.controllers.seeds import Seeds
    from vmplane.controllers.volumes import Volumes
    from vmplane.hosts.drivers.sim import SimDriver
    from vmplane.hosts.drivers.simfabric import SimFabric
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.ha")
CHECK_INTERVAL_S = 1.0
IN_FLIGHT = [OperationState.pending.value, OperationState.running.value]


class HaController:
    def __init__(
        self, plane: Plane, volumes: Volumes, migration_settle: MigrationSettle, networking: Networking, seeds: Seeds
    ):
        self.plane = plane
        self.recovery = HostRecovery(plane, self.agent, volumes, migration_settle, networking, seeds)
        self._stop = threading.Event()

    def start(self) -> None:
        every(
            lambda: CHECK_INTERVAL_S,
            self.check,
            self._stop,
            "ha",
            log,
            when=self.plane.membership.coordinates,
            owner=lambda: self.plane.membership.epoch,
        )

    def stop(self) -> None:
        self._stop.set()

    # -- detection -------------------------------------------------------------------------------
    def check(self) -> list[str]:
        """One pass: every down host past its grace with VMs on it is declared failed. Returns what
        was declared, in words."""
        h, v = L.HOSTS.c, L.VMS.c
        with self.plane.db.read() as s:
            conn = s.connection()
            down = conn.execute(
                select(h.name, h.down_since).where(h.state == HostState.down.value, h.down_since.is_not(None))
            ).all()
            if not down:
                return self._resume_stranded()
            names = [r.name for r in down]
            # hosts holding an HA VM: running there, or a claim there (a migration's target)
            with_vms = set(
                conn.execute(
                    select(h.name)
                    .join(L.CLAIMS, L.CLAIMS.c.host_id == h.id)
                    .join(L.VMS, v.id == L.CLAIMS.c.vm_id)
                    .where(h.name.in_(names), v.ha_policy == "restart")
                    .group_by(h.name)
                ).scalars()
            )
        now, declared = utcnow(), []
        for name, since in down:
            meta = self.plane.capacity.hosts.get(name)
            if meta is None or name not in with_vms:
                continue
            grace = float(cast(float, self.plane.catalog.effective("vmplane.ha.grace", meta.zone, meta.cluster)))
            silent = (now - since).total_seconds()
            if silent < grace:
                continue
            if self._whole_cluster_down(meta.cluster):
                self._hold(name, meta.cluster)
                continue
            signal = self.signal(name)
            words = (
                f"its hypervisor has not answered for {silent:.0f} s (grace {grace:g} s); second signal: "
                f"{signal.detail}; "
                + (
                    "it looks dead"
                    if signal.alive is False
                    else "it may still run its guests"
                    if signal.alive
                    else "its liveness is unknown"
                )
                + "; fencing it before its VMs run elsewhere"
            )
            if self.declare(name, words):
                declared.append(f"{name}: {words}")
        return declared + self._resume_stranded()

    # -- a recovery that ended without restarting everything (N4) ---------------------------------
    def stranded(self, conn, name: str | None = None) -> list[str]:
        """Hosts `fencing` or `fenced` that still hold `unknown` HA VMs with no recovery in flight: a
        recovery that failed (an error it could not get past) left them; nothing else runs them again."""
        h, v, op = L.HOSTS.c, L.VMS.c, L.OPERATIONS.c
        query = (
            select(h.name)
            .join(L.VMS, v.host_id == h.id)
            .where(
                h.state.in_([HostState.fencing.value, HostState.fenced.value]),
                v.state == VmState.unknown.value,
                v.ha_policy == "restart",
                ~select(op.id).where(op.kind == "recover", op.target == h.name, op.state.in_(IN_FLIGHT)).exists(),
            )
            .group_by(h.name)
            .order_by(h.name)
        )
        if name is not None:
            query = query.where(h.name == name)
        return list(conn.execute(query).scalars())

    def _resume_stranded(self) -> list[str]:
        with self.plane.db.read() as s:
            hosts = self.stranded(s.connection())
        resumed = []
        for name in hosts:
            reason = "its last recovery ended with HA VMs still unknown on it; recovering it again"
            if self.resume_host(name, reason):
                resumed.append(f"{name}: {reason}")
        return resumed

    def resume_host(self, name: str, reason: str) -> str | None:
        """A new recovery of a `fencing` host (fenced first) or a `fenced` one (its HA VMs restarted);
        None if it is neither or a recovery of it runs already."""
        with self.plane.capacity.lock, self.plane.db.transaction() as conn:
            row = conn.execute(select(L.HOSTS.c.state).where(L.HOSTS.c.name == name).with_for_update()).first()
            if row is None or row.state not in (HostState.fencing.value, HostState.fenced.value):
                return None
            if self._recovering(conn, name):
                return None
            op_id = self.recovery.begin(conn, name, reason)
            if row.state == HostState.fenced.value:
                L.set_operation(conn, op_id, step="restarting")
        log.error("host %s: %s (operation %s)", name, reason, op_id)
        self._launch(op_id)
        return op_id

    def has_stranded(self, name: str) -> bool:
        """Whether a failed recovery left `name` with HA VMs unknown and no recovery in flight."""
        with self.plane.db.read() as s:
            return bool(self.stranded(s.connection(), name))

    def recover(self, name: str, who: str = "an operator") -> dict:
        """`host recover NAME` on a host a failed recovery left `fencing`/`fenced` with HA VMs unknown:
        its recovery runs again. Conflict when nothing is left to recover there."""
        with self.plane.db.read() as s:
            conn = s.connection()
            row = conn.execute(select(L.HOSTS.c.state, L.HOSTS.c.state_reason).where(L.HOSTS.c.name == name)).first()
            if row is None:
                raise NotFound(f"host {name!r} does not exist", field="host")
            running = self._recovering(conn, name)
            stranded = bool(self.stranded(conn, name))
        if running:
            raise Conflict(
                f"host {name}: its recovery runs already (operation {running}; `vmplane operation show {running}`)",
                field="host",
            )
        if not stranded:
            raise Conflict(
                f"host {name} is {row.state}: nothing is left to recover (no HA VM of it is unknown)", field="host"
            )
        op_id = self.resume_host(name, f"recovered again by {who}")
        if op_id is None:
            raise Conflict(f"host {name}: nothing is left to recover (its state changed meanwhile)", field="host")
        return {"host": name, "state": row.state, "operation": op_id}

    def _whole_cluster_down(self, cluster: str) -> bool:
        members = [n for n, meta in self.plane.capacity.hosts.items() if meta.cluster == cluster]
        return len(members) > 1 and all(
            self.plane.capacity.index.host(n).state == HostState.down for n in members if n in self.plane.capacity.index
        )

    def _hold(self, name: str, cluster: str) -> None:
        reason = (
            f"every host of cluster {cluster} stopped answering at once: the control plane's own network is "
            f"the likely failure; nothing is fenced (fence by hand: vmplane host fence {name})"
        )
        with self.plane.db.transaction() as conn:
            row = conn.execute(select(L.HOSTS.c.state_reason).where(L.HOSTS.c.name == name)).first()
            if row and row.state_reason != reason:
                L.set_host_state(conn, name, HostState.down, state_reason=reason)
                log.error("host %s: %s", name, reason)

    def signal(self, name: str):
        """The second, independent liveness signal of a host (liveness.py): a sim host's power; a local
        host's own processes; else unknown (a remote host's heartbeat needs the shared storage mounted
        on the control plane)."""
        from vmplane.hosts.liveness import Signal, local_signal

        with self.plane.db.read() as s:
            row = s.connection().execute(select(L.HOSTS.c.driver, L.HOSTS.c.uri).where(L.HOSTS.c.name == name)).first()
        try:
            # a host removed meanwhile (row None) fails here, and is "can not be read" below, as always
            driver, uri = row.driver, row.uri  # type: ignore[union-attr]  # the AttributeError is the answer
            if driver == "sim":
                from vmplane.hosts.fencing.sim import sim_signal

                return sim_signal(self._fabric(name), name)
            return (local_signal(uri) if uri else None) or Signal(None, "no second signal for a remote host")
        except Exception as exc:  # noqa: BLE001 - a second signal that fails is "unknown"
            return Signal(None, f"can not be read ({exc})")

    def declare(self, name: str, reason: str) -> str | None:
        """Declare `name` failed: `fencing`, with a recovery operation that runs now. None if it is not
        down (any more) or a recovery of it already runs."""
        with self.plane.capacity.lock:
            with self.plane.db.transaction() as conn:
                row = conn.execute(select(L.HOSTS.c.state).where(L.HOSTS.c.name == name).with_for_update()).first()
                if row is None or row.state not in (HostState.down.value, HostState.fencing.value):
                    return None
                if self._recovering(conn, name):
                    return None
                L.set_host_state(conn, name, HostState.fencing, f"declared failed: {reason}", state_reason=reason)
                op_id = self.recovery.begin(conn, name, reason)
            self.plane.capacity.set_state(name, HostState.fencing)
        log.error("host %s declared failed: %s", name, reason)
        self._launch(op_id)
        return op_id

    @staticmethod
    def _recovering(conn, name: str) -> str | None:
        op = L.OPERATIONS.c
        return conn.execute(
            select(op.id).where(op.kind == "recover", op.target == name, op.state.in_(IN_FLIGHT))
        ).scalar()

    def _launch(self, op_id: str) -> None:
        self.plane.executor.submit(self.plane.ops.run, op_id, self.recovery.run, CAUSE)

    # -- what operators do -----------------------------------------------------------------------
    def fence(self, name: str, confirm_off: bool = False, who: str = "an operator") -> dict:
        """`host fence NAME`: fence a host that does not answer now, without waiting for the grace.
        `--confirm-off`: the operator's word that it is off (pulled the plug, checked the BMC): its HA
        VMs are restarted without asking an agent. Refused for a host that answers."""
        with self.plane.db.read() as s:
            row = s.connection().execute(select(L.HOSTS).where(L.HOSTS.c.name == name)).first()
        if row is None:
            raise NotFound(f"host {name!r} does not exist", field="host")
        if row.state not in (HostState.down.value, HostState.fencing.value, HostState.fenced.value):
            raise Conflict(
                f"host {name} is {row.state}: it answers; only a host that does not can be fenced "
                f"(maintenance drains a host that answers)",
                field="host",
            )
        if row.state == HostState.fenced.value:
            with self.plane.db.read() as s:
                stranded = bool(self.stranded(s.connection(), name))
            if not stranded:
                raise Conflict(
                    f"host {name} is already fenced ({row.state_reason}) and nothing is left to recover there",
                    field="host",
                )
            return self.recover(name, who)  # a recovery that failed left it so: run again
        if confirm_off:
            with self.plane.capacity.lock:
                with self.plane.db.transaction() as conn:
                    how = f"confirmed off by {who}"
                    L.set_host_state(conn, name, HostState.fenced, how, state_reason=how)
                    op_id = self._recovering(conn, name)
                    if op_id is None:
                        op_id = self.recovery.begin(conn, name, how)
                        L.set_operation(conn, op_id, step="restarting")
                        launch = True
                    else:
                        launch = False  # the running recovery sees `fenced` on its next attempt
                self.plane.capacity.set_state(name, HostState.fenced)
            if launch:
                self._launch(op_id)
            return {"host": name, "state": HostState.fenced.value, "operation": op_id}
        with acting_as("operator"):
            op_id = self.declare(name, f"fenced by hand ({who})") or self._current(name)
        return {"host": name, "state": HostState.fencing.value, "operation": op_id}

    def _current(self, name: str) -> str | None:
        with self.plane.db.read() as s:
            return self._recovering(s.connection(), name)

    def set_agents(self, name: str, agents: list[dict]) -> list[dict]:
        from vmplane.hosts.fencing import validate as validate_agents

        try:
            agents = validate_agents(agents)
        except ValueError as exc:
            raise Invalid(f"fence agent: {exc}", field="agents") from None
        with self.plane.db.transaction() as conn:
            if conn.execute(L.HOSTS.update().where(L.HOSTS.c.name == name).values(fence_agents=agents)).rowcount != 1:
                raise NotFound(f"host {name!r} does not exist", field="host")
        return agents

    def set_policy(self, vm: str, policy: str | None, priority: int | None) -> None:
        """`vm update --ha restart|off --ha-priority N`. Restart needs every disk of the VM on a shared
        pool: a disk on a host's own pool is lost with that host."""
        from vmplane.store import storageledger as SL

        with self.plane.db.transaction() as conn:
            row = L.vm_row(conn, name=vm, lock=True)
            policy = check_ha(policy or row.ha_policy, row.ha_priority if priority is None else priority)
            if policy == "restart":
                local = [v.name for v in SL.vm_volumes(conn, row.id) if v.pool_kind != "shared"]
                if local:
                    raise Invalid(
                        f"--ha restart needs every disk of vm {vm} on a shared pool: {', '.join(local)} "
                        f"would be lost with its host",
                        field="ha_policy",
                    )
            L.set_vm(conn, row.id, ha_policy=policy, ha_priority=row.ha_priority if priority is None else priority)

    def nemesis(self, name: str, mode: str | None) -> dict:
        """`host fail NAME --mode M` (mode None: `host recover NAME`) on a local or simulated host."""
        with self.plane.db.read() as s:
            row = s.connection().execute(select(L.HOSTS).where(L.HOSTS.c.name == name)).first()
        if row is None:
            raise NotFound(f"host {name!r} does not exist", field="host")
        if row.driver == "sim":
            fabric = self._fabric(name)
            fabric.fail_host(name, mode) if mode else fabric.recover_host(name)
        else:
            from vmplane.hosts import localhosts

            local = localhosts.from_uri(row.uri) if row.uri else None
            if local is None:
                raise Conflict(
                    f"host {name} is a remote host ({row.uri}); the nemesis only acts on local and simulated hosts",
                    field="host",
                )
            try:
                localhosts.fail(local, mode) if mode else localhosts.recover(local)
            except (ValueError, RuntimeError) as exc:
                raise Conflict(f"host {name}: {exc}", field="mode") from None
        log.warning("nemesis: host %s %s", name, f"fails ({mode})" if mode else "recovers")
        return {"host": name, "failed": mode}

    def _fabric(self, host: str) -> SimFabric:
        """The simulated fabric of a sim host (its driver is a SimDriver)."""
        return cast("SimDriver", self.plane.drivers[host]).fabric

    def agent(self, config: dict, row):
        """The fence agent of one config entry of host `row`."""
        if config.get("agent") == "sim":
            from vmplane.hosts.fencing.sim import SimAgent

            return SimAgent(self._fabric(row.name))
        from vmplane.hosts.fencing import agent_for

        return agent_for(config, row.uri, row.name)


HA_POLICIES = ("restart", "off")
MAX_PRIORITY = 1000


def check_ha(policy: str, priority: int) -> str:
    """A VM's HA policy and priority, checked (Invalid naming the field)."""
    if policy not in HA_POLICIES:
        raise Invalid(f"ha_policy must be restart or off, got {policy!r}", field="ha_policy")
    if not 0 <= priority <= MAX_PRIORITY:
        raise Invalid(f"ha_priority must be in 0..{MAX_PRIORITY}, got {priority}", field="ha_priority")
    return policy
