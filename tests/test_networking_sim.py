"""The networking controller on sim hosts (controllers/networking.py): a VM with NICs starts only on a host
that holds its networks, keeps its MAC and address across stop/start and migration, and the hosts follow
the store's view (a security-group change, a deleted VM) without being asked."""

import pytest
from sqlalchemy import select, update

from vmplane.controllers import nics
from vmplane.core.driver import DriverError
from vmplane.core.errors import Conflict, Invalid, NotFound
from vmplane.core.networks import parse_rule
from vmplane.hosts.drivers.simfaults import SimFaults
from vmplane.orchestrator import InlineExecutor, Orchestrator
from vmplane.store import Database
from vmplane.store import ledger as L
from vmplane.store import networks as NW
from vmplane.store import secgroups as SG

from .conftest import add_basics, add_sim_hosts


@pytest.fixture
def o(tmp_path):
    db = Database(f"sqlite:///{tmp_path}/store.db")
    db.migrate()
    o = Orchestrator(db, InlineExecutor())
    o.load()
    o.catalog.create_zone("z1")
    o.catalog.create_cluster("c1", "z1")
    o.catalog.create_zone("z2")
    o.catalog.create_cluster("c2", "z2")
    add_sim_hosts(o, 2)
    add_sim_hosts(o, 1, cluster="c2", prefix="far")
    add_basics(o)
    for project in ("a", "b"):
        o.catalog.create_project(project, 100, 1 << 20, 100, count_overhead=False)
    for project, zone, net, cidr in (
        ("a", "z1", "a-net", "10.10.0.0/24"),
        ("b", "z1", "b-net", "10.10.0.0/24"),  # another project: the same CIDR
        ("a", "z2", "a-far", "10.20.0.0/24"),
    ):
        with o.db.transaction() as conn:
            zone_id = next(z.id for z in o.catalog.zones() if z.name == zone)
            project_id = L.lock_project(conn, name=project).id
            NW.create_network(conn, net, "isolated", zone_id, cidr, project_id=project_id)
    yield o
    o.close()
    db.dispose()


def _nics(o, vm):
    with o.db.read() as s:
        return NW.nics_of(s.connection(), o.vm(vm).id)


def _fabric(o, host="h1"):
    return o.drivers[host].fabric


def test_a_vm_with_a_nic_starts_where_its_network_is_held_and_keeps_its_mac_and_address(o):
    o.create_vm("web", "a", "small", "tiny", start=True, networks=[("a-net", None)])
    vm = o.vm("web")
    (nic,) = _nics(o, "web")
    assert (nic.network, nic.ip, nic.mac) == ("a-net", "10.10.0.2", "02:76:70:00:00:01")
    host = vm.host.name
    spec = _fabric(o, host).spec(host, o.domain_name("web"))
    assert [(n.mac, n.bridge, n.tap) for n in spec.nics] == [(nic.mac, "vmpn1", "vmpt1")]
    # the host holds every network of its zone, and the NIC's filter
    assert _fabric(o, host).bridges(host) == {"vmpn1", "vmpn2"}
    assert ("vmpt1", nic.mac, nic.ip) in _fabric(o, host).ports(host)
    o.stop_vm("web")
    o.start_vm("web")
    assert _nics(o, "web") == [nic]
    other = "h2" if host == "h1" else "h1"
    o.migrator.migrate("web", other)
    assert o.vm("web").host.name == other
    spec = _fabric(o, other).spec(other, o.domain_name("web"))
    assert [n.mac for n in spec.nics] == [nic.mac] and _nics(o, "web") == [nic]


def test_nics_on_another_projects_or_another_zones_network_are_refused_with_nothing_made(o):
    with pytest.raises(NotFound, match="b-net"):
        o.create_vm("web", "a", "small", "tiny", networks=[("b-net", None)])
    with pytest.raises(Invalid, match="zone") as refused:
        o.create_vm("web", "a", "small", "tiny", zone="z1", networks=[("a-net", None), ("a-far", None)])
    assert refused.value.field == "networks"
    assert [v.name for v in o.vms()] == []


