"""Guest networks in the store (store/networks.py): CIDR rules per project, and addresses and MACs allocated
exactly once under concurrency, on SQLite and PostgreSQL."""

import threading

import pytest
from sqlalchemy import func, select

from vmplane.core.errors import AlreadyExists, Conflict, Invalid, NotFound
from vmplane.orchestrator import InlineExecutor, Orchestrator
from vmplane.store import Database
from vmplane.store import ledger as L
from vmplane.store import networks as NW

from .conftest import add_basics, add_sim_hosts


@pytest.fixture
def cluster(db_url):
    db = Database(db_url)
    db.migrate()
    o = Orchestrator(db, InlineExecutor())
    o.load()
    o.catalog.create_zone("z1")
    o.catalog.create_cluster("c1", "z1")
    add_sim_hosts(o, 1)
    add_basics(o)
    for project in ("a", "b"):
        o.catalog.create_project(project, 1000, 1 << 30, 1000, count_overhead=False)
    yield o
    o.close()
    db.dispose()


def _ids(o, *names):
    with o.db.read() as s:
        conn = s.connection()
        return [L.lock_project(conn, name=n).id for n in names]


def _zone(o):
    return o.catalog.zones()[0].id


def _network(o, name, project, cidr, **kw):
    (project_id,) = _ids(o, project)
    with o.db.transaction() as conn:
        return NW.create_network(conn, name, "isolated", _zone(o), cidr, project_id=project_id, **kw)


def _count_nics(o):
    with o.db.read() as s:
        return s.connection().execute(select(func.count()).select_from(NW.NICS)).scalar_one()


def test_two_projects_may_use_one_cidr_but_a_project_never_overlaps_itself(cluster):
    _network(cluster, "a-net", "a", "10.10.0.0/24")
    _network(cluster, "b-net", "b", "10.10.0.0/24")  # another project: its own layer 2
    with pytest.raises(Conflict, match="overlaps the project's network a-net") as err:
        _network(cluster, "a-net2", "a", "10.10.0.128/25")
    assert err.value.field == "cidr"
    with pytest.raises(AlreadyExists):
        _network(cluster, "a-net", "b", "10.99.0.0/24")
    for cidr, gateway, field in (("10.20.0.0/30", None, "cidr"), ("10.20.0.0/24", "10.21.0.1", "gateway")):
        with pytest.raises(Invalid) as err:
            _network(cluster, "bad", "a", cidr, gateway=gateway)
        assert err.value.field == field
    with pytest.raises(NotFound) as err, cluster.db.transaction() as conn:  # not "already exists"
        NW.create_network(conn, "elsewhere", "isolated", 999, "10.70.0.0/24", project_id=_ids(cluster, "a")[0])
    assert err.value.field == "zone"
    with cluster.db.read() as s:
        assert [r.name for r in NW.network_rows(s.connection())] == ["a-net", "b-net"]  # nothing half-made


def test_a_member_sees_its_own_networks_and_the_shared_provider_ones(cluster):
    _network(cluster, "a-net", "a", "10.10.0.0/24")
    with cluster.db.transaction() as conn:
        NW.create_network(conn, "public", "provider", _zone(cluster), "192.0.2.0/24", shared=True)
        NW.create_network(conn, "admin-only", "provider", _zone(cluster), "198.51.100.0/24")
        with pytest.raises(Conflict, match="provider network public"):
            NW.create_network(conn, "public2", "provider", _zone(cluster), "192.0.2.0/25")
    (a, b) = _ids(cluster, "a", "b")
    with cluster.db.read() as s:
        assert [r.name for r in NW.network_rows(s.connection(), a)] == ["a-net", "public"]
        assert [r.name for r in NW.network_rows(s.connection(), b)] == ["public"]


def _vms(o, count, project="a"):
    for i in range(count):
        o.create_vm(f"v{i}", project, "small", "tiny")
    return [v.id for v in o.vms()]


@pytest.mark.parametrize(("cidr", "vms", "fits"), [("10.30.0.0/24", 200, 200), ("10.31.0.0/29", 8, 4)])
def test_concurrent_nics_on_one_network_get_each_address_and_mac_once(cluster, cidr, vms, fits):
    _network(cluster, "n", "a", cidr)
    vm_ids = _vms(cluster, vms)
    start, got, refused = threading.Barrier(len(vm_ids)), [], []
    lock = threading.Lock()

    def one(vm_id):
        start.wait()
        try:
            with cluster.db.transaction() as conn:
                nic = NW.add_nic(conn, vm_id, "n")
        except Conflict as exc:
            with lock:
                refused.append(exc.message)
            return
        with lock:
            got.append(nic)

    threads = [threading.Thread(target=one, args=(vm_id,)) for vm_id in vm_ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(got) == fits and len(refused) == vms - fits
    assert all("no free address" in m for m in refused)
    assert len({n.ip for n in got}) == len({n.mac for n in got}) == fits  # 0 duplicates
    assert "10.3" in got[0].ip and all(n.slot == 0 for n in got)
    with cluster.db.read() as s:  # what the store holds is what was handed out
        conn = s.connection()
        stored = {(n.ip, n.mac) for vm_id in vm_ids for n in NW.nics_of(conn, vm_id)}
    assert stored == {(n.ip, n.mac) for n in got}


def test_an_address_asked_for_is_checked_and_a_refusal_adds_nothing(cluster):
    _network(cluster, "n", "a", "10.40.0.0/24")
    v0, v1 = _vms(cluster, 2)
    with cluster.db.transaction() as conn:
        first = NW.add_nic(conn, v0, "n", "10.40.0.10")
        second = NW.add_nic(conn, v0, "n")  # the VM's next slot, the lowest free address
    assert (first.ip, first.slot, second.ip, second.slot) == ("10.40.0.10", 0, "10.40.0.2", 1)
    for ip, kind, words in (
        ("10.40.1.1", Invalid, "outside"),
        ("10.40.0.0", Invalid, "network address"),
        ("10.40.0.255", Invalid, "broadcast"),
        ("10.40.0.1", Invalid, "gateway"),
        ("10.40.0.10", Conflict, "taken"),
    ):
        with pytest.raises(kind, match=words), cluster.db.transaction() as conn:
            NW.add_nic(conn, v1, "n", ip)
    assert _count_nics(cluster) == 2
    with pytest.raises(NotFound), cluster.db.transaction() as conn:
        NW.add_nic(conn, v1, "missing")


def test_a_network_in_use_is_not_deleted_and_the_refusal_names_its_vms(cluster):
    _network(cluster, "n", "a", "10.50.0.0/24")
    (v0,) = _vms(cluster, 1)
    with cluster.db.transaction() as conn:
        NW.add_nic(conn, v0, "n")
    with pytest.raises(Conflict, match="in use by the NICs of v0") as err, cluster.db.transaction() as conn:
        NW.delete_network(conn, "n")
    assert err.value.field == "network"
    with cluster.db.transaction() as conn:
        conn.execute(NW.NICS.delete())
        NW.delete_network(conn, "n")
    with cluster.db.read() as s:
        assert NW.network_rows(s.connection()) == []
