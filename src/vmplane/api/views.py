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
                           migration_address=h.migration_address)


def project_out(p: Project) -> schemas.ProjectOut:
    return schemas.ProjectOut(
        name=p.name, count_overhead=p.count_overhead, max_concurrent_migrations=p.max_concurrent_migrations,
        quota={"vcpus": p.quota_vcpus, "memory_mib": p.quota_memory_mib, "vms": p.quota_vms},
        usage={"vcpus": p.used_vcpus, "memory_mib": p.used_memory_mib, "vms": p.used_vms})


def vm_out(vm: Vm) -> schemas.VmOut:
    return schemas.VmOut(name=vm.name, project=vm.project.name, offering=vm.offering.name,
                         template=vm.template.name, state=vm.state, host=vm.host.name if vm.host else None,
                         vcpus=vm.vcpus, memory_mib=vm.memory_mib, max_vcpus=vm.max_vcpus,
                         max_memory_mib=vm.max_memory_mib, overhead_mib=vm.overhead_mib,
                         dynamically_scalable=vm.dynamically_scalable, created_at=vm.created_at)


def operation_out(op: Operation | None) -> schemas.OperationOut | None:
    return schemas.OperationOut.model_validate(op) if op is not None else None
