"""Core SQL that moves the quota ledger, host claims and operations, inside a caller's write transaction.

Rows are locked (SELECT ... FOR UPDATE on PostgreSQL; SQLite's write transaction already holds the
database lock) before the pure rules decide, so a decision and its write can not interleave with
another admission. No rule lives here: callers decide, these functions read and write.

Statements are built once with bind parameters: building a SQLAlchemy statement per call costs
~4x its execution on SQLite (measured), and admissions are the hot path.
"""

from __future__ import annotations

import datetime as dt
import functools
import uuid
from typing import Any

from sqlalchemy import Select, Update, bindparam, delete, insert, select, update
from sqlalchemy.engine import Connection, Row
from sqlalchemy.sql.schema import ScalarElementColumnDefault

from vmplane.core.errors import NotFound
from vmplane.core.migration import MigrationState
from vmplane.core.model import ClaimKind, HostState, OperationState, Quota, Usage, VmState
from vmplane.store import events, prepared
from vmplane.store.ownership import owner_of
from vmplane.store.schema import (
    Claim,
    Cluster,
    ConsoleTicket,
    GuestAgent,
    Host,
    Migration,
    Nic,
    NicSecGroup,
    Offering,
    Operation,
    Project,
    Template,
    Vm,
    Zone,
    utcnow,
)

PROJECTS = Project.__table__
HOSTS = Host.__table__
VMS = Vm.__table__
CLAIMS = Claim.__table__
OPERATIONS = Operation.__table__
TEMPLATES = Template.__table__
MIGRATIONS = Migration.__table__

_P, _H, _V, _C, _O, _T = (t.c for t in (PROJECTS, HOSTS, VMS, CLAIMS, OPERATIONS, TEMPLATES))

