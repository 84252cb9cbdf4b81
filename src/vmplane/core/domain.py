"""What a VM's record asks of its host: the domain spec a start or a restart defines (pure)."""

from __future__ import annotations

from typing import Any

from vmplane.core import cpumodels
from vmplane.core.driver import DomainSpec
from vmplane.core.names import domain_name
from vmplane.core.scaling import cap_for_share


def spec_of(vm: Any) -> DomainSpec:
    """The domain of a VM row (name, vcpus, max_vcpus, memory_mib, max_memory_mib, image, cpu_cap_percent, and
    what chooses its CPU model: cpu_model_of)."""
    return DomainSpec(
        name=domain_name(vm.name),
        vcpus=vm.vcpus,
        max_vcpus=vm.max_vcpus or vm.vcpus,
        memory_mib=vm.memory_mib,
        max_memory_mib=vm.max_memory_mib or vm.memory_mib,
        image=vm.image,
        cpu_cap=cap_for_share(vm.cpu_cap_percent / 100) if vm.cpu_cap_percent else None,
        cpu_model=cpu_model_of(vm),
    )


def cpu_model_of(vm: Any) -> str:
    """The CPU model a start of this VM row gives its domain (its offering's, else its host's cluster's); a row
    without those columns (not read with its host's cluster) gets the default."""
    return cpumodels.effective(
        getattr(vm, "offering_cpu_model", None),
        getattr(vm, "host_cluster_cpu_model", None),
        getattr(vm, "host_cluster_cpu_baseline", None),
    )
