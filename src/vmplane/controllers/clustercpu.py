"""A cluster's guest CPU model (issue 33): its hosts' baseline, recomputed and stored when a host joins or
leaves, and the named model an admin sets on it, refused unless every host of the cluster runs it.

What each host runs is read from its hypervisor when it is added (Driver.host_cpu) and kept on its row; the
baseline is asked of one host's hypervisor (Driver.baseline_cpu: libvirt's baselineHypervisorCPU) and then
checked against every host's usable models (core/cpumodels.choose_baseline), so a baseline QEMU can not run as a
named model (under TCG) falls back to one all hosts run, with the reason kept on the cluster.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sqlalchemy import bindparam, select
from sqlalchemy.engine import Connection

from vmplane.core import cpumodels
from vmplane.core.driver import DriverError, HostCpu
from vmplane.core.errors import Conflict, Invalid
from vmplane.store.catalog import get_by_name
from vmplane.store.schema import Cluster, Host

if TYPE_CHECKING:
    from vmplane.plane.context import Plane

log = logging.getLogger("vmplane.clustercpu")


def stored(cpu: HostCpu | None) -> dict[str, str | None]:
    """A host row's CPU columns for what its hypervisor said (None: it could not say)."""
    if cpu is None:
        return {"cpu_model": None, "cpu_models": None, "cpu_xml": None}
    return {"cpu_model": cpu.model or None, "cpu_models": " ".join(cpu.usable), "cpu_xml": cpu.xml or None}


def check_host_joins(cluster: Cluster, host: str, cpu: HostCpu | None) -> None:
    """Refuse (409) a host that can not run the model an admin set on its cluster."""
    if cluster.cpu_model and cpu is not None and cpumodels.cannot_run(cluster.cpu_model, {host: cpu.usable}):
        raise Conflict(
            f"host {host} can not run CPU model {cluster.cpu_model}, the model of cluster {cluster.name} "
            f"(it runs {', '.join(cpu.usable) or 'none'}); set another model on the cluster first",
            field="cpu_model",
        )


_CLUSTER_CPUS = (
    select(Host.name, Host.cpu_model, Host.cpu_models, Host.cpu_xml)
    .join(Cluster, Cluster.id == Host.cluster_id)
    .where(Cluster.name == bindparam("cluster"), Host.cpu_models.is_not(None))
)


def _host_cpus(plane: Plane, cluster: str) -> dict[str, HostCpu]:
    """{host: its CPU} of the cluster's hosts that described theirs (columns only: read at every join)."""
    with plane.db.read() as s:
        rows = s.execute(_CLUSTER_CPUS, {"cluster": cluster})
        return {h.name: HostCpu(h.cpu_model or "", tuple(h.cpu_models.split()), h.cpu_xml or "") for h in rows}


def recompute(plane: Plane, cluster: str) -> tuple[str, str]:
    """The cluster's baseline from its hosts now, stored on it: (model, why it is not the hypervisor's own
    baseline, "" when it is)."""
    cpus = _host_cpus(plane, cluster)
    usable = {name: cpu.usable for name, cpu in cpus.items()}
    asked = next((plane.drivers[name] for name in sorted(cpus) if name in plane.drivers), None)
    try:
        baseline = asked.baseline_cpu(list(cpus.values())) if asked is not None else cpumodels.DEFAULT
    except DriverError as exc:  # that host does not answer now: the family table's choice, saying so
        baseline = ""
        log.warning("cluster %s: no CPU baseline from %s: %s", cluster, asked.host if asked else "-", exc)
    model, why = cpumodels.choose_baseline(baseline, usable)
    if not baseline and usable:
        why = f"the hypervisor gave no baseline ({asked.host if asked else '-'} did not answer); {why}"
    with plane.db.write() as s:
        row = get_by_name(s, Cluster, cluster, field="cluster")
        row.cpu_baseline, row.cpu_baseline_why = model, why or None
    if why:
        log.info("cluster %s: CPU baseline %s: %s", cluster, model, why)
    return model, why


_HOST_CPU = select(Host.cpu_model, Host.cpu_models).where(Host.name == bindparam("name"))


def migration_problem(conn: Connection, vm: Any, target: str) -> str | None:
    """Why the VM row `vm` (running, with its host_name and cpu_model) can not live-migrate to `target` for its
    CPU model (core/cpumodels.migration_problem), read from both hosts' rows."""
    if vm.cpu_model is None:
        return None
    source = conn.execute(_HOST_CPU, {"name": vm.host_name}).first()
    to = conn.execute(_HOST_CPU, {"name": target}).first()
    if source is None or to is None:
        return None
    return cpumodels.migration_problem(
        vm.name,
        vm.cpu_model,
        (vm.host_name, source.cpu_model),
        (target, to.cpu_model, cpumodels.split(to.cpu_models)),
    )


def set_model(plane: Plane, cluster: str, model: str | None) -> Cluster:
    """Set (or with None, clear: back to the baseline) the cluster's CPU model. 422 for a name that is not a
    model's; 409 naming the first host that can not run it. VMs running keep their model until they start
    again."""
    why = cpumodels.check_cluster_model(model)
    if why:
        raise Invalid(why, field="cpu_model")
    if model is not None:
        cpus = _host_cpus(plane, cluster)
        short = cpumodels.cannot_run(model, {name: cpu.usable for name, cpu in cpus.items()})
        if short:
            runs = ", ".join(cpus[short[0]].usable) or "none"
            raise Conflict(
                f"host {short[0]} of cluster {cluster} can not run CPU model {model} (it runs {runs})"
                + (f"; nor can {', '.join(short[1:])}" if short[1:] else ""),
                field="cpu_model",
            )
    with plane.db.write() as s:
        row = get_by_name(s, Cluster, cluster, field="cluster")
        row.cpu_model = model
        s.flush()
        s.refresh(row)
    return row