_PROJECT_BY_ID = select(PROJECTS).where(_P.id == bindparam("id")).with_for_update()
_PROJECT_BY_NAME = select(PROJECTS).where(_P.name == bindparam("name")).with_for_update()
_ADD_TO_LEDGER = (
    update(PROJECTS)
    .where(_P.id == bindparam("_id"))
    .values(
        used_vcpus=_P.used_vcpus + bindparam("dv"),
        used_memory_mib=_P.used_memory_mib + bindparam("dm"),
        used_vms=_P.used_vms + bindparam("dn"),
        used_storage_mib=_P.used_storage_mib + bindparam("ds"),
    )
)
_HOST_BY_NAME = select(HOSTS).where(_H.name == bindparam("name")).with_for_update()
# Compare-and-add: takes capacity on an enabled host only if it still fits, atomically on any database.
_TAKE_ON_HOST = (
    update(HOSTS)
    .where(
        _H.id == bindparam("_id"),
        _H.state == "enabled",
        _H.used_vcpus + bindparam("dv") <= bindparam("cap_vcpus"),
        _H.used_memory_mib + bindparam("dm") <= bindparam("cap_memory"),
    )
    .values(used_vcpus=_H.used_vcpus + bindparam("dv"), used_memory_mib=_H.used_memory_mib + bindparam("dm"))
)
_ADD_TO_HOST = (
    update(HOSTS)
    .where(_H.id == bindparam("_id"))
    .values(used_vcpus=_H.used_vcpus + bindparam("dv"), used_memory_mib=_H.used_memory_mib + bindparam("dm"))
)
_INSERT_CLAIM = insert(CLAIMS)
_RESIZE_RUNNING_CLAIM = (
    update(CLAIMS)
    .where(_C.vm_id == bindparam("_vm"), _C.kind == ClaimKind.running.value)
    .values(vcpus=_C.vcpus + bindparam("dv"), memory_mib=_C.memory_mib + bindparam("dm"))
)
_CLAIMS_OF_VM = (
    select(_C.host_id, _C.vcpus, _C.memory_mib, _H.name)
    .join(HOSTS, _H.id == _C.host_id)
    .where(_C.vm_id == bindparam("vm_id"))
)
_DELETE_CLAIMS_OF_VM = delete(CLAIMS).where(_C.vm_id == bindparam("vm_id"))
_VM_CHARGE = select(_V.project_id, _V.charged_vcpus, _V.charged_memory_mib).where(_V.id == bindparam("id"))
_INSERT_OPERATION = insert(OPERATIONS)
_INSERT_VM = insert(VMS)
_VM_DEFAULTS = {c.name: c.default.arg for c in VMS.columns if isinstance(c.default, ScalarElementColumnDefault)}
_OPERATION = select(OPERATIONS).where(_O.id == bindparam("id"))
_VM_ID_BY_NAME = select(_V.id).where(_V.name == bindparam("name"))
_F = Offering.__table__.c
_VM_ZONE, _VM_CLUSTER = Zone.__table__.alias("vm_zone"), Cluster.__table__.alias("vm_cluster")
_HOST_CLUSTER = Cluster.__table__.alias("host_cluster")  # its host's: the guest CPU model (core/cpumodels.py)
_VM_WITH_HOST = (
    select(
        VMS,
        _H.name.label("host_name"),
        _T.image.label("image"),
        _T.dynamically_scalable.label("template_dynamic"),
        _F.dynamic_scaling.label("offering_dynamic"),
        _F.cpu_cap.label("offering_cpu_cap"),
        _F.cpu_speed_mhz.label("offering_cpu_mhz"),
        _VM_ZONE.c.name.label("zone_name"),
        _VM_CLUSTER.c.name.label("cluster_name"),
        _F.cpu_model.label("offering_cpu_model"),
        _HOST_CLUSTER.c.cpu_model.label("host_cluster_cpu_model"),
        _HOST_CLUSTER.c.cpu_baseline.label("host_cluster_cpu_baseline"),
    )
    .join(TEMPLATES, _T.id == _V.template_id)
    .join(Offering.__table__, _F.id == _V.offering_id)
    .outerjoin(HOSTS, _H.id == _V.host_id)
    .outerjoin(_VM_ZONE, _VM_ZONE.c.id == _V.zone_id)  # the VM's placement scope
    .outerjoin(_VM_CLUSTER, _VM_CLUSTER.c.id == _V.cluster_id)
    .outerjoin(_HOST_CLUSTER, _HOST_CLUSTER.c.id == _H.cluster_id)
)
_VM_BY_ID = _VM_WITH_HOST.where(_V.id == bindparam("id"))
_VM_BY_NAME = _VM_WITH_HOST.where(_V.name == bindparam("name"))
# FOR UPDATE OF vms: a state transition (stopped -> starting ...) must not be read twice concurrently
_VM_BY_ID_LOCKED = _VM_BY_ID.with_for_update(of=VMS)
_VM_BY_NAME_LOCKED = _VM_BY_NAME.with_for_update(of=VMS)
_OPERATION_LOCKED = _OPERATION.with_for_update()
# what the event log needs of a row before it changes
_VM_FOR_EVENT = (
    select(_V.name, _V.state, _V.project_id, _V.host_id, _V.vcpus, _V.memory_mib, _H.name.label("host"))
    .outerjoin(HOSTS, _H.id == _V.host_id)
    .where(_V.id == bindparam("id"))
)
_HOST_NAME = select(_H.name).where(_H.id == bindparam("id"))
_OPERATION_FOR_EVENT = select(_O.state, _O.kind, _O.target, _O.vm_id, _O.project_id).where(_O.id == bindparam("id"))
_M = MIGRATIONS.c
_MIGRATION_FOR_EVENT = select(_M.id, _M.state, _M.vm_name, _M.project_id, _M.source, _M.target).where(
    _M.id == bindparam("id")
)


@functools.cache
def _update_by_id(table_name: str, fields: tuple[str, ...]) -> Update:
    table = {"vms": VMS, "operations": OPERATIONS, "migrations": MIGRATIONS}[table_name]
    return update(table).where(table.c.id == bindparam("_id")).values({f: bindparam(f) for f in fields})


def _row(conn: Connection, stmt: Select[Any], **params: Any) -> Row[Any] | None:
    """One row of `stmt` in `conn`'s transaction, read on its DBAPI cursor (the rows of the hottest paths:
    about a third of a SQLAlchemy execution's cost), its columns as attributes; None if there is none."""
    return prepared.prepared(conn.engine, stmt).row_in(conn, **params)


def _enum_values(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.value if isinstance(v, (VmState, OperationState)) else v) for k, v in fields.items()}


