"""Guest networks and security groups: the API over store/networks.py and store/secgroups.py.

Each request is one transaction: a refusal (bad input, an overlap, a network or group in use) leaves nothing
half-made. Every change the hosts must apply (networks made or deleted, rules, memberships, groups deleted)
tells the networking controller once its transaction has committed (`orch.networking.changed()`), which
re-applies the hosts' networks and filters. Members reach their own project only; another project's network
or group is reported as not existing, as elsewhere.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path
from pydantic import Field, StrictBool, StrictInt
from sqlalchemy import func, select
from sqlalchemy.engine import Connection, Row

from vmplane.api.deps import AnyCaller, Caller, Orch, require_admin
from vmplane.api.paging import StrictQueryRoute
from vmplane.api.schemas import INT_MAX, Name, Request, Response, UtcDatetime
from vmplane.core import networks as rules
from vmplane.core.errors import Invalid, NotFound
from vmplane.store import networks as NW
from vmplane.store import secgroups as SG
from vmplane.store.schema import Project, Vm, Zone

router = APIRouter(tags=["networks"], route_class=StrictQueryRoute)

_N, _NIC, _P, _V, _Z = NW.NETWORKS.c, NW.NICS.c, Project.__table__.c, Vm.__table__.c, Zone.__table__.c
_G, _R, _M = SG.GROUPS.c, SG.RULES.c, SG.MEMBERS.c
Address = Annotated[str, Field(max_length=64)]
RuleId = Annotated[int, Path(ge=1, le=INT_MAX)]


# -- bodies ---------------------------------------------------------------------------------------------
class NetworkCreate(Request):
    name: Name
    project: Name | None = Field(None, description="an isolated network's project; none for a provider network")
    cidr: Address = Field(description="an IPv4 network of at least 8 addresses, like 10.10.0.0/24")
    gateway: Address | None = Field(None, description="a host address inside it; default: its first")
    provider: StrictBool = Field(False, description="bridged to the hosts' uplink (admin only)")
    shared: StrictBool = Field(False, description="a provider network every project's VMs may use")
    zone: Name | None = Field(None, description="default: the only zone")


class NetworkNic(Response):
    vm: str
    mac: str | None
    ip: str
    state: str


class NetworkOut(Response):
    name: str
    kind: str = Field(description="isolated (a project's) or provider (bridged to the hosts' uplink)")
    project: str | None
    zone: str
    cidr: str
    gateway: str
    shared: bool
    addresses_used: int = Field(description="NICs on it")
    addresses_total: int = Field(description="addresses NICs may take (not the gateway's nor the DHCP server's)")
    nics: list[NetworkNic] | None = Field(None, description="the NICs on it (show only; a member: its own VMs')")
    created_at: UtcDatetime


class SecGroupCreate(Request):
    name: Name
    project: Name


class RuleCreate(Request):
    direction: Literal["in", "out"]
    proto: Literal["tcp", "udp", "icmp", "any"]
    port: Annotated[str, Field(max_length=16)] | StrictInt | None = Field(
        None, description="tcp and udp: a port (22) or a range (22-23); none: every port"
    )
    from_cidr: Address | None = Field(None, description="traffic from (in) or to (out) this CIDR")
    from_group: Name | None = Field(None, description="... or from (to) the members of this group of the project")


class RuleOut(Response):
    id: int
    direction: str
    proto: str
    port: str | None
    from_cidr: str | None
    from_group: str | None


class SecGroupMember(Response):
    vm: str
    network: str
    mac: str | None
    ip: str


class SecGroupOut(Response):
    name: str
    project: str
    rule_count: int
    member_count: int = Field(description="NICs in it")
    rules: list[RuleOut] | None = Field(None, description="show only")
    members: list[SecGroupMember] | None = Field(None, description="show only")
    created_at: UtcDatetime


class VmSecGroup(Request):
    group: Name


class VmNicGroups(Response):
    network: str
    mac: str | None
    ip: str
    secgroups: list[str]


# -- shared helpers -------------------------------------------------------------------------------------
def _changed(orch) -> None:
    """The hosts' networks and filters must follow what was just committed."""
    orch.networking.changed()


def _project_id(conn: Connection, who: Caller, name: str) -> int:
    found = conn.execute(select(_P.id).where(_P.name == name)).scalar()
    if found is None:
        raise NotFound(f"project {name!r} does not exist", field="project")
    who.check_project(found, "project", name)
    return int(found)


