"""Security groups in the store: a project's groups, their rules, and which NICs are members, inside a
caller's write transaction (the rule syntax is core/networks.parse_rule).

Every project has a `default` group, made the first time it is needed: inbound from its own members, all
outbound. A NIC of a project network joins `default` unless other groups are named. A group still used (a
member NIC, or another group's rule that names it) is not deleted; the refusal names what uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.engine import Connection, Row
from sqlalchemy.exc import IntegrityError

from vmplane.core.errors import AlreadyExists, Conflict, NotFound
from vmplane.core.names import check_name
from vmplane.core.networks import Rule
from vmplane.store.schema import Nic, NicSecGroup, SecGroup, SecGroupRule, Vm

GROUPS = SecGroup.__table__
RULES = SecGroupRule.__table__
MEMBERS = NicSecGroup.__table__
DEFAULT = "default"
DEFAULT_RULES = (Rule("in", "any", group=DEFAULT), Rule("out", "any", cidr="0.0.0.0/0"))


@dataclass(frozen=True)
class StoredRule:
    id: int
    group: str
    rule: Rule


def group_row(conn: Connection, project_id: int, name: str) -> Row[Any]:
    g = GROUPS.c
    row = conn.execute(select(GROUPS).where(g.project_id == project_id, g.name == name)).first()
    if row is None:
        raise NotFound(f"security group {name!r} does not exist in the project", field="secgroup")
    return row


def create_group(conn: Connection, project_id: int, name: str) -> int:
    check_name(name, "secgroup")
    try:
        result = conn.execute(insert(GROUPS).values(name=name, project_id=project_id))
    except IntegrityError:
        raise AlreadyExists(f"security group {name!r} already exists in the project", field="secgroup") from None
    return int(result.inserted_primary_key[0])  # type: ignore[index]


def ensure_default(conn: Connection, project_id: int) -> int:
    """The project's `default` group, made with its two rules when it does not exist yet."""
    g = GROUPS.c
    found = conn.execute(select(g.id).where(g.project_id == project_id, g.name == DEFAULT)).scalar()
    if found is not None:
        return int(found)
    group_id = create_group(conn, project_id, DEFAULT)
    for rule in DEFAULT_RULES:
        add_rule(conn, project_id, DEFAULT, rule)
    return group_id


def add_rule(conn: Connection, project_id: int, group: str, rule: Rule) -> int:
    """A rule on `group`; a rule that names a group (`--from-group`) names one of the same project."""
    row = group_row(conn, project_id, group)
    remote = group_row(conn, project_id, rule.group).id if rule.group is not None else None
    result = conn.execute(
        insert(RULES).values(
            secgroup_id=row.id,
            direction=rule.direction,
            proto=rule.proto,
            port_min=rule.port_min,
            port_max=rule.port_max,
            cidr=rule.cidr,
            remote_group_id=remote,
        )
    )
    return int(result.inserted_primary_key[0])  # type: ignore[index]


def remove_rule(conn: Connection, project_id: int, group: str, rule_id: int) -> None:
    row = group_row(conn, project_id, group)
    r = RULES.c
    if conn.execute(RULES.delete().where(r.id == rule_id, r.secgroup_id == row.id)).rowcount != 1:
        raise NotFound(f"security group {group} has no rule {rule_id}", field="rule")


def rules_of(conn: Connection, project_id: int, group: str) -> list[StoredRule]:
    row = group_row(conn, project_id, group)
    r = RULES.c
    remote = GROUPS.alias("remote")
    rows = conn.execute(
        select(r.id, r.direction, r.proto, r.port_min, r.port_max, r.cidr, remote.c.name)
        .outerjoin(remote, remote.c.id == r.remote_group_id)
        .where(r.secgroup_id == row.id)
        .order_by(r.id)
    )
    return [StoredRule(x.id, group, Rule(x.direction, x.proto, x.port_min, x.port_max, x.cidr, x.name)) for x in rows]


def join(conn: Connection, nic_id: int, group_id: int) -> None:
    m = MEMBERS.c
    if conn.execute(select(m.nic_id).where(m.nic_id == nic_id, m.secgroup_id == group_id)).first() is None:
        conn.execute(insert(MEMBERS).values(nic_id=nic_id, secgroup_id=group_id))


def leave(conn: Connection, nic_id: int, group_id: int) -> None:
    m = MEMBERS.c
    conn.execute(MEMBERS.delete().where(m.nic_id == nic_id, m.secgroup_id == group_id))


def groups_of(conn: Connection, nic_id: int) -> list[str]:
    m, g = MEMBERS.c, GROUPS.c
    stmt = select(g.name).join(MEMBERS, m.secgroup_id == g.id).where(m.nic_id == nic_id).order_by(g.name)
    return list(conn.execute(stmt).scalars())


def delete_group(conn: Connection, project_id: int, name: str) -> None:
    """Delete a group nothing uses; refused (409) naming the VMs whose NICs are members, or the groups whose
    rules name it."""
    row = group_row(conn, project_id, name)
    m, v, n, r, g = MEMBERS.c, Vm.__table__.c, Nic.__table__.c, RULES.c, GROUPS.c
    vms = list(
        dict.fromkeys(
            conn.execute(
                select(v.name)
                .join(Nic.__table__, n.vm_id == v.id)
                .join(MEMBERS, m.nic_id == n.id)
                .where(m.secgroup_id == row.id)
                .order_by(v.name)
            ).scalars()
        )
    )
    if vms:
        raise Conflict(f"security group {name} is in use by the NICs of {', '.join(vms)}", field="secgroup")
    naming = list(
        conn.execute(
            select(g.name)
            .join(RULES, r.secgroup_id == g.id)
            .where(r.remote_group_id == row.id, g.id != row.id)
            .distinct()
            .order_by(g.name)
        ).scalars()
    )
    if naming:
        raise Conflict(f"security group {name} is named by the rules of {', '.join(naming)}", field="secgroup")
    conn.execute(GROUPS.delete().where(g.id == row.id))