def lock_project(conn: Connection, project_id: int | None = None, name: str | None = None) -> Row[Any]:
    """The project's row, locked (every admission reads it: a raw read, its columns as attributes)."""
    if project_id is not None:
        row = _row(conn, _PROJECT_BY_ID, id=project_id)
    else:
        row = _row(conn, _PROJECT_BY_NAME, name=name)
    if row is None:
        raise NotFound(f"project {name or project_id!r} does not exist", field="project")
    return row


def quota_row(p: Row[Any]) -> Quota:
    return Quota(p.quota_vcpus, p.quota_memory_mib, p.quota_vms, p.quota_storage_mib)


def ledger_row(p: Row[Any]) -> Usage:
    return Usage(p.used_vcpus, p.used_memory_mib, p.used_vms, p.used_storage_mib)


def add_to_ledger(conn: Connection, project_id: int, delta: Usage) -> None:
    prepared.write(
        conn,
        _ADD_TO_LEDGER,
        {"_id": project_id, "dv": delta.vcpus, "dm": delta.memory_mib, "dn": delta.vms, "ds": delta.storage_mib},
    )


def lock_host(conn: Connection, name: str) -> Row[Any]:
    row = conn.execute(_HOST_BY_NAME, {"name": name}).first()
    if row is None:
        raise NotFound(f"host {name!r} does not exist", field="host")
    return row


def take_on_host(
    conn: Connection, host_id: int, vcpus: int, memory_mib: int, cap_vcpus: int, cap_memory_mib: int
) -> bool:
    """Add to a host's usage if it stays within the given capacity and the host is enabled; False if not."""
    return (
        prepared.write(
            conn,
            _TAKE_ON_HOST,
            {"_id": host_id, "dv": vcpus, "dm": memory_mib, "cap_vcpus": cap_vcpus, "cap_memory": cap_memory_mib},
        )
        == 1
    )


def grow_running_claim(conn: Connection, vm_id: int, vcpus: int, memory_mib: int) -> None:
    """Add to a VM's running claim row what take_on_host() already took on its host."""
    conn.execute(_RESIZE_RUNNING_CLAIM, {"_vm": vm_id, "dv": vcpus, "dm": memory_mib})


def shrink_running_claim(conn: Connection, vm_id: int, host_id: int, vcpus: int, memory_mib: int) -> None:
    """Give back part of a VM's running claim: the claim row and its host's usage together."""
    conn.execute(_RESIZE_RUNNING_CLAIM, {"_vm": vm_id, "dv": -vcpus, "dm": -memory_mib})
    conn.execute(_ADD_TO_HOST, {"_id": host_id, "dv": -vcpus, "dm": -memory_mib})


def record_claim(
    conn: Connection, host_id: int, vm_id: int, operation_id: str | None, kind: ClaimKind, vcpus: int, memory_mib: int
) -> None:
    """The claim row for usage already taken on the host with take_on_host()."""
    prepared.write(
        conn,
        _INSERT_CLAIM,
        {
            "host_id": host_id,
            "vm_id": vm_id,
            "operation_id": operation_id,
            "kind": kind.value,
            "vcpus": vcpus,
            "memory_mib": memory_mib,
        },
    )


def release_vm(conn: Connection, vm_id: int, note: str = "") -> list[tuple[str, int, int]]:
    """Give back all a VM holds: claims (host usage) and its charge on the ledger; the VM is left stopped
    (`note`: why, for the event log). Returns (host, vcpus, memory_mib) freed, for the capacity index."""
    freed = []
    for host_id, vcpus, memory, host_name in conn.execute(_CLAIMS_OF_VM, {"vm_id": vm_id}).all():
        conn.execute(_ADD_TO_HOST, {"_id": host_id, "dv": -vcpus, "dm": -memory})
        freed.append((host_name, vcpus, memory))
    conn.execute(_DELETE_CLAIMS_OF_VM, {"vm_id": vm_id})
    vm = conn.execute(_VM_CHARGE, {"id": vm_id}).one()
    add_to_ledger(conn, vm.project_id, Usage(-vm.charged_vcpus, -vm.charged_memory_mib, 0))
    set_vm(conn, vm_id, note, charged_vcpus=0, charged_memory_mib=0, host_id=None, state=VmState.stopped)
    return freed


