"""Storage rows to response bodies."""

from __future__ import annotations

from ..orchestrator import Orchestrator
from ..store.schema import Host, Operation, Project, Vm
from . import schemas


def host_out(orch: Orchestrator, h: Host) -> schemas.HostOut:
    cap = orch.host_capacity(h.name)
    return schemas.HostOut(name=h.name, cluster=h.cluster.name, zone=h.cluster.zone.name, driver=h.driver,
                           uri=h.uri, state=h.state, cores=h.cores, cpu_mhz=h.cpu_mhz, memory_mib=h.memory_mib,
                           vcpus_capacity=cap.vcpus_capacity, memory_capacity_mib=cap.memory_capacity_mib,
                           used_vcpus=h.used_vcpus, used_memory_mib=h.used_memory_mib,
                           migration_address=h.migration_address, state_reason=h.state_reason,
                           down_since=h.down_since, fence_agents=[a.get("agent", "?") for a in h.fence_agents or []])


def project_out(p: Project) -> schemas.ProjectOut:
    return schemas.ProjectOut(
        name=p.name, count_overhead=p.count_overhead, max_concurrent_migrations=p.max_concurrent_migrations,
        quota={"vcpus": p.quota_vcpus, "memory_mib": p.quota_memory_mib, "vms": p.quota_vms,
               "storage_mib": p.quota_storage_mib},
        usage={"vcpus": p.used_vcpus, "memory_mib": p.used_memory_mib, "vms": p.used_vms,
               "storage_mib": p.used_storage_mib})


def pool_out(r) -> schemas.PoolOut:
    return schemas.PoolOut(name=r.name, kind=r.kind, cluster=r.cluster_name, host=r.host_name, path=r.path,
                           state=r.state, capacity_mib=r.capacity_mib, allocation_mib=r.allocation_mib,
                           available_mib=r.available_mib, used_mib=r.used_mib, free_mib=r.capacity_mib - r.used_mib,
                           shared_checked=r.shared_checked)


def volume_out(r) -> schemas.VolumeOut:
    return schemas.VolumeOut(name=r.name, project=r.project, pool=r.pool_name, host=r.pool_host, size_mib=r.size_mib,
                             format=r.format, role=r.role, state=r.state, vm=r.vm_name, device=r.device,
                             template=r.template, copy_to=r.copy_pool_name)


def _zone_of(vm: Vm) -> str | None:
    """The VM's zone; one placed before zones mattered is in its host's until it next starts."""
    if vm.zone is not None:
        return vm.zone.name
    return vm.host.cluster.zone.name if vm.host else None


def vm_out(vm: Vm) -> schemas.VmOut:
    return schemas.VmOut(name=vm.name, project=vm.project.name, offering=vm.offering.name,
                         template=vm.template.name, state=vm.state, host=vm.host.name if vm.host else None,
                         vcpus=vm.vcpus, memory_mib=vm.memory_mib, max_vcpus=vm.max_vcpus,
                         max_memory_mib=vm.max_memory_mib, overhead_mib=vm.overhead_mib,
                         dynamic_scaling=vm.dynamically_scalable, zone=_zone_of(vm),
                         cluster=vm.cluster.name if vm.cluster else None, boot_memory_mib=vm.boot_memory_mib,
                         ha_policy=vm.ha_policy, ha_priority=vm.ha_priority, created_at=vm.created_at)


def operation_out(op: Operation | None) -> schemas.OperationOut | None:
    """The store's `target` is the VM's name, or the host's for a drain: the API names which."""
    if op is None:
        return None
    on_host = op.kind in ("drain", "recover")
    return schemas.OperationOut(id=op.id, kind=op.kind, vm=None if on_host else op.target,
                                host=op.target if on_host else None, state=op.state, step=op.step,
                                progress=op.progress, message=op.message, result=op.result,
                                created_at=op.created_at, updated_at=op.updated_at)


def migration_out(row: dict) -> schemas.MigrationOut:
    """A migration row (migrator.get/list/migrate/cancel) in the API's vocabulary."""
    return schemas.MigrationOut(**{**row, "vm": row["vm_name"], "waiting_for": row.get("waiting_for") or None})
