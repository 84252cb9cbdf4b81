"""Placement groups in the store: create, list, show, delete, and the rule a placement applies.

The rules themselves are pure (groups.py); this module reads a group and where its members run
(their hosts' claims, and the host of a charged member) into a GroupRule.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.engine import Connection, Row
from sqlalchemy.exc import IntegrityError

from vmplane.core.errors import AlreadyExists, Conflict, Invalid, NotFound
from vmplane.core.groups import POLICIES, GroupRule, describe
from vmplane.core.model import CHARGED_STATES, UNREACHABLE_HOST_STATES
from vmplane.core.names import check_name
from vmplane.store import Database
from vmplane.store.schema import Claim, Group, Host, Project, Vm

_G, _V, _C, _H, _P = (Group.__table__.c, Vm.__table__.c, Claim.__table__.c, Host.__table__.c, Project.__table__.c)
GROUPS = Group.__table__
_CHARGED = sorted(s.value for s in CHARGED_STATES)
_FAILED = sorted(s.value for s in UNREACHABLE_HOST_STATES)


def _row(conn: Connection, name: str, project_id: int | None = None) -> Row[Any]:
    """A group by name; `project_id` (a member's): another project's group is reported as not existing."""
    row = conn.execute(
        select(GROUPS, _P.name.label("project")).join(Project.__table__, _P.id == _G.project_id).where(_G.name == name)
    ).first()
    if row is None or (project_id is not None and row.project_id != project_id):
        raise NotFound(f"group {name!r} does not exist", field="group")
    return row


def _members(conn: Connection, group_ids: list[int]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {g: [] for g in group_ids}
    if group_ids:
        for gid, vm in conn.execute(select(_V.group_id, _V.name).where(_V.group_id.in_(group_ids)).order_by(_V.name)):
            out[gid].append(vm)
    return out


def _view(row: Row[Any], members: list[str]) -> dict[str, Any]:
    return {
        "name": row.name,
        "project": row.project,
        "policy": row.policy,
        "hard": bool(row.hard),
        "rule": describe(row.policy, bool(row.hard)),
        "vms": members,
        "created_at": row.created_at,
    }


def create(
    db: Database, name: str, project: str, policy: str, hard: bool = True, project_id: int | None = None
) -> dict[str, Any]:
    """A new group of `project`; `project_id` (a member's) refuses another project's (as not existing)."""
    check_name(name)
    if policy not in POLICIES:
        raise Invalid(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}", field="policy")
    with db.transaction() as conn:
        p = conn.execute(select(_P.id).where(_P.name == project)).first()
        if p is None or (project_id is not None and p.id != project_id):
            raise NotFound(f"project {project!r} does not exist", field="project")
        try:
            conn.execute(insert(GROUPS).values(name=name, project_id=p.id, policy=policy, hard=hard))
        except IntegrityError:
            raise AlreadyExists(f"group {name!r} already exists", field="name") from None
        return _view(_row(conn, name), [])


def rows(db: Database, project_id: int | None = None) -> list[dict[str, Any]]:
    """Every group (a member: its project's), with its VMs."""
    with db.transaction() as conn:
        q = select(GROUPS, _P.name.label("project")).join(Project.__table__, _P.id == _G.project_id)
        if project_id is not None:
            q = q.where(_G.project_id == project_id)
        found = list(conn.execute(q.order_by(_G.name)))
        members = _members(conn, [r.id for r in found])
        return [_view(r, members[r.id]) for r in found]


def show(db: Database, name: str, project_id: int | None = None) -> dict[str, Any]:
    with db.transaction() as conn:
        row = _row(conn, name, project_id)
        rule = group_rule_for(conn, group_id=row.id)
        view = _view(row, _members(conn, [row.id])[row.id])
        view["placed"] = [{"vm": vm, "host": host} for vm, host in (rule.placed if rule else ())]
        return view


def delete(db: Database, name: str, project_id: int | None = None) -> None:
    """Refused (409) while VMs are in the group, naming them."""
    with db.transaction() as conn:
        row = _row(conn, name, project_id)
        members = _members(conn, [row.id])[row.id]
        if members:
            shown = ", ".join(members[:10]) + (f" and {len(members) - 10} more" if len(members) > 10 else "")
            raise Conflict(f"group {name} still has VMs: {shown}; delete them first", field="group")
        conn.execute(GROUPS.delete().where(_G.id == row.id))


def resolve_group(conn: Connection, name: str, project_id: int) -> int:
    """The id of group `name` for a VM of project `project_id`; a group of another project (or none)
    is refused with 404 naming `group`."""
    row = conn.execute(select(_G.id, _G.project_id).where(_G.name == name)).first()
    if row is None or row.project_id != project_id:
        raise NotFound(f"group {name!r} does not exist in the VM's project", field="group")
    return int(row.id)


def group_rule_for(
    conn: Connection, vm_id: int | None = None, group_id: int | None = None, exclude_vm_id: int | None = None
) -> GroupRule | None:
    """The placement rule of a VM's group (`vm_id`: that VM's group, the VM itself left out) or of a
    group (`group_id`, e.g. for a VM being created), with where its other members are placed: the
    hosts of their claims (a migrating member holds its source and its target) and the host of a
    charged member. Members on a failed host (down, fencing, fenced) are left out: that host takes no
    placement, and they are restarted elsewhere themselves (so a hard affinity group's restarts follow
    the first member restarted instead of all being refused). None when there is no group."""
    if vm_id is not None and group_id is None:
        group_id = conn.execute(select(_V.group_id).where(_V.id == vm_id)).scalar()
        exclude_vm_id = vm_id if exclude_vm_id is None else exclude_vm_id
    if group_id is None:
        return None
    g = conn.execute(select(_G.name, _G.policy, _G.hard).where(_G.id == group_id)).first()
    if g is None:
        return None
    others = _V.group_id == group_id
    if exclude_vm_id is not None:
        others = others & (_V.id != exclude_vm_id)
    alive = _H.state.notin_(_FAILED)
    claimed = (
        select(_V.name, _H.name)
        .join(Claim.__table__, _C.vm_id == _V.id)
        .join(Host.__table__, _H.id == _C.host_id)
        .where(others, alive)
    )
    running = (
        select(_V.name, _H.name).join(Host.__table__, _H.id == _V.host_id).where(others, alive, _V.state.in_(_CHARGED))
    )
    placed = sorted({(vm, host) for vm, host in conn.execute(claimed.union(running))})
    return GroupRule(g.name, g.policy, bool(g.hard), tuple(placed))
