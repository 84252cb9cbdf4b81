"""An in-memory hypervisor for scale tests and demos: thousands of hosts, no QEMU.

It keeps the same contracts as a real host (a domain runs on one host; a migration moves it;
sizes change as asked) so the orchestrator cannot tell the difference in its rules. It never
stands in for the real path in tests of guest behaviour.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

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
)


class SimDriver(Driver):
    kind = "sim"

    def __init__(self, host: str, info: HostInfo):
        super().__init__(host)
        self._info = info
        self._domains: dict[str, DomainInfo] = {}
        self._specs: dict[str, DomainSpec] = {}
        self._lock = threading.Lock()
        # None: a migration is instant; else memory is copied at this rate (for limit and drain timelines)
        self.copy_rate_mib_s: float | None = None
        self._aborts: set[str] = set()

    def host_info(self) -> HostInfo:
        return self._info

    def start(self, spec: DomainSpec) -> None:
        with self._lock:
            current = self._domains.get(spec.name)
            if current is not None and current.running:
                raise DriverError(self.host, f"domain {spec.name} is already running")
            self._specs[spec.name] = spec
            self._domains[spec.name] = DomainInfo(spec.name, True, spec.vcpus, spec.memory_mib, spec.cpu_cap)

    def stop(self, name: str, timeout_s: float = 30.0) -> None:
        with self._lock:
            self._domains.pop(name, None)
            self._specs.pop(name, None)

    def domains(self) -> list[DomainInfo]:
        with self._lock:
            return list(self._domains.values())

    def domain(self, name: str) -> DomainInfo | None:
        with self._lock:
            return self._domains.get(name)

    def _running(self, name: str) -> DomainInfo:
        info = self._domains.get(name)
        if info is None or not info.running:
            raise DriverError(self.host, f"domain {name} is not running here")
        return info

    def set_vcpus(self, name: str, vcpus: int) -> str:
        with self._lock:
            info = self._running(name)
            spec = self._specs[name]
            if vcpus > spec.max_vcpus:
                raise DriverError(self.host, f"{vcpus} vCPUs is above the domain's maximum {spec.max_vcpus}")
            method = "hotplug" if vcpus >= info.vcpus else "unplug"
            self._domains[name] = replace(info, vcpus=vcpus)
            return method

    def set_memory(self, name: str, memory_mib: int) -> str:
        with self._lock:
            info = self._running(name)
            spec = self._specs[name]
            if memory_mib > spec.max_memory_mib:
                raise DriverError(self.host, f"{memory_mib} MiB is above the domain's maximum {spec.max_memory_mib}")
            self._domains[name] = replace(info, memory_mib=memory_mib)
            return "virtio-mem"

    def set_cpu_cap(self, name: str, cap: CpuCap | None) -> None:
        with self._lock:
            info = self._running(name)
            self._domains[name] = replace(info, cpu_cap=cap)

    def migrate(self, name: str, target: Driver, params: MigrationParams,
                progress: ProgressCallback | None = None) -> MigrationStats:
        if not isinstance(target, SimDriver):
            raise DriverError(self.host, "a sim host can only migrate to another sim host")
        with self._lock:
            info = self._running(name)
            spec = self._specs[name]
            self._aborts.discard(name)
        t0 = time.monotonic()
        if self.copy_rate_mib_s:
            duration = info.memory_mib / self.copy_rate_mib_s
            while (elapsed := time.monotonic() - t0) < duration:
                if name in self._aborts:
                    raise DriverError(self.host, f"migration of {name} cancelled; it keeps running here")
                if progress:
                    progress(int(100 * elapsed / duration), f"copied {int(info.memory_mib * elapsed / duration)} "
                                                            f"of {info.memory_mib} MiB")
                time.sleep(min(0.02, duration - elapsed))
        target.start(replace(spec, vcpus=info.vcpus, memory_mib=info.memory_mib, cpu_cap=info.cpu_cap))
        self.stop(name)
        if progress:
            progress(100, "switched over")
        return MigrationStats(total_ms=int((time.monotonic() - t0) * 1000), downtime_ms=0,
                              bytes_sent=info.memory_mib * 1024 * 1024)

    def abort_migration(self, name: str) -> None:
        self._aborts.add(name)

    def guest_view(self, name: str) -> GuestView:
        with self._lock:
            info = self._running(name)
            return GuestView(info.vcpus, info.memory_mib * 1024)

    def guest_exec(self, name: str, command: str, timeout_s: float = 30.0) -> str:
        raise DriverError(self.host, "sim hosts have no guest to run commands in; use a libvirt host")

    def adopt(self, spec: DomainSpec) -> None:
        """Re-seed a domain after a control-plane restart (sim hosts live in the control plane's process)."""
        with self._lock:
            self._specs[spec.name] = spec
            self._domains[spec.name] = DomainInfo(spec.name, True, spec.vcpus, spec.memory_mib, spec.cpu_cap)
