"""The storage part of the audit: the store's volumes against what the pools hold and what the running
domains have attached, read from the hosts; and the pools' used space against the volumes on them."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from sqlalchemy import select

from vmplane.controllers.volumes import disk_spec, domain_name, file_of
from vmplane.core import storagerules as R
from vmplane.core.driver import DriverError
from vmplane.store import snapshots as SS
from vmplane.store import storageledger as SL
from vmplane.store import volumemoves as MV
from vmplane.store.schema import Host, Vm

if TYPE_CHECKING:
    from vmplane.controllers.pools import Pools
    from vmplane.controllers.volumes import Volumes
    from vmplane.plane.context import Plane

_PROBE = re.compile(re.escape(R.VOLUME_PREFIX) + r"probe-[0-9a-f]{8}\.raw$")  # pools.py's shared check
# a step in flight: the host may differ
SETTLING = ("creating", "deleting", "attaching", "detaching", "resizing", "moving")


def storage_problems(plane: Plane, volume_ctl: Volumes, pool_ctl: Pools) -> list[str]:
    problems: list[str] = []
    with plane.db.transaction() as conn:
        pools = SL.pool_rows(conn)
        volumes = SL.volume_rows(conn)
        chains = SS.chain_files(conn)  # snapshots' files (issue 32): owned by their volume
        leftovers = MV.leftovers(conn)  # a moved volume's old file, a move's partial copy: not yet deleted
        problems += volume_ctl.usage_check(conn)
        running = dict(
            conn.execute(select(Vm.name, Host.name).join(Host, Host.id == Vm.host_id).where(Vm.state == "running"))
            .tuples()
            .all()
        )
    for pool in pools:
        owned = {r.file for r in leftovers if r.pool_id == pool.id} | {
            v.move_file for v in volumes if v.move_pool_name == pool.name and v.move_file
        }
        problems += _pool_problems(plane, pool_ctl, pool, volumes, chains, owned)
    for vm, host in running.items():
        expected = {disk_spec(v).path for v in volumes if v.vm_name == vm and v.state == "attached"}
        try:
            have = set(plane.drivers[host].domain_disks(domain_name(vm)).values()) if host in plane.drivers else None
        except DriverError:
            continue
        if have is None:
            continue
        for path in sorted(expected - have):
            problems.append(f"vm {vm}: the store attaches {path}, the domain on {host} does not have it")
        for path in sorted(have - expected):
            if any(disk_spec(v).path == path and v.state in SETTLING for v in volumes):
                continue
            if any(v.state == "moving" and path == f"{v.move_pool_path}/{v.move_file}" for v in volumes if v.move_file):
                continue  # a live move switched the domain, the store not yet
            problems.append(f"vm {vm}: the domain on {host} has {path}, which the store does not attach to it")
    return problems


def _pool_problems(
    plane: Plane, pool_ctl: Pools, pool, volumes, chains=(), owned: frozenset[str] | set[str] = frozenset()
) -> list[str]:
    host = next((h for h in pool_ctl.hosts_of(pool) if h in plane.drivers), None)
    if host is None:
        return []
    try:
        listed = {v.name: v for v in plane.drivers[host].volumes(pool.name)}
    except DriverError:
        return []  # can not tell: nothing is said
    expected = {file_of(v): v for v in volumes if v.pool_name == pool.name or v.copy_pool_name == pool.name}
    problems = []
    for file, v in sorted(expected.items()):
        got = listed.get(file)
        if got is None and v.state not in SETTLING and v.copy_pool_name != pool.name:
            problems.append(f"volume {v.name}: not in pool {pool.name} (read on {host})")
        elif got is not None and got.capacity_mib < v.size_mib and v.state not in SETTLING:
            problems.append(f"volume {v.name}: pool {pool.name} says {got.capacity_mib} MiB, the store {v.size_mib}")
    return problems + unowned_files(
        pool.name, host, {f: i for f, i in listed.items() if f not in owned}, volumes, chains
    )


def unowned_files(pool: str, host: str, files, volumes, chains=()) -> list[str]:
    """Files of vmplane's (their name says so) in `pool`, as `host` lists them, that no volume owns there:
    neither a volume's file on that pool nor its migration copy's. Another volume of the same name could
    be given such a file (another tenant's data: review N2); the operator decides what to do with it."""
    owned = {file_of(v) for v in volumes if pool in (v.pool_name, v.copy_pool_name)}
    on_pool = {v.id for v in volumes if v.pool_name == pool}
    owned |= {f.file for f in chains if f.volume_id in on_pool}
    return [
        f"pool {pool} on {host} holds {file}, a vmplane volume file that no volume owns (once its data is "
        f"not needed: `virsh vol-delete --pool {pool} {file}` on {host})"
        for file in sorted(set(files) - owned)
        if file.startswith(R.VOLUME_PREFIX) and not _PROBE.match(file)
    ]
