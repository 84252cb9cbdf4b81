"""The usage counters of LibvirtDriver (issue 33's graphs): every running domain's counters in one bulk call,
`virConnectGetAllDomainStats` (state, CPU time, balloon, vCPUs, block and interface stats), plus the host's own
CPU time and memory (`getCPUStats`, `getMemoryStats`): three small RPCs per host per sampling round.

On a connection of its own, one call at a time: the sampler runs in its own thread every round, and two calls
waiting on one connection when keepalive closes it and the daemon then dies crash libvirt 9.0's client (the
SIGSEGV of the second waiter that `_quick_call` and `_poll_dom` avoid). The main connection's reads (the host
monitor, the operations) never wait on a slow bulk read, and the guest agent poll's connection is not shared
either (its lock is held for an agent's answer, seconds). A round that finds the previous one still waiting
on this host gives up at once (no second waiter, no pile of threads): the host leaves a gap in the graphs.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import libvirt

from vmplane.core.driver import DriverError
from vmplane.core.stats import DomainCounters, HostCounters

STATS = (
    libvirt.VIR_DOMAIN_STATS_STATE
    | libvirt.VIR_DOMAIN_STATS_CPU_TOTAL
    | libvirt.VIR_DOMAIN_STATS_BALLOON
    | libvirt.VIR_DOMAIN_STATS_VCPU
    | libvirt.VIR_DOMAIN_STATS_BLOCK
    | libvirt.VIR_DOMAIN_STATS_INTERFACE
)
# Running domains only (shut-off ones have no counters), never waiting for a domain's job: a paused domain is
# left out (a migration's incoming destination, whose inactive image must not be read while the source still
# writes it: CI saw a destination fail its migration's finish on `query-block`, "Less bitmaps found than
# specified in header extension", after a backup's checkpoints; a source in its stop-and-copy; a snapshot's
# pause). Such a domain's graph has a gap for that round.
ACTIVE = (
    libvirt.VIR_CONNECT_GET_ALL_DOMAINS_STATS_ACTIVE
    | libvirt.VIR_CONNECT_GET_ALL_DOMAINS_STATS_RUNNING
    | libvirt.VIR_CONNECT_GET_ALL_DOMAINS_STATS_NOWAIT
)


def _sum(record: dict, kind: str, key: str) -> int:
    """The sum of `kind.N.key` over the `kind.count` devices of a stats record."""
    return sum(int(record.get(f"{kind}.{i}.{key}", 0) or 0) for i in range(int(record.get(f"{kind}.count", 0))))


def domain_counters(name: str, record: dict) -> DomainCounters:
    """One domain's counters from its `getAllDomainStats` record (libvirt's typed parameters)."""
    current = int(record.get("balloon.current", 0) or 0)
    available, unused = record.get("balloon.available"), record.get("balloon.unused")
    if available is not None and unused is not None:  # the guest's balloon driver says what it uses
        used: int | None = int(available) - int(unused)
    else:
        used = int(record["balloon.rss"]) if "balloon.rss" in record else None
    return DomainCounters(
        name=name,
        vcpus=int(record.get("vcpu.current", 1) or 1),
        cpu_ns=int(record.get("cpu.time", 0) or 0),
        memory_kib=current,
        used_kib=used,
        rd_bytes=_sum(record, "block", "rd.bytes"),
        wr_bytes=_sum(record, "block", "wr.bytes"),
        rx_bytes=_sum(record, "net", "rx.bytes"),
        tx_bytes=_sum(record, "net", "tx.bytes"),
    )


class StatsMixin:
    if TYPE_CHECKING:
        host: str
        _conn_lock: Any
        _dead: list

        def _open(self) -> Any: ...
        def _ensure_events(self) -> None: ...
        def _let_go(self, conn: Any) -> None: ...

    _stats_conn: Any = None
    _stats_lock_: threading.Lock | None = None

    @property
    def _stats_lock(self) -> threading.Lock:
        if self._stats_lock_ is None:
            self._stats_lock_ = threading.Lock()
        return self._stats_lock_

    def domain_stats(self) -> HostCounters:
        """Every running domain's counters and the host's CPU time and memory, read now."""
        if not self._stats_lock.acquire(blocking=False):
            raise DriverError(self.host, "usage counters: the previous read has not been answered yet")
        try:
            conn = self._stats_connection()
            at = time.time()
            try:
                records = conn.getAllDomainStats(STATS, ACTIVE)
                cpu = conn.getCPUStats(libvirt.VIR_NODE_CPU_STATS_ALL_CPUS)
                memory = conn.getMemoryStats(libvirt.VIR_NODE_MEMORY_STATS_ALL_CELLS)
                cpus = conn.getInfo()[2]
                domains = tuple(domain_counters(dom.name(), record) for dom, record in records)
            except libvirt.libvirtError as exc:
                raise DriverError(self.host, f"usage counters: {exc.get_error_message()}") from None
        finally:
            self._stats_lock.release()
        busy = int(cpu.get("kernel", 0)) + int(cpu.get("user", 0))
        total = busy + int(cpu.get("idle", 0)) + int(cpu.get("iowait", 0))
        free = sum(int(memory.get(k, 0)) for k in ("free", "buffers", "cached"))
        return HostCounters(
            at=at,
            cpus=cpus,
            memory_kib=int(memory.get("total", 0)),
            free_kib=free,
            cpu_busy_ns=busy if total else None,
            cpu_total_ns=total or None,
            domains=domains,
        )

    def _stats_connection(self) -> Any:
        """The sampler's own connection, opened again (probed first: `_open`) once it died; a dead one is
        kept, never freed (libvirt's event loop may still hold its remote client: see `conn`)."""
        conn = self._stats_conn
        if conn is not None and conn.isAlive():
            return conn
        if conn is not None:
            with self._conn_lock:
                self._dead.append(conn)
            self._stats_conn = None
        self._ensure_events()  # keepalive runs on libvirt's event loop
        conn = self._open()
        conn.setKeepAlive(5, 3)
        self._stats_conn = conn
        return conn

    def _close_stats(self) -> None:
        conn, self._stats_conn = self._stats_conn, None  # (no lock: a read stuck on it must not hold a close)
        if conn is not None:
            self._let_go(conn)  # closed, or kept when dead (as the console's connections)
