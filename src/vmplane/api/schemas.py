"""Request and response bodies of the REST API (kept apart from the storage models)."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainSerializer, StrictBool, StrictInt

from vmplane.core.model import STORE_INT_MAX

Name = Annotated[str, Field(min_length=1, max_length=63, description="lowercase letters, digits and '-'")]
INT_MAX = STORE_INT_MAX
Positive = Annotated[StrictInt, Field(gt=0, le=INT_MAX)]
NonNegative = Annotated[StrictInt, Field(ge=0, le=INT_MAX)]
HaPolicy = Literal["restart", "off"]
HaPriority = Annotated[StrictInt, Field(ge=0, le=1000, description="HA restarts go highest first")]


def _utc(value: dt.datetime) -> dt.datetime:
    """The store keeps naive UTC; every response says so (ISO 8601 with +00:00)."""
    return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


def utc_iso(value: dt.datetime) -> str:
    """A stored time as every response gives it (UtcDatetime's JSON form)."""
    return _utc(value).isoformat()


UtcDatetime = Annotated[
    dt.datetime, AfterValidator(_utc), PlainSerializer(dt.datetime.isoformat, return_type=str, when_used="json")
]


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Response(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class ErrorBody(BaseModel):
    """Every error: a stable code, a message for people, and the field (or query parameter) at fault."""

    error: str = Field(
        description="unauthorized, forbidden, not_found, method_not_allowed, already_exists, "
        "conflict, quota_exceeded, insufficient_capacity, invalid, internal"
    )
    message: str
    field: str | None = Field(description="the field or query parameter at fault; null where none")


# -- zones, clusters, hosts --------------------------------------------------------------------
class ZoneCreate(Request):
    name: Name


class ZoneOut(Response):
    name: str


CpuModel = Annotated[str, Field(min_length=1, max_length=63, description="a named CPU model (libvirt's names)")]


class ClusterCreate(Request):
    name: Name
    zone: Name
    cpu_model: CpuModel | None = Field(None, description="its guests' CPU model; null: the baseline of its hosts")


class ClusterUpdate(Request):
    cpu_model: CpuModel | None = Field(
        description="a named model every host of the cluster runs (else 409 naming the host), or null: the "
        "baseline of its hosts; VMs running keep theirs until they start again"
    )


class ClusterOut(Response):
    name: str
    zone: str
    cpu_model: str | None = Field(None, description="the admin's model; null: the baseline")
    cpu_baseline: str | None = Field(None, description="the baseline of its hosts (recomputed as hosts join/leave)")
    cpu_baseline_why: str | None = Field(None, description="why the baseline is not the hypervisor's own")
    effective_cpu_model: str = Field("qemu64", description="what a VM started now gets (unless its offering says)")


class HostCreate(Request):
    name: Name
    cluster: Name
    driver: Literal["sim", "libvirt"] = "sim"
    cores: Positive | None = None
    cpu_mhz: Positive | None = None
    memory_mib: Positive | None = None
    uri: Annotated[str, Field(max_length=1024)] | None = None
    migration_address: Annotated[str, Field(max_length=255, pattern=r"^[A-Za-z0-9.:\[\]-]+$")] | None = None
    local_pool: StrictBool = Field(True, description="make its local pool local-NAME too (as `vmplane up` does)")
    cpu_model: CpuModel | None = Field(None, description="a sim host's CPU family (a libvirt host says its own)")


class HostOut(Response):
    name: str
    cluster: str
    zone: str
    driver: str
    uri: str | None
    state: str
    cores: int
    cpu_mhz: int
    memory_mib: int
    vcpus_capacity: int
    memory_capacity_mib: int
    used_vcpus: int
    used_memory_mib: int
    migration_address: str | None = None
    state_reason: str | None = Field(None, description="why it is down, fencing or fenced")
    down_since: UtcDatetime | None = Field(None, description="since when it does not answer")
    fence_agents: list[str] = Field(default_factory=list, description="its fence agents, in order (kinds only)")
    cpu_model: str | None = Field(None, description="its CPU for guests (libvirt's host-model; a sim host's family)")


class FenceRequest(Request):
    confirm_off: StrictBool = Field(
        False,
        description="the operator's word that the host is off: its HA VMs are restarted without asking a fence agent",
    )


class FenceAgents(Request):
    agents: list[dict] = Field(
        description='tried in order, e.g. [{"agent": "ipmi", "address": "10.0.0.5", '
        '"username": "admin", "password": "..."}]'
    )


class HostFailure(Request):
    mode: Literal["power", "daemon", "network"] = Field(
        description="power: daemon and guests killed; daemon: libvirtd killed, guests run on; network: the host "
        "unreachable from the control plane, guests run on"
    )


# -- projects ----------------------------------------------------------------------------------
class ProjectCreate(Request):
    name: Name
    vcpus: NonNegative
    memory_mib: NonNegative
    vms: NonNegative = 100
    count_overhead: StrictBool = False
    max_concurrent_migrations: NonNegative | None = Field(None, description="0 or null = unlimited")
    storage_mib: NonNegative = Field(1024 * 1024, description="provisioned size of its volumes and root disks")
    backups_mib: NonNegative = Field(1024 * 1024, description="what its backups take in the backup stores")


class QuotaUpdate(Request):
    vcpus: NonNegative | None = None
    memory_mib: NonNegative | None = None
    vms: NonNegative | None = None
    count_overhead: StrictBool | None = None
    max_concurrent_migrations: NonNegative | None = Field(None, description="0 = unlimited")
    storage_mib: NonNegative | None = None
    backups_mib: NonNegative | None = None


class ResourceUsage(BaseModel):
    used: int
    quota: int
    percent: float


class ProjectOut(Response):
    name: str
    quota: dict[str, int]
    usage: dict[str, int]
    count_overhead: bool
    max_concurrent_migrations: int | None


class UsageOut(BaseModel):
    project: str
    count_overhead: bool
    vcpus: ResourceUsage
    memory_mib: ResourceUsage
    vms: ResourceUsage
    storage_mib: ResourceUsage
    consistent: bool = Field(description="the ledger equals the usage recomputed from the VMs and volumes")


# -- offerings and templates -------------------------------------------------------------------
class OfferingCreate(Request):
    name: Name
    kind: Literal["fixed", "custom-constrained", "custom-unconstrained"]
    vcpus: Positive | None = None
    memory_mib: Positive | None = None
    min_vcpus: Positive | None = None
    max_vcpus: Positive | None = None
    min_memory_mib: Positive | None = None
    max_memory_mib: Positive | None = None
    cpu_speed_mhz: Positive = 1000
    cpu_cap: StrictBool = False
    dynamic_scaling: StrictBool = False
    root_disk_mib: Positive | None = Field(None, description="root disk size; null: the template image's size")
    max_root_disk_mib: Positive | None = Field(None, description="a VM may ask for a root disk up to this")
    ha_policy: HaPolicy = Field("off", description="its VMs' default HA policy")
    cpu_model: CpuModel | None = Field(
        None,
        description="its VMs' guest CPU: null (their cluster's), host-model (the host's own CPU: a live migration "
        "to a host with another CPU may be refused) or a named model (a host that can not run it refuses the VM)",
    )


class OfferingOut(Response):
    name: str
    kind: str
    vcpus: int | None
    memory_mib: int | None
    min_vcpus: int | None
    max_vcpus: int | None
    min_memory_mib: int | None
    max_memory_mib: int | None
    cpu_speed_mhz: int
    cpu_cap: bool
    dynamic_scaling: bool
    root_disk_mib: int | None = None
    max_root_disk_mib: int | None = None
    ha_policy: str = "off"
    cpu_model: str | None = Field(None, description="null: the cluster's")
    retired: bool = Field(description="takes no new VMs; VMs using it keep it")


class TemplateCreate(Request):
    name: Name
    image: (
        Annotated[
            str,
            Field(
                min_length=1,
                max_length=1024,
                description="a kernel image (tiny-linux, or a folder with vmlinuz and initrd.gz), or a "
                "disk image file (qcow2 or raw) on the control plane: imported, it boots "
                "as it is",
            ),
        ]
        | None
    ) = None
    disk: Annotated[str, Field(min_length=1, max_length=1024)] | None = Field(
        None, description="root disk image of a kernel template: tiny-linux (the test guest's) or an image file"
    )
    from_image: Name | None = Field(
        None, description="an uploaded image (POST /images/{name}) that boots as it is; instead of image and disk"
    )
    dynamic_scaling: StrictBool = False


class TemplateOut(Response):
    name: str
    image: str
    dynamic_scaling: bool
    disk_image: str | None = Field(None, description="its VMs' root disks are overlays on this image")
    disk_format: str | None = None
    disk_mib: int | None = None
    checksum: str | None = Field(None, description="sha256 of the imported image file")
    retired: bool = Field(description="takes no new VMs; VMs using it keep it")


# -- settings ----------------------------------------------------------------------------------
class SettingSet(Request):
    value: Annotated[str, Field(max_length=256)] | StrictInt | float | StrictBool = Field(
        description="a JSON number, boolean or string; checked against the key's type and range"
    )
    scope: Literal["global", "zone", "cluster"] = "global"
    scope_name: Name | None = None


class SettingOut(BaseModel):
    key: str
    value: object
    source: str
    default: object
    range: str = Field(description="the values the key accepts, e.g. (0, 100] or 1..1000")
    scope: str
    scope_name: str | None
    narrowest_scope: str
    description: str
    warnings: list[str] = Field([], description="after a change: hosts now allocated beyond their capacity")


# -- VMs and operations ------------------------------------------------------------------------
class VmCreate(Request):
    name: Name
    project: Name
    offering: Name
    template: Name
    vcpus: Positive | None = None
    memory_mib: Positive | None = None
    dynamic_scaling: StrictBool = True
    start: StrictBool = False
    zone: Name | None = Field(
        None, description="the zone it runs in for life; may be left out when there is one zone or a cluster is given"
    )
    cluster: Name | None = Field(None, description="pin it to one cluster of its zone; any cluster when left out")
    root_disk_mib: Positive | None = Field(None, description="root disk size (templates with a disk image)")
    pool: Name | None = Field(None, description="the pool of its root disk; placement picks when left out")
    ha_policy: HaPolicy | None = Field(
        None, description="restart: run it again elsewhere when its host fails; null: its offering's policy"
    )
    ha_priority: HaPriority = 0
    group: Name | None = Field(None, description="its placement group (of its project)")
    networks: list[Annotated[str, Field(max_length=128)]] = Field(
        [], description='its NICs, in order: each "NET" or "NET:IP" (an address of the network asked for)'
    )
    secgroups: list[Name] = Field(
        [], description="the security groups of its NICs (of its project); none: the project's default"
    )
    hostname: Annotated[str, Field(max_length=253)] | None = Field(
        None, description="the guest's hostname, told by its cloud-init seed (default: the VM's name when it has one)"
    )
    ssh_keys: list[Annotated[str, Field(max_length=16384)]] = Field(
        [], description="OpenSSH public keys (one per item) for the guest's root, told by its cloud-init seed"
    )
    user_data: Annotated[str, Field(max_length=70000)] | None = Field(
        None, description="cloud-init user data: a #cloud-config YAML mapping or a #! script, at most 64 KiB"
    )
    project_keys: StrictBool = Field(True, description="add the project's SSH keys (project key add) to the seed")
    dry_run: StrictBool = Field(
        False, description="check everything (quota, placement, pool) and answer the plan; nothing is created"
    )


class VmUpdate(Request):
    ha_policy: HaPolicy | None = None
    ha_priority: HaPriority | None = None


class VmNic(Response):
    network: str
    mac: str | None
    ip: str
    secgroups: list[str]
    state: str = Field(description="attached, or the step it is in (attaching, detaching)")


class VmOut(Response):
    name: str
    project: str
    offering: str
    template: str
    state: str
    host: str | None
    vcpus: int
    memory_mib: int
    max_vcpus: int | None
    max_memory_mib: int | None
    overhead_mib: int
    dynamic_scaling: bool
    zone: str | None = Field(description="the zone it runs in")
    cluster: str | None = Field(description="the cluster it is pinned to; null when any cluster of its zone will do")
    boot_memory_mib: int | None = Field(
        description="memory it started with: live scaling never goes below it; null while it has not started"
    )
    ha_policy: str = Field("off", description="restart: run it again elsewhere when its host fails")
    ha_priority: int = Field(0, description="HA restarts go highest first")
    created_at: UtcDatetime
    nics: list[VmNic] | None = Field(None, description="its network cards, first first (vm show only; null in lists)")
    hostname: str | None = Field(None, description="the hostname its cloud-init seed tells (none: no hostname asked)")
    ssh_keys: int = Field(0, description="SSH keys in its cloud-init seed (its own and its project's at create)")
    agent: str | None = Field(
        None,
        description="its QEMU guest agent: connected, or none (no agent answers: the guest boots, has none, or "
        "it hangs); null when the VM is not running or was not asked yet",
    )
    guest_addresses: list[str] | None = Field(
        None,
        description="the addresses its guest holds (`eth0 10.0.0.5/24`), as its agent reports them; beside the "
        "NICs' recorded ones (a difference is drift: `vmplane audit`); null without an agent",
    )
    cpu_cap_percent: float | None = Field(
        None, description="its CPU cap: the share of one host CPU each vCPU may use (%); null: not capped"
    )
    group: str | None = Field(None, description="its placement group")
    disks: list[str] | None = Field(
        None, description="its disks, one a line: device, volume, size, pool (vm show only; null in lists)"
    )
    live_scaling: str | None = Field(
        None,
        description="whether it can be live-scaled, and up to what or why not: its offering, template and zone "
        "setting and what it was prepared for at start, together (vm show only)",
    )


class OperationOut(Response):
    id: str
    kind: str
    vm: str | None = Field(description="the VM it acts on (start, stop, scale, reconcile); null for a drain")
    host: str | None = Field(description="the host it acts on (drain); null otherwise")
    state: str
    step: str
    progress: int
    message: str
    result: dict | None
    created_at: UtcDatetime
    updated_at: UtcDatetime
    requested_by: str | None = Field(
        None, description="who asked for it: its first event's cause (`user <token>`, or a loop's name)"
    )


class EventOut(Response):
    id: int = Field(description="increasing: `since=<id>` asks for the events after this one")
    at: UtcDatetime
    kind: Literal["vm", "host", "migration", "operation", "volume", "pool"]
    subject: str = Field(description="the VM's, host's, volume's or pool's name, the migration's or operation's id")
    vm: str | None = Field(description="the VM it concerns, if any")
    host: str | None = Field(description="the host it concerns (a VM's host, a migration's source), if any")
    project: str | None = Field(
        description="the project of its VM; null for hosts and drains (or a project since deleted)"
    )
    old_state: str | None = Field(description="null when the subject was created")
    new_state: str | None
    cause: str = Field(
        description="`user <token name>` for API requests (and the work they start), or "
        "`monitor`, `recovery`, `sync`, `libvirt event`"
    )
    message: str


class VmStop(Request):
    force: StrictBool = Field(False, description="power off at once instead of asking the guest first")


ExecArg = Annotated[str, Field(max_length=4096)]


class ExecRequest(Request):
    command: (
        Annotated[str, Field(min_length=1, max_length=4096)]
        | Annotated[list[ExecArg], Field(min_length=1, max_length=256)]
    ) = Field(
        description='an argv, as `kubectl exec` takes it: `["sh", "-c", "echo a; echo b"]` runs `sh` '
        "with exactly these two arguments (each is quoted for the guest's shell); or a string, one "
        "shell command line run by `sh -c` in the guest (not split by vmplane). Its standard "
        "input is empty; when it outlives `timeout_s` it is stopped in the guest and the answer "
        "is 409"
    )
    timeout_s: Annotated[float, Field(gt=0, le=600)] = 60.0


class ExecResult(BaseModel):
    output: str
    exit_code: int


class MigrateRequest(Request):
    to: Name | None = Field(None, description="target host; placement chooses when left out")
    dry_run: StrictBool = False
    policy: Literal["vmplane", "hypervisor-default"] = Field(
        "vmplane", description="vmplane's measured policy per accelerator, or the hypervisor's own defaults"
    )
    bandwidth_mib_s: Positive | None = Field(None, description="override the policy (admins only)")
    postcopy: StrictBool | None = Field(None, description="override the policy (admins only)")
    max_downtime_ms: Positive | None = Field(None, description="override the policy (admins only)")
    postcopy_bandwidth_mib_s: Positive | None = Field(
        None, description="override the policy: the post-copy phase's bandwidth (admins only; at least 64 MiB/s)"
    )


class MigrationOut(BaseModel):
    id: str
    vm: str
    source: str = Field(description="the host it leaves")
    target: str = Field(description="the host it goes to")
    state: str
    reason: str
    waiting_for: str | None = Field(description="the limit a queued migration waits for; null when none")
    progress: int
    cancel_requested: bool = Field(False, description="a cancel was taken: the copy is being aborted")
    params: dict | None
    stats: dict | None
    created_at: UtcDatetime
    started_at: UtcDatetime | None
    finished_at: UtcDatetime | None


class MigrationPlan(BaseModel):
    vm: str
    source: str
    target: str
    dry_run: bool
    claim_vcpus: int
    claim_memory_mib: int
    reason: str


class ScaleRequest(Request):
    offering: Name | None = Field(None, description="scale to this offering (any kind, fixed included)")
    vcpus: Positive | None = None
    memory_mib: Positive | None = None
    cpu_cap: StrictBool | None = Field(
        None, description="true/false to apply/remove the CPU cap; left out: kept, or the new offering's"
    )
    dry_run: StrictBool = False


class MaintenanceRequest(Request):
    action: Literal["enter", "exit"]
    dry_run: StrictBool = False


class VmAccepted(BaseModel):
    vm: VmOut
    operation: OperationOut | None = None


class TokenCreate(Request):
    name: Name
    role: Literal["admin", "member"] = "member"
    project: Name | None = None


class TokenInfo(BaseModel):
    name: str
    role: str
    project: str | None
    created_at: UtcDatetime


class TokenOut(BaseModel):
    name: str
    role: str
    project: str | None
    token: str = Field(description="shown once; only its hash is stored")


class AuditOut(BaseModel):
    ok: bool
    problems: list[str]


class SyncChange(BaseModel):
    field: str = Field(description="host, state, vcpus, memory_mib or cpu_cap")
    record: str = Field(description="what the record said")
    host: str = Field(description="what the host runs, now recorded")


class VmSyncOut(BaseModel):
    vm: str
    in_sync: bool = Field(description="the record already said what the host runs; nothing changed")
    changes: list[SyncChange]
    over_quota: str | None = Field(
        None, description="the adopted size exceeds the project's quota by this (the VM keeps running)"
    )
    message: str
    host: str | None = Field(None, description="where the VM runs; none: no host runs it (recorded stopped)")


# -- storage -----------------------------------------------------------------------------------
class PoolCreate(Request):
    name: Name
    kind: Literal["local", "shared"]
    host: Name | None = Field(None, description="a local pool's host")
    cluster: Name | None = Field(None, description="a shared pool's cluster")
    path: Annotated[str, Field(min_length=1, max_length=1000)] | None = Field(
        None, description="folder on the host(s); default /var/lib/vmplane/local or /var/lib/vmplane/shared/NAME"
    )


class PoolOut(Response):
    name: str
    kind: str
    cluster: str
    host: str | None
    path: str
    state: str
    capacity_mib: int = Field(description="read back from a host")
    allocation_mib: int = Field(description="taken on the pool's file system, read back")
    available_mib: int
    used_mib: int = Field(description="provisioned size of vmplane's volumes on it (and copies coming in)")
    free_mib: int = Field(description="capacity - used: what placement gives out")
    shared_checked: bool


class VolumeCreate(Request):
    name: Name
    project: Name
    size_mib: Positive
    pool: Name | None = None


class VolumeAttach(Request):
    vm: Name


class VolumeResize(Request):
    size_mib: Positive = Field(description="the new size: larger than today's (volumes only grow)")


class VolumeMove(Request):
    pool: Name = Field(description="the pool to move it to (live, by a block copy, while its VM runs)")


class ColdMigrationOut(BaseModel):
    vm: str
    source: str | None = Field(description="the host it last ran on")
    target: str
    state: str = Field(description="succeeded, or planned (dry run)")
    dry_run: bool
    disks: dict[str, str] = Field(description="each disk and the pool it is on afterwards")
    copied: list[str] = Field(description="the disks copied to the target host's local pools")


class VolumeOut(Response):
    name: str
    project: str
    pool: str
    host: str | None = Field(description="a local pool's host")
    size_mib: int
    format: str
    role: str = Field(description="root (a VM's root disk) or data")
    state: str
    vm: str | None
    device: str | None
    template: str | None
    copy_to: str | None = Field(description="the pool a migration copies it to, while it does")
    file: str = Field(description="its active file in the pool (with snapshots: the top of its chain)")
