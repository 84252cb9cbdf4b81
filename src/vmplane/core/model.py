"""Plain data of the concepts (README.md, "Concepts"), shared by the pure rules and the shell. No I/O here."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from vmplane.core.groups import GroupRule


STORE_INT_MAX = 2**31 - 1  # the store's integer columns are 32-bit on PostgreSQL


class HostState(str, enum.Enum):
    enabled = "enabled"
    maintenance = "maintenance"
    disabled = "disabled"
    down = "down"  # its hypervisor does not answer (maybe a blip)
    fencing = "fencing"  # declared failed: being powered off before its VMs run elsewhere
    fenced = "fenced"  # confirmed off (by its fence agent or an operator)


# Hosts vmplane can not ask: what their VMs do is unknown until they answer again.
UNREACHABLE_HOST_STATES = frozenset({HostState.down, HostState.fencing, HostState.fenced})


class VmState(str, enum.Enum):
    stopped = "stopped"
    starting = "starting"
    running = "running"
    stopping = "stopping"
    migrating = "migrating"
    scaling = "scaling"
    error = "error"
    unknown = "unknown"


# States in which a VM holds quota and host capacity (docs/design/quotas.md). A stopping VM keeps its
# charge until its domain is gone: freeing it earlier would let a new VM in while the old one
# still runs.
CHARGED_STATES = frozenset(
    {VmState.starting, VmState.running, VmState.stopping, VmState.migrating, VmState.scaling, VmState.unknown}
)  # unknown: its host is unreachable; it may run


class OfferingKind(str, enum.Enum):
    fixed = "fixed"
    custom_constrained = "custom-constrained"
    custom_unconstrained = "custom-unconstrained"


class OperationState(str, enum.Enum):
    pending = "pending"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"


IN_FLIGHT_OPERATION_STATES = frozenset({OperationState.pending, OperationState.running})
IN_FLIGHT_OPERATION_VALUES = tuple(sorted(st.value for st in IN_FLIGHT_OPERATION_STATES))  # for SQL


class ClaimKind(str, enum.Enum):
    running = "running"  # a VM started on / running on the host
    migration_target = "migration-target"
    scale = "scale"  # the increase of a scale in progress


DEFAULT_STORAGE_QUOTA_MIB = 1024 * 1024  # 1 TiB: a project created without --storage


@dataclass(frozen=True)
class Quota:
    vcpus: int
    memory_mib: int
    vms: int
    storage_mib: int = DEFAULT_STORAGE_QUOTA_MIB


@dataclass(frozen=True)
class Usage:
    vcpus: int = 0
    memory_mib: int = 0
    vms: int = 0
    storage_mib: int = 0  # provisioned size of the project's volumes, charged while they exist

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.vcpus + other.vcpus,
            self.memory_mib + other.memory_mib,
            self.vms + other.vms,
            self.storage_mib + other.storage_mib,
        )

    def __sub__(self, other: Usage) -> Usage:
        return Usage(
            self.vcpus - other.vcpus,
            self.memory_mib - other.memory_mib,
            self.vms - other.vms,
            self.storage_mib - other.storage_mib,
        )


@dataclass(frozen=True)
class Offering:
    name: str
    kind: OfferingKind
    vcpus: int | None = None
    memory_mib: int | None = None
    min_vcpus: int | None = None
    max_vcpus: int | None = None
    min_memory_mib: int | None = None
    max_memory_mib: int | None = None
    cpu_speed_mhz: int = 1000
    cpu_cap: bool = False
    dynamic_scaling: bool = False
    root_disk_mib: int | None = None
    max_root_disk_mib: int | None = None
    ha_policy: str = "off"  # its VMs' default: restart them elsewhere when their host fails, or not
    cpu_model: str | None = None  # its VMs' guest CPU: None (the cluster's), "host-model" or a named model


@dataclass(frozen=True)
class Size:
    """What a VM asks for: vCPUs and guest memory (without overhead)."""

    vcpus: int
    memory_mib: int


@dataclass(frozen=True)
class HostCapacity:
    """A host as placement sees it: raw size, overcommit factors, and what is claimed on it."""

    name: str
    cluster: str
    state: HostState
    cores: int
    memory_mib: int
    cpu_factor: float = 1.0
    mem_factor: float = 1.0
    overhead_ratio: float = 1.0
    strategy: str = "spread"
    used_vcpus: int = 0
    used_memory_mib: int = 0
    zone: str = ""

    # capped at the store's integer range: a huge overcommit factor must not overflow a host's counters
    @property
    def vcpus_capacity(self) -> int:
        return min(int(self.cores * self.cpu_factor), STORE_INT_MAX)

    @property
    def memory_capacity_mib(self) -> int:
        return min(int(self.memory_mib * self.mem_factor), STORE_INT_MAX)


# -- failover (failover.py's rules) ----------------------------------------------------------
class Load(NamedTuple):
    """vCPUs and memory (MiB, with overhead: what the VMs claim on their host)."""

    vcpus: int = 0
    memory_mib: int = 0


@dataclass(frozen=True)
class Reserve:
    """What placement needs to keep the failover reserve (plain data, on PlacementRequest.reserve):
    k per cluster (clusters with k > 0 only), the HA load per host of those clusters, whether the VM
    placed is an HA VM, and what a migration frees on its source at the same time."""

    k_by_cluster: Mapping[str, int]
    ha_load: Mapping[str, Load]
    is_ha: bool
    action: str = "placing it on {host}"  # the refusal's subject: "starting web-3 on {host}" would ...
    release: tuple[str, Load] | None = None  # (source host, the VM's claim there) of a migration


@dataclass(frozen=True)
class PlacementRequest:
    size: Size
    exclude_hosts: frozenset[str] = field(default_factory=frozenset)
    cluster: str | None = None  # restrict to one cluster
    zone: str | None = None  # restrict to one zone
    exclude_reason: str = "excluded by the request"
    storage_hosts: frozenset[str] | None = None  # only hosts that can open the VM's disks (None: any)
    storage_reason: str = "can not reach the VM's disks"
    group: GroupRule | None = None  # the VM's placement group (groups.py): hard filters, soft weighs
    reserve: Reserve | None = None  # the failover reserve to keep (failover.py); None: not checked


@dataclass(frozen=True)
class Refusal:
    """Why one host was filtered out, in words a dry run prints."""

    host: str
    filter: str
    reason: str

    def __str__(self) -> str:
        return f"{self.host}: {self.reason}"
