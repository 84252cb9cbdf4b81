"""Storage rows to response bodies."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from sqlalchemy import String, bindparam, cast, func, literal_column, select

from vmplane.api import schemas
from vmplane.core import guestagent as agent_rules
from vmplane.core.errors import NotFound
from vmplane.core.scaling import ScalingFlags
from vmplane.core.storagerules import volume_file
from vmplane.core.units import format_mib
from vmplane.orchestrator import Orchestrator
from vmplane.store import Database
from vmplane.store import guestagents as guest_agents
from vmplane.store import storageledger as SL
from vmplane.store.prepared import prepared
from vmplane.store.schema import (
    Cluster,
    Group,
    Host,
    Network,
    Nic,
    NicSecGroup,
    Offering,
    Operation,
    Project,
    SecGroup,
    Template,
    Vm,
    Zone,
)


def host_out(orch: Orchestrator, h: Host) -> schemas.HostOut:
    cap = orch.host_capacity(h.name)
    return schemas.HostOut(
        name=h.name,
        cluster=h.cluster.name,
        zone=h.cluster.zone.name,
        driver=h.driver,
        uri=h.uri,
        state=h.state,
        cores=h.cores,
        cpu_mhz=h.cpu_mhz,
        memory_mib=h.memory_mib,
        vcpus_capacity=cap.vcpus_capacity,
        memory_capacity_mib=cap.memory_capacity_mib,
        used_vcpus=h.used_vcpus,
        used_memory_mib=h.used_memory_mib,
        migration_address=h.migration_address,
        state_reason=h.state_reason,
        down_since=h.down_since,
        fence_agents=[a.get("agent", "?") for a in h.fence_agents or []],
        cpu_model=h.cpu_model,
    )


def project_out(p: Project) -> schemas.ProjectOut:
    return schemas.ProjectOut(
        name=p.name,
        count_overhead=p.count_overhead,
        max_concurrent_migrations=p.max_concurrent_migrations,
        quota={
            "vcpus": p.quota_vcpus,
            "memory_mib": p.quota_memory_mib,
            "vms": p.quota_vms,
            "storage_mib": p.quota_storage_mib,
            "backups_mib": p.quota_backup_mib,
        },
        usage={
            "vcpus": p.used_vcpus,
            "memory_mib": p.used_memory_mib,
            "vms": p.used_vms,
            "storage_mib": p.used_storage_mib,
            "backups_mib": p.used_backup_mib,
        },
    )


def pool_out(r) -> schemas.PoolOut:
    return schemas.PoolOut(
        name=r.name,
        kind=r.kind,
        cluster=r.cluster_name,
        host=r.host_name,
        path=r.path,
        state=r.state,
        capacity_mib=r.capacity_mib,
        allocation_mib=r.allocation_mib,
        available_mib=r.available_mib,
        used_mib=r.used_mib,
        free_mib=r.capacity_mib - r.used_mib,
        shared_checked=r.shared_checked,
    )


def volume_out(r) -> schemas.VolumeOut:
    return schemas.VolumeOut(
        name=r.name,
        project=r.project,
        pool=r.pool_name,
        host=r.pool_host,
        size_mib=r.size_mib,
        format=r.format,
        role=r.role,
        state=r.state,
        vm=r.vm_name,
        device=r.device,
        template=r.template,
        copy_to=r.copy_pool_name,
        file=r.file_name or volume_file(r.name, r.format),
    )


def _zone_of(vm: Vm) -> str | None:
    """The VM's zone; one placed before zones mattered is in its host's until it next starts."""
    if vm.zone is not None:
        return vm.zone.name
    return vm.host.cluster.zone.name if vm.host else None


def agent_fields(vm_state: str, agent: str | None, interfaces: str | None) -> dict:
    """VmOut's `agent` and `guest_addresses` from what the guest agent controller stored (its state and
    interfaces' JSON): nothing for a VM that does not run."""
    if vm_state not in guest_agents.RUNNING or agent is None:
        return {"agent": None, "guest_addresses": None}
    shown = agent_rules.shown(agent_rules.from_json(interfaces or "[]")) if agent == "connected" else None
    return {"agent": agent, "guest_addresses": shown}


