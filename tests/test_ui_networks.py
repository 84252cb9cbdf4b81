"""The web console's guest networks (issue 29, read only): a VM's NICs on its page (or the one line that says
how to get one), a project's networks, shared provider networks and security groups on its page, the networks
a host carries with their devices and the networking controller's last failure there, the networks list and
one network's NICs; a member sees its project's and the shared networks only, and on a shared network only
its own VMs' NICs. The pages' SQL statements do not grow with the number of NICs (no query per row).
The screenshots are in test_ui_networks_browser.py."""

from __future__ import annotations

import re

import pytest
from sqlalchemy import event

from vmplane.core.driver import DriverError
from vmplane.core.networks import parse_rule
from vmplane.store import Database
from vmplane.store import ledger as L
from vmplane.store import networks as NW
from vmplane.store import secgroups as SG
from vmplane.ui.render import PAGE_SIZE

from .stores import store_url
from .ui_serverkit import ADMIN, ALPHA, BETA, build, error, pager, row, rows, text

HINT = "no network card: vm create --network NET"


def _networked(db):
    """ui_serverkit's console (a1-a3 and b1 without NICs) plus: alpha-net (alpha) and beta-net (beta) with one
    CIDR, a shared provider network `public`; alpha's group `web` (tcp 80 in); VMs n1 (running, alpha-net),
    n2 (stopped, alpha-net at .50 then public, groups default and web), nb (running, beta on beta-net and public)."""
    console = build(db)
    o = console.o
    zone_id = next(z.id for z in o.catalog.zones() if z.name == "z1")
    with o.db.transaction() as conn:
        for name, project, cidr in (("alpha-net", "alpha", "10.10.0.0/24"), ("beta-net", "beta", "10.10.0.0/24")):
            NW.create_network(conn, name, "isolated", zone_id, cidr, project_id=L.lock_project(conn, name=project).id)
        NW.create_network(conn, "public", "provider", zone_id, "192.168.50.0/28", shared=True)
        alpha_id = L.lock_project(conn, name="alpha").id
        SG.ensure_default(conn, alpha_id)
        SG.create_group(conn, alpha_id, "web")
        SG.add_rule(conn, alpha_id, "web", parse_rule("in", "tcp", "80", "0.0.0.0/0", None))
    o.create_vm("n1", "alpha", "f1", "t", start=True, networks=[("alpha-net", None)])
    o.create_vm("n2", "alpha", "f1", "t", networks=[("alpha-net", "10.10.0.50"), ("public", None)],
                secgroups=["default", "web"])  # fmt: skip
    o.create_vm("nb", "beta", "f1", "t", start=True, networks=[("beta-net", None), ("public", None)])
    return console


@pytest.fixture(scope="module")
def con(tmp_path_factory):
    """One console for the tests that only read."""
    db = Database(store_url(tmp_path_factory.mktemp("ui-net")))
    db.migrate()
    console = _networked(db)
    yield console
    console.o.close()
    db.dispose()


@pytest.fixture
def fresh(db):
    console = _networked(db)
    yield console
    console.o.close()


@pytest.fixture
def admin(con):
    return con.client(ADMIN)


@pytest.fixture
def alpha(con):
    return con.client(ALPHA)


def _nics(o, vm: str) -> list[tuple[str, str, str, list[str]]]:
    """(network, MAC, IP, groups) of the VM's NICs, from the store."""
    with o.db.read() as s:
        conn = s.connection()
        return [(n.network, n.mac, n.ip, SG.groups_of(conn, n.id)) for n in NW.nics_of(conn, o.vm(vm).id)]


def _network_id(o, name: str) -> int:
    with o.db.read() as s:
        return NW.network_row(s.connection(), name).id


# -- the VM page -----------------------------------------------------------------------------------
def test_a_vms_page_lists_each_nic_with_its_network_kind_mac_ip_groups_and_state(con, admin):
    r = admin.get("/ui/vms/n2")
    assert r.status_code == 200
    nics = _nics(con.o, "n2")
    assert [n[0] for n in nics] == ["alpha-net", "public"] and nics[0][2] == "10.10.0.50"
    assert rows(r.text, "data-nic") == [n[1] for n in nics]  # in slot order: the first NIC first
    # (stopped: what the guest holds is not known)
    assert (
        row(r.text, nics[0][1], "data-nic")
        == f"alpha-net isolated {nics[0][1]} 10.10.0.50 unknown default, web attached"
    )
    assert (
        row(r.text, nics[1][1], "data-nic")
        == f"public provider shared {nics[1][1]} {nics[1][2]} unknown default, web attached"
    )
    assert "Guest agent: not known" in text(r.text)
    assert 'href="/ui/networks/public"' in r.text and HINT not in text(r.text)
    shown = {
        (n["network"], n["mac"], n["ip"], tuple(n["secgroups"]))
        for n in con.api(ADMIN).get("/api/v1/vms/n2").json()["nics"]
    }
    assert shown == {(net, mac, ip, tuple(groups)) for net, mac, ip, groups in nics}  # what `vm show` says


