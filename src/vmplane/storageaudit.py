"""The storage part of the audit: the store's volumes against what the pools hold and what the running
domains have attached, read from the hosts; and the pools' used space against the volumes on them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import select

from . import storagerules as R
from .drivers.base import DriverError
from .store import storageledger as SL
from .store.schema import Host, Vm
from .volumes import disk_spec, domain_name

if TYPE_CHECKING:
    from .orchestrator import Orchestrator

SETTLING = ("creating", "deleting", "attaching", "detaching", "resizing")     # a step in flight: the host may differ


def storage_problems(o: "Orchestrator") -> list[str]:
    problems: list[str] = []
    with o.db.transaction() as conn:
        pools = SL.pool_rows(conn)
        volumes = SL.volume_rows(conn)
        problems += o.volumes.usage_check(conn)
        running = dict(conn.execute(select(Vm.name, Host.name).join(Host, Host.id == Vm.host_id)
                                    .where(Vm.state == "running")).all())
    for pool in pools:
        problems += _pool_problems(o, pool, volumes)
    for vm, host in running.items():
        expected = {disk_spec(v).path for v in volumes if v.vm_name == vm and v.state == "attached"}
        try:
            have = set(o.drivers[host].domain_disks(domain_name(vm)).values()) if host in o.drivers else None
        except DriverError:
            continue
        if have is None:
            continue
        for path in sorted(expected - have):
            problems.append(f"vm {vm}: the store attaches {path}, the domain on {host} does not have it")
        for path in sorted(have - expected):
            if any(disk_spec(v).path == path and v.state in SETTLING for v in volumes):
                continue
            problems.append(f"vm {vm}: the domain on {host} has {path}, which the store does not attach to it")
    return problems


def _pool_problems(o: "Orchestrator", pool, volumes) -> list[str]:
    host = next((h for h in o.pools.hosts_of(pool) if h in o.drivers), None)
    if host is None:
        return []
    try:
        listed = {v.name: v for v in o.drivers[host].volumes(pool.name)}
    except DriverError:
        return []                       # can not tell: nothing is said
    expected = {R.volume_file(v.name, v.format): v for v in volumes
                if v.pool_name == pool.name or v.copy_pool_name == pool.name}
    problems = []
    for file, v in sorted(expected.items()):
        got = listed.get(file)
        if got is None and v.state not in SETTLING and v.copy_pool_name != pool.name:
            problems.append(f"volume {v.name}: not in pool {pool.name} (read on {host})")
        elif got is not None and got.capacity_mib < v.size_mib and v.state not in SETTLING:
            problems.append(f"volume {v.name}: pool {pool.name} says {got.capacity_mib} MiB, the store {v.size_mib}")
    for file in sorted(set(listed) - set(expected)):
        if file.startswith(R.VOLUME_PREFIX) and not file.startswith(R.VOLUME_PREFIX + "probe-"):
            problems.append(f"pool {pool.name} holds {file}, a vmplane volume the store does not know")
    return problems