def vm_out(vm: Vm, agent: guest_agents.AgentView | None = None) -> schemas.VmOut:
    """`agent`: what its guest agent last said (store/guestagents.views), when the caller read it."""
    return schemas.VmOut(
        **agent_fields(
            vm.state, agent.state if agent else None, agent_rules.to_json(agent.interfaces) if agent else None
        ),
        name=vm.name,
        nics=None,
        project=vm.project.name,
        offering=vm.offering.name,
        template=vm.template.name,
        state=vm.state,
        host=vm.host.name if vm.host else None,
        vcpus=vm.vcpus,
        memory_mib=vm.memory_mib,
        max_vcpus=vm.max_vcpus,
        max_memory_mib=vm.max_memory_mib,
        overhead_mib=vm.overhead_mib,
        dynamic_scaling=vm.dynamically_scalable,
        zone=_zone_of(vm),
        cluster=vm.cluster.name if vm.cluster else None,
        boot_memory_mib=vm.boot_memory_mib,
        ha_policy=vm.ha_policy,
        ha_priority=vm.ha_priority,
        created_at=vm.created_at,
        hostname=vm.hostname,
        ssh_keys=len(vm.ssh_keys or ()),
        cpu_cap_percent=vm.cpu_cap_percent,
        group=vm.group.name if vm.group else None,
    )


def _vm_view():
    """One VM by name as VmOut's fields, in one Core select (the hot read of GET /vms/{name}: loading
    the ORM object with its seven joined relationships cost several times the query itself)."""
    v, p, o, t = Vm.__table__.c, Project.__table__, Offering.__table__, Template.__table__
    h, z, c = Host.__table__.alias("h"), Zone.__table__.alias("z"), Cluster.__table__.alias("c")
    hc, hz = Cluster.__table__.alias("hc"), Zone.__table__.alias("hz")  # the host's, for _zone_of
    ga, g = guest_agents.AGENTS, Group.__table__
    joined = (
        Vm.__table__.join(p, p.c.id == v.project_id)
        .join(o, o.c.id == v.offering_id)
        .join(t, t.c.id == v.template_id)
        .outerjoin(h, h.c.id == v.host_id)
        .outerjoin(z, z.c.id == v.zone_id)
        .outerjoin(c, c.c.id == v.cluster_id)
        .outerjoin(hc, hc.c.id == h.c.cluster_id)
        .outerjoin(hz, hz.c.id == hc.c.zone_id)
        .outerjoin(ga, ga.c.vm_id == v.id)
        .outerjoin(g, g.c.id == v.group_id)
    )
    return (
        select(
            v.name,
            p.c.name.label("project"),
            o.c.name.label("offering"),
            t.c.name.label("template"),
            v.state,
            h.c.name.label("host"),
            v.vcpus,
            v.memory_mib,
            v.max_vcpus,
            v.max_memory_mib,
            v.overhead_mib,
            v.dynamically_scalable.label("dynamic_scaling"),
            func.coalesce(z.c.name, hz.c.name).label("zone"),
            c.c.name.label("cluster"),
            v.boot_memory_mib,
            v.ha_policy,
            v.ha_priority,
            v.created_at,
            v.project_id,
            _vm_nics_text(v.id).label("nics"),
            v.hostname,
            v.ssh_keys,
            ga.c.state.label("agent"),
            ga.c.interfaces.label("guest_addresses"),
            v.cpu_cap_percent,
            g.c.name.label("group"),
            literal_column("NULL").label("disks"),
            literal_column("NULL").label("live_scaling"),
            v.prepared,
            v.id,
            o.c.dynamic_scaling.label("offering_dynamic"),
            t.c.dynamically_scalable.label("template_dynamic"),
            c.c.name.label("cluster_name"),
        )
        .select_from(joined)
        .where(v.name == bindparam("name"))
    )


def _vm_nics_text(vm_id):
    """The VM's NICs as one string in the VM's own row (GET /vms/{name} stays one query): a NIC is "slot
    network mac ip state g1,g2", NICs apart by ";" (no name, MAC, address or state holds " ", "," or ";")."""
    n, net, m, g = Nic.__table__.c, Network.__table__.c, NicSecGroup.__table__.c, SecGroup.__table__.c
    groups = (
        select(func.aggregate_strings(g.name, _text(",")))
        .select_from(NicSecGroup.__table__.join(SecGroup.__table__, g.id == m.secgroup_id))
        .where(m.nic_id == n.id)
        .scalar_subquery()
    )
    nic = (
        cast(n.slot, String)
        + _text(" ")
        + net.name
        + _text(" ")
        + func.coalesce(n.mac, _text("-"))
        + _text(" ")
        + n.ip
        + _text(" ")
        + n.state
        + _text(" ")
        + func.coalesce(groups, _text(""))
    )
    return (
        select(func.aggregate_strings(nic, _text(";")))
        .select_from(Nic.__table__.join(Network.__table__, net.id == n.network_id))
        .where(n.vm_id == vm_id)
        .scalar_subquery()
    )


def _text(value: str):
    """A constant written into the SQL (the prepared read binds only the statement's own parameters)."""
    return literal_column(f"'{value}'", String)