def _listed_project(conn: Connection, who: Caller, project: str | None) -> int | None:
    """The project a list is of: the one asked for, else a member's own (an admin's: every project)."""
    if project is not None:
        return _project_id(conn, who, project)
    return None if who.is_admin else who.project_id


def nic_requests(entries: list[str]) -> list[tuple[str, str | None]]:
    """`vm create`'s networks, each "NET" or "NET:IP", as (network, address or None); 422 naming `networks`."""
    out: list[tuple[str, str | None]] = []
    for entry in entries:
        net, sep, ip = entry.partition(":")
        if not net or (sep and not ip) or ":" in ip:
            raise Invalid(f"networks: {entry!r} is not NET or NET:IP (like web or web:10.10.0.5)", field="networks")
        out.append((net, ip or None))
    return out


# -- networks -------------------------------------------------------------------------------------------
def _zone_id(conn: Connection, zone: str | None) -> int:
    """The zone asked for, else the only zone (as a VM's: core/scope.vm_scope)."""
    zones = {r.name: r.id for r in conn.execute(select(_Z.id, _Z.name))}
    if zone is not None:
        if zone not in zones:
            raise NotFound(f"zone {zone!r} does not exist; zones: {', '.join(sorted(zones)) or 'none'}", field="zone")
        return zones[zone]
    if len(zones) == 1:
        return next(iter(zones.values()))
    if not zones:
        raise Invalid("there is no zone yet; create one (vmplane zone create) first", field="zone")
    raise Invalid(f"{len(zones)} zones exist; choose the network's zone: {', '.join(sorted(zones))}", field="zone")


def _guest_addresses(cidr: str) -> int:
    """The addresses NICs may take: the hosts' ones less the gateway's and the DHCP server's."""
    first, last = rules.usable(rules.parse_cidr(cidr))
    return int(last) - int(first) + 1 - 2


_USED = select(func.count()).where(_NIC.network_id == _N.id).correlate(NW.NETWORKS).scalar_subquery()
_NETWORK_VIEW = (
    select(
        _N.id,
        _N.name,
        _N.kind,
        _P.name.label("project"),
        _N.project_id,
        _Z.name.label("zone"),
        _N.cidr,
        _N.gateway,
        _N.shared,
        _N.created_at,
        _USED.label("addresses_used"),
    )
    .select_from(NW.NETWORKS.outerjoin(Project.__table__, _P.id == _N.project_id).join(Zone.__table__))
    .order_by(_N.name)
)


def _network_view(row: Row[Any]) -> dict[str, Any]:
    return {
        "name": row.name,
        "kind": row.kind,
        "project": row.project,
        "zone": row.zone,
        "cidr": row.cidr,
        "gateway": row.gateway,
        "shared": bool(row.shared),
        "addresses_used": int(row.addresses_used),
        "addresses_total": _guest_addresses(row.cidr),
        "created_at": row.created_at,
    }


def _visible_network(conn: Connection, who: Caller, name: str) -> Row[Any]:
    """A network the caller may see: an admin any; a member its project's and the shared provider ones."""
    row = conn.execute(_NETWORK_VIEW.where(_N.name == name)).first()
    if row is None or not (who.is_admin or row.project_id == who.project_id or row.shared):
        raise NotFound(f"network {name!r} does not exist", field="network")
    return row


def _nics_on(conn: Connection, network_id: int, project_id: int | None) -> list[dict[str, Any]]:
    stmt = (
        select(_V.name.label("vm"), _NIC.mac, _NIC.ip, _NIC.state)
        .join(Vm.__table__, _V.id == _NIC.vm_id)
        .where(_NIC.network_id == network_id)
        .order_by(_V.name, _NIC.slot)
    )
    if project_id is not None:  # a shared network's other NICs are other projects' VMs
        stmt = stmt.where(_V.project_id == project_id)
    return [r._asdict() for r in conn.execute(stmt)]


