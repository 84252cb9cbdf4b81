"""The hypervisor driver interface: what the orchestrator asks of a host, designed around libvirt.

One driver object speaks to one host. Sizes are MiB and vCPUs; a CPU cap is a CFS period/quota
applied per vCPU. Methods raise DriverError with a message naming the host.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from vmplane.core.hostnet import Applied, HostNetworks
from vmplane.core.stats import HostCounters


class DriverError(Exception):
    """A host refused or failed a request; `host` says which."""

    def __init__(self, host: str, message: str):
        super().__init__(f"{host}: {message}")
        self.host = host


def confirm_unplug(
    host: str,
    what: str,
    request: Callable[[], str | None],
    gone: Callable[[], bool],
    tries: int,
    wait_s: float,
    pause: Callable[[float], object] = time.sleep,
) -> None:
    """Ask for a device's removal up to `tries` times, each time waiting up to `wait_s` for `gone()` to
    confirm it left the domain; else DriverError naming `what`. A hypervisor that accepted the request
    has only *sent* it (libvirt's detach): the guest may complete it later or never. `request` returns
    an error message to mention (e.g. "an unplug is still pending") or None; `pause(s)` waits between
    looks (an event may end it early). Shared by the libvirt and the sim drivers."""
    errors = []
    for _ in range(tries):
        t0 = time.monotonic()
        error = request()
        if error:
            errors.append(error)
        while True:
            if gone():
                return
            if time.monotonic() - t0 >= wait_s:
                break
            pause(min(0.2, wait_s / 4))
    raise DriverError(
        host,
        f"{what} still attached after {tries} unplug requests: the guest did not release it"
        + (f" (libvirt: {errors[-1]})" if errors else ""),
    )


@dataclass(frozen=True)
class HostInfo:
    cores: int
    cpu_mhz: int
    memory_mib: int


@dataclass(frozen=True)
class HostCpu:
    """A host's CPU as its hypervisor reports it for guests: `model` its own (libvirt's host-model, a sim host's
    family), `usable` the named models it runs, `xml` libvirt's host-model CPU description (what a baseline is
    computed from; "" for the sim)."""

    model: str
    usable: tuple[str, ...]
    xml: str = ""


@dataclass(frozen=True)
class CpuCap:
    """CFS bandwidth applied to each vCPU: quota_us of CPU time every period_us."""

    period_us: int
    quota_us: int


@dataclass(frozen=True)
class DiskSpec:
    """A volume as a domain's disk: `path` is where the host sees the volume's file (its pool's
    target path + the volume name); `target` the guest device (vda, vdb, ...)."""

    pool: str
    volume: str
    path: str
    target: str
    format: str = "qcow2"
    readonly: bool = False
    device: str = "disk"  # or "cdrom": a read-only CD-ROM on virtio-scsi (a cloud-init seed, target sdX)


@dataclass(frozen=True)
class NicSpec:
    """A NIC as a domain's interface: its MAC, the host bridge of its network (the same name on every host)
    and its tap's name (core/networks.py names both); `mtu` below the bridge's when its network is carried
    over VXLAN."""

    mac: str
    bridge: str
    tap: str
    mtu: int | None = None


@dataclass(frozen=True)
class DomainSpec:
    """Everything a host needs to run a VM. `max_*` is the live-scaling ceiling (== current when
    the VM is not prepared). `image` names the kernel + initrd of a direct kernel boot; "" boots
    from the first disk as it is (a bootable disk image)."""

    name: str
    vcpus: int
    max_vcpus: int
    memory_mib: int
    max_memory_mib: int
    image: str
    cpu_cap: CpuCap | None = None
    disks: tuple[DiskSpec, ...] = ()
    nics: tuple[NicSpec, ...] = ()
    cpu_model: str = "qemu64"  # a named model or "host-model" (core/cpumodels.py chooses it)

    @property
    def prepared(self) -> bool:
        return self.max_vcpus > self.vcpus or self.max_memory_mib > self.memory_mib


@dataclass(frozen=True)
class DomainInfo:
    """A domain as its host reports it (read back, never what was asked).

    `state`/`reason` are libvirt's (`running`/`booted`, `paused`/`postcopy-failed`, `shutoff`/`destroyed`,
    ...); `paused`/`migration` or `paused`/`starting-up` on a migration's target is its incoming domain,
    which never ran the guest (migration.incoming()). `running` means the guest executes (running or
    blocked): a PAUSED domain is not running, although its QEMU holds memory: that is `active`. `vcpus` is
    the plugged count; `usable_vcpus` what the guest may use (a soft scale-down leaves vCPUs plugged but
    offline and capped); `memory_mib` the domain's current memory (boot memory + DIMMs)."""

    name: str
    running: bool
    vcpus: int
    memory_mib: int
    cpu_cap: CpuCap | None = None
    state: str = "running"
    reason: str = ""
    soft_vcpus: int | None = None  # the whole-domain cap in CPUs a soft scale-down set; None: none

    @property
    def active(self) -> bool:
        """A QEMU process exists for it (running, paused, blocked, shutting down): it holds the host's memory."""
        return self.state not in ("shutoff", "crashed", "nostate")

    @property
    def usable_vcpus(self) -> int:
        return min(self.vcpus, self.soft_vcpus) if self.soft_vcpus else self.vcpus


