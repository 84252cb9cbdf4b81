"""Usage graphs' points (issue 33) through the API: a VM's (its project's members too) or a host's (admins) CPU,
memory, disk and network over the last hour, day or month, as the console's charts draw them (ui/charts.py),
one point per bucket (oldest first; a missing bucket is a gap: the host did not answer or the VM did not run)."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from fastapi import APIRouter, Query

from vmplane.api.deps import Admin, AnyCaller, Orch
from vmplane.api.paging import StrictQueryRoute
from vmplane.core import stats as rules
from vmplane.store import stats as store

router = APIRouter(tags=["stats"], route_class=StrictQueryRoute)
RANGES = {"hour": (rules.FINE, 3600), "day": (rules.FINE, 24 * 3600), "month": (rules.COARSE, 31 * 24 * 3600)}
Span = Annotated[Literal["hour", "day", "month"], Query(alias="range", description="how far back")]


def _series(orch: Orch, kind: str, obj_id: int, name: str, span: str) -> dict:
    tier, back = RANGES[span]
    with orch.db.read() as s:
        points = store.series(s.connection(), kind, obj_id, tier, rules.bucket(time.time() - back, tier))
    return {
        kind: name,
        "range": span,
        "step_s": tier.step_s,
        "points": [{"at": at, **{f: getattr(p, f) for f in rules.FIELDS}} for at, p in points],
        "latest": {f: rules.latest(points, f) for f in rules.FIELDS},
    }


@router.get("/vms/{name}/stats")
def vm_stats(name: str, orch: Orch, who: AnyCaller, span: Span = "hour") -> dict:
    """The VM's usage points: cpu_pct (of its vCPUs), cpu_cores, mem_used_mib, mem_total_mib, disk_rd_bps,
    disk_wr_bps, net_rx_bps, net_tx_bps (bytes per second); `at` is the bucket's start (seconds since 1970)."""
    vm = orch.vm(name)
    who.check_project(vm.project_id, "vm", name)
    return _series(orch, "vm", vm.id, name, span)


@router.get("/hosts/{name}/stats")
def host_stats(name: str, orch: Orch, _: Admin, span: Span = "hour") -> dict:
    """The host's usage points (its own CPU and memory; its VMs' disk and network traffic summed)."""
    return _series(orch, "host", orch.host(name).id, name, span)