def test_the_hosts_follow_the_store_a_new_rule_and_a_deleted_vm_reach_them_in_a_pass(o):
    o.create_vm("web", "a", "small", "tiny", start=True, networks=[("a-net", "10.10.0.9")])
    host = o.vm("web").host.name
    with o.db.transaction() as conn:
        project_id = L.lock_project(conn, name="a").id
        SG.add_rule(conn, project_id, "default", parse_rule("in", "tcp", "22", "0.0.0.0/0", None))
    assert o.networking.ensure(host) is True  # the view moved: applied
    assert o.networking.ensure(host) is False  # nothing moved since
    o.stop_vm("web")
    o.delete_vm("web")
    o.networking.reconcile()
    assert ("vmpt1", "02:76:70:00:00:01", "10.10.0.9") not in _fabric(o, host).ports(host)
    with o.db.read() as s:
        assert NW.users_of(s.connection(), NW.network_row(s.connection(), "a-net").id) == []


def test_a_failed_apply_is_reported_and_applied_again_once_the_host_answers(o):
    o.create_vm("web", "a", "small", "tiny", start=True, networks=[("a-net", None)])
    host = o.vm("web").host.name
    _fabric(o, host).fail_host(host, "network")
    with pytest.raises(DriverError):
        o.networking.ensure(host, force=True)
    assert host in o.networking.failures
    _fabric(o, host).recover_host(host)
    assert o.networking.ensure(host) is True  # not confirmed since the failure: applied again
    assert host not in o.networking.failures


def test_a_domain_whose_bridge_the_host_does_not_hold_is_refused_as_libvirt_refuses_it(o):
    from vmplane.core.driver import DomainSpec, NicSpec

    spec = DomainSpec("vmplane-x", 1, 1, 256, 256, "tiny-linux", nics=(NicSpec("02:76:70:00:00:09", "vmpn9", "vmpt9"),))
    with pytest.raises(DriverError, match="vmpn9"):
        o.drivers["far1"].start(spec)


def _domain_macs(o, vm):
    host = o.vm(vm).host.name
    return set(o.drivers[host].domain_nics(o.domain_name(vm)))


def _states(o, vm):
    with o.db.read() as s:
        rows = s.connection().execute(select(NW.NICS.c.mac, NW.NICS.c.state).where(NW.NICS.c.vm_id == o.vm(vm).id))
        return dict(rows.all())


def test_a_nic_is_hot_plugged_into_a_running_vm_and_unplugged_once_the_guest_let_it_go(o):
    o.create_vm("web", "a", "small", "tiny", start=True, networks=[("a-net", None)])
    added = o.nics.add("web", "a-net", "10.10.0.50")
    assert (added.ip, added.slot) == ("10.10.0.50", 1)
    assert _domain_macs(o, "web") == {"02:76:70:00:00:01", added.mac}
    assert _states(o, "web")[added.mac] == "attached"
    host = o.vm("web").host.name
    assert ("vmpt2", added.mac, "10.10.0.50") in _fabric(o, host).ports(host)
    o.nics.remove("web", added.mac)
    assert _domain_macs(o, "web") == {"02:76:70:00:00:01"} and added.mac not in _states(o, "web")


def test_a_stopped_vms_new_nic_is_defined_at_its_next_start(o):
    o.create_vm("web", "a", "small", "tiny", zone="z1")
    nic = o.nics.add("web", "a-net")
    o.start_vm("web")
    assert _domain_macs(o, "web") == {nic.mac}


def test_a_guest_that_never_lets_the_nic_go_keeps_it_detaching_until_asked_again(o):
    o.create_vm("web", "a", "small", "tiny", start=True, networks=[("a-net", None), ("a-net", None)])
    mac = "02:76:70:00:00:02"
    fabric = _fabric(o)
    fabric.faults = SimFaults(seed=3, detach_never=1.0)
    with pytest.raises(Conflict, match="still in vm web") as refused:
        o.nics.remove("web", mac)
    assert refused.value.field == "mac"
    assert _states(o, "web")[mac] == "detaching" and mac in _domain_macs(o, "web")
    fabric.faults = None  # the guest complies when asked again
    fabric._nic_unplugs.clear()
    o.nics.remove("web", mac)
    assert mac not in _states(o, "web") and mac not in _domain_macs(o, "web")