def test_a_running_vms_page_shows_its_agent_and_what_the_guest_holds_marking_an_address_not_recorded(fresh):
    o, admin = fresh.o, fresh.client(ADMIN)
    (nic,) = _nics(o, "n1")
    mac, ip = nic[1], nic[2]
    assert "Guest agent: not known" in text(admin.get("/ui/vms/n1").text)  # not asked yet
    host = o.vm("n1").host.name
    o.guest_agents.check_host(host, force=True)
    r = admin.get("/ui/vms/n1")
    assert "Guest agent: connected" in text(r.text)
    assert row(r.text, mac, "data-nic") == f"alpha-net isolated {mac} {ip} {ip}/24 default attached"
    assert 'class="drift"' not in r.text
    driver = o.drivers[host]
    real = driver.agent_interfaces
    driver.agent_interfaces = lambda name, timeout_s=5.0: [  # the guest's own `ip addr add`
        i._replace(addresses=[*i.addresses, "10.10.0.99/24"]) if i.mac == mac else i for i in real(name, timeout_s)
    ]
    o.guest_agents.check_host(host, force=True)
    r = admin.get("/ui/vms/n1")
    assert row(r.text, mac, "data-nic") == f"alpha-net isolated {mac} {ip} {ip}/24 10.10.0.99/24 default attached"
    assert '<code class="drift" title="not the recorded address: vmplane audit">10.10.0.99/24</code>' in r.text
    o.drivers[host].fabric.silence_agent(o.domain_name("n1"))
    o.guest_agents.check_host(host, force=True)
    r = admin.get("/ui/vms/n1")
    assert "Guest agent: none" in text(r.text) and row(r.text, mac, "data-nic").endswith(
        f"{ip} unknown default attached"
    )


def test_a_vm_without_a_nic_says_how_to_get_one_on_its_page_and_in_its_live_fragment(admin):
    for url, headers in (("/ui/vms/a1", {}), ("/ui/f/vms/a1", {"HX-Request": "true"})):
        r = admin.get(url, headers=headers)
        assert r.status_code == 200 and HINT in text(r.text) and "data-nic=" not in r.text, url
        assert '<div id="vm-network">' in r.text, url  # the page swaps it in when the VM changes


# -- the project page ------------------------------------------------------------------------------
def test_a_project_page_lists_its_networks_the_shared_ones_and_its_security_groups(con, admin):
    r = admin.get("/ui/projects/alpha")
    assert r.status_code == 200
    section = r.text.split('data-section="networks"')[1]
    assert rows(section, "data-network") == ["alpha-net", "public"]  # not beta's, though it has the same CIDR
    api = {n["name"]: n for n in con.api(ADMIN).get("/api/v1/networks").json()}
    own = api["alpha-net"]
    assert row(section, "alpha-net", "data-network") == (
        f"alpha-net isolated z1 10.10.0.0/24 {own['gateway']} {own['addresses_used']} / {own['addresses_total']} 2"
    )
    assert (own["addresses_used"], own["addresses_total"]) == (2, 252)  # n1 and n2; /24 less gateway and DHCP
    public = api["public"]
    assert row(section, "public", "data-network") == (  # its NICs: n2's and beta's nb's; alpha's VMs: n2 only
        f"public provider shared z1 192.168.50.0/28 {public['gateway']} 2 / {public['addresses_total']} 1"
    )
    assert rows(section, "data-secgroup") == ["default", "web"]
    # default: in from its members and all out; its members n1's NIC and n2's two
    assert row(section, "default", "data-secgroup") == "default 2 3"
    assert row(section, "web", "data-secgroup") == "web 1 2"  # n2's two NICs
    beta = admin.get("/ui/projects/beta").text.split('data-section="networks"')[1]
    assert rows(beta, "data-network") == ["beta-net", "public"]
    assert row(beta, "public", "data-network").endswith(" 1")  # beta's own VM on it


