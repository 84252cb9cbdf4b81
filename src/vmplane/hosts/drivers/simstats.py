"""The sim driver's usage counters (issue 33's graphs): what libvirt's bulk stats call would say, made up but
plausible. Each running guest keeps a load (a share of its vCPUs, from its name, with a slow wobble; a test
may set it: `set_guest_load`) and its counters grow by it between two readings: CPU time, disk and network
bytes. A guest this driver had not seen running (started, restarted or migrated here) starts from zero, as a
new QEMU process does: the counters go backwards, as libvirt's do. A host that does not answer raises, as
its other calls do (`SimDriver._call`)."""

from __future__ import annotations

import math
import time
import zlib
from typing import TYPE_CHECKING, Any

from vmplane.core.stats import NS, DomainCounters, HostCounters

DISK_BPS = 4 * 1024 * 1024  # bytes/s a fully busy guest writes (and a quarter of it reads)
NET_BPS = 2 * 1024 * 1024  # bytes/s a fully busy guest sends (and half of it receives)
LOADS = "guest_loads"  # the fabric's attribute: {domain name: load 0..1} set by tests


def set_guest_load(fabric: Any, name: str, load: float | None) -> None:
    """Make the guest `name` keep `load` of its vCPUs busy from now (None: its own made-up load again)."""
    loads = fabric.__dict__.setdefault(LOADS, {})
    if load is None:
        loads.pop(name, None)
    else:
        loads[name] = load


def guest_load(fabric: Any, name: str, at: float) -> float:
    """The share of its vCPUs the guest `name` keeps busy at `at`: set by a test, else 2-42 % from its name,
    wobbling by half of that over ~an hour."""
    set_to = fabric.__dict__.get(LOADS, {}).get(name)
    if set_to is not None:
        return float(set_to)
    seed = zlib.crc32(name.encode())
    base = 0.02 + (seed % 41) / 100
    return base * (1 + 0.5 * math.sin(at / 600 + seed % 7))


class SimStatsMixin:
    if TYPE_CHECKING:
        host: str
        fabric: Any
        _info: Any

        def _call(self, what: str) -> None: ...

    _counters: dict[str, tuple[float, float, DomainCounters]] | None = None  # name -> (booted, at, counters)
    _host_cpu: tuple[float, int, int] | None = None  # (at, busy ns, total ns)

    def domain_stats(self) -> HostCounters:
        """Every running guest's counters, grown by its load since the last reading, and the host's."""
        self._call("usage counters")
        at = time.time()
        before = self._counters or {}
        now: dict[str, tuple[float, float, DomainCounters]] = {}
        for info in self.fabric.domains(self.host):
            if not info.running:
                continue
            booted = self.fabric._booted.get(info.name, 0.0)
            known = before.get(info.name)
            if known is None or known[0] != booted:  # a new QEMU here: its counters start from zero
                known = (booted, at, DomainCounters(info.name, info.vcpus, 0, info.memory_mib * 1024))
            now[info.name] = (booted, at, self._grown(known[2], info, at - known[1], at))
        self._counters = now
        domains = tuple(c for _b, _a, c in now.values())
        return self._host_counters(at, domains, before)

    def _grown(self, c: DomainCounters, info: Any, seconds: float, at: float) -> DomainCounters:
        load = guest_load(self.fabric, info.name, at)
        memory_kib = info.memory_mib * 1024
        share = 0.4 + (zlib.crc32(info.name.encode()) % 40) / 100  # of its memory the guest uses
        return DomainCounters(
            name=info.name,
            vcpus=info.vcpus,
            cpu_ns=c.cpu_ns + int(info.vcpus * load * seconds * NS),
            memory_kib=memory_kib,
            used_kib=int(memory_kib * share),
            rd_bytes=c.rd_bytes + int(load * seconds * DISK_BPS / 4),
            wr_bytes=c.wr_bytes + int(load * seconds * DISK_BPS),
            rx_bytes=c.rx_bytes + int(load * seconds * NET_BPS / 2),
            tx_bytes=c.tx_bytes + int(load * seconds * NET_BPS),
        )

    def _host_counters(self, at: float, domains: tuple[DomainCounters, ...], before: dict) -> HostCounters:
        """The host's CPU: its guests' CPU time plus 2 % of its cores for itself; its memory: what its guests
        have, the rest free."""
        cores = self._info.cores
        # first reading: as if the host had run an hour, 5 % busy
        last_at, busy, total = self._host_cpu or (at, int(0.05 * cores * 3600 * NS), int(cores * 3600 * NS))
        seconds = max(at - last_at, 0.0)
        guests = sum(max(d.cpu_ns - before[d.name][2].cpu_ns, 0) for d in domains if d.name in before)
        busy += guests + int(0.02 * cores * seconds * NS)
        total += int(cores * seconds * NS)
        self._host_cpu = (at, busy, total)
        memory_kib = self._info.memory_mib * 1024
        return HostCounters(
            at=at,
            cpus=cores,
            memory_kib=memory_kib,
            free_kib=max(memory_kib - sum(d.memory_kib for d in domains), 0),
            cpu_busy_ns=busy if total else None,
            cpu_total_ns=total or None,
            domains=domains,
        )
