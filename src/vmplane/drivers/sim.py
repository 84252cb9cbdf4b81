"""An in-memory hypervisor for scale tests and demos: thousands of hosts, no QEMU.

It keeps the same contracts as a real host (a domain runs on one host; a migration moves it;
sizes change as asked) so the orchestrator cannot tell the difference in its rules. Its domains
live in a SimFabric, outside the control plane's memory, so they outlive a killed control plane
as a real host's do. It never stands in for the real path in tests of guest behaviour.
"""

from __future__ import annotations

import time

from .base import (
    CpuCap,
    DomainInfo,
    DomainSpec,
    Driver,
    DriverError,
    GuestView,
    HostInfo,
    MigrationParams,
    MigrationStats,
    ProgressCallback,
    Resized,
)
from .simfabric import SimFabric


class SimDriver(Driver):
    kind = "sim"

    def __init__(self, host: str, info: HostInfo, fabric: SimFabric | None = None):
        super().__init__(host)
        self._info = info
        self.fabric = fabric or SimFabric()
        # None: a migration is instant; else memory is copied at this rate (for limit and drain timelines)
        self.copy_rate_mib_s: float | None = None
        self._aborts: set[str] = set()

    def host_info(self) -> HostInfo:
        return self._info

    def start(self, spec: DomainSpec) -> None:
        if not self.fabric.put(self.host, spec):
            raise DriverError(self.host, f"domain {spec.name} is already running")

    def stop(self, name: str, timeout_s: float = 30.0) -> None:
        self.fabric.remove(self.host, name)

    def domains(self) -> list[DomainInfo]:
        return self.fabric.domains(self.host)

    def domain(self, name: str) -> DomainInfo | None:
        return self.fabric.domain(self.host, name)

    def _spec(self, name: str) -> DomainSpec:
        spec = self.fabric.spec(self.host, name)
        if spec is None:
            raise DriverError(self.host, f"domain {name} is not running here")
        return spec

    def _read_back(self, name: str, method: str) -> Resized:
        """What the domain is now (the same contract as a real host: read back, not what was asked)."""
        info = self.fabric.domain(self.host, name)
        if info is None:
            raise DriverError(self.host, f"domain {name} is not running here")
        return Resized.of(method, info)

    def set_vcpus(self, name: str, vcpus: int) -> Resized:
        spec = self._spec(name)
        if vcpus > spec.max_vcpus:
            raise DriverError(self.host, f"{vcpus} vCPUs is above the domain's maximum {spec.max_vcpus}")
        self.fabric.update(self.host, name, vcpus=vcpus)
        return self._read_back(name, "hotplug" if vcpus >= spec.vcpus else "unplug")

    def set_memory(self, name: str, memory_mib: int) -> Resized:
        spec = self._spec(name)
        if memory_mib > spec.max_memory_mib:
            raise DriverError(self.host, f"{memory_mib} MiB is above the domain's maximum {spec.max_memory_mib}")
        if memory_mib == spec.memory_mib:
            return self._read_back(name, "unchanged")
        self.fabric.update(self.host, name, memory_mib=memory_mib)
        return self._read_back(name, "dimm" if memory_mib > spec.memory_mib else "dimm-unplug")  # as libvirt does

    def set_cpu_cap(self, name: str, cap: CpuCap | None) -> Resized:
        if not self.fabric.update(self.host, name, cpu_cap=cap):
            raise DriverError(self.host, f"domain {name} is not running here")
        return self._read_back(name, "cap")

    def migrate(self, name: str, target: Driver, params: MigrationParams,
                progress: ProgressCallback | None = None) -> MigrationStats:
        if not isinstance(target, SimDriver):
            raise DriverError(self.host, "a sim host can only migrate to another sim host")
        spec = self._spec(name)
        t0 = time.monotonic()
        try:
            return self._copy(name, spec, target, t0, progress)
        finally:
            self._aborts.discard(name)      # an abort asked before the copy began still counts

    def _copy(self, name: str, spec: DomainSpec, target: "SimDriver", t0: float,
              progress: ProgressCallback | None) -> MigrationStats:
        if name in self._aborts:
            raise DriverError(self.host, f"migration of {name} cancelled; it keeps running here")
        if self.copy_rate_mib_s:
            duration = spec.memory_mib / self.copy_rate_mib_s
            while (elapsed := time.monotonic() - t0) < duration:
                if name in self._aborts:
                    raise DriverError(self.host, f"migration of {name} cancelled; it keeps running here")
                if progress:
                    progress(int(100 * elapsed / duration), f"copied {int(spec.memory_mib * elapsed / duration)} "
                                                            f"of {spec.memory_mib} MiB")
                time.sleep(min(0.02, duration - elapsed))
        if not self.fabric.move(name, self.host, target.host):
            raise DriverError(self.host, f"{target.host} already runs a domain {name}, or it left {self.host}")
        if progress:
            progress(100, "switched over")
        return MigrationStats(total_ms=int((time.monotonic() - t0) * 1000), downtime_ms=0,
                              bytes_sent=spec.memory_mib * 1024 * 1024)

    def abort_migration(self, name: str) -> None:
        self._aborts.add(name)

    def guest_view(self, name: str) -> GuestView:
        spec = self._spec(name)
        return GuestView(spec.vcpus, spec.memory_mib * 1024)

    def guest_exec(self, name: str, command: str, timeout_s: float = 30.0) -> str:
        raise DriverError(self.host, "sim hosts have no guest to run commands in; use a libvirt host")