# -- the host page ---------------------------------------------------------------------------------
def test_a_host_page_shows_the_networks_it_carries_with_their_devices_and_its_nics_there(con, admin):
    o = con.o
    host = o.vm("n1").host.name
    r = admin.get(f"/ui/hosts/{host}")
    assert r.status_code == 200
    section = r.text.split('data-section="networks"')[1].split("</section>")[0]
    assert "no failed apply of its networks recorded" in text(section)
    assert rows(section, "data-network") == ["alpha-net", "beta-net", "public"]  # every network of its zone
    for name in ("alpha-net", "beta-net", "public"):
        nid = _network_id(o, name)
        words = row(section, name, "data-network").split()
        assert words[words.index(f"vmpn{nid:x}") :][:3] == [f"vmpn{nid:x}", f"vmpx{nid:x}", str(10000 + nid)]
        assert words[-1] == str(sum(1 for v in ("n1", "nb") if o.vm(v).host.name == host and name in _names(o, v)))
    shown = set(re.findall(r"<code>(vmpn[0-9a-f]+)</code>", section))
    assert o.drivers[host].fabric.bridges(host) == shown  # the names the host holds


def _names(o, vm):
    return [n[0] for n in _nics(o, vm)]


def test_a_host_page_shows_why_the_last_apply_of_its_networks_failed_until_one_succeeds(fresh):
    o, admin = fresh.o, fresh.client(ADMIN)
    host = o.vm("n1").host.name
    o.drivers[host].fabric.fail_host(host, "network")
    with pytest.raises(DriverError) as failed:
        o.networking.ensure(host, force=True)
    r = admin.get(f"/ui/hosts/{host}")
    assert error(r.text)["message"] == f"the last apply of its networks failed: {failed.value}"
    assert str(failed.value) and "no failed apply" not in r.text
    o.drivers[host].fabric.recover_host(host)
    assert o.networking.ensure(host) is True
    r = admin.get(f"/ui/hosts/{host}")
    assert "no failed apply of its networks recorded" in text(r.text) and 'class="error"' not in r.text


# -- the networks list and one network ------------------------------------------------------------
def test_the_networks_list_is_in_the_nav_and_shows_an_admin_every_network(con, admin):
    r = admin.get("/ui/networks")
    assert r.status_code == 200 and '<a href="/ui/networks" aria-current="page">Networks</a>' in r.text
    assert rows(r.text, "data-network") == ["alpha-net", "beta-net", "public"]
    assert row(r.text, "beta-net", "data-network").startswith("beta-net isolated beta z1 10.10.0.0/24")
    # public's NICs: n2's and nb's; a /28's 14 host addresses less the gateway's and the DHCP server's
    assert row(r.text, "public", "data-network").endswith(" 2 / 12 2")
    fragment = admin.get("/ui/f/networks", headers={"HX-Request": "true"})
    assert "<html" not in fragment.text and rows(fragment.text, "data-network") == rows(r.text, "data-network")
    assert 'href="/ui/networks"' in admin.get("/ui").text


def test_a_network_page_lists_its_nics_with_their_vms_macs_and_addresses(con, admin):
    r = admin.get("/ui/networks/public")
    assert r.status_code == 200
    page = text(r.text)
    assert "Network public provider shared" in page and "CIDR 192.168.50.0/28" in page
    expected = sorted((vm, *n[1:3]) for vm in ("n2", "nb") for n in _nics(con.o, vm) if n[0] == "public")
    listed = [(re.search(r'href="/ui/vms/(\w+)"', m).group(1), mac) for mac, m in _nic_rows(r.text)]
    assert listed == [(vm, mac) for vm, mac, _ip in expected]
    for vm, mac, ip in expected:
        assert row(r.text, mac, "data-nic") == f"{vm} {mac} {ip} attached"
    assert "NICs (2)" in page
    assert admin.get("/ui/networks/nope").status_code == 404


def _nic_rows(markup):
    return re.findall(r'<tr data-nic="([^"]+)">(.*?)</tr>', markup, re.S)


