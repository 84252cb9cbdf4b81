"""The truth harness's storage check of review N2: files on the pools that no volume owns, read from the
sim fabric itself (not through the drivers, their faults or the audit's code): every host of every pool
(a failed host's local pool too), against every volume's file and migration copy in the store."""

from __future__ import annotations

from vmplane.controllers.storageaudit import unowned_files
from vmplane.hosts.drivers.sim import SimDriver
from vmplane.hosts.drivers.simstorage import SimStorageError
from vmplane.orchestrator import Orchestrator
from vmplane.store import snapshots as SS
from vmplane.store import storageledger as SL


def unowned_pool_files(o: Orchestrator) -> list[str]:
    """A finding per vmplane file on a pool that no volume owns (it could be handed to another volume of
    that name: another tenant's data)."""
    fabric = next((d.fabric for d in o.drivers.values() if isinstance(d, SimDriver)), None)
    if fabric is None:
        return []
    with o.db.transaction() as conn:
        pools, volumes, chains = SL.pool_rows(conn), SL.volume_rows(conn), SS.chain_files(conn)
    problems: list[str] = []
    for pool in pools:
        for host in o.pools.hosts_of(pool):
            try:
                files = [f.name for f in fabric.volumes(host, pool.name)]
            except SimStorageError:
                continue  # not defined (or not running) there: no file to judge
            problems += [f"truth: {p}" for p in unowned_files(pool.name, host, files, volumes, chains)]
            if pool.kind == "shared":
                break  # every host sees the same files
    return problems