@router.post("/networks", status_code=201, response_model=NetworkOut)
def create_network(body: NetworkCreate, orch: Orch, who: AnyCaller):
    """A project's isolated network (an admin or the project's member), or a provider network bridged to the
    hosts' uplink (`provider`, admin only; `shared`: every project's VMs may use it). A project's networks
    never overlap one another, nor a zone's provider networks; two projects may use one CIDR."""
    if body.provider:
        require_admin(who)
    with orch.db.transaction() as conn:
        project_id = _project_id(conn, who, body.project) if body.project is not None else None
        if project_id is None and not body.provider:
            raise Invalid("an isolated network needs its project (or provider: true, admin only)", field="project")
        NW.create_network(
            conn,
            body.name,
            "provider" if body.provider else "isolated",
            _zone_id(conn, body.zone),
            body.cidr,
            body.gateway,
            project_id,
            body.shared,
        )
        view = _network_view(_visible_network(conn, who, body.name))
    _changed(orch)
    return {**view, "nics": []}


@router.get("/networks", response_model=list[NetworkOut])
def list_networks(orch: Orch, who: AnyCaller):
    """Every network; a member: its project's and the shared provider networks."""
    stmt = _NETWORK_VIEW if who.is_admin else _NETWORK_VIEW.where((_N.project_id == who.project_id) | _N.shared)
    with orch.db.read() as s:
        return [_network_view(r) for r in s.connection().execute(stmt)]


@router.get("/networks/{name}", response_model=NetworkOut)
def show_network(name: str, orch: Orch, who: AnyCaller):
    """One network, with the NICs on it (a member sees its own VMs' NICs) and its addresses used."""
    with orch.db.read() as s:
        conn = s.connection()
        row = _visible_network(conn, who, name)
        return {**_network_view(row), "nics": _nics_on(conn, row.id, None if who.is_admin else who.project_id)}


@router.delete("/networks/{name}", status_code=204)
def delete_network(name: str, orch: Orch, who: AnyCaller) -> None:
    """Refused (409) while a NIC uses it, naming the VMs; a provider network is an admin's to delete."""
    with orch.db.transaction() as conn:
        row = _visible_network(conn, who, name)
        if row.kind == "provider":
            require_admin(who)
        NW.delete_network(conn, name)
    _changed(orch)


# -- security groups ------------------------------------------------------------------------------------
def _ports(rule: rules.Rule) -> str | None:
    if rule.port_min is None:
        return None
    return str(rule.port_min) if rule.port_min == rule.port_max else f"{rule.port_min}-{rule.port_max}"


def _rule_view(stored: SG.StoredRule) -> dict[str, Any]:
    r = stored.rule
    return {
        "id": stored.id,
        "direction": r.direction,
        "proto": r.proto,
        "port": _ports(r),
        "from_cidr": r.cidr,
        "from_group": r.group,
    }


_RULE_COUNT = select(func.count()).where(_R.secgroup_id == _G.id).correlate(SG.GROUPS).scalar_subquery()
_MEMBER_COUNT = select(func.count()).where(_M.secgroup_id == _G.id).correlate(SG.GROUPS).scalar_subquery()
_GROUP_VIEW = (
    select(
        _G.id,
        _G.name,
        _P.name.label("project"),
        _G.project_id,
        _G.created_at,
        _RULE_COUNT.label("rule_count"),
        _MEMBER_COUNT.label("member_count"),
    )
    .join(Project.__table__, _P.id == _G.project_id)
    .order_by(_P.name, _G.name)
)


def _group_view(row: Row[Any]) -> dict[str, Any]:
    return {
        "name": row.name,
        "project": row.project,
        "rule_count": int(row.rule_count),
        "member_count": int(row.member_count),
        "created_at": row.created_at,
    }


def _group_detail(conn: Connection, project_id: int, name: str) -> dict[str, Any]:
    """A group with its rules (ids to remove them by) and its member NICs."""
    row = conn.execute(_GROUP_VIEW.where(_G.project_id == project_id, _G.name == name)).first()
    if row is None:
        raise NotFound(f"security group {name!r} does not exist in the project", field="secgroup")
    members = conn.execute(
        select(_V.name.label("vm"), _N.name.label("network"), _NIC.mac, _NIC.ip)
        .select_from(SG.MEMBERS.join(NW.NICS, _NIC.id == _M.nic_id))
        .join(Vm.__table__, _V.id == _NIC.vm_id)
        .join(NW.NETWORKS, _N.id == _NIC.network_id)
        .where(_M.secgroup_id == row.id)
        .order_by(_V.name, _NIC.slot)
    )
    return {
        **_group_view(row),
        "rules": [_rule_view(r) for r in SG.rules_of(conn, project_id, name)],
        "members": [m._asdict() for m in members],
    }