def release_claim(
    conn: Connection, vm_id: int, operation_id: str | None, kind: ClaimKind | None = None
) -> list[tuple[str, int, int]]:
    """Release one VM's claim(s) selected by operation (a migration target) or by kind; returns freed."""
    where = [_C.vm_id == vm_id]
    if operation_id is not None:
        where.append(_C.operation_id == operation_id)
    if kind is not None:
        where.append(_C.kind == kind.value)
    freed = []
    for claim_id, host_id, vcpus, memory, host_name in conn.execute(
        select(_C.id, _C.host_id, _C.vcpus, _C.memory_mib, _H.name).join(HOSTS, _H.id == _C.host_id).where(*where)
    ).all():
        conn.execute(_ADD_TO_HOST, {"_id": host_id, "dv": -vcpus, "dm": -memory})
        conn.execute(delete(CLAIMS).where(_C.id == claim_id))
        freed.append((host_name, vcpus, memory))
    return freed


def move_running_claim(
    conn: Connection, vm_id: int, to_host_id: int, operation_id: str | None, vcpus: int, memory_mib: int, taken: bool
) -> list[tuple[str, int, int]]:
    """Move a VM's running claim to another host (an HA restart, or its undo): the old claim and its
    host's usage go; the new claim is recorded, its usage already taken with take_on_host() (`taken`)
    or added here without a capacity check (back onto a fenced host, which places nothing).
    The project's charge does not change. Returns what was freed, for the capacity index."""
    freed = release_claim(conn, vm_id, None, ClaimKind.running)
    if not taken:
        conn.execute(_ADD_TO_HOST, {"_id": to_host_id, "dv": vcpus, "dm": memory_mib})
    record_claim(conn, to_host_id, vm_id, operation_id, ClaimKind.running, vcpus, memory_mib)
    return freed


def promote_claim(conn: Connection, vm_id: int, operation_id: str) -> None:
    """A migration target's claim becomes the VM's running claim."""
    conn.execute(
        update(CLAIMS).where(_C.vm_id == vm_id, _C.operation_id == operation_id).values(kind=ClaimKind.running.value)
    )


def new_operation(
    conn: Connection,
    kind: str,
    target: str,
    vm_id: int | None,
    project_id: int | None,
    step: str,
    message: str = "",
    result: dict[str, Any] | None = None,
    progress: int = 10,
) -> str:
    op_id = str(uuid.uuid4())
    now = utcnow()
    prepared.write(
        conn,
        _INSERT_OPERATION,
        {
            "id": op_id,
            "kind": kind,
            "target": target,
            "vm_id": vm_id,
            "project_id": project_id,
            "state": OperationState.pending.value,
            "step": step,
            "progress": progress,
            "message": message,
            "result": result,
            "created_at": now,
            "updated_at": now,
            "owner": owner_of(conn),
        },
    )
    _operation_event(conn, op_id, kind, target, vm_id, project_id, None, OperationState.pending.value, message)
    return op_id


def set_operation(conn: Connection, op_id: str, before: Row[Any] | None = None, **fields: Any) -> None:
    """Update an operation; a change of its state is recorded in the event log in the same transaction.
    `before`: its row as the caller read (and locked) it in this transaction, else it is read here."""
    fields = _enum_values({**fields, "updated_at": utcnow()})
    if fields.get("host_id") is not None:
        fields["last_host_id"] = fields["host_id"]  # kept when it stops: where a leftover domain can be
    if before is None and "state" in fields:
        before = _row(conn, _OPERATION_FOR_EVENT, id=op_id)
    prepared.write(conn, _update_by_id("operations", tuple(sorted(fields))), {"_id": op_id, **fields})
    if before is not None and before.state != fields["state"]:
        _operation_event(
            conn,
            op_id,
            before.kind,
            before.target,
            before.vm_id,
            before.project_id,
            before.state,
            fields["state"],
            fields.get("message", ""),
        )


