"""Guest networks in the store: networks, and NICs with their MAC and address, inside a caller's write
transaction (the rules are core/networks.py).

Addresses are allocated exactly once under concurrency: a NIC's transaction locks its network's row first
(every allocation on that network waits for it), reads the addresses taken, picks one and inserts the NIC;
the unique constraint on (network, ip) is the backstop. Its MAC follows from its row id (core.networks.mac_of),
set in the same transaction. A project's isolated networks never overlap: a create locks the project row
before it compares; a zone's provider networks likewise under the zone's row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.engine import Connection, Row
from sqlalchemy.exc import IntegrityError

from vmplane.core import networks as rules
from vmplane.core.errors import AlreadyExists, Conflict, Invalid, NotFound
from vmplane.core.names import check_name
from vmplane.store import ledger as L
from vmplane.store import secgroups as sg
from vmplane.store.schema import Network, Nic, Vm, Zone

NETWORKS = Network.__table__
NICS = Nic.__table__
KINDS = ("isolated", "provider")


@dataclass(frozen=True)
class NicRecord:
    id: int
    vm_id: int
    network: str
    slot: int
    mac: str
    ip: str


def create_network(
    conn: Connection,
    name: str,
    kind: str,
    zone_id: int,
    cidr: str,
    gateway: str | None = None,
    project_id: int | None = None,
    shared: bool = False,
) -> int:
    """Insert a network after its rules: a valid name and CIDR, a gateway inside it, no overlap with the
    project's (isolated) or the zone's (provider) other networks. Returns its id."""
    check_name(name)
    if kind not in KINDS:
        raise Invalid(f"kind must be one of {', '.join(KINDS)}, not {kind!r}", field="kind")
    if (kind == "isolated") != (project_id is not None):
        raise Invalid("an isolated network belongs to a project; a provider network to none", field="project")
    if shared and kind != "provider":
        raise Invalid("only a provider network is shared between projects", field="shared")
    net = rules.parse_cidr(cidr)
    gw = rules.gateway_for(net, gateway)
    c, z = NETWORKS.c, Zone.__table__.c
    if project_id is not None:  # a project's networks are compared under its row's lock, a zone's under its own
        L.lock_project(conn, project_id)
    zone = select(z.id).where(z.id == zone_id)
    if conn.execute(zone if project_id is not None else zone.with_for_update()).first() is None:
        raise NotFound(f"zone #{zone_id} does not exist", field="zone")
    same = (c.project_id == project_id) if project_id is not None else (c.kind == "provider") & (c.zone_id == zone_id)
    others = [(r.name, rules.parse_cidr(r.cidr)) for r in conn.execute(select(c.name, c.cidr).where(same))]
    clash = rules.overlapping(net, others)
    if clash is not None:
        owner = "the project's" if project_id is not None else "the zone's provider"
        raise Conflict(f"cidr {net} overlaps {owner} network {clash}", field="cidr")
    try:
        result = conn.execute(
            insert(NETWORKS).values(
                name=name,
                kind=kind,
                project_id=project_id,
                zone_id=zone_id,
                cidr=str(net),
                gateway=str(gw),
                shared=shared,
            )
        )
    except IntegrityError:
        raise AlreadyExists(f"network {name!r} already exists", field="name") from None
    return int(result.inserted_primary_key[0])  # type: ignore[index]


def network_row(conn: Connection, name: str, lock: bool = False) -> Row[Any]:
    stmt = select(NETWORKS).where(NETWORKS.c.name == name)
    row = conn.execute(stmt.with_for_update() if lock else stmt).first()
    if row is None:
        raise NotFound(f"network {name!r} does not exist", field="network")
    return row


def network_rows(conn: Connection, project_id: int | None = None) -> list[Row[Any]]:
    """Every network, or those a project's member may use: its own and the shared provider networks."""
    c = NETWORKS.c
    stmt = select(NETWORKS).order_by(c.name)
    if project_id is not None:
        stmt = stmt.where((c.project_id == project_id) | (c.shared.is_(True)))
    return list(conn.execute(stmt))


def users_of(conn: Connection, network_id: int) -> list[str]:
    """The VMs with a NIC on the network, by name."""
    v = Vm.__table__.c
    stmt = select(v.name).join(NICS, NICS.c.vm_id == v.id).where(NICS.c.network_id == network_id).order_by(v.name)
    return list(dict.fromkeys(conn.execute(stmt).scalars()))


def delete_network(conn: Connection, name: str) -> None:
    """Delete a network no NIC uses; refused (409) naming the VMs that still have one on it."""
    row = network_row(conn, name, lock=True)
    users = users_of(conn, row.id)
    if users:
        shown = ", ".join(users[:10]) + (f" and {len(users) - 10} more" if len(users) > 10 else "")
        raise Conflict(f"network {name} is in use by the NICs of {shown}; remove them first", field="network")
    conn.execute(NETWORKS.delete().where(NETWORKS.c.id == row.id))


