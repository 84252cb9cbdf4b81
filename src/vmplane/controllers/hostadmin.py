"""Hosts as an operator adds, removes, enables and disables them: their rows, drivers and capacity rows.

The only writer of `plane.drivers` (under the capacity lock). A libvirt host is asked for its size when
it is added (and refused, naming its URI, when it does not answer); a sim host is given one.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sqlalchemy import select

from vmplane.controllers import clustercpu
from vmplane.core import cpumodels
from vmplane.core.driver import Driver, DriverError, HostCpu, HostInfo
from vmplane.core.errors import Conflict, Invalid, NotFound
from vmplane.core.model import UNREACHABLE_HOST_STATES, HostState
from vmplane.core.names import check_name
from vmplane.hosts.drivers.sim import SimDriver
from vmplane.hosts.drivers.simfabric import SimFabric
from vmplane.hosts.fencing import default_agents
from vmplane.store import ledger as L
from vmplane.store.catalog import ensure_new, get_by_name
from vmplane.store.lifecycle import delete_host_row
from vmplane.store.schema import Cluster, Host

if TYPE_CHECKING:
    from vmplane.plane.context import Plane

UNREACHABLE = {st.value for st in UNREACHABLE_HOST_STATES}
log = logging.getLogger("vmplane.hostadmin")


def libvirt_driver(host: str, uri: str | None) -> Driver:
    try:
        from vmplane.hosts.drivers.libvirt import LibvirtDriver
    except ImportError:
        raise Invalid(
            "libvirt hosts need the libvirt-python package (scripts/setup.sh installs it)", field="driver"
        ) from None
    return LibvirtDriver(host, uri or "")


class HostAdmin:
    def __init__(self, plane: Plane):
        self.plane = plane

    def load(self) -> None:
        """A driver for every host of the store (at start)."""
        with self.plane.db.read() as s:
            for host in s.scalars(select(Host)).unique():
                self.plane.drivers[host.name] = self._make_driver(host)

    def _make_driver(self, host: Host) -> Driver:
        if host.driver == "sim":
            return SimDriver(
                host.name,
                HostInfo(host.cores, host.cpu_mhz, host.memory_mib),
                SimFabric.for_store(self.plane.db.url),
                cpu_family=host.cpu_model,
            )
        return libvirt_driver(host.name, host.uri)

    def set_host_state(self, name: str, state: HostState) -> None:
        """Enable a host or take it out of placement (maintenance, disabled). Refused (409) for a host
        that does not answer (down, fencing, fenced): its state is the monitor's and HA's until it answers."""
        state = HostState(state)
        capacity = self.plane.capacity
        with capacity.lock:
            with self.plane.db.transaction() as conn:
                now = conn.execute(select(L.HOSTS.c.state).where(L.HOSTS.c.name == name).with_for_update()).scalar()
                if now is None:
                    raise NotFound(f"host {name!r} does not exist", field="host")
                if now in UNREACHABLE and now != state.value:
                    raise Conflict(
                        f"host {name} is {now}: it does not answer; its state comes back when it does "
                        f"(vmplane host show {name} says why)",
                        field="host",
                    )
                L.set_host_state(conn, name, state)  # records the change in the event log
            capacity.set_state(name, state)

    def refresh(self) -> None:
        """Learn hosts other control-plane processes added or removed, and the index from the store."""
        drivers = self.plane.drivers
        with self.plane.db.read() as s:
            hosts = {h.name: h for h in s.scalars(select(Host)).unique()}
        with self.plane.capacity.lock:
            gone = [drivers.pop(name) for name in set(drivers) - set(hosts)]
            for name in set(hosts) - set(drivers):
                drivers[name] = self._make_driver(hosts[name])
        for driver in gone:  # outside the lock: closing asks the daemon, which may not answer
            driver.close()
        self.plane.capacity.rebuild()

    def add_host(
        self,
        name: str,
        cluster: str,
        driver: str,
        cores: int | None = None,
        cpu_mhz: int | None = None,
        memory_mib: int | None = None,
        uri: str | None = None,
        migration_address: str | None = None,
        cpu_model: str | None = None,
    ) -> Host:
        """Register a host. `cpu_model` is a sim host's CPU family (core/cpumodels.FAMILIES); a libvirt host
        says its own. Its cluster's CPU baseline is recomputed (controllers/clustercpu.py)."""
        check_name(name)
        cpu: HostCpu | None = None
        if driver == "sim":
            for field, value in (("cores", cores), ("cpu_mhz", cpu_mhz), ("memory_mib", memory_mib)):
                if value is None:
                    raise Invalid(f"a sim host needs {field}", field=field)
                if value <= 0:
                    raise Invalid(f"{field} must be greater than 0, got {value}", field=field)
            why = cpumodels.check_name(cpu_model) if cpu_model is not None else None
            if why:
                raise Invalid(why, field="cpu_model")
            family = cpu_model or cpumodels.SIM_FAMILY
            cpu = HostCpu(family, cpumodels.runnable(family))
        elif driver == "libvirt":
            if not uri:
                raise Invalid(
                    "a libvirt host needs its uri (qemu+tls://HOST/system, or qemu+unix:///system?socket=...)",
                    field="uri",
                )
            probe = libvirt_driver(name, uri)
            try:
                info = probe.host_info()
                cpu = self._host_cpu(probe)
            except DriverError as exc:
                raise Invalid(f"cannot reach libvirt at {uri}: {exc}", field="uri") from None
            finally:
                probe.close()
            cores, cpu_mhz, memory_mib = info.cores, info.cpu_mhz, info.memory_mib
        else:
            raise Invalid(f"unknown driver {driver!r}; use sim or libvirt", field="driver")
        with self.plane.capacity.lock:
            with self.plane.db.write() as s:
                ensure_new(s, Host, name)
                c = get_by_name(s, Cluster, cluster, field="cluster")
                clustercpu.check_host_joins(c, name, cpu)
                s.add(
                    Host(
                        name=name,
                        cluster_id=c.id,
                        driver=driver,
                        uri=uri,
                        cores=cores,
                        cpu_mhz=cpu_mhz,
                        memory_mib=memory_mib,
                        state=HostState.enabled.value,
                        used_vcpus=0,
                        used_memory_mib=0,
                        migration_address=migration_address,
                        fence_agents=default_agents(driver, uri),
                        **clustercpu.stored(cpu),
                    )
                )
            host = self.host(name)
            self.plane.drivers[name] = self._make_driver(host)
            self.plane.capacity.put_host(host)
        clustercpu.recompute(self.plane, cluster)
        if self.plane.membership.epoch is not None:
            self.plane.membership.balance()  # its listener: this process or another, from now on
        return self.host(name)

    @staticmethod
    def _host_cpu(probe: Driver) -> HostCpu | None:
        """What a new host says of its CPU; None (not known: never checked) when it can not say."""
        try:
            return probe.host_cpu()
        except DriverError as exc:
            log.warning("host %s did not describe its CPU: %s", probe.host, exc)
            return None

    def remove_host(self, name: str) -> None:
        """Delete a host that holds nothing (lifecycle.delete_host_row says what still uses it), with
        its driver and its row in the capacity index."""
        cluster = self.host(name).cluster.name
        with self.plane.capacity.lock:
            delete_host_row(self.plane.catalog, name)
            driver = self.plane.drivers.pop(name, None)
            self.plane.capacity.drop_host(name)
        if driver is not None:
            driver.close()
        clustercpu.recompute(self.plane, cluster)

    def hosts(self) -> list[Host]:
        with self.plane.db.read() as s:
            return list(s.scalars(select(Host).order_by(Host.name)).unique())

    def host(self, name: str) -> Host:
        with self.plane.db.read() as s:
            return get_by_name(s, Host, name, field="host")
