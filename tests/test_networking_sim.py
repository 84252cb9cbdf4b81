"""The networking controller on sim hosts (controllers/networking.py): a VM with NICs starts only on a host
that holds its networks, keeps its MAC and address across stop/start and migration, and the hosts follow
the store's view (a security-group change, a deleted VM) without being asked."""

import pytest

from vmplane.core.driver import DriverError
from vmplane.core.errors import Invalid, NotFound
from vmplane.core.networks import parse_rule
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