def add_nic(conn: Connection, vm_id: int, network: str, ip: str | None = None) -> NicRecord:
    """A NIC for the VM on `network`, with the address asked for (checked) or the lowest free one, and its
    MAC; the VM's next slot. Locks the network's row: allocations on one network are one at a time."""
    row = network_row(conn, network, lock=True)
    net, gateway = rules.parse_cidr(row.cidr), rules.parse_address(row.gateway, "gateway")
    c = NICS.c
    taken = [rules.parse_address(a) for a in conn.execute(select(c.ip).where(c.network_id == row.id)).scalars()]
    if ip is not None:
        address = rules.check_address(net, gateway, taken, rules.parse_address(ip), row.name)
    else:
        address = rules.next_address(net, gateway, taken, row.name)
    slot = conn.execute(select(func.coalesce(func.max(c.slot) + 1, 0)).where(c.vm_id == vm_id)).scalar_one()
    try:
        nic_id = int(
            conn.execute(
                insert(NICS).values(
                    vm_id=vm_id,
                    network_id=row.id,
                    slot=slot,
                    ip=str(address),
                    state="attached",
                )
            ).inserted_primary_key[0]  # type: ignore[index]
        )
    except IntegrityError:  # the network's lock makes this a bug, not a race: say so plainly
        raise Conflict(f"ip {address} is taken on network {row.name}", field="ip") from None
    mac = rules.mac_of(nic_id)
    conn.execute(update(NICS).where(c.id == nic_id).values(mac=mac))
    return NicRecord(nic_id, vm_id, row.name, slot, mac, str(address))


def nics_of(conn: Connection, vm_id: int) -> list[NicRecord]:
    c, n = NICS.c, NETWORKS.c
    rows = conn.execute(
        select(c.id, c.vm_id, n.name, c.slot, c.mac, c.ip)
        .join(NETWORKS, n.id == c.network_id)
        .where(c.vm_id == vm_id)
        .order_by(c.slot)
    )
    return [NicRecord(r.id, r.vm_id, r.name, r.slot, r.mac, r.ip) for r in rows]


def add_vm_nics(
    conn: Connection,
    vm_id: int,
    project_id: int,
    zone_id: int | None,
    networks: Sequence[tuple[str, str | None]],
    secgroups: Sequence[str] = (),
) -> list[NicRecord]:
    """The NICs of a new VM, in order (the first is the first network), each in the project's `secgroups`
    (none named: `default`). A network of another project is reported as not existing; one of another zone,
    a 4xx naming `networks`. Inside the VM's own transaction: nothing is made when one is refused."""
    made = []
    groups = [sg.group_row(conn, project_id, g).id for g in secgroups] or [sg.ensure_default(conn, project_id)]
    for name, ip in networks:
        row = network_row(conn, name)
        if row.kind == "isolated" and row.project_id != project_id:
            raise NotFound(f"network {name} not found", field="networks")
        if zone_id is not None and row.zone_id != zone_id:
            zones = Zone.__table__.c
            found = conn.execute(select(zones.id, zones.name).where(zones.id.in_([row.zone_id, zone_id])))
            names: dict[int, str] = {int(r.id): str(r.name) for r in found}
            raise Invalid(
                f"network {name} is in zone {names.get(row.zone_id)}, the VM in zone {names.get(zone_id)}",
                field="networks",
            )
        nic = add_nic(conn, vm_id, name, ip)
        for gid in groups:
            sg.join(conn, nic.id, gid)
        made.append(nic)
    return made


def zone_of_network(conn: Connection, name: str) -> str:
    row = network_row(conn, name)
    return str(conn.execute(select(Zone.__table__.c.name).where(Zone.__table__.c.id == row.zone_id)).scalar_one())


def delete_nic(conn: Connection, nic_id: int) -> None:
    """A NIC and its group memberships: its MAC and address are free again."""
    conn.execute(sg.MEMBERS.delete().where(sg.MEMBERS.c.nic_id == nic_id))
    conn.execute(NICS.delete().where(NICS.c.id == nic_id))


def nics_between_steps(conn: Connection) -> list[tuple[int, str, str, str, str | None, str, Any]]:
    """(NIC id, MAC, state, VM, host, VM state, NIC created at) of every NIC left attaching or detaching."""
    c, v, h = NICS.c, Vm.__table__.c, L.HOSTS.c
    return [
        (r.id, r.mac, r.state, r.name, r.host, r.vm_state, r.created_at)
        for r in conn.execute(
            select(c.id, c.mac, c.state, v.name, h.name.label("host"), v.state.label("vm_state"), c.created_at)
            .join(Vm.__table__, v.id == c.vm_id)
            .outerjoin(L.HOSTS, h.id == v.host_id)
            .where(c.state.in_(["attaching", "detaching"]))
        )
    ]


def running_nics(conn: Connection) -> dict[tuple[str, str], dict[str, str]]:
    """{(VM, host): {MAC: state}} of every running VM that has NICs."""
    c, v, h = NICS.c, Vm.__table__.c, L.HOSTS.c
    out: dict[tuple[str, str], dict[str, str]] = {}
    rows = conn.execute(
        select(v.name, h.name.label("host"), c.mac, c.state)
        .join(Vm.__table__, v.id == c.vm_id)
        .join(L.HOSTS, h.id == v.host_id)
        .where(v.state == "running", c.mac.is_not(None))
    )
    for r in rows:
        out.setdefault((r.name, r.host), {})[r.mac] = r.state
    return out