def _nics_of_text(text: str | None) -> list[dict]:
    """_vm_nics_text's string as VmNic bodies, first NIC first."""
    nics = []
    for item in text.split(";") if text else []:
        slot, network, mac, ip, state, groups = item.split(" ", 5)
        nics.append(
            (
                int(slot),
                {
                    "network": network,
                    "mac": None if mac == "-" else mac,
                    "ip": ip,
                    "secgroups": sorted(groups.split(",")) if groups else [],
                    "state": state,
                },
            )
        )
    return [body for _, body in sorted(nics, key=lambda x: x[0])]


_VM_VIEW = _vm_view()
_VM_FIELDS = tuple(schemas.VmOut.model_fields)
assert set(_VM_FIELDS) <= set(_VM_VIEW.selected_columns.keys()), "VmOut has a field _vm_view does not select"


def vm_body(db: Database, name: str, project_id: int | None = None) -> dict:
    """A VM's JSON body as in lists (as vm_out(...).model_dump(mode="json"): tests/test_api_polish.py
    pins the two alike). `project_id`: a member's project; another project's VM does not exist for it."""
    return _vm_body(_vm_row(db, name, project_id))


def vm_detail(db: Database, name: str, project_id: int | None, scale_setting: Callable[[Any, Any], bool]) -> dict:
    """GET /vms/{name}'s body: vm_body and what `vm show` adds, its disks and whether it can be live-scaled
    (`scale_setting(zone, cluster)`: enable.dynamic.scale.vm where it is)."""
    row = _vm_row(db, name, project_id)
    body = _vm_body(row)
    with db.read() as s:
        vols = SL.vm_volumes(s.connection(), row["id"])
    body["disks"] = [f"{v.device or '-'} {v.name} {format_mib(v.size_mib)} on {v.pool_name}" for v in vols]
    flags = ScalingFlags(
        scale_setting(row["zone"], row["cluster_name"]),
        bool(row["offering_dynamic"]),
        bool(row["template_dynamic"]),
        bool(row["dynamic_scaling"]),
    )
    body["live_scaling"] = scaling_words(
        row["state"], bool(row["prepared"]), flags, row["max_vcpus"], row["max_memory_mib"]
    )
    return body


def scaling_words(state: str, prepared: bool, flags: ScalingFlags, max_vcpus, max_memory_mib) -> str:
    """`vm show`'s live_scaling: yes and up to what (running, prepared at start), or why not."""
    off = flags.first_off()
    if state == "running" and prepared:
        return f"yes: up to {max_vcpus} vCPUs / {format_mib(max_memory_mib)} (prepared at start)"
    if state == "running":
        why = f"{off} is off" if off else "the switches are on now, but it started before: stop and start it"
        return f"no: it started unprepared ({why}); a scale restarts it or is refused"
    if off:
        return f"no: {off} is off (a scale of the stopped VM changes its size for its next start)"
    return "yes, once started: its offering, template, zone setting and its own flag allow it"


def _vm_row(db: Database, name: str, project_id: int | None) -> Any:
    row = prepared(db.engine, _VM_VIEW).first(name=name)
    if row is None or (project_id is not None and row["project_id"] != project_id):
        raise NotFound(f"vm {name!r} does not exist", field="vm")
    return row


def _vm_body(row: Any) -> dict:
    body = {field: row[field] for field in _VM_FIELDS}
    body["created_at"] = schemas.utc_iso(body["created_at"])
    body["nics"] = _nics_of_text(body["nics"])
    keys = body["ssh_keys"]
    body["ssh_keys"] = len(json.loads(keys) if isinstance(keys, str) else keys or ())
    body.update(agent_fields(body["state"], body["agent"], body["guest_addresses"]))
    return body


def operation_out(op: Operation | None, requested_by: str | None = None) -> schemas.OperationOut | None:
    """The store's `target` is the VM's name, or the host's for a drain: the API names which."""
    if op is None:
        return None
    on_host = op.kind in ("drain", "recover")
    return schemas.OperationOut(
        id=op.id,
        kind=op.kind,
        vm=None if on_host else op.target,
        host=op.target if on_host else None,
        state=op.state,
        step=op.step,
        progress=op.progress,
        message=op.message,
        result=op.result,
        created_at=op.created_at,
        updated_at=op.updated_at,
        requested_by=requested_by,
    )


def migration_out(row: dict) -> schemas.MigrationOut:
    """A migration row (migrator.get/list/migrate/cancel) in the API's vocabulary."""
    return schemas.MigrationOut(**{**row, "vm": row["vm_name"], "waiting_for": row.get("waiting_for") or None})
