"""The console's reads of guest networks (issue 29): a VM's NICs, a project's networks and security groups, the
networks a host carries, the networks list and one network's NICs. Each read is one or two SQL statements
whatever the number of networks, NICs or VMs: counts are correlated subqueries and a section's total is a
window count in the same statement (never a Python loop over rows, never one query per row)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Select, distinct, func, or_, select

from vmplane.core import networks as rules
from vmplane.core.errors import NotFound
from vmplane.store import guestagents as guest_agents
from vmplane.store.schema import Network, Nic, NicSecGroup, Project, SecGroup, SecGroupRule, Vm, Zone

NETWORKS, NICS, VMS = Network.__table__, Nic.__table__, Vm.__table__
GROUPS, RULES, MEMBERS = SecGroup.__table__, SecGroupRule.__table__, NicSecGroup.__table__
N, NIC, V, P, Z = NETWORKS.c, NICS.c, VMS.c, Project.__table__.c, Zone.__table__.c
G, R, M = GROUPS.c, RULES.c, MEMBERS.c


def guest_addresses(cidr: str) -> int:
    """The addresses NICs may take: the network's host addresses less the gateway's and the DHCP server's
    (as the API counts them: api/routers/networks._guest_addresses)."""
    first, last = rules.usable(rules.parse_cidr(cidr))
    return int(last) - int(first) + 1 - 2


def _visible(project_id: int | None):
    """The networks a project's member may see or use: its own and the shared provider ones (None: every one)."""
    return None if project_id is None else or_(N.project_id == project_id, N.shared.is_(True))


def _network_columns(project_id: int | None) -> Select:
    """A network with its addresses used (every NIC on it) and its VMs (a project's only, when given: a shared
    network's other VMs are other projects')."""
    used = select(func.count()).where(NIC.network_id == N.id).correlate(NETWORKS).scalar_subquery()
    vms = select(func.count(distinct(NIC.vm_id))).where(NIC.network_id == N.id).correlate(NETWORKS)
    if project_id is not None:  # (the join only then: every network's NICs' VMs are read otherwise)
        vms = vms.join_from(NICS, VMS, V.id == NIC.vm_id).where(V.project_id == project_id)
    return select(
        N.id,
        N.name,
        N.kind,
        N.project_id,
        P.name.label("project"),
        Z.name.label("zone"),
        N.cidr,
        N.gateway,
        N.shared,
        used.label("addresses_used"),
        vms.scalar_subquery().label("vm_count"),
    ).select_from(NETWORKS.outerjoin(Project.__table__, P.id == N.project_id).join(Zone.__table__, Z.id == N.zone_id))


def _network_dict(row) -> dict[str, Any]:
    out = dict(row._mapping)
    out["addresses_total"] = guest_addresses(row.cidr)
    out["shared"] = bool(row.shared)
    return out


def network_page(db, project_id: int | None, limit: int, offset: int = 0) -> tuple[list[dict], int]:
    """One page of networks by name and their total: every one, or (`project_id`) the project's and the shared
    provider networks it may use, with that project's VMs on each."""
    stmt, count = _network_columns(project_id), select(func.count()).select_from(NETWORKS)
    where = _visible(project_id)
    if where is not None:
        stmt, count = stmt.where(where), count.where(where)
    with db.read() as s:
        conn = s.connection()
        total = conn.execute(count).scalar_one()
        rows = conn.execute(stmt.order_by(N.name).limit(limit).offset(offset))
        return [_network_dict(r) for r in rows], total


def network_detail(db, name: str, project_id: int | None, limit: int) -> tuple[dict, list[dict], int]:
    """A network the caller may see (else 404 in the API's words), its NICs by VM (a member: its own VMs') up to
    `limit`, and how many there are. Two statements."""
    nics_shown = select(func.count()).select_from(NICS.join(VMS, V.id == NIC.vm_id)).where(NIC.network_id == N.id)
    if project_id is not None:
        nics_shown = nics_shown.where(V.project_id == project_id)
    stmt = _network_columns(project_id).add_columns(nics_shown.correlate(NETWORKS).scalar_subquery().label("nic_total"))
    with db.read() as s:
        conn = s.connection()
        row = conn.execute(stmt.where(N.name == name)).first()
        if row is None or not (project_id is None or row.project_id == project_id or row.shared):
            raise NotFound(f"network {name!r} does not exist", field="network")
        nics = select(V.name.label("vm"), NIC.slot, NIC.mac, NIC.ip, NIC.state).join(VMS, V.id == NIC.vm_id)
        nics = nics.where(NIC.network_id == row.id)
        if project_id is not None:
            nics = nics.where(V.project_id == project_id)
        listed = [dict(r._mapping) for r in conn.execute(nics.order_by(V.name, NIC.slot).limit(limit))]
    return _network_dict(row), listed, int(row.nic_total)