def _operation_event(
    conn: Connection,
    op_id: str,
    kind: str,
    target: str,
    vm_id: int | None,
    project_id: int | None,
    old: str | None,
    new: str,
    message: str,
) -> None:
    """An operation's event: its subject is its id, its message starts with what it does (`start app`)."""
    events.record(
        conn,
        "operation",
        op_id,
        old_state=old,
        new_state=new,
        message=f"{kind} {target}" + (f": {message}" if message else ""),
        vm=target if vm_id is not None else None,
        host=target if kind == "drain" else None,
        project_id=project_id,
    )


def operation_row(conn: Connection, op_id: str, lock: bool = False) -> Row[Any]:
    row = _row(conn, _OPERATION_LOCKED if lock else _OPERATION, id=op_id)
    if row is None:
        raise NotFound(f"operation {op_id} does not exist", field="operation")
    return row


def vm_id_by_name(conn: Connection, name: str) -> int | None:
    return conn.execute(_VM_ID_BY_NAME, {"name": name}).scalar()


def vm_row(conn: Connection, vm_id: int | None = None, name: str | None = None, lock: bool = False) -> Row[Any]:
    """A VM with its host's name and its template's image, as the driver needs them."""
    if vm_id is not None:
        row = _row(conn, _VM_BY_ID_LOCKED if lock else _VM_BY_ID, id=vm_id)
    else:
        row = _row(conn, _VM_BY_NAME_LOCKED if lock else _VM_BY_NAME, name=name)
    if row is None:
        raise NotFound(f"vm {name or vm_id!r} does not exist", field="vm")
    return row


def set_migration(conn: Connection, migration_id: str, **fields: Any) -> None:
    """Update a migration; a change of its state is recorded in the event log in the same transaction."""
    if "state" in fields and not isinstance(fields["state"], str):
        fields["state"] = fields["state"].value
    before = conn.execute(_MIGRATION_FOR_EVENT, {"id": migration_id}).first() if "state" in fields else None
    prepared.write(conn, _update_by_id("migrations", tuple(sorted(fields))), {"_id": migration_id, **fields})
    if before is not None and before.state != fields["state"]:
        migration_event(conn, before, before.state, fields["state"], fields.get("reason", ""))


def migration_event(conn: Connection, row: Row[Any], old: str | None, new: str, reason: str = "") -> None:
    """A migration's event (`row` has its id, vm_name, project_id, source and target): subject its id,
    host its source, the message `source -> target` and why."""
    events.record(
        conn,
        "migration",
        row.id,
        old_state=old,
        new_state=new,
        message=f"{row.vm_name}: {row.source} -> {row.target}" + (f": {reason}" if reason else ""),
        vm=row.vm_name,
        host=row.source,
        project_id=row.project_id,
    )


def start_queued_migration(conn: Connection, migration_id: str, state: MigrationState, started_at: dt.datetime) -> bool:
    """Move a migration from queued to `state` (copying); False if it is no longer queued."""
    m = MIGRATIONS.c
    started = (
        conn.execute(
            update(MIGRATIONS)
            .where(m.id == migration_id, m.state == "queued")
            .values(state=state.value, started_at=started_at, waiting_for="", owner=owner_of(conn))
        ).rowcount
        == 1
    )  # the process that copies it
    if started:  # by the pump, in any thread: the event names whoever asked for the migration
        row = conn.execute(_MIGRATION_FOR_EVENT, {"id": migration_id}).one()
        with events.acting_as(
            events.cause_of(conn, "migration", migration_id, vm=row.vm_name) or events.current_cause()
        ):
            migration_event(conn, row, "queued", state.value)
    return started


def migration_created(conn: Connection, migration_id: str, reason: str = "") -> None:
    """The event of a migration just inserted (queued)."""
    row = conn.execute(_MIGRATION_FOR_EVENT, {"id": migration_id}).one()
    migration_event(conn, row, None, row.state, reason)


def set_vm(conn: Connection, vm_id: int, note: str = "", **fields: Any) -> None:
    """Update a VM's row; a change of its state (or host) is recorded in the event log in the same
    transaction, with `note` (and the new size or host, when they change) as its message."""
    fields = _enum_values({**fields, "updated_at": utcnow()})
    if fields.get("host_id") is not None:
        fields["last_host_id"] = fields["host_id"]  # kept when it stops: where a leftover domain can be
    before = _row(conn, _VM_FOR_EVENT, id=vm_id) if "state" in fields or "host_id" in fields else None
    prepared.write(conn, _update_by_id("vms", tuple(sorted(fields))), {"_id": vm_id, **fields})
    if before is not None:
        _vm_event(conn, before, fields, note)


