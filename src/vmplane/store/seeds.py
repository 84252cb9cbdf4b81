"""cloud-init seeds in the store (issue 30): a project's SSH keys, and the seed a VM's record says (its
hostname, keys, user data, and its NICs' addresses), inside a caller's transaction. The rules and the
files are core/cloudinit.py."""

from __future__ import annotations

from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.engine import Connection, Row
from sqlalchemy.exc import IntegrityError

from vmplane.core import cloudinit as CI
from vmplane.core import networks as N
from vmplane.core.errors import AlreadyExists, NotFound
from vmplane.core.names import check_name
from vmplane.store.schema import Network, Nic, ProjectKey, Vm

KEYS = ProjectKey.__table__


def add_project_key(conn: Connection, project_id: int, name: str, key: str) -> Row[Any]:
    check_name(name)
    line = CI.check_ssh_key(key, field="key")
    try:
        conn.execute(insert(KEYS).values(project_id=project_id, name=name, key=line))
    except IntegrityError:
        raise AlreadyExists(f"the project has a key named {name} already", field="name") from None
    return project_keys(conn, project_id, name)[0]


def project_keys(conn: Connection, project_id: int, name: str | None = None) -> list[Row[Any]]:
    k = KEYS.c
    stmt = select(k.name, k.key, k.created_at).where(k.project_id == project_id).order_by(k.name)
    return list(conn.execute(stmt.where(k.name == name) if name is not None else stmt))


def remove_project_key(conn: Connection, project_id: int, name: str) -> None:
    k = KEYS.c
    if conn.execute(KEYS.delete().where(k.project_id == project_id, k.name == name)).rowcount == 0:
        raise NotFound(f"the project has no key named {name}", field="name")


def seed_of(conn: Connection, vm_id: int) -> CI.Seed | None:
    """The seed a VM's record says, or None when it asks for none (no hostname, key nor user data)."""
    v = Vm.__table__.c
    row = conn.execute(select(v.name, v.hostname, v.ssh_keys, v.user_data).where(v.id == vm_id)).one()
    if not (row.hostname or row.ssh_keys or row.user_data):
        return None
    nic, n = Nic.__table__.c, Network.__table__.c
    nics = conn.execute(
        select(nic.mac, nic.ip, n.cidr, n.gateway, n.kind)
        .join(Network.__table__, n.id == nic.network_id)
        .where(nic.vm_id == vm_id, nic.mac.is_not(None))
        .order_by(nic.slot)
    ).all()
    return CI.Seed(
        instance_id=row.name,
        hostname=row.hostname or row.name,
        ssh_keys=tuple(row.ssh_keys or ()),
        user_data=row.user_data,
        nics=tuple(
            CI.SeedNic(r.mac, f"{r.ip}/{N.parse_cidr(r.cidr).prefixlen}", r.gateway if r.kind == "provider" else None)
            for r in nics
        ),
    )