def vm_nics(db, vm_id: int) -> list[dict]:
    """A VM's NICs in slot order, each with its network (name, kind) and its security groups' names. Two
    statements: the NICs, then every membership of those NICs."""
    stmt = (
        select(NIC.id, NIC.slot, NIC.mac, NIC.ip, NIC.state, N.name.label("network"), N.kind, N.shared)
        .join(NETWORKS, N.id == NIC.network_id)
        .where(NIC.vm_id == vm_id)
        .order_by(NIC.slot)
    )
    with db.read() as s:
        conn = s.connection()
        nics = [dict(r._mapping, secgroups=[]) for r in conn.execute(stmt)]
        if nics:
            by_id = {n["id"]: n for n in nics}
            groups = select(M.nic_id, G.name).join(GROUPS, G.id == M.secgroup_id).where(M.nic_id.in_(list(by_id)))
            for nic_id, group in conn.execute(groups.order_by(G.name)):
                by_id[nic_id]["secgroups"].append(group)
    return nics


def project_groups(db, project_id: int, limit: int) -> tuple[list[dict], int]:
    """A project's security groups by name with their rule and member-NIC counts, and how many it has."""
    rule_count = select(func.count()).where(R.secgroup_id == G.id).correlate(GROUPS).scalar_subquery()
    member_count = select(func.count()).where(M.secgroup_id == G.id).correlate(GROUPS).scalar_subquery()
    stmt = (
        select(G.name, rule_count.label("rule_count"), member_count.label("member_count"), func.count().over())
        .where(G.project_id == project_id)
        .order_by(G.name)
        .limit(limit)
    )
    with db.read() as s:
        rows = list(s.connection().execute(stmt))
    return [dict(name=r[0], rule_count=r[1], member_count=r[2]) for r in rows], (rows[0][3] if rows else 0)


def host_networks(db, zone_id: int, host_id: int, limit: int) -> tuple[list[dict], int]:
    """The networks of a host's zone (every host of a zone carries all of them) by name, each with its device
    names and VNI on the host and the NICs of the VMs recorded there, and how many the zone has."""
    # the host's NICs by network: from its VMs (an index on vms.host_id), not through every NIC of the zone
    here = (
        select(NIC.network_id, func.count().label("n"))
        .select_from(VMS.join(NICS, NIC.vm_id == V.id))
        .where(V.host_id == host_id)
        .group_by(NIC.network_id)
        .subquery()
    )
    stmt = (
        select(N.id, N.name, N.kind, N.cidr, N.shared, P.name.label("project"))
        .add_columns(func.coalesce(here.c.n, 0).label("nics_here"), func.count().over().label("total"))
        .select_from(
            NETWORKS.outerjoin(Project.__table__, P.id == N.project_id).outerjoin(here, here.c.network_id == N.id)
        )
        .where(N.zone_id == zone_id)
        .order_by(N.name)
        .limit(limit)
    )
    with db.read() as s:
        rows = list(s.connection().execute(stmt))
    out = [
        dict(r._mapping, bridge=rules.bridge_of(r.id), vxlan=rules.vxlan_of(r.id), vni=rules.vni_of(r.id)) for r in rows
    ]
    return out, (rows[0].total if rows else 0)


def vm_agent(db, vm_id: int, vm_state: str) -> dict | None:
    """What a running VM's guest agent last said, for its page: {state, by_mac: {MAC: [ADDR/PREFIX]}}, or
    None when the VM does not run or was not asked yet."""
    if vm_state not in guest_agents.RUNNING:
        return None
    with db.read() as s:
        view = guest_agents.views(s.connection(), [vm_id]).get(vm_id)
    if view is None:
        return None
    by_mac = {i.mac.lower(): [a for a in i.addresses if ":" not in a] for i in view.interfaces}
    return {"state": view.state, "by_mac": by_mac}