@router.post("/secgroups", status_code=201, response_model=SecGroupOut)
def create_secgroup(body: SecGroupCreate, orch: Orch, who: AnyCaller):
    """A project's security group, without rules (nothing in, nothing out until rules say so). The project's
    `default` group (in from its own members, all out) is made with it when it does not exist yet."""
    with orch.db.transaction() as conn:
        project_id = _project_id(conn, who, body.project)
        SG.ensure_default(conn, project_id)
        SG.create_group(conn, project_id, body.name)
        return _group_detail(conn, project_id, body.name)


@router.get("/secgroups", response_model=list[SecGroupOut])
def list_secgroups(orch: Orch, who: AnyCaller, project: str | None = None):
    """Security groups (of `project`; a member: its own project's) with their counts of rules and members."""
    with orch.db.read() as s:
        conn = s.connection()
        project_id = _listed_project(conn, who, project)
        stmt = _GROUP_VIEW if project_id is None else _GROUP_VIEW.where(_G.project_id == project_id)
        return [_group_view(r) for r in conn.execute(stmt)]


@router.get("/secgroups/{project}/{name}", response_model=SecGroupOut)
def show_secgroup(project: str, name: str, orch: Orch, who: AnyCaller):
    """One group: its rules with their ids, and its member NICs."""
    if name == SG.DEFAULT:  # made the first time it is needed: asking for it is a need
        with orch.db.transaction() as conn:
            project_id = _project_id(conn, who, project)
            SG.ensure_default(conn, project_id)
            return _group_detail(conn, project_id, name)
    with orch.db.read() as s:
        conn = s.connection()
        return _group_detail(conn, _project_id(conn, who, project), name)


@router.delete("/secgroups/{project}/{name}", status_code=204)
def delete_secgroup(project: str, name: str, orch: Orch, who: AnyCaller) -> None:
    """Refused (409) while NICs are members or another group's rule names it, naming them."""
    with orch.db.transaction() as conn:
        SG.delete_group(conn, _project_id(conn, who, project), name)
    _changed(orch)


def _parse_rule(body: RuleCreate) -> rules.Rule:
    """The rule's own checks (core.networks.parse_rule), in the API's field names."""
    port = None if body.port is None else str(body.port)
    try:
        return rules.parse_rule(body.direction, body.proto, port, body.from_cidr, body.from_group)
    except Invalid as exc:
        if exc.field != "from":
            raise
        field = "from_group" if body.from_cidr is None and body.from_group is not None else "from_cidr"
        message = exc.message.replace("--from-group", "from_group").replace("--from", "from_cidr")
        raise Invalid(message, field=field) from None


@router.post("/secgroups/{project}/{name}/rules", status_code=201, response_model=RuleOut)
def add_secgroup_rule(project: str, name: str, body: RuleCreate, orch: Orch, who: AnyCaller):
    """A rule: traffic in (from) or out (to) a CIDR or a group of the project, by protocol and port range.
    It applies to the group's running NICs at once."""
    rule = _parse_rule(body)
    with orch.db.transaction() as conn:
        project_id = _project_id(conn, who, project)
        SG.ensure_default(conn, project_id)
        SG.group_row(conn, project_id, name)
        if rule.group is not None:
            try:
                SG.group_row(conn, project_id, rule.group)
            except NotFound as exc:
                raise NotFound(exc.message, field="from_group") from None
        rule_id = SG.add_rule(conn, project_id, name, rule)
    _changed(orch)
    return _rule_view(SG.StoredRule(rule_id, name, rule))


@router.delete("/secgroups/{project}/{name}/rules/{rule_id}", status_code=204)
def remove_secgroup_rule(project: str, name: str, rule_id: RuleId, orch: Orch, who: AnyCaller) -> None:
    """A connection the rule let in stays open (connection tracking); new ones are refused."""
    with orch.db.transaction() as conn:
        SG.remove_rule(conn, _project_id(conn, who, project), name, rule_id)
    _changed(orch)


# -- a VM's groups ----------------------------------------------------------------------------------------
def _vm_ids(conn: Connection, who: Caller, name: str) -> tuple[int, int]:
    row = conn.execute(select(_V.id, _V.project_id).where(_V.name == name)).first()
    if row is None:
        raise NotFound(f"vm {name!r} does not exist", field="vm")
    who.check_project(row.project_id, "vm", name)
    return row.id, row.project_id