@dataclass(frozen=True)
class PoolSpec:
    """A storage pool as a host defines it: a libvirt `dir` pool named `name` at `path` (as the host
    sees it). A shared pool has the same path on every host of its cluster, and the same files."""

    name: str
    path: str


@dataclass(frozen=True)
class PoolInfo:
    """A pool as its host reports it (refreshed, read back). Sizes in MiB."""

    name: str
    path: str
    state: str  # "running", "inactive", "building", "degraded", "inaccessible"
    capacity_mib: int
    allocation_mib: int
    available_mib: int


@dataclass(frozen=True)
class VolumeInfo:
    """A volume as its pool reports it: `capacity_mib` the virtual size the guest sees,
    `allocation_mib` what it takes on the pool, `backing` the backing file of an overlay."""

    pool: str
    name: str
    path: str
    format: str
    capacity_mib: int
    allocation_mib: int
    backing: str | None = None


@dataclass(frozen=True)
class Resized:
    """What a live change left: `method` says how it was done; the rest is read back from the host
    after the change (the domain's size now), which is what the store may record."""

    method: str
    vcpus: int  # vCPUs the guest may use (plugged, less those offlined softly)
    memory_mib: int  # the domain's current memory
    cpu_cap: CpuCap | None  # the per-vCPU cap in force
    plugged_vcpus: int = 0

    @classmethod
    def of(cls, method: str, info: DomainInfo) -> Resized:
        return cls(method, info.usable_vcpus, info.memory_mib, info.cpu_cap, info.vcpus)


class ConsoleStream(Protocol):
    """A domain's serial console, opened by `Driver.open_console` (issue 31): bytes from the guest and keys to
    it. `read` returns b"" when nothing came within `timeout_s`, and raises DriverError once the console
    closed (the domain stopped or left the host: a migration's source)."""

    def read(self, timeout_s: float) -> bytes: ...
    def write(self, data: bytes) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class GuestView:
    """What the guest itself reports: online vCPUs and MemTotal."""

    vcpus_online: int
    memtotal_kib: int


class GuestInterface(NamedTuple):
    """One network interface as the guest agent reports it: its name in the guest (lo, eth0...), its MAC
    ("" when the guest says none) and its addresses, each `ADDR/PREFIX` (IPv4 and IPv6)."""

    name: str
    mac: str
    addresses: list[str]