def test_a_nic_the_host_could_not_plug_is_not_left_in_the_record(o, monkeypatch):
    """The host fails every call: the plug is not known to have happened, so the NIC keeps its step
    (attaching) until the host answers; then the settle pass reads the domain and removes the NIC."""
    o.create_vm("web", "a", "small", "tiny", start=True, networks=[("a-net", None)])
    host = o.vm("web").host.name
    with o.db.transaction() as conn:  # a network the host does not hold yet
        zone_id = next(z.id for z in o.catalog.zones() if z.name == "z1")
        project_id = L.lock_project(conn, name="a").id
        NW.create_network(conn, "a-two", "isolated", zone_id, "10.11.0.0/24", project_id=project_id)
    fabric = _fabric(o, host)
    fabric.faults = SimFaults(seed=4, transient=1.0)
    with pytest.raises(Conflict, match="did not say whether vm web has NIC") as refused:
        o.nics.add("web", "a-two")
    assert refused.value.field == "mac"
    assert _states(o, "web") == {"02:76:70:00:00:01": "attached", "02:76:70:00:00:02": "attaching"}
    assert o.nics.settle() == []  # a step this young may be another process's call: left to it
    monkeypatch.setattr(nics, "BUSY_S", 0.0)
    assert o.nics.settle() == []  # the host still does not answer: nothing changes
    fabric.faults = None
    assert o.nics.settle() == ["vm web: NIC 02:76:70:00:00:02 is not in the domain: removed from the record"]
    assert _states(o, "web") == {"02:76:70:00:00:01": "attached"}


def test_the_audit_reports_a_nic_plugged_or_removed_behind_vmplanes_back(o):
    o.create_vm("web", "a", "small", "tiny", start=True, networks=[("a-net", None)])
    assert o.auditor.audit_nics() == []
    host = o.vm("web").host.name
    fabric, domain = _fabric(o, host), o.domain_name("web")
    fabric.plug_nic(host, domain, ["02:aa:00:00:00:01", "vmpn1", "tapx", 1450])  # by hand on the host
    fabric.request_nic_unplug(host, domain, "02:76:70:00:00:01", 0)
    assert o.auditor.audit_nics() == [
        f"vm web: NIC 02:76:70:00:00:01 is in the record but not in its domain on {host}",
        f"vm web: its domain on {host} has NIC 02:aa:00:00:00:01, which the record does not have",
    ]
    assert any("02:aa:00:00:00:01" in p for p in o.audit())


def test_metrics_count_networks_nics_and_each_networks_addresses(o):
    from vmplane.api.metricscollect import StateCollector

    o.create_vm("web", "a", "small", "tiny", start=True, networks=[("a-net", None), ("a-net", None)])
    text = StateCollector(o.plane).text()
    assert 'vmplane_networks{kind="isolated"} 3' in text
    assert 'vmplane_nics{state="attached"} 2' in text
    assert 'vmplane_network_addresses_used{network="a-net"} 2' in text
    assert 'vmplane_network_addresses_total{network="a-net"} 252' in text  # 254 less gateway and DHCP server
    assert 'vmplane_network_addresses_used{network="b-net"} 0' in text


def test_a_removal_killed_before_the_domain_was_asked_is_settled_attached_and_a_stopped_vms_by_its_record(
    o, monkeypatch
):
    """The crash harness's finding: a NIC left detaching with the domain never asked stayed so for ever."""
    monkeypatch.setattr(nics, "BUSY_S", 0.0)
    o.create_vm("web", "a", "small", "tiny", start=True, networks=[("a-net", None), ("a-net", None)])
    with o.db.transaction() as conn:  # as a kill between the two steps leaves them
        conn.execute(update(NW.NICS).where(NW.NICS.c.mac == "02:76:70:00:00:02").values(state="detaching"))
    assert o.nics.settle() == ["vm web: NIC 02:76:70:00:00:02 is in the domain: attached"]
    o.stop_vm("web")
    with o.db.transaction() as conn:
        conn.execute(update(NW.NICS).where(NW.NICS.c.mac == "02:76:70:00:00:02").values(state="detaching"))
        conn.execute(update(NW.NICS).where(NW.NICS.c.mac == "02:76:70:00:00:01").values(state="attaching"))
    assert sorted(o.nics.settle()) == [
        "vm web: NIC 02:76:70:00:00:01 is in the domain: attached",
        "vm web: NIC 02:76:70:00:00:02 is not in the domain: removed from the record",
    ]
