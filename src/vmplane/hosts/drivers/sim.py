"""An in-memory hypervisor for scale tests and demos: thousands of hosts, no QEMU.

It keeps the same contracts as a real host (a domain runs on one host; a migration moves it;
sizes change as asked) so the orchestrator cannot tell the difference in its rules. Its domains
live in a SimFabric, outside the control plane's memory, so they outlive a killed control plane
as a real host's do. It never stands in for the real path in tests of guest behaviour.

Fault mode (drivers/simfaults.py; off by default, on per driver or per fabric) makes it behave as
libvirt does at its worst: a DIMM unplug that the guest completes late or never (set_memory then
confirms it as the libvirt driver does, with the same helper: base.confirm_unplug), errors raised
after a partial effect, transient errors on any call, a connection lost mid-copy while the copy goes
on, post-copy failure (paused on both hosts), guests that power off, crash or pause on their own,
and lifecycle events (`watch`) that arrive late, twice or not at all.

Host failures (drivers/simhosts.py: `fabric.fail_host(host, "power"|"daemon"|"network")`, and in
fault mode flaps, partitions and reboots): while its host does not answer, every call raises
DriverError ("cannot connect to the hypervisor"; retry-able), no event comes from it, and a
migration to or from it fails (one under way fails as soon as either end stops answering: the domain
stays on the source, or is gone with it if the source lost its power; the target keeps nothing, except,
after a power loss of the source, its incoming domain until its keepalive notices: simfabric.py).

During a copy the target holds libvirt's incoming domain (paused, reason `migration`), which the
switch-over replaces. Guests answer the migration's check (`guest_health`) at once, unless made silent
(`fabric.silence_guest`: a guest still booting, or one that never answers).

Storage (drivers/simstorage.py): pools with a capacity, volumes (qcow2 overlays allocate what the
guest wrote), disks that must exist and that no two running domains open for writing (lockd), disk
hot-plug with detaches completed late or never, and migrations that copy disks at a rate
(`disk_copy_rate_mib_s`) before the memory, failing mid-copy in fault mode.
"""

from __future__ import annotations

import os
import threading
import time

from vmplane.core import cpumodels
from vmplane.core import driver as base
from vmplane.core.driver import (
    CpuCap,
    DomainInfo,
    DomainSpec,
    Driver,
    DriverError,
    GuestInterface,
    GuestView,
    HostCpu,
    HostInfo,
    MigrationParams,
    MigrationStats,
    NicSpec,
    ProgressCallback,
    Resized,
)
from vmplane.core.hostnet import Applied, HostNetworks
from vmplane.hosts.drivers.simblockcopy import SimBlockCopyMixin
from vmplane.hosts.drivers.simconsole import SimConsole
from vmplane.hosts.drivers.simevents import (
    CRASHED,
    RESUMED,
    SHUTDOWN,
    SHUTDOWN_GUEST,
    STOPPED,
    STOPPED_CRASHED,
    STOPPED_DESTROYED,
    STOPPED_MIGRATED,
    STOPPED_SHUTDOWN,
    SUSPENDED,
    SUSPENDED_IOERROR,
    SUSPENDED_POSTCOPY_FAILED,
    UNDEFINED,
)
from vmplane.hosts.drivers.simfabric import SimFabric
from vmplane.hosts.drivers.simfaults import SimFaults
from vmplane.hosts.drivers.simsnapshots import SimSnapshotMixin
from vmplane.hosts.drivers.simstats import SimStatsMixin
from vmplane.hosts.drivers.simstorage import CopyPlan, SimStorageDriver, SimStorageError