@dataclass(frozen=True)
class MigrationParams:
    bandwidth_mib_s: int | None = None  # pre-copy bandwidth cap; None = the hypervisor's default
    max_downtime_ms: int | None = None
    postcopy: bool = False
    postcopy_after_s: float | None = None  # switch to post-copy this long after the first pass starts
    postcopy_bandwidth_mib_s: int | None = None
    parallel_connections: int | None = None
    auto_converge: bool = False  # QEMU throttles a guest that dirties memory faster than the link
    timeout_s: float | None = None  # vmplane.migration.timeout: the copy ends by then
    timeout_action: str = "abort"  # at the deadline, still in pre-copy: "abort", or "postcopy"
    # (switch, if `postcopy` allows it; a post-copy can't be aborted)
    copy_disks: tuple[str, ...] = ()  # disk targets (vda, ...) copied to the target host with the
    # memory (their overlays, created beforehand on the target:
    # VIR_MIGRATE_NON_SHARED_INC); the backing image is there already
    shared_disks: bool = False  # the other disks are on storage both hosts share (checked by
    # vmplane): libvirt's own check does not know a local bind
    # mount, so VIR_MIGRATE_UNSAFE is passed


@dataclass
class MigrationStats:
    total_ms: int = 0
    downtime_ms: int = 0
    bytes_sent: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


ProgressCallback = Callable[[int, str], None]  # (percent 0..100, message)