def _nic_groups(conn: Connection, vm_id: int) -> list[dict[str, Any]]:
    return [
        {"network": n.network, "mac": n.mac, "ip": n.ip, "secgroups": SG.groups_of(conn, n.id)}
        for n in NW.nics_of(conn, vm_id)
    ]


def _vm_nics_in(conn: Connection, who: Caller, vm: str, group: str) -> tuple[list[NW.NicRecord], int]:
    """The VM's NICs and the group's id (of the VM's project); a VM without NICs has nothing to join."""
    vm_id, project_id = _vm_ids(conn, who, vm)
    if group == SG.DEFAULT:
        SG.ensure_default(conn, project_id)
    try:
        group_id = SG.group_row(conn, project_id, group).id
    except NotFound as exc:  # in the words of the request: its `group`
        raise NotFound(exc.message, field="group") from None
    nics = NW.nics_of(conn, vm_id)
    if not nics:
        raise Invalid(f"vm {vm} has no NIC: a security group filters a VM's NICs", field="vm")
    return nics, group_id


@router.post("/vms/{name}/secgroups", response_model=list[VmNicGroups])
def join_secgroup(name: str, body: VmSecGroup, orch: Orch, who: AnyCaller):
    """Every NIC of the VM joins the group (of the VM's project); its rules apply to the running VM at once.
    Returns the VM's NICs with their groups."""
    with orch.db.transaction() as conn:
        nics, group_id = _vm_nics_in(conn, who, name, body.group)
        for nic in nics:
            SG.join(conn, nic.id, group_id)
        view = _nic_groups(conn, nics[0].vm_id)
    _changed(orch)
    return view


@router.delete("/vms/{name}/secgroups/{group}", response_model=list[VmNicGroups])
def leave_secgroup(name: str, group: str, orch: Orch, who: AnyCaller):
    """Every NIC of the VM leaves the group (404 when none was in it). Returns the VM's NICs with their groups."""
    with orch.db.transaction() as conn:
        nics, group_id = _vm_nics_in(conn, who, name, group)
        joined = conn.execute(
            select(func.count()).where(_M.secgroup_id == group_id, _M.nic_id.in_([n.id for n in nics]))
        ).scalar_one()
        if not joined:
            raise NotFound(f"vm {name} is not in security group {group}", field="group")
        for nic in nics:
            SG.leave(conn, nic.id, group_id)
        view = _nic_groups(conn, nics[0].vm_id)
    _changed(orch)
    return view


# -- a VM's NICs, hot-plugged -------------------------------------------------------------------------------
class NicAdd(Request):
    network: Name
    ip: Annotated[str, Field(max_length=39)] | None = Field(None, description="the address (else the lowest free)")
    secgroups: list[Name] = Field([], description="its security groups (none: the project's default)")


class NicOut(Response):
    network: str
    mac: str
    ip: str
    slot: int


@router.post("/vms/{name}/nics", status_code=201, response_model=NicOut)
def add_nic(name: str, body: NicAdd, orch: Orch, who: AnyCaller):
    """A NIC on `network`, hot-plugged into the running VM (read back before it is answered), or recorded
    for a stopped VM's next start. Its MAC and address are allocated once and never change."""
    with orch.db.read() as s:
        _vm_ids(s.connection(), who, name)
        if not who.is_admin:
            row = NW.network_row(s.connection(), body.network)
            if row.kind == "provider" and not row.shared:
                raise NotFound(f"network {body.network!r} does not exist", field="network")
    nic = orch.nics.add(name, body.network, body.ip, body.secgroups)
    return NicOut(network=nic.network, mac=nic.mac, ip=nic.ip, slot=nic.slot)


@router.delete("/vms/{name}/nics/{mac}", status_code=204)
def remove_nic(name: str, mac: Annotated[str, Path(max_length=17)], orch: Orch, who: AnyCaller):
    """Unplug the NIC from the running VM; answered once the guest let it go (libvirt's device-removed
    event, or the domain no longer lists it). A guest that keeps it: 409, the NIC stays `detaching`."""
    with orch.db.read() as s:
        _vm_ids(s.connection(), who, name)
    orch.nics.remove(name, mac)