class SimDriver(SimStorageDriver, SimSnapshotMixin, SimBlockCopyMixin, SimStatsMixin, Driver):
    kind = "sim"
    blocking_calls = False  # in-process, serialised by the fabric's lock: one call after another
    UNPLUG_TRIES = 3  # as the libvirt driver
    UNPLUG_WAIT_S = 0.15  # per request (libvirt: 5 s; a sim guest answers faster or never)

    def __init__(
        self,
        host: str,
        info: HostInfo,
        fabric: SimFabric | None = None,
        faults: SimFaults | None = None,
        cpu_family: str | None = None,
    ):
        super().__init__(host)
        self._info = info
        self.cpu_family = cpu_family or cpumodels.SIM_FAMILY  # its CPU: it runs this model and the older ones
        self.fabric = fabric or SimFabric()
        self.faults = faults  # None: the fabric's (fabric.faults), which is None unless switched on
        # None: a migration is instant; else memory is copied at this rate (for limit and drain timelines)
        # (harnesses of several processes set it for all: $VMPLANE_SIM_COPY_RATE_MIB_S)
        self.copy_rate_mib_s: float | None = float(os.environ.get("VMPLANE_SIM_COPY_RATE_MIB_S") or 0) or None
        # disks are copied at this rate (MiB/s); None: the fabric's (fabric.disk_copy_rate_mib_s)
        self.disk_copy_rate_mib_s: float | None = None
        self._aborts: set[str] = set()
        self._copies: dict[str, threading.Thread] = {}  # copies going on after a lost connection
        self._restarting_until = 0.0  # fault mode: libvirtd restarting until then

    fabric: SimFabric  # (SimStorageDriver knows it as its StorageFabric half)

    # -- fault mode --------------------------------------------------------------------------------
    @property
    def _faults(self) -> SimFaults | None:
        return self.faults if self.faults is not None else self.fabric.faults

    def _chance(self, kind: str) -> bool:
        f = self._faults
        return f is not None and f.chance(kind)

    def _emit(self, name: str, event: int, detail: int) -> None:
        if self._faults is not None:
            self.fabric.emit(self.host, name, event, detail)

    def _call(self, what: str) -> None:
        """Every call: the host may not answer (failed, or a flap), a guest of this host may act on its
        own, and the daemon may be restarting."""
        f = self._faults
        try:
            self.fabric.check_host(self.host, what)
            if f is not None and f.enabled:
                for kind, mode, span in (
                    ("host_reboot", "power", f.reboot_s),
                    ("host_partition", "network", f.partition_s),
                    ("host_flap", "network", f.flap_s),
                ):
                    if f.chance(kind):
                        self.fabric.fail_host(self.host, mode, f.delay(span))
                        self.fabric.check_host(self.host, what)
        except DriverError:
            if f is not None:
                f.count("host_call")
            raise
        if f is None or not f.enabled:
            return
        for kind in ("guest_poweroff", "guest_crash", "guest_pause"):
            if f.chance(kind):
                self._guest_acts(kind, f)
        restarting = time.monotonic() < self._restarting_until or f.bursting(self.host)
        if restarting or f.chance("transient"):  # a restart fails every call for a while
            if not restarting:
                self._restarting_until = time.monotonic() + f.delay(f.restart_s)
            else:
                f.count("transient_call")
            raise DriverError(self.host, f"{what}: daemon restarting: the connection to libvirtd was reset; retry")

    def _guest_acts(self, kind: str, f: SimFaults) -> None:
        running = [d.name for d in self.fabric.domains(self.host) if d.running]
        if not running:
            return
        name = f.pick(running)
        if kind == "guest_poweroff":  # poweroff -f inside: QEMU exits, a transient domain goes
            self.fabric.remove(self.host, name)
            self._emit(name, SHUTDOWN, SHUTDOWN_GUEST)
            self._emit(name, STOPPED, 0)
            self._emit(name, UNDEFINED, 0)
        elif kind == "guest_crash":  # on_crash=destroy: left defined, shut off (crashed)
            self.fabric.set_state(self.host, name, "shutoff", "crashed")
            self._emit(name, CRASHED, 0)
            self._emit(name, STOPPED, STOPPED_CRASHED)
        else:  # an I/O error pauses it; it is resumed a little later
            self.fabric.set_state(self.host, name, "paused", "ioerror")
            self.fabric.pause_until(name, f.delay(f.pause_s))
            self._emit(name, SUSPENDED, SUSPENDED_IOERROR)

    def watch(self, callback) -> None:
        """`callback(host, domain_name, event, detail)` for lifecycle events of this host's domains, with
        libvirt's numbers. Events are sent in fault mode only (late, twice or lost as it says)."""
        self.fabric.watch(self.host, callback)

    # -- the driver --------------------------------------------------------------------------------
    def host_info(self) -> HostInfo:
        self.fabric.check_host(self.host, "get the host's info")
        return self._info

    def host_cpu(self) -> HostCpu:
        self.fabric.check_host(self.host, "get the host's CPU")
        return HostCpu(self.cpu_family, cpumodels.runnable(self.cpu_family))

    def baseline_cpu(self, cpus: list[HostCpu]) -> str:
        return cpumodels.family_baseline(c.model for c in cpus)

    def _check_cpu(self, spec: DomainSpec, what: str, family: str | None = None) -> None:
        """Refuse a domain whose CPU model this host does not run, as QEMU would (`family`: the CPU a
        host-model domain got where it started)."""
        model = family or spec.cpu_model
        if model != cpumodels.HOST_MODEL and model not in cpumodels.runnable(self.cpu_family):
            raise DriverError(
                self.host,
                f"{what} {spec.name}: the guest CPU model {model} is not usable on this host (its CPU is "
                f"{self.cpu_family})",
            )

    def start(self, spec: DomainSpec) -> None:
        self._call(f"start {spec.name}")
        if not spec.image and not spec.disks:
            raise DriverError(self.host, f"start {spec.name}: no kernel image and no disk to boot from")
        self._check_cpu(spec, "start")
        try:
            started = self.fabric.put(self.host, spec)
        except SimStorageError as e:
            raise DriverError(self.host, f"start {spec.name}: {e}") from None
        if not started:
            raise DriverError(self.host, f"domain {spec.name} is already running")
        if self._chance("partial"):
            raise DriverError(self.host, f"start {spec.name}: the reply was lost (the domain started)")

    def stop(self, name: str, timeout_s: float = 30.0) -> str | None:
        self._call(f"stop {name}")
        if self.fabric.remove(self.host, name):
            self._emit(name, STOPPED, STOPPED_DESTROYED)
            self._emit(name, UNDEFINED, 0)
            if self._chance("partial"):
                raise DriverError(self.host, f"stop {name}: the reply was lost (the domain was destroyed)")
        return None  # (the sim does not say how: its guests power off at once)

    def reboot(self, name: str, force: bool = False) -> str:
        self._call(f"reboot {name}")
        info = self.fabric.domain(self.host, name)
        if info is None or not info.running:
            raise DriverError(self.host, f"domain {name} is not running here")
        if self._chance("partial"):
            raise DriverError(self.host, f"reboot {name}: the reply was lost (the guest was asked)")
        return "reset (forced)" if force else "asked through its guest agent"

    def undefine_if_shut_off(self, name: str) -> bool:
        self._call(f"undefine {name} if shut off")
        if self.fabric.remove(self.host, name, shut_off_only=True):
            self._emit(name, UNDEFINED, 0)
            return True
        return self.fabric.domain(self.host, name) is None

    def move_behind_our_back(self, name: str, target: SimDriver) -> bool:
        """A migration vmplane did not order (a lapsed owner's late migrateToURI3): the domain moves to
        `target` and this host sends STOPPED/migrated (fault mode delivers events). False if it did not move."""
        if not self.fabric.move(name, self.host, target.host):
            return False
        self._emit(name, STOPPED, STOPPED_MIGRATED)
        target._emit(name, RESUMED, 1)
        return True

    def domains(self) -> list[DomainInfo]:
        self._call("list domains")
        return self.fabric.domains(self.host)

    def domain(self, name: str) -> DomainInfo | None:
        self._call(f"look up {name}")
        return self.fabric.domain(self.host, name)

    def _spec(self, name: str) -> DomainSpec:
        spec = self.fabric.spec(self.host, name)
        if spec is None:
            raise DriverError(self.host, f"domain {name} is not running here")
        return spec

    def _read_back(self, name: str, method: str) -> Resized:
        """What the domain is now (the same contract as a real host: read back, not what was asked)."""
        info = self.fabric.domain(self.host, name)
        if info is None or not info.active:
            raise DriverError(self.host, f"domain {name} is not running here")
        return Resized.of(method, info)

    def _partial(self, what: str) -> None:
        if self._chance("partial"):
            raise DriverError(self.host, f"{what}: an error after the change was made (it stays made)")

    # -- guest networks ---------------------------------------------------------------------------
    def apply_networks(self, want: HostNetworks) -> Applied:
        """Hold `want` (bridges, filter ports): the call may fail before (transient) or after (partial)."""
        self._call(f"apply {len(want.plan.networks)} network(s)")
        self.fabric.set_networks(self.host, want)
        self.fabric.set_bridge_prefixes(  # what the sim guests' agents report with their leases
            self.host, {n.bridge: int(n.address.split("/")[1]) for n in want.plan.networks if n.address}
        )
        self._partial("read the host's networks back")
        return Applied(len(want.plan.networks), len(want.ports))

    def domain_nics(self, name: str) -> dict[str, str]:
        self._call(f"read the NICs of {name}")
        return {mac: bridge for mac, bridge, *_rest in self.fabric.nics(self.host, name)}

    def attach_nic(self, name: str, nic: NicSpec) -> None:
        self._call(f"attach NIC {nic.mac} to {name}")
        self._spec(name)  # running here, or a DriverError
        have = {mac: bridge for mac, bridge, *_rest in self.fabric.nics(self.host, name)}
        if have.get(nic.mac) != nic.bridge:
            try:
                self.fabric.plug_nic(self.host, name, [nic.mac, nic.bridge, nic.tap, nic.mtu])
            except ValueError as exc:
                raise DriverError(self.host, f"attach NIC {nic.mac} to {name}: {exc}") from None
        self._partial(f"attach NIC {nic.mac}")

    def detach_nic(self, name: str, mac: str) -> None:
        """An unplug the guest completes at once, late or never (fault mode: detach_late/detach_never, as a
        disk's), confirmed by reading the domain back."""
        self._call(f"detach NIC {mac} from {name}")

        def request() -> str | None:
            if self.fabric.nic_unplug_pending(self.host, name, mac):
                return "an unplug of this NIC is still in progress"
            if self._chance("detach_never"):
                self.fabric.request_nic_unplug(self.host, name, mac, None)
            elif self._chance("detach_late"):
                f = self._faults
                assert f is not None  # (a fault only happens in fault mode)
                self.fabric.request_nic_unplug(self.host, name, mac, f.delay(f.unplug_delay_s))
            else:
                self.fabric.request_nic_unplug(self.host, name, mac, 0)
            return None

        def gone() -> bool:
            return all(n[0] != mac for n in self.fabric.nics(self.host, name))

        base.confirm_unplug(self.host, f"NIC {mac} of {name}", request, gone, self.UNPLUG_TRIES, self.UNPLUG_WAIT_S)
        self._partial(f"read {name} after the detach of NIC {mac}")

    def set_vcpus(self, name: str, vcpus: int) -> Resized:
        self._call(f"set vCPUs of {name}")
        spec = self._spec(name)
        if vcpus > spec.max_vcpus:
            raise DriverError(self.host, f"{vcpus} vCPUs is above the domain's maximum {spec.max_vcpus}")
        self.fabric.update(self.host, name, vcpus=vcpus)
        self._partial(f"set {vcpus} vCPUs")
        return self._read_back(name, "hotplug" if vcpus >= spec.vcpus else "unplug")

    def set_memory(self, name: str, memory_mib: int) -> Resized:
        """Grow at once; shrink by an unplug request the guest completes at once, late or never (fault
        mode), confirmed by reading the domain back (base.confirm_unplug, as the libvirt driver)."""
        self._call(f"set memory of {name}")
        spec = self._spec(name)
        if memory_mib > spec.max_memory_mib:
            raise DriverError(self.host, f"{memory_mib} MiB is above the domain's maximum {spec.max_memory_mib}")
        if memory_mib == spec.memory_mib:
            return self._read_back(name, "unchanged")
        if memory_mib > spec.memory_mib:
            self.fabric.update(self.host, name, memory_mib=memory_mib)
            self._partial(f"attach a {memory_mib - spec.memory_mib} MiB DIMM")
            return self._read_back(name, "dimm")

        def request() -> str | None:
            if self.fabric.pending_unplug(self.host, name) == memory_mib:
                return "an unplug of this DIMM is still in progress"
            if self._chance("unplug_never"):
                self.fabric.request_unplug(self.host, name, memory_mib, None)
            elif self._chance("unplug_late"):
                f = self._faults
                assert f is not None  # (a fault only happens in fault mode)
                self.fabric.request_unplug(self.host, name, memory_mib, f.delay(f.unplug_delay_s))
            elif not self.fabric.update(self.host, name, memory_mib=memory_mib):
                raise DriverError(self.host, f"domain {name} went away during a DIMM unplug")
            return None

        def gone() -> bool:
            info = self.fabric.domain(self.host, name)
            if info is None or not info.active:
                raise DriverError(self.host, f"domain {name} went away during a DIMM unplug")
            return info.memory_mib <= memory_mib

        base.confirm_unplug(
            self.host,
            f"DIMM ({spec.memory_mib - memory_mib} MiB) of {name}",
            request,
            gone,
            self.UNPLUG_TRIES,
            self.UNPLUG_WAIT_S,
        )
        self._partial("read the domain after the unplug")
        return self._read_back(name, "dimm-unplug")  # as libvirt does

    def set_cpu_cap(self, name: str, cap: CpuCap | None) -> Resized:
        self._call(f"set the CPU cap of {name}")
        if not self.fabric.update(self.host, name, cpu_cap=cap):
            raise DriverError(self.host, f"domain {name} is not running here")
        self._partial("set the CPU cap")
        return self._read_back(name, "cap")

    def migrate(
        self, name: str, target: Driver, params: MigrationParams, progress: ProgressCallback | None = None
    ) -> MigrationStats:
        if not isinstance(target, SimDriver):
            raise DriverError(self.host, "a sim host can only migrate to another sim host")
        self._call(f"migrate {name}")
        spec = self._spec(name)
        # a host-model guest has this host's CPU: the target must run this host's family
        target._check_cpu(spec, "migrate", self.cpu_family if spec.cpu_model == cpumodels.HOST_MODEL else None)
        self._ends_answer(name, target)
        t0 = time.monotonic()
        try:
            plan = self._plan_copy(name, spec.disks, target.host, params) if spec.disks else CopyPlan([])
            if not self.fabric.begin_incoming(name, self.host, target.host):
                self._ends_answer(name, target)
                raise DriverError(self.host, f"{target.host} already runs a domain {name}, or it left {self.host}")
            try:
                return self._copy(name, spec, target, t0, progress, plan, self._disk_rate(params))
            except BaseException:
                if name not in self._copies:  # (a copy that goes on without us keeps its incoming domain)
                    self.fabric.end_incoming(name, self.host, target.host)
                raise
        finally:
            self._aborts.discard(name)  # an abort asked before the copy began still counts

    def _copy(
        self,
        name: str,
        spec: DomainSpec,
        target: SimDriver,
        t0: float,
        progress: ProgressCallback | None,
        plan: CopyPlan,
        disk_rate: float | None,
    ) -> MigrationStats:
        """The disks first (NBD mirror, at `disk_rate`), then the memory (at copy_rate_mib_s)."""
        if name in self._aborts:
            raise DriverError(self.host, f"migration of {name} cancelled; it keeps running here")
        disk_mib = plan.mib
        disk_s = disk_mib / disk_rate if disk_rate and disk_mib else 0.0
        died = self.fabric.daemon_died_at(target.host)  # an incoming domain lives as long as its daemon
        if self._chance("lost_connection"):  # the copy goes on without us
            f = self._faults
            assert f is not None  # (a fault only happens in fault mode)
            delay = f.delay(f.copy_delay_s) + disk_s

            def go_on():
                time.sleep(delay)
                self.fabric.copied(plan, disk_mib)
                if self.fabric.daemon_died_at(target.host) == died and self.fabric.move(name, self.host, target.host):
                    self._emit(name, STOPPED, STOPPED_MIGRATED)
                else:
                    self.fabric.end_incoming(name, self.host, target.host)
                self._copies.pop(name, None)

            thread = threading.Thread(target=go_on, name=f"sim-copy-{name}", daemon=True)
            self._copies[name] = thread
            thread.start()
            raise DriverError(
                self.host,
                f"migration of {name}: the client connection was lost mid-copy "
                f"(end of file while reading data: Input/output error)",
            )
        memory_s = spec.memory_mib / self.copy_rate_mib_s if self.copy_rate_mib_s else 0.0
        fail_s = None if plan.fail_at_mib is None else (plan.fail_at_mib / disk_rate if disk_rate else 0.0)
        t1, duration = time.monotonic(), disk_s + memory_s
        while (elapsed := time.monotonic() - t1) < duration or fail_s is not None:
            self._ends_answer(name, target, plan, disk_rate * elapsed if disk_rate else 0.0)
            # (no rate: disk_s is 0, so the disks are done at once)
            disk_done = disk_mib if elapsed >= disk_s or not disk_rate else disk_rate * elapsed
            if fail_s is not None and elapsed >= fail_s:
                assert plan.fail_at_mib is not None  # (fail_s is its time)
                self.fabric.copied(plan, plan.fail_at_mib)
                cause = "Input/output error" if plan.fault else "No space left on device"
                raise DriverError(
                    self.host,
                    f"migration of {name}: copying its disks to {target.host} failed after "
                    f"{int(plan.fail_at_mib)} of {disk_mib} MiB: {cause}; it keeps "
                    f"running here",
                )
            if name in self._aborts:
                self.fabric.copied(plan, disk_done)
                raise DriverError(self.host, f"migration of {name} cancelled; it keeps running here")
            if progress:
                memory_done = (
                    0
                    if elapsed < disk_s
                    else int(spec.memory_mib * min(1.0, (elapsed - disk_s) / memory_s) if memory_s else spec.memory_mib)
                )
                done, total = disk_done + memory_done, disk_mib + spec.memory_mib
                progress(
                    int(100 * done / total) if total else 100,
                    f"copied {memory_done} of {spec.memory_mib} MiB"
                    if not disk_mib
                    else f"copied {int(disk_done)} of {disk_mib} MiB of disks, {memory_done} of {spec.memory_mib} "
                    f"MiB of memory",
                )
            time.sleep(max(0.0, min(0.02, duration - elapsed, (fail_s - elapsed) if fail_s is not None else 1)))
        self.fabric.copied(plan, disk_mib)
        if self._chance("postcopy_failed") and self.fabric.copy_paused(name, self.host, target.host, "postcopy-failed"):
            self._emit(name, SUSPENDED, SUSPENDED_POSTCOPY_FAILED)
            target._emit(name, SUSPENDED, SUSPENDED_POSTCOPY_FAILED)
            raise DriverError(
                self.host,
                f"migration of {name}: post-copy failed: the domain is paused on {self.host} and on {target.host}",
            )
        if self.fabric.daemon_died_at(target.host) != died:
            raise DriverError(
                self.host,
                f"migration of {name}: {target.host}'s libvirtd died during the copy and its "
                f"incoming domain with it; it keeps running here",
            )
        if not self.fabric.move(name, self.host, target.host):
            self._ends_answer(name, target)
            raise DriverError(self.host, f"{target.host} already runs a domain {name}, or it left {self.host}")
        self._emit(name, STOPPED, STOPPED_MIGRATED)
        target._emit(name, RESUMED, 1)
        if progress:
            progress(100, "switched over")
        return MigrationStats(
            total_ms=int((time.monotonic() - t0) * 1000),
            downtime_ms=0,
            bytes_sent=(spec.memory_mib + disk_mib) * 1024 * 1024,
            extra={"disk_bytes": disk_mib * 1024 * 1024} if spec.disks else {},
        )

    def _ends_answer(self, name: str, target: SimDriver, plan: CopyPlan | None = None, disk_done: float = 0.0) -> None:
        """A migration needs both ends: DriverError as soon as either does not answer (what the source
        keeps: its domain, unless it lost its power; the target keeps nothing but, after the source's power
        loss, its incoming domain, until its keepalive)."""
        for end in (self.host, target.host):
            state = self.fabric.host_state(end)
            if state.reachable:
                continue
            if plan is not None:
                self.fabric.copied(plan, min(disk_done, plan.mib))
            keeps = (
                "it was lost with its host"
                if self.fabric.host_state(self.host).power == "off"
                else "it keeps running on " + self.host
            )
            raise DriverError(
                self.host,
                f"migration of {name} to {target.host}: {end} does not answer "
                f"(connection reset by peer; host {state.mode}); {keeps}",
            )

    def resume_postcopy(self, name: str, target: Driver, params: MigrationParams) -> None:
        """Recover a failed post-copy (paused on both hosts): the domain then runs on the target only."""
        self._call(f"resume the failed post-copy migration of {name}")
        if isinstance(target, SimDriver):
            self.fabric.check_host(target.host, f"resume the failed post-copy migration of {name}")
        if not isinstance(target, SimDriver) or not self.fabric.resume_postcopy(name, self.host, target.host):
            raise DriverError(
                self.host,
                f"resume the failed post-copy migration of {name}: the domain is not "
                f"paused (postcopy-failed) on {self.host} and {target.host}",
            )
        self._emit(name, STOPPED, STOPPED_MIGRATED)
        target._emit(name, RESUMED, 2)

    def abort_migration(self, name: str) -> None:
        self._aborts.add(name)
        self.fabric.check_host(self.host, f"abort the migration of {name}")

    def migration_active(self, name: str) -> bool:
        self.fabric.check_host(self.host, f"job of {name}")
        return name in self._copies

    def guest_view(self, name: str) -> GuestView:
        self._call(f"ask the guest of {name}")
        spec = self._spec(name)
        return GuestView(spec.vcpus, spec.memory_mib * 1024)

    def guest_health(self, name: str, timeout_s: float = 60.0) -> str:
        """What the migration's guest check reads (migrator.HEALTH_COMMAND's answer: uptime, kernel errors),
        once the guest answers (fabric.silence_guest: a guest still booting, or one that never answers);
        DriverError after `timeout_s` without an answer."""
        self._call(f"ask the guest of {name}")
        if not self.fabric.guest_answers(self.host, name, timeout_s):
            raise DriverError(self.host, f"the guest of {name} did not answer on its console within {timeout_s:g} s")
        return f"{self.fabric.guest_uptime(name):.2f}\n0\n"

    def guest_exec(self, name: str, command: str, timeout_s: float = 30.0) -> str:
        raise DriverError(self.host, "sim hosts have no guest to run commands in; use a libvirt host")

    def open_console(self, name: str) -> SimConsole:
        self._call(f"open the console of {name}")
        return SimConsole(self, name)

    # -- the guest agent (simagent.py: every running guest has one, unless fabric.silence_agent) ----------
    def _agent_answers(self, name: str, what: str) -> None:
        self._call(f"{what} (guest agent of {name})")
        self._spec(name)  # running here, or a DriverError
        if not self.fabric.agent_answers(self.host, name):
            raise DriverError(self.host, f"guest agent of {name}: {what}: QEMU guest agent is not connected")

    def agent_ping(self, name: str, timeout_s: float = 2.0) -> bool:
        self._call(f"guest-ping (guest agent of {name})")
        if self.fabric.domain(self.host, name) is None:  # as libvirt's: a domain the host lacks is an error
            raise DriverError(self.host, f"domain {name} does not exist here")
        return self.fabric.agent_answers(self.host, name)

    def agent_interfaces(self, name: str, timeout_s: float = 5.0) -> list[GuestInterface]:
        self._agent_answers(name, "guest-network-get-interfaces")
        return self.fabric.agent_interfaces(self.host, name)

    def agent_exec(self, name: str, command: str, timeout_s: float = 30.0) -> tuple[str, int]:
        self._agent_answers(name, "guest-exec")
        raise DriverError(self.host, "sim guests run no commands, not even through their agent; use a libvirt host")

    def fs_freeze(self, name: str, thaw_after_s: float = 10.0) -> int:
        """One file system frozen, thawed at the latest `thaw_after_s` later (kept in the fabric's file: a
        control plane killed meanwhile changes nothing)."""
        self._agent_answers(name, "guest-fsfreeze-freeze")
        self.fabric.freeze(name, time.time() + thaw_after_s)
        return 1

    def fs_thaw(self, name: str) -> int:
        self._agent_answers(name, "guest-fsfreeze-thaw")
        return int(self.fabric.thaw(name))

    def fs_frozen(self, name: str) -> bool:
        self._agent_answers(name, "guest-fsfreeze-status")
        return self.fabric.frozen(name)

    def agent_shutdown(self, name: str) -> None:
        """The guest powers off at once: its domain is left shut off (reason shutdown), as a defined domain's
        on_poweroff=destroy leaves it on a real host."""
        self._agent_answers(name, "guest-shutdown")
        if self.fabric.set_state(self.host, name, "shutoff", "shutdown"):
            self._emit(name, SHUTDOWN, SHUTDOWN_GUEST)
            self._emit(name, STOPPED, STOPPED_SHUTDOWN)
