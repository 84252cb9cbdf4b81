"""What one host must hold for its guests' networks, read from the store in one transaction (issue 29): its
zone's networks and hosts (the plan), the NICs it runs or is about to receive (the filter's ports), the
rules and members of their security groups, and each network's DHCP reservations. The result is plain data
for core/hostnet and core/netfilter; the networking controller hands it to the host's driver.

A NIC is a port of the host its VM is recorded on, and of the target of its VM's migration under way (the
target holds its filter before the copy starts). Every host of a zone serves DHCP for every NIC of the
zone's networks: each host's server answers only its own guests (the filter keeps DHCP off the VXLAN
ports), so a migrated or restarted guest finds its reservation wherever it lands.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.engine import Connection

from vmplane.core import hostnet as H
from vmplane.core import networks as N
from vmplane.core.driver import NicSpec
from vmplane.core.migration import ACTIVE
from vmplane.core.netfilter import Port
from vmplane.core.networks import Rule
from vmplane.store.schema import Cluster, Host, Migration, Network, Nic, NicSecGroup, SecGroupRule, Vm, Zone

_ACTIVE = [st.value for st in ACTIVE]


@dataclass(frozen=True)
class ZoneHost:
    name: str
    migration_address: str | None
    uri: str | None


def zone_of(conn: Connection, host: str) -> int | None:
    h, c = Host.__table__.c, Cluster.__table__.c
    return conn.execute(select(c.zone_id).join(Host.__table__, h.cluster_id == c.id).where(h.name == host)).scalar()


def zone_hosts(conn: Connection, zone_id: int) -> list[ZoneHost]:
    h, c = Host.__table__.c, Cluster.__table__.c
    rows = conn.execute(
        select(h.name, h.migration_address, h.uri)
        .join(Cluster.__table__, h.cluster_id == c.id)
        .where(c.zone_id == zone_id)
    ).all()
    return [ZoneHost(*r) for r in rows]


def zones_with_networks(conn: Connection) -> list[str]:
    """The names of the zones that have a network."""
    n, z = Network.__table__.c, Zone.__table__.c
    return list(conn.execute(select(z.name).where(z.id.in_(select(n.zone_id).distinct()))).scalars())


def group_key(group_id: int) -> str:
    return f"g{group_id}"


def host_networks(
    conn: Connection, host: str, underlay: Callable[[ZoneHost], str], underlay_mtu: int = 1500
) -> H.HostNetworks | None:
    """What `host` must hold; None when it has no zone (not in the store). `underlay` gives a host's address
    on the network between hosts."""
    zone_id = zone_of(conn, host)
    if zone_id is None:
        return None
    n, nic, v, m = Network.__table__.c, Nic.__table__.c, Vm.__table__.c, Migration.__table__.c
    hosts = {zh.name: underlay(zh) for zh in zone_hosts(conn, zone_id)}
    nets = conn.execute(select(n.id, n.cidr, n.gateway, n.kind).where(n.zone_id == zone_id).order_by(n.id)).all()
    views = [H.NetworkView(i, str(zone_id), cidr, gw, kind == "provider") for i, cidr, gw, kind in nets]
    plan = H.plan(host, str(zone_id), hosts, views, underlay_mtu)
    host_id = conn.execute(select(Host.__table__.c.id).where(Host.__table__.c.name == host)).scalar_one()
    incoming = select(m.vm_id).where(m.target_host_id == host_id, m.state.in_(_ACTIVE))
    nics = conn.execute(
        select(nic.id, nic.network_id, nic.mac, nic.ip, v.host_id, v.id.in_(incoming).label("incoming"))
        .join(Vm.__table__, v.id == nic.vm_id)
        .join(Network.__table__, n.id == nic.network_id)
        .where(n.zone_id == zone_id, nic.mac.is_not(None))
        .order_by(nic.id)
    ).all()
    ms = NicSecGroup.__table__.c
    zone_nics = select(nic.id).join(Network.__table__, n.id == nic.network_id).where(n.zone_id == zone_id)
    groups: dict[int, list[str]] = {}
    group_ids: set[int] = set()
    for nic_id, gid in conn.execute(select(ms.nic_id, ms.secgroup_id).where(ms.nic_id.in_(zone_nics))):
        groups.setdefault(nic_id, []).append(group_key(gid))
        group_ids.add(gid)
    members: dict[str, list[str]] = {}
    for row in nics:
        for key in groups.get(row.id, []):
            members.setdefault(key, []).append(row.ip)
    ports = tuple(
        Port(N.tap_of(r.id), N.bridge_of(r.network_id), r.mac, r.ip, tuple(sorted(groups.get(r.id, []))))
        for r in nics
        if r.host_id == host_id or r.incoming
    )
    r = SecGroupRule.__table__.c
    rules: dict[str, list[Rule]] = {}
    for row in conn.execute(  # the rules of the zone's NICs' groups only (the filter reads no other)
        select(r.secgroup_id, r.direction, r.proto, r.port_min, r.port_max, r.cidr, r.remote_group_id).where(
            r.secgroup_id.in_(group_ids)
        )
    ):
        remote = group_key(row.remote_group_id) if row.remote_group_id is not None else None
        rule = Rule(row.direction, row.proto, row.port_min, row.port_max, row.cidr, remote)
        rules.setdefault(group_key(row.secgroup_id), []).append(rule)
    dhcp = tuple(
        H.Dhcp(
            N.bridge_of(net_id),
            cidr,
            gateway if kind == "provider" else None,
            tuple(sorted((r.mac, r.ip) for r in nics if r.network_id == net_id)),
        )
        for net_id, cidr, gateway, kind in nets
    )
    return H.HostNetworks(
        plan,
        ports,
        {k: tuple(v) for k, v in rules.items()},
        {k: tuple(sorted(v)) for k, v in members.items()},
        dhcp,
    )


def nic_specs(conn: Connection, vm_id: int, underlay_mtu: int = 1500) -> tuple[NicSpec, ...]:
    """The interfaces of a VM's domain, in slot order (its first NIC first); a NIC carried over VXLAN gets an
    MTU below the underlay's (a provider network's is the uplink's own)."""
    nic, n = Nic.__table__.c, Network.__table__.c
    rows = conn.execute(
        select(nic.id, nic.network_id, nic.mac, n.kind)
        .join(Network.__table__, n.id == nic.network_id)
        .where(nic.vm_id == vm_id, nic.mac.is_not(None))
        .order_by(nic.slot)
    ).all()
    return tuple(
        NicSpec(mac, N.bridge_of(net), N.tap_of(nic_id), underlay_mtu - (0 if kind == "provider" else H.VXLAN_OVERHEAD))
        for nic_id, net, mac, kind in rows
    )