class Driver(abc.ABC):
    """One host's hypervisor."""

    kind: str = "abstract"
    # a call waits on a daemon (a remote host, a socket): calls for several VMs are made in parallel
    blocking_calls: bool = True

    def __init__(self, host: str):
        self.host = host
        self.migration_address: str | None = None  # where this host takes incoming migrations

    @abc.abstractmethod
    def host_info(self) -> HostInfo: ...

    def host_cpu(self) -> HostCpu:
        """The host's CPU for guests (core/cpumodels.py); a driver that can not say runs the default model."""
        return HostCpu("qemu64", ("qemu64",))

    def baseline_cpu(self, cpus: list[HostCpu]) -> str:
        """The newest named CPU model all of `cpus` run (asked of this host's hypervisor: libvirt's
        baselineHypervisorCPU); core/cpumodels.choose_baseline checks it is usable on each host."""
        return "qemu64"

    @abc.abstractmethod
    def start(self, spec: DomainSpec) -> None:
        """Define and start a domain; returns once the hypervisor runs it."""

    @abc.abstractmethod
    def stop(self, name: str, timeout_s: float = 30.0) -> str | None:
        """Stop a domain (graceful first, then forced) and remove its definition; how it went, in words,
        when the host can say (asked through the guest agent or ACPI, forced after the timeout)."""

    def reboot(self, name: str, force: bool = False) -> str:
        """Ask a running domain's guest to reboot (its guest agent, else ACPI), or with `force` reset it (a
        hardware reset: what the guest had not written is lost); the domain keeps running either way. How it
        was asked, in words. DriverError when the host has no such running domain or refuses."""
        raise DriverError(self.host, f"the {self.kind} driver can not reboot a domain")

    def undefine_if_shut_off(self, name: str) -> bool:
        """Remove the definition of a domain only if it is shut off now; never stops a domain (what a
        settle removes was read shut off earlier, and may have been started since). True: removed, or
        the host has no such domain; False: it is active, left as it is."""
        raise DriverError(self.host, f"the {self.kind} driver can not remove a shut-off definition alone")

    @abc.abstractmethod
    def domains(self) -> list[DomainInfo]:
        """Every domain this host runs or has defined."""

    def domain(self, name: str) -> DomainInfo | None:
        """The domain, running or only defined; None only when the host confirms it has no such domain
        (a host that can not be asked raises DriverError: unknown is not absent)."""
        for info in self.domains():
            if info.name == name:
                return info
        return None

    # The set_* methods return what the domain IS after the change, read back from the host (a
    # Resized), never what was asked: a request the hypervisor only accepted (a DIMM unplug the guest
    # has not completed) is not an effect. They raise DriverError when the change is not confirmed;
    # the domain may then be anywhere between the old and the new size: read it back (domain()).

    @abc.abstractmethod
    def set_vcpus(self, name: str, vcpus: int) -> Resized:
        """Change the live vCPU count; method "hotplug", "unplug", "soft", "online", "unchanged"."""

    @abc.abstractmethod
    def set_memory(self, name: str, memory_mib: int) -> Resized:
        """Change the live memory; method "dimm", "dimm-unplug", "unchanged". An unplug returns only
        once the DIMM left the domain (confirmed), else raises naming why."""

    @abc.abstractmethod
    def set_cpu_cap(self, name: str, cap: CpuCap | None) -> Resized:
        """Apply, change or (None) remove the CPU cap of a running domain; method "cap"."""

    @abc.abstractmethod
    def migrate(
        self, name: str, target: Driver, params: MigrationParams, progress: ProgressCallback | None = None
    ) -> MigrationStats:
        """Live-migrate a running domain to the target host; on failure it keeps running here."""

    def abort_migration(self, name: str) -> None:  # noqa: B027 (optional: a driver without it cannot cancel)
        """Cancel an outgoing migration of `name`; it then fails and the domain keeps running here."""

    def migration_active(self, name: str) -> bool:
        """Whether the hypervisor still migrates `name` away from this host on its own."""
        return False

    @abc.abstractmethod
    def guest_view(self, name: str) -> GuestView: ...

    def domain_stats(self) -> HostCounters:
        """Every running domain's usage counters and the host's own, read now (libvirt's bulk stats call):
        what the graphs' sampler (controllers/stats.py) turns into rates."""
        raise DriverError(self.host, f"the {self.kind} driver has no usage counters")

    # -- storage (pools of volumes; every method reads back what it changed) ---------------------
    def _no_storage(self) -> DriverError:
        return DriverError(self.host, f"the {self.kind} driver has no storage")

    def define_pool(self, spec: PoolSpec) -> PoolInfo:
        """Define (persistent, autostarted), build and start a pool; an existing pool of that name and
        path is started if needed and returned. Another path under that name: DriverError."""
        raise self._no_storage()

    def pool_info(self, name: str) -> PoolInfo | None:
        """The pool, refreshed; None only when the host confirms it has no such pool."""
        raise self._no_storage()

    def remove_pool(self, name: str) -> None:
        """Stop and undefine a pool (its files are left alone); absent is fine."""
        raise self._no_storage()

    def volumes(self, pool: str) -> list[VolumeInfo]:
        """Every volume of the pool (refreshed first)."""
        raise self._no_storage()

    def volume(self, pool: str, name: str) -> VolumeInfo | None:
        """None only when the pool confirms it has no such volume."""
        for info in self.volumes(pool):
            if info.name == name:
                return info
        return None

    def create_volume(
        self,
        pool: str,
        name: str,
        capacity_mib: int,
        format: str = "qcow2",
        backing: str | None = None,
        backing_format: str | None = None,
    ) -> VolumeInfo:
        """Create a volume (a qcow2 overlay on `backing` when given: the guest sees the backing image's
        data, grown to `capacity_mib`). A volume of that name already there is returned as it is:
        the caller compares."""
        raise self._no_storage()

    def delete_volume(self, pool: str, name: str) -> None:
        """Delete a volume and its data; absent is fine. Refused (DriverError) while a domain uses it."""
        raise self._no_storage()

    def resize_volume(self, pool: str, name: str, capacity_mib: int) -> VolumeInfo:
        """Grow a volume no running domain uses (offline); returns it read back."""
        raise self._no_storage()

    def upload_volume(self, pool: str, name: str, source: str, format: str) -> VolumeInfo:
        """Create a volume with the contents of the local file `source` (a template image), through
        the hypervisor's own upload stream."""
        raise self._no_storage()

    def clone_volume(self, pool: str, name: str, source: str) -> VolumeInfo:
        """A new qcow2 volume in `pool` holding what the file at `source` (a volume of a pool this host has)
        shows through its whole chain: a full copy, on no backing file (libvirt: `createXMLFrom`). Read back."""
        raise self._no_storage()

    def backup_disks(
        self, name: str, disks: dict[str, tuple[str, bool]], since: str | None, checkpoint: str,
        timeout_s: float = 3600.0, on_progress: Callable[[int, int], None] | None = None,
    ) -> int:  # fmt: skip
        """Back up a running domain's disks in one job: `disks` maps a disk's target to the qcow2 file it is
        written into (made beforehand: for an incremental disk, on the previous backup's file) and whether only
        what changed since checkpoint `since` goes (else all of it); take checkpoint `checkpoint` on those disks
        at the same moment. `on_progress(processed, total)` is called as the job goes (bytes). Returns once the
        job ended, with the bytes it transferred; DriverError when it failed."""
        raise self._no_storage()

    def checkpoint_xml(self, name: str, checkpoint: str) -> str:
        """A checkpoint's description, to define it again where the domain runs next."""
        raise self._no_storage()

    def define_checkpoints(self, name: str, xmls: list[str]) -> None:
        """Define again (oldest first) the checkpoints the running domain does not have (its bitmaps are in
        its qcow2 file: libvirt forgets the checkpoints when the domain is undefined or moves)."""
        raise self._no_storage()

    def abort_backup(self, name: str, checkpoint: str) -> None:
        """Undo a backup a crash cut short: its job aborted if it still runs, its checkpoint (and bitmap)
        deleted if it was taken. A domain that is not there has neither."""
        raise self._no_storage()

    def volume_sha256(self, pool: str, name: str) -> tuple[str, int]:
        """(sha256, size) of a volume's file, read through the hypervisor's download stream."""
        raise self._no_storage()

    def attach_disk(self, name: str, disk: DiskSpec) -> None:
        """Hot-plug a disk into a running domain (and its persistent definition, if any); returns once
        the domain lists it (read back)."""
        raise self._no_storage()

    def detach_disk(self, name: str, target: str) -> None:
        """Unplug a disk from a running domain; returns only once the hypervisor confirmed the device
        left (libvirt's DEVICE_REMOVED, or the domain no longer lists it); else DriverError."""
        raise self._no_storage()

    def domain_disks(self, name: str) -> dict[str, str]:
        """The disks a domain has now, read back: {target: path}."""
        raise self._no_storage()

    def grow_disk(self, name: str, target: str, capacity_mib: int) -> None:
        """Grow a running domain's disk live (libvirt's blockResize); read back."""
        raise self._no_storage()

    def snapshot_disks(self, name: str, overlays: dict[str, str]) -> None:
        """Put a new empty qcow2 overlay (`overlays`: {target: path}, made by the host in the disk's pool
        directory) on each listed disk of a running domain, all at once (no disk switched unless all are),
        and switch the domain to them; the others (a CD-ROM) are left alone. The caller reads back
        (`domain_disks`): an error may come after the switch was made."""
        raise self._no_storage()

    def domain_chain(self, name: str, target: str) -> list[str]:
        """The files a running domain's disk reads now, read back: its active file first, then each backing
        file down the chain."""
        raise self._no_storage()

    def commit_disk(self, name: str, target: str, top: str, base: str, timeout_s: float = 600.0) -> None:
        """Merge `top` into `base`, its backing file in the running domain's disk `target` (a live block
        commit): when `top` is the active file the domain is switched to `base` (pivot); otherwise `top`'s
        child is rebased onto `base`. Returns once the job ended; the caller reads back (`domain_chain`)."""
        raise self._no_storage()

    def copy_disk(self, name: str, target: str, dest: str, timeout_s: float = 3600.0) -> None:
        """Copy a running domain's disk `target` (its whole chain) into a new qcow2 file at `dest` (a path of a
        pool this host has) while the guest runs (a block copy), then switch the domain to it (pivot), its
        persistent definition too. Returns once the job ended; the caller reads back (`domain_disks`). A job
        that fails leaves the domain on its file, and maybe a partial `dest` (the caller deletes it)."""
        raise self._no_storage()

    def abort_disk_copy(self, name: str, target: str) -> None:
        """Abort a block copy of disk `target` a crash cut short (no pivot); no job, no domain: nothing."""
        raise self._no_storage()

    def copy_volume_from(self, pool: str, name: str, source: Driver, source_pool: str, source_name: str) -> VolumeInfo:
        """A new volume `name` in `pool` of this host with the bytes of volume `source_name` of `source_pool`
        on host `source` (a file as it is: an overlay keeps its backing image's path, which must be on this
        host too). Read back; a copy that fails may leave a partial `name` (the caller deletes it)."""
        raise self._no_storage()

    @abc.abstractmethod
    def guest_exec(self, name: str, command: str, timeout_s: float = 30.0) -> str:
        """Run a shell command inside the guest and return its output."""

    # -- guest networks (issue 29) -------------------------------------------------------------------
    def attach_nic(self, name: str, nic: NicSpec) -> None:
        """Hot-plug a NIC into a running domain; returns once the domain lists it (read back)."""
        raise DriverError(self.host, "this host cannot hot-plug NICs")

    def detach_nic(self, name: str, mac: str) -> None:
        """Unplug a NIC from a running domain; returns only once the hypervisor confirmed the device left
        (libvirt's DEVICE_REMOVED, or the domain no longer lists it); else DriverError."""
        raise DriverError(self.host, "this host cannot unplug NICs")

    def domain_nics(self, name: str) -> dict[str, str]:
        """The NICs a domain has now, read back: {MAC: bridge}."""
        raise DriverError(self.host, "this host cannot list NICs")

    def apply_networks(self, want: HostNetworks) -> Applied:
        """Bring the host's guest networks (bridges, VXLAN, filter, DHCP) to `want` and read them back: a
        DriverError when the host does not hold them afterwards."""
        raise DriverError(self.host, "this host cannot carry guest networks (its driver has no host commands)")

    # -- the QEMU guest agent (issue 30): a guest without one makes these fail, never wait past their timeout --
    def _no_agent(self) -> DriverError:
        return DriverError(self.host, "no guest agent on this host's driver")

    def agent_ping(self, name: str, timeout_s: float = 2.0) -> bool:
        """Whether the guest agent of `name` answers (`guest-ping`) within `timeout_s`: False, not an error,
        when it does not or the domain has no agent."""
        raise self._no_agent()

    def agent_interfaces(self, name: str, timeout_s: float = 5.0) -> list[GuestInterface]:
        """The guest's network interfaces and their addresses, as its agent reports them
        (`guest-network-get-interfaces`); DriverError when the agent does not answer."""
        raise self._no_agent()

    def agent_exec(self, name: str, command: str, timeout_s: float = 30.0) -> tuple[str, int]:
        """Run a shell command line in the guest through its agent (`guest-exec`): (output, with standard
        error merged in, exit code). A command still running at `timeout_s` is left running in the guest,
        and DriverError says so."""
        raise self._no_agent()

    def open_console(self, name: str) -> ConsoleStream:
        """The serial console of a running domain, for a person (issue 31); never taken from another holder
        (a `virsh console`): DriverError then."""
        raise DriverError(self.host, "this host has no serial console to open")

    def fs_freeze(self, name: str, thaw_after_s: float = 10.0) -> int:
        """Freeze the guest's file systems through its agent (how many); thawed by `fs_thaw`, or at the
        latest `thaw_after_s` later whatever happens to the caller. DriverError without an agent."""
        raise self._no_agent()

    def fs_thaw(self, name: str) -> int:
        """Thaw the guest's file systems (how many)."""
        raise self._no_agent()

    def fs_frozen(self, name: str) -> bool:
        """Whether the guest's file systems are frozen, as its agent says."""
        raise self._no_agent()

    def agent_shutdown(self, name: str) -> None:
        """Ask the guest agent to power the guest off (`guest-shutdown`, mode powerdown); DriverError when
        the agent did not take the request. The domain's own end says when it is off."""
        raise self._no_agent()

    def close(self) -> None:  # noqa: B027 (optional: a driver without connections has nothing to release)
        """Release connections; the host itself keeps running."""