def _vm_event(conn: Connection, before: Row[Any], fields: dict[str, Any], note: str) -> None:
    state = fields.get("state", before.state)
    host_id = fields.get("host_id", before.host_id)
    moved = host_id is not None and host_id != before.host_id
    if state == before.state and not moved:
        return
    host = conn.execute(_HOST_NAME, {"id": host_id}).scalar() if moved else before.host
    words = [note] if note else []
    if moved:
        words.append(f"on {host}" if before.host_id is None else f"moved from {before.host} to {host}")
    if "vcpus" in fields or "memory_mib" in fields:
        vcpus, memory = fields.get("vcpus", before.vcpus), fields.get("memory_mib", before.memory_mib)
        words.append(f"{vcpus} vCPU{'s' if vcpus != 1 else ''} / {memory} MiB")
    events.record(
        conn,
        "vm",
        before.name,
        old_state=before.state,
        new_state=state,
        message="; ".join(words),
        vm=before.name,
        host=host,
        project_id=before.project_id,
    )


def insert_vm(conn: Connection, note: str = "", host_name: str | None = None, **fields: Any) -> int:
    """A new VM's row, and its `created` event (old state none, new state the row's). `host_name`: the
    name of `host_id` when the caller knows it (else it is read)."""
    now = utcnow()
    if fields.get("host_id") is not None:
        fields = {**fields, "last_host_id": fields["host_id"]}
    row = {**_VM_DEFAULTS, **_enum_values(fields), "created_at": now, "updated_at": now}
    vm_id = prepared.insert_for_id(conn, _INSERT_VM, row)
    host = None
    if fields.get("host_id"):
        host = host_name or conn.execute(_HOST_NAME, {"id": fields["host_id"]}).scalar()
    state = _enum_values({"state": fields.get("state", VmState.stopped.value)})["state"]
    words = [f"created with {fields['vcpus']} vCPU{'s' if fields['vcpus'] != 1 else ''} / {fields['memory_mib']} MiB"]
    events.record(
        conn,
        "vm",
        fields["name"],
        old_state=None,
        new_state=state,
        message="; ".join(words + ([f"on {host}"] if host else []) + ([note] if note else [])),
        vm=fields["name"],
        host=host,
        project_id=fields.get("project_id"),
    )
    return vm_id


def delete_vm(conn: Connection, vm_id: int, note: str = "") -> None:
    """Delete a VM's row (its claims and charge already given back) and record it `deleted`."""
    before = conn.execute(_VM_FOR_EVENT, {"id": vm_id}).first()
    nics = select(Nic.__table__.c.id).where(Nic.__table__.c.vm_id == vm_id).scalar_subquery()
    conn.execute(NicSecGroup.__table__.delete().where(NicSecGroup.__table__.c.nic_id.in_(nics)))
    conn.execute(Nic.__table__.delete().where(Nic.__table__.c.vm_id == vm_id))  # its addresses are free again
    conn.execute(GuestAgent.__table__.delete().where(GuestAgent.__table__.c.vm_id == vm_id))
    conn.execute(ConsoleTicket.__table__.delete().where(ConsoleTicket.__table__.c.vm_id == vm_id))
    conn.execute(VMS.delete().where(_V.id == vm_id))
    if before is not None:
        events.record(
            conn,
            "vm",
            before.name,
            old_state=before.state,
            new_state="deleted",
            message=note,
            vm=before.name,
            host=before.host,
            project_id=before.project_id,
        )


def set_host_state(conn: Connection, name: str, state: HostState | str, note: str = "", **fields: Any) -> bool:
    """Set a host's state (and other `fields`, e.g. state_before_down); a change is recorded in the
    event log in the same transaction. False if the host does not exist."""
    state = state.value if hasattr(state, "value") else state
    old = conn.execute(select(_H.state).where(_H.name == name).with_for_update()).first()
    if old is None:
        return False
    conn.execute(update(HOSTS).where(_H.name == name).values(state=state, **fields))
    if old.state != state:
        events.record(conn, "host", name, old_state=old.state, new_state=state, message=note, host=name)
    return True
