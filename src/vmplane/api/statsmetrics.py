"""/metrics' usage gauges (issue 33's graphs): each VM's and each host's latest sampled point (store/stats.py),
read at scrape time beside metricscollect's state gauges, in one statement.

Cardinality: one series per VM per gauge (labelled {vm}) and per host ({host}): at 10,000 VMs and 500 hosts,
6 x 10,500 = 63,000 series, a few MB of text per scrape; this is the one read of a scrape that grows with the
number of VMs (a row per running VM, by design). A VM that stopped (or whose host stopped answering) drops out
once its latest point is older than STALE_BUCKETS fine buckets. Rates are gauges (per second over the last
sampling interval), as the graphs show them; no counter is exported (libvirt's reset when a guest restarts)."""

from __future__ import annotations

import time

from sqlalchemy import and_, func, select
from sqlalchemy.engine import Connection

from vmplane.core import stats as rules
from vmplane.store.schema import Host, StatSample, Vm

MIB = 1024 * 1024
STALE_BUCKETS = 3
GAUGES = (  # (suffix, doc, field, scale)
    ("cpu_percent", "CPU used, percent of its vCPUs (a host: of its cores)", "cpu_pct", 1),
    (
        "memory_used_bytes",
        "Memory used (a guest: as its balloon driver says, else what QEMU holds)",
        "mem_used_mib",
        MIB,
    ),
    ("disk_read_bytes_per_second", "Disk bytes read per second", "disk_rd_bps", 1),
    ("disk_write_bytes_per_second", "Disk bytes written per second", "disk_wr_bps", 1),
    ("network_receive_bytes_per_second", "Network bytes received per second", "net_rx_bps", 1),
    ("network_transmit_bytes_per_second", "Network bytes sent per second", "net_tx_bps", 1),
)
_S, _V, _H = StatSample.__table__, Vm.__table__, Host.__table__


def gauges(conn: Connection, now: float | None = None) -> list[tuple[str, str, tuple[str, ...], list[tuple]]]:
    """(name, doc, labels, [(label value, value)]) of every usage gauge, from the latest fresh points."""
    now = time.time() if now is None else now
    since = rules.bucket(now, rules.FINE) - STALE_BUCKETS * rules.FINE.step_s
    fields = [_S.c[f] for _s, _d, f, _m in GAUGES]
    rows = conn.execute(
        select(_S.c.kind, func.coalesce(_V.c.name, _H.c.name), *fields)
        .select_from(
            _S.outerjoin(_V, and_(_S.c.kind == "vm", _V.c.id == _S.c.obj_id)).outerjoin(
                _H, and_(_S.c.kind == "host", _H.c.id == _S.c.obj_id)
            )
        )
        .where(_S.c.tier == rules.FINE.name, _S.c.kind.in_(("vm", "host")), _S.c.bucket >= since)
        .order_by(_S.c.bucket)
    )
    latest: dict[str, dict[str, tuple]] = {"vm": {}, "host": {}}
    for kind, name, *values in rows:
        if name is not None:  # (an object deleted since its point)
            latest[kind][name] = tuple(values)
    out: list[tuple[str, str, tuple[str, ...], list[tuple]]] = []
    for kind, points in latest.items():
        for i, (suffix, doc, _field, scale) in enumerate(GAUGES):
            samples = [(name, v[i] * scale) for name, v in sorted(points.items()) if v[i] is not None]
            out.append((f"vmplane_{kind}_{suffix}", f"{doc}: the latest sampled point", (kind,), samples))
    return out