def test_a_member_sees_its_projects_and_the_shared_networks_and_on_a_shared_one_its_own_nics_only(con, alpha):
    r = alpha.get("/ui/networks")
    assert rows(r.text, "data-network") == ["alpha-net", "public"]
    assert "beta" not in text(r.text) and not re.search(r"\bnb\b", r.text)
    public = alpha.get("/ui/networks/public")
    assert public.status_code == 200 and [
        re.search(r"/ui/vms/(\w+)", m).group(1) for _, m in _nic_rows(public.text)
    ] == ["n2"]
    assert not re.search(r"\bnb\b", public.text) and "your project's VMs only" in text(public.text)
    for url, headers in (("/ui/networks/beta-net", {}), ("/ui/networks/beta-net", {"HX-Request": "true"})):
        r = alpha.get(url, headers=headers)
        assert r.status_code == 404 and error(r.text) == {
            "error": "not_found",
            "field": "network",
            "message": "network 'beta-net' does not exist",
        }
    for url in ("/ui/projects/alpha", "/ui/vms/n2", "/ui/f/networks"):
        r = alpha.get(url)
        assert r.status_code == 200 and "beta" not in r.text and not re.search(r"\bnb\b", r.text), url
    assert alpha.get("/ui/vms/nb").status_code == 404
    assert rows(con.client(BETA).get("/ui/networks").text, "data-network") == ["beta-net", "public"]


def test_the_networks_list_pages_on_the_server_and_a_host_page_says_how_many_it_shows(fresh):
    o, admin = fresh.o, fresh.client(ADMIN)
    with o.db.transaction() as conn:
        beta_id = L.lock_project(conn, name="beta").id
        for i in range(PAGE_SIZE):
            NW.create_network(conn, f"x{i:02d}", "isolated", o.vm("nb").host.cluster.zone_id, f"10.100.{i}.0/24",
                              project_id=beta_id)  # fmt: skip
    names = sorted(["alpha-net", "beta-net", "public", *(f"x{i:02d}" for i in range(PAGE_SIZE))])
    first = admin.get("/ui/networks")
    assert first.status_code == 200, first.text[-2000:]
    assert rows(first.text, "data-network") == names[:PAGE_SIZE]
    p = pager(first.text)
    assert (p["first"], p["last"], p["total"], p["prev"], p["next"]) == (1, PAGE_SIZE, len(names), None, PAGE_SIZE)
    rest = admin.get(p["next_url"], headers={"HX-Request": "true"})
    assert rows(rest.text, "data-network") == names[PAGE_SIZE:] and "<html" not in rest.text
    host = admin.get(f"/ui/hosts/{o.vm('nb').host.name}")
    assert f"Networks ({len(names)}, first {PAGE_SIZE})" in text(host.text)
    assert len(rows(host.text.split('data-section="networks"')[1], "data-network")) == PAGE_SIZE
    assert rows(fresh.client(ALPHA).get("/ui/networks").text, "data-network") == ["alpha-net", "public"]


# -- no query per row ------------------------------------------------------------------------------
def test_the_pages_statements_do_not_grow_with_the_nics_vms_and_groups(fresh):
    o, admin = fresh.o, fresh.client(ADMIN)
    host = o.vm("n1").host.name
    pages = ["/ui/vms/n2", "/ui/projects/alpha", f"/ui/hosts/{host}", "/ui/networks", "/ui/networks/public"]
    before = {url: _selects(o.db, admin, url) for url in pages}
    with o.db.transaction() as conn:
        alpha_id = L.lock_project(conn, name="alpha").id
        for i in range(4):
            SG.create_group(conn, alpha_id, f"g{i}")
        NW.create_network(
            conn, "more", "isolated", o.vm("n1").host.cluster.zone_id, "10.30.0.0/24", project_id=alpha_id
        )
    for i in range(5):
        o.create_vm(f"m{i}", "alpha", "f1", "t", networks=[("public", None), ("more", None)],
                    secgroups=["default", "web", "g1"])  # fmt: skip
    after = {url: _selects(o.db, admin, url.replace("n2", "m4")) for url in pages}
    assert after == before
    assert len(rows(admin.get("/ui/networks/public").text, "data-nic")) == 7


def _selects(db, client, url: str) -> int:
    """The SELECT statements a page's request runs (the session check's included)."""
    seen = []

    def count(conn, cursor, statement, *args):
        if statement.lstrip().upper().startswith("SELECT"):
            seen.append(statement)

    event.listen(db.engine, "before_cursor_execute", count)
    try:
        assert client.get(url).status_code == 200, url
    finally:
        event.remove(db.engine, "before_cursor_execute", count)
    return len(seen)
