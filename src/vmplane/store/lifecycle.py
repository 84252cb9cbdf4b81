"""Deleting admin objects: each delete is refused (409 `conflict`) while something still uses it, and
the refusal names what (a few names and the count).

Checks and the delete are one write transaction, so nothing can start using the object in between on
SQLite (whose write transactions hold the database lock); on PostgreSQL the foreign keys refuse a row
that would point at a deleted one. Hosts are deleted through HostAdmin.remove_host
(controllers/hostadmin.py), which also drops the host's driver and its row in the capacity index.
"""

from __future__ import annotations

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.orm import InstrumentedAttribute, Session
from sqlalchemy.sql import ColumnElement

from vmplane.core.errors import Conflict
from vmplane.core.migration import ACTIVE
from vmplane.store.catalog import Catalog, get_by_name
from vmplane.store.schema import (
    Claim,
    Cluster,
    Host,
    Migration,
    Offering,
    Pool,
    Project,
    Setting,
    Template,
    Token,
    Vm,
    Volume,
    Zone,
)

SHOWN = 5


def _few(s: Session, name_column: InstrumentedAttribute[str], where: ColumnElement[bool], noun: str) -> str | None:
    """'3 VMs (a, b, c)', or 'N VMs (five names, ...)'; None when there are none."""
    count = s.scalar(select(func.count()).select_from(name_column.class_).where(where)) or 0
    if not count:
        return None
    names = list(s.scalars(select(name_column).where(where).order_by(name_column).limit(SHOWN)))
    more = ", ..." if count > len(names) else ""
    return f"{count} {noun}{'' if count == 1 else 's'} ({', '.join(names)}{more})"


def _refuse_if_used(noun: str, name: str, uses: list[str | None]) -> None:
    found = [u for u in uses if u]
    if found:
        raise Conflict(f"{noun} {name} is still used by {'; '.join(found)}; delete or move them first", field=noun)


def delete_project(catalog: Catalog, name: str) -> None:
    with catalog.db.write() as s:
        p = get_by_name(s, Project, name, field="project", for_update=True)
        _refuse_if_used(
            "project",
            name,
            [
                _few(s, Vm.name, Vm.project_id == p.id, "VM"),
                _few(s, Token.name, Token.project_id == p.id, "token"),
                _few(s, Volume.name, Volume.project_id == p.id, "volume"),
            ],
        )
        s.delete(p)


def delete_offering(catalog: Catalog, name: str) -> None:
    with catalog.db.write() as s:
        o = get_by_name(s, Offering, name, field="offering", for_update=True)
        _refuse_if_used("offering", name, [_few(s, Vm.name, Vm.offering_id == o.id, "VM")])
        s.delete(o)
    catalog.forget(offering=name)


def delete_template(catalog: Catalog, name: str) -> None:
    with catalog.db.write() as s:
        t = get_by_name(s, Template, name, field="template", for_update=True)
        _refuse_if_used(
            "template",
            name,
            [
                _few(s, Vm.name, Vm.template_id == t.id, "VM"),
                _few(s, Volume.name, Volume.template_id == t.id, "volume"),
            ],
        )
        s.delete(t)
    catalog.forget(template=name)


def _drop_settings(catalog: Catalog, s: Session, scope: str, name: str) -> None:
    s.execute(delete(Setting).where(Setting.scope == scope, Setting.scope_name == name))


def delete_zone(catalog: Catalog, name: str) -> None:
    """A zone without clusters (and no VM scoped to it) goes, with the settings set at its scope."""
    with catalog.db.write() as s:
        z = get_by_name(s, Zone, name, field="zone", for_update=True)
        _refuse_if_used(
            "zone",
            name,
            [_few(s, Cluster.name, Cluster.zone_id == z.id, "cluster"), _few(s, Vm.name, Vm.zone_id == z.id, "VM")],
        )
        _drop_settings(catalog, s, "zone", name)
        s.delete(z)
    catalog._settings_changed()


def delete_cluster(catalog: Catalog, name: str) -> None:
    """A cluster without hosts (and no VM scoped to it) goes, with the settings set at its scope."""
    with catalog.db.write() as s:
        c = get_by_name(s, Cluster, name, field="cluster", for_update=True)
        _refuse_if_used(
            "cluster",
            name,
            [
                _few(s, Host.name, Host.cluster_id == c.id, "host"),
                _few(s, Vm.name, Vm.cluster_id == c.id, "VM"),
                _few(s, Pool.name, Pool.cluster_id == c.id, "pool"),
            ],
        )
        _drop_settings(catalog, s, "cluster", name)
        s.delete(c)
    catalog._settings_changed()


def delete_host_row(catalog: Catalog, name: str) -> None:
    """Delete a host that holds nothing: no VM on it, no claim, no active migration from or to it, no
    local pool. Its finished migrations leave the history with it (they point at the host's row)."""
    with catalog.db.write() as s:
        h = get_by_name(s, Host, name, field="host", for_update=True)
        _refuse_if_used("host", name, _host_uses(s, h, pools=True))
        touches = or_(Migration.source_host_id == h.id, Migration.target_host_id == h.id)
        s.execute(delete(Migration).where(touches))
        # stopped VMs that last ran here forget it (a delete of one then asks its cluster's hosts)
        s.execute(update(Vm).where(Vm.last_host_id == h.id).values(last_host_id=None))
        s.delete(h)


def check_host_unused(catalog: Catalog, name: str) -> None:
    """Refuse (409, naming them) if anything but its local pools is on the host: what `host delete`
    checks before it deletes the host's empty local pools, so that a refusal changes nothing."""
    with catalog.db.read() as s:
        _refuse_if_used("host", name, _host_uses(s, get_by_name(s, Host, name, field="host"), pools=False))


def _host_uses(s: Session, h: Host, pools: bool) -> list[str | None]:
    touches = or_(Migration.source_host_id == h.id, Migration.target_host_id == h.id)
    active = Migration.state.in_([st.value for st in ACTIVE])
    claimed = select(Vm.name).join(Claim, Claim.vm_id == Vm.id).where(Claim.host_id == h.id).subquery()
    return [
        _few(s, Vm.name, Vm.host_id == h.id, "VM"),
        _few(s, Vm.name, Vm.name.in_(select(claimed.c.name)), "claim of VM"),
        _few(s, Migration.vm_name, touches & active, "active migration of VM"),
        _few(s, Pool.name, Pool.host_id == h.id, "local pool") if pools else None,
    ]
