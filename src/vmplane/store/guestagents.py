"""What running VMs' guest agents last said, in the store (issue 30): one row per VM (`guest_agents`),
written by the agent controller only when its answer changed; read by `vm show`, `vm list --wide`, the
console and the audit. The rules (how often, what is drift) are core/guestagent.py."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import delete, insert, select, update
from sqlalchemy.engine import Connection

from vmplane.core import guestagent as rules
from vmplane.core.driver import GuestInterface
from vmplane.store import ledger as L
from vmplane.store.schema import GuestAgent, Nic, Vm, utcnow

AGENTS = GuestAgent.__table__
RUNNING = ("running", "scaling")


@dataclass(frozen=True)
class AgentView:
    state: str  # connected | none
    interfaces: list[GuestInterface]
    host: str


@dataclass(frozen=True)
class RunningVm:
    vm_id: int
    name: str
    nics: dict[str, str]  # MAC -> recorded IP


def running(conn: Connection, host: str | None = None) -> dict[str, list[RunningVm]]:
    """{host: the VMs running there, with their NICs' recorded addresses}, of one host or of all (one
    query either way)."""
    v, h, n = Vm.__table__.c, L.HOSTS.c, Nic.__table__.c
    q = (
        select(h.name.label("host"), v.id, v.name, n.mac, n.ip)
        .join(L.HOSTS, h.id == v.host_id)
        .outerjoin(Nic.__table__, (n.vm_id == v.id) & n.mac.is_not(None))
        .where(v.state.in_(RUNNING))
        .order_by(v.id)
    )
    if host is not None:
        q = q.where(h.name == host)
    vms: dict[int, tuple[str, RunningVm]] = {}
    for r in conn.execute(q):
        _host, vm = vms.setdefault(r.id, (r.host, RunningVm(r.id, r.name, {})))
        if r.mac is not None:
            vm.nics[r.mac] = r.ip
    out: dict[str, list[RunningVm]] = {}
    for where, vm in vms.values():
        out.setdefault(where, []).append(vm)
    return out


def running_on(conn: Connection, host: str) -> list[RunningVm]:
    """The VMs running on `host`, with their NICs' recorded addresses."""
    return running(conn, host).get(host, [])


def views(conn: Connection, vm_ids: Iterable[int] | None = None) -> dict[int, AgentView]:
    """{vm_id: what its agent last said}; VMs never read have none."""
    q = select(AGENTS)
    if vm_ids is not None:
        q = q.where(AGENTS.c.vm_id.in_(list(vm_ids)))
    return {r.vm_id: AgentView(r.state, rules.from_json(r.interfaces), r.host) for r in conn.execute(q)}


def record(conn: Connection, vm_id: int, host: str, state: str, interfaces: list[GuestInterface]) -> bool:
    """Keep what a VM's agent said on `host`; whether it changed (nothing is written when it did not)."""
    text = rules.to_json(interfaces)
    row = conn.execute(select(AGENTS).where(AGENTS.c.vm_id == vm_id)).first()
    if row is not None and (row.state, row.interfaces, row.host) == (state, text, host):
        return False
    values = {"state": state, "interfaces": text, "host": host, "changed_at": utcnow()}
    if row is None:
        conn.execute(insert(AGENTS).values(vm_id=vm_id, **values))
    else:
        conn.execute(update(AGENTS).where(AGENTS.c.vm_id == vm_id).values(**values))
    return True


def forget_stopped(conn: Connection) -> int:
    """Drop the rows of VMs no longer running (their agent said nothing since): how many."""
    v = Vm.__table__.c
    running = select(v.id).where(v.state.in_(RUNNING))
    return conn.execute(delete(AGENTS).where(AGENTS.c.vm_id.not_in(running))).rowcount or 0
