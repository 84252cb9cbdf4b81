"""Drift: where a VM's domain differs from the record, field by field (pure).

Compares what a host reports of a domain (drivers.base.DomainInfo, read without touching the guest's
console) with the record: memory (the domain's current memory, hot-plugged DIMMs included), vCPUs
(plugged; a soft scale-down leaves vCPUs plugged and holds the domain to the recorded count with a
whole-domain CPU cap), the per-vCPU CPU cap and the run state. `vm sync` adopts the host's values
(`host_size`), `vmplane audit` reports them (`Drift.__str__`).
"""

from __future__ import annotations

from dataclasses import dataclass

from vmplane.core.driver import CpuCap, DomainInfo
from vmplane.core.model import VmState
from vmplane.core.scaling import cap_for_share

_RUNNING_STATES = frozenset({"running", "blocked"})  # the guest executes (blocked: waiting on I/O)
CAP_TOLERANCE = 0.006  # cap_for_share rounds the quota/period to whole microseconds


@dataclass(frozen=True)
class Drift:
    """One field of one VM that the host has otherwise than the record."""

    vm: str
    field: str  # memory_mib, vcpus, cpu_cap, state
    record: str
    host_value: str
    host: str

    def __str__(self) -> str:
        return f"vm {self.vm}: {self.field} is {self.host_value} on {self.host}, the record says {self.record}"


def state_name(d: DomainInfo) -> str:
    """The domain's run state as the driver reports it (`running`, `paused`, `shutoff`, ...), with the
    reason when there is one: `paused (postcopy-failed)`."""
    state = getattr(d, "state", None) or ("running" if d.running else "shutoff")
    reason = getattr(d, "reason", "")
    return f"{state} ({reason})" if reason and state not in _RUNNING_STATES else state


def is_active(d: DomainInfo) -> bool:
    """QEMU runs for this domain (running, paused, ...): it holds host memory and must be claimed."""
    return d.running or (bool(getattr(d, "active", False)) and getattr(d, "state", "running") != "running")


def is_paused(d: DomainInfo) -> bool:
    return getattr(d, "state", "running") in ("paused", "pmsuspended", "suspended")


def soft_limit(d: DomainInfo) -> int | None:
    """The whole CPUs a domain-wide cap holds the domain to (a soft scale-down); None: no such cap."""
    return getattr(d, "soft_vcpus", None) or None


def vcpus_match(recorded: int, d: DomainInfo) -> bool:
    """Plugged == recorded with no domain-wide cap below it, or more plugged and the domain-wide cap holds
    the domain to the recorded count. Review finding 8 gives `plugged == store or (plugged > store and
    global_quota == store x global_period)`; its first half also passes a domain that a leftover soft cap
    holds below the record (the project pays for CPUs the guest can not use), so the cap is read there too."""
    return host_vcpus(d) == recorded


def host_vcpus(d: DomainInfo) -> int:
    """The vCPUs the domain really has the use of: plugged, or fewer when a domain-wide cap holds it to fewer."""
    limit = soft_limit(d)
    return min(d.vcpus, limit) if limit else d.vcpus


def share_of(cap: CpuCap | None) -> float | None:
    """A per-vCPU cap as a share of one host CPU (2 decimals); None: uncapped."""
    if cap is None or cap.period_us <= 0:
        return None
    return round(cap.quota_us / cap.period_us, 2)


def cap_words(share: float | None) -> str:
    return "off" if share is None else f"{share:.2f} CPU per vCPU"


def caps_match(record_percent: float | None, cap: CpuCap | None) -> bool:
    if not record_percent:
        return cap is None
    if cap is None or cap.period_us <= 0:
        return False
    if cap == cap_for_share(record_percent / 100):
        return True
    return abs(cap.quota_us / cap.period_us - record_percent / 100) <= CAP_TOLERANCE


@dataclass(frozen=True)
class HostSize:
    """What the host gives a VM, as the record would hold it."""

    vcpus: int
    memory_mib: int
    cpu_cap_percent: float | None


def host_size(d: DomainInfo) -> HostSize:
    share = share_of(d.cpu_cap)
    return HostSize(host_vcpus(d), d.memory_mib, share * 100 if share is not None else None)


def size_drift(
    name: str, host: str, vcpus: int, memory_mib: int, cpu_cap_percent: float | None, d: DomainInfo
) -> list[Drift]:
    """The fields in which a running domain differs from the record of a running VM."""
    found = []
    if d.memory_mib != memory_mib:
        found.append(Drift(name, "memory_mib", str(memory_mib), str(d.memory_mib), host))
    if not vcpus_match(vcpus, d):
        limit = soft_limit(d)
        shown = f"{d.vcpus} plugged, capped to {limit} CPUs" if limit and limit < d.vcpus else str(d.vcpus)
        found.append(Drift(name, "vcpus", str(vcpus), shown, host))
    if not caps_match(cpu_cap_percent, d.cpu_cap):
        found.append(
            Drift(
                name,
                "cpu_cap",
                cap_words(round(cpu_cap_percent / 100, 2) if cpu_cap_percent else None),
                cap_words(share_of(d.cpu_cap)),
                host,
            )
        )
    if getattr(d, "state", "running") not in _RUNNING_STATES or not d.running:
        found.append(Drift(name, "state", "running", state_name(d), host))
    return found


MOVING_STATES = frozenset({VmState.starting, VmState.stopping, VmState.migrating, VmState.scaling})


@dataclass(frozen=True)
class StoredVm:
    """What the store says of one VM, for comparing with what the hosts run."""

    name: str
    domain: str
    state: VmState
    host: str | None
    vcpus: int
    memory_mib: int
    cpu_cap_percent: float | None = None
    busy: bool = False  # an operation or a migration of it is in flight
    migration: tuple[str, str] | None = None  # (source, target) of its migration while it copies/checks
