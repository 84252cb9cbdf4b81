"""Guest networks and security groups through the API and the CLI (sim hosts): what a user sees of them,
who may reach what, refusals naming the field with nothing half-made, and that every change the hosts must
follow tells the networking controller."""

import json

import pytest

from vmplane.store import networks as NW
from vmplane.store import secgroups as SG

from .conftest import add_basics, add_sim_hosts, in_process_cli

API = "/api/v1"


class Changes:
    """Counts the networking controller's `changed()` calls (and passes them on to it when it exists)."""

    def __init__(self, real):
        self.real = real
        self.count = 0

    def changed(self):
        self.count += 1
        if self.real is not None:
            self.real.changed()


@pytest.fixture
def net(orch, api, monkeypatch):
    """Two projects on sim hosts, their members' headers, and the count of changes told to the controller."""
    add_sim_hosts(orch, 2)
    add_basics(orch)
    for project in ("a", "b"):
        orch.catalog.create_project(project, 16, 65536, 20)
    members = {
        p: {
            "Authorization": "Bearer "
            + api.post(f"{API}/tokens", json={"name": f"m-{p}", "role": "member", "project": p}).json()["token"]
        }
        for p in ("a", "b")
    }
    changes = Changes(getattr(orch, "networking", None))
    monkeypatch.setattr(orch, "networking", changes, raising=False)
    return api, members, changes


def _ok(response, status=200):
    assert response.status_code == status, response.text
    return response.json() if response.content else None


def _refused(response, status, field):
    assert response.status_code == status, response.text
    body = response.json()
    assert body["field"] == field, body
    return body["message"]


def _network(api, name, cidr, project="a", **kw):
    return api.post(f"{API}/networks", json={"name": name, "project": project, "cidr": cidr, **kw})


def _nic(orch, vm, network, groups=("default",)):
    """A NIC made in the store (as `vm create --network` makes one), in the project's groups."""
    with orch.db.transaction() as conn:
        row = orch.vm(vm)
        nic = NW.add_nic(conn, row.id, network)
        SG.ensure_default(conn, row.project_id)
        for group in groups:
            SG.join(conn, nic.id, SG.group_row(conn, row.project_id, group).id)
    return nic


# -- networks -------------------------------------------------------------------------------------------
def test_networks_are_created_listed_shown_and_deleted(net):
    api, _, changes = net
    made = _ok(_network(api, "a-net", "10.10.0.0/24"), 201)
    assert {k: made[k] for k in ("kind", "project", "zone", "cidr", "gateway", "shared")} == {
        "kind": "isolated",
        "project": "a",
        "zone": "z1",
        "cidr": "10.10.0.0/24",
        "gateway": "10.10.0.1",
        "shared": False,
    }
    assert (made["addresses_used"], made["addresses_total"], made["nics"]) == (0, 252, [])
    _ok(_network(api, "b-net", "10.10.0.0/24", project="b", gateway="10.10.0.254"), 201)  # another project: ok
    _ok(api.post(f"{API}/networks", json={"name": "public", "cidr": "192.0.2.0/24", "provider": True}), 201)
    assert [(n["name"], n["project"], n["gateway"]) for n in _ok(api.get(f"{API}/networks"))] == [
        ("a-net", "a", "10.10.0.1"),
        ("b-net", "b", "10.10.0.254"),
        ("public", None, "192.0.2.1"),
    ]
    assert _ok(api.get(f"{API}/networks/b-net"))["nics"] == []
    assert changes.count == 3
    _ok(api.delete(f"{API}/networks/b-net"), 204)
    _refused(api.get(f"{API}/networks/b-net"), 404, "network")
    _refused(api.delete(f"{API}/networks/b-net"), 404, "network")
    assert changes.count == 4


def test_bad_networks_are_refused_naming_the_field_and_nothing_is_made(net):
    api, _, changes = net
    _ok(_network(api, "a-net", "10.10.0.0/24"), 201)
    assert "overlaps the project's network a-net" in _refused(_network(api, "x", "10.10.0.128/25"), 409, "cidr")
    _refused(_network(api, "x", "10.20.0.0/30"), 422, "cidr")  # too small
    _refused(_network(api, "x", "10.20.0.0/24", gateway="10.21.0.1"), 422, "gateway")
    _refused(_network(api, "x", "10.20.0.0/24", gateway="10.20.0.0"), 422, "gateway")  # the network address
    _refused(_network(api, "x", "10.20.0.1/24"), 422, "cidr")  # host bits set
    _refused(_network(api, "x", "not-a-cidr"), 422, "cidr")
    _refused(_network(api, "a-net", "10.30.0.0/24"), 409, "name")
    _refused(_network(api, "x", "10.20.0.0/24", zone="nowhere"), 404, "zone")
    _refused(_network(api, "x", "10.20.0.0/24", shared=True), 422, "shared")  # only a provider one is shared
    _refused(_network(api, "x", "10.20.0.0/24", provider=True), 422, "project")  # a provider one has none
    _refused(api.post(f"{API}/networks", json={"name": "x", "cidr": "10.20.0.0/24"}), 422, "project")
    _refused(_network(api, "x", "10.20.0.0/24", project="nope"), 404, "project")
    _refused(_network(api, "Bad_Name", "10.20.0.0/24"), 422, "name")
    assert [n["name"] for n in _ok(api.get(f"{API}/networks"))] == ["a-net"]
    assert changes.count == 1  # the one made


def test_members_reach_their_own_projects_networks_and_the_shared_ones_only(net):
    api, members, changes = net
    as_a = members["a"]
    _ok(_network(api, "b-net", "10.10.0.0/24", project="b"), 201)
    _ok(
        api.post(f"{API}/networks", json={"name": "public", "cidr": "192.0.2.0/24", "provider": True, "shared": True}),
        201,
    )
    _ok(api.post(f"{API}/networks", json={"name": "uplink", "cidr": "198.51.100.0/24", "provider": True}), 201)
    provider = {"name": "mine", "cidr": "203.0.113.0/24", "provider": True}
    assert api.post(f"{API}/networks", json=provider, headers=as_a).status_code == 403
    other = {"name": "x", "project": "b", "cidr": "10.50.0.0/24"}
    _refused(api.post(f"{API}/networks", json=other, headers=as_a), 404, "project")
    _ok(api.post(f"{API}/networks", json={"name": "a-net", "project": "a", "cidr": "10.10.0.0/24"}, headers=as_a), 201)
    assert [n["name"] for n in _ok(api.get(f"{API}/networks", headers=as_a))] == ["a-net", "public"]
    _refused(api.get(f"{API}/networks/b-net", headers=as_a), 404, "network")
    _refused(api.get(f"{API}/networks/uplink", headers=as_a), 404, "network")
    assert _ok(api.get(f"{API}/networks/public", headers=as_a))["kind"] == "provider"
    _refused(api.delete(f"{API}/networks/b-net", headers=as_a), 404, "network")
    assert api.delete(f"{API}/networks/public", headers=as_a).status_code == 403
    assert [n["name"] for n in _ok(api.get(f"{API}/networks"))] == ["a-net", "b-net", "public", "uplink"]
    _ok(api.delete(f"{API}/networks/a-net", headers=as_a), 204)
    assert changes.count == 5  # four made, one deleted: the refusals told nothing
    vm = {"name": "w", "project": "a", "offering": "small", "template": "tiny", "networks": ["uplink"]}
    _refused(api.post(f"{API}/vms", json=vm, headers=as_a), 404, "networks")  # an admin's, not shared
    _ok(api.post(f"{API}/vms", json={**vm, "networks": ["public"]}, headers=as_a), 201)


def test_vm_show_lists_its_nics_and_a_network_in_use_is_not_deleted_naming_the_vm(net, orch):
    api, members, _ = net
    _ok(_network(api, "a-net", "10.10.0.0/24"), 201)
    orch.create_vm("v1", "a", "small", "tiny")
    orch.create_vm("v2", "a", "small", "tiny")
    first = _nic(orch, "v1", "a-net")
    _nic(orch, "v1", "a-net", groups=())
    nics = _ok(api.get(f"{API}/vms/v1"))["nics"]
    assert nics == [
        {"network": "a-net", "mac": first.mac, "ip": "10.10.0.2", "secgroups": ["default"], "state": "attached"},
        {"network": "a-net", "mac": nics[1]["mac"], "ip": "10.10.0.3", "secgroups": [], "state": "attached"},
    ]
    assert first.mac.startswith("02:76:70:") and nics[1]["mac"] != first.mac
    assert _ok(api.get(f"{API}/vms/v2"))["nics"] == []
    assert _ok(api.get(f"{API}/vms/v1", headers=members["a"]))["nics"] == nics
    assert all(v["nics"] is None for v in _ok(api.get(f"{API}/vms")))  # lists do not show NICs
    shown = _ok(api.get(f"{API}/networks/a-net"))
    assert (shown["addresses_used"], [(n["vm"], n["ip"]) for n in shown["nics"]]) == (
        2,
        [("v1", "10.10.0.2"), ("v1", "10.10.0.3")],
    )
    assert "v1" in _refused(api.delete(f"{API}/networks/a-net"), 409, "network")
    assert _ok(api.get(f"{API}/networks/a-net"))["addresses_used"] == 2


def test_a_vm_joins_and_leaves_a_group_with_every_nic(net, orch):
    api, members, changes = net
    _ok(_network(api, "a-net", "10.10.0.0/24"), 201)
    orch.create_vm("v1", "a", "small", "tiny")
    orch.create_vm("bare", "a", "small", "tiny")
    _nic(orch, "v1", "a-net")
    _nic(orch, "v1", "a-net")
    _ok(api.post(f"{API}/secgroups", json={"name": "web", "project": "a"}), 201)
    before = changes.count
    joined = _ok(api.post(f"{API}/vms/v1/secgroups", json={"group": "web"}))
    assert [n["secgroups"] for n in joined] == [["default", "web"], ["default", "web"]]
    assert [g["secgroups"] for g in _ok(api.get(f"{API}/vms/v1"))["nics"]] == [["default", "web"]] * 2
    web = _ok(api.get(f"{API}/secgroups/a/web"))
    assert (web["member_count"], {m["vm"] for m in web["members"]}) == (2, {"v1"})
    assert "v1" in _refused(api.delete(f"{API}/secgroups/a/web"), 409, "secgroup")
    _refused(api.post(f"{API}/vms/v1/secgroups", json={"group": "web"}, headers=members["b"]), 404, "vm")
    _refused(api.post(f"{API}/vms/v1/secgroups", json={"group": "nope"}), 404, "group")
    _refused(api.post(f"{API}/vms/bare/secgroups", json={"group": "web"}), 422, "vm")
    left = _ok(api.delete(f"{API}/vms/v1/secgroups/web", headers=members["a"]))
    assert [n["secgroups"] for n in left] == [["default"], ["default"]]
    _refused(api.delete(f"{API}/vms/v1/secgroups/web"), 404, "group")
    assert changes.count == before + 2  # the join and the leave; no refusal told anything
    _ok(api.delete(f"{API}/secgroups/a/web"), 204)


def test_vm_create_with_networks_makes_its_nics_and_a_bad_entry_names_networks(net, orch):
    api, _, _ = net
    _ok(_network(api, "a-net", "10.10.0.0/24"), 201)
    _ok(api.post(f"{API}/secgroups", json={"name": "web", "project": "a"}), 201)
    base = {"project": "a", "offering": "small", "template": "tiny"}
    for bad in ("a-net:", ":10.10.0.5", "a-net:10.10.0.5:1", ""):
        _refused(api.post(f"{API}/vms", json={**base, "name": "x", "networks": [bad]}), 422, "networks")
    _ok(_network(api, "b-net", "10.10.0.0/24", project="b"), 201)
    _refused(api.post(f"{API}/vms", json={**base, "name": "x", "networks": ["a-net", "b-net"]}), 404, "networks")
    _refused(api.post(f"{API}/vms", json={**base, "name": "x", "networks": ["a-net:10.10.0.1"]}), 422, "ip")
    assert [v["name"] for v in _ok(api.get(f"{API}/vms"))] == []
    body = {**base, "name": "web-1", "networks": ["a-net", "a-net:10.10.0.50"], "secgroups": ["web"]}
    _ok(api.post(f"{API}/vms", json=body), 201)
    nics = _ok(api.get(f"{API}/vms/web-1"))["nics"]
    assert [(n["network"], n["ip"], n["secgroups"]) for n in nics] == [
        ("a-net", "10.10.0.2", ["web"]),
        ("a-net", "10.10.0.50", ["web"]),
    ]
    assert "web-1" in _refused(api.delete(f"{API}/networks/a-net"), 409, "network")


# -- security groups ------------------------------------------------------------------------------------
def test_rules_are_added_shown_and_removed_and_a_group_in_use_is_kept(net):
    api, members, changes = net
    made = _ok(api.post(f"{API}/secgroups", json={"name": "web", "project": "a"}), 201)
    assert (made["rules"], made["members"]) == ([], [])
    _refused(api.post(f"{API}/secgroups", json={"name": "web", "project": "a"}), 409, "secgroup")
    _ok(api.post(f"{API}/secgroups", json={"name": "web", "project": "b"}), 201)  # each project its own
    rules = f"{API}/secgroups/a/web/rules"
    ssh = _ok(api.post(rules, json={"direction": "in", "proto": "tcp", "port": "22", "from_cidr": "192.0.2.7/24"}), 201)
    assert {k: ssh[k] for k in ("port", "from_cidr", "from_group")} == {
        "port": "22",
        "from_cidr": "192.0.2.0/24",
        "from_group": None,
    }
    web = _ok(api.post(rules, json={"direction": "in", "proto": "tcp", "port": 8080, "from_group": "default"}), 201)
    assert web["port"] == "8080"
    _ok(api.post(rules, json={"direction": "in", "proto": "udp", "port": "5000-5010", "from_cidr": "0.0.0.0/0"}), 201)
    shown = _ok(api.get(f"{API}/secgroups/a/web"))
    assert [(r["id"], r["port"]) for r in shown["rules"]] == [
        (ssh["id"], "22"),
        (web["id"], "8080"),
        (web["id"] + 1, "5000-5010"),
    ]
    _ok(api.delete(f"{rules}/{ssh['id']}"), 204)
    _refused(api.delete(f"{rules}/{ssh['id']}"), 404, "rule")
    assert changes.count == 4  # three rules added, one removed
    # the default group (made with the project's first group) is named by web's rule: kept while it is
    default = _ok(api.get(f"{API}/secgroups/a/default"))
    assert [(r["direction"], r["from_group"], r["from_cidr"]) for r in default["rules"]] == [
        ("in", "default", None),
        ("out", None, "0.0.0.0/0"),
    ]
    assert "web" in _refused(api.delete(f"{API}/secgroups/a/default"), 409, "secgroup")
    assert [(g["name"], g["rule_count"]) for g in _ok(api.get(f"{API}/secgroups", params={"project": "a"}))] == [
        ("default", 2),
        ("web", 2),
    ]
    assert {g["project"] for g in _ok(api.get(f"{API}/secgroups", headers=members["b"]))} == {"b"}
    _refused(api.get(f"{API}/secgroups", params={"project": "a"}, headers=members["b"]), 404, "project")
    _refused(api.get(f"{API}/secgroups/a/web", headers=members["b"]), 404, "project")
    _refused(
        api.post(rules, json={"direction": "in", "proto": "any", "from_cidr": "0.0.0.0/0"}, headers=members["b"]),
        404,
        "project",
    )
    _ok(api.delete(f"{API}/secgroups/a/web", headers=members["a"]), 204)
    _refused(api.get(f"{API}/secgroups/a/web"), 404, "secgroup")


@pytest.mark.parametrize(
    ("rule", "field"),
    [
        ({"proto": "icmp", "port": "22", "from_cidr": "0.0.0.0/0"}, "port"),
        ({"proto": "tcp", "port": "0", "from_cidr": "0.0.0.0/0"}, "port"),
        ({"proto": "tcp", "port": 70000, "from_cidr": "0.0.0.0/0"}, "port"),
        ({"proto": "tcp", "port": "23-22", "from_cidr": "0.0.0.0/0"}, "port"),
        ({"proto": "tcp", "port": "ssh", "from_cidr": "0.0.0.0/0"}, "port"),
        ({"proto": "tcp", "from_cidr": "0.0.0.0/0", "from_group": "default"}, "from_cidr"),
        ({"proto": "tcp"}, "from_cidr"),
        ({"proto": "tcp", "from_cidr": "somewhere"}, "from_cidr"),
        ({"proto": "tcp", "from_group": "nope"}, "from_group"),
        ({"proto": "gre", "from_cidr": "0.0.0.0/0"}, "proto"),
        ({"proto": "tcp", "from_cidr": "0.0.0.0/0", "direction": "up"}, "direction"),
    ],
)
def test_a_bad_rule_is_refused_naming_its_field_and_adds_nothing(net, rule, field):
    api, _, changes = net
    _ok(api.post(f"{API}/secgroups", json={"name": "web", "project": "a"}), 201)
    response = api.post(f"{API}/secgroups/a/web/rules", json={"direction": "in", **rule})
    _refused(response, 404 if field == "from_group" else 422, field)
    assert _ok(api.get(f"{API}/secgroups/a/web"))["rules"] == [] and changes.count == 0


# -- the CLI --------------------------------------------------------------------------------------------
@pytest.fixture
def cli(net, monkeypatch):
    """The CLI against the in-process API (as tests/test_lists.py points it)."""
    return in_process_cli(net[0], monkeypatch)


def test_network_and_secgroup_commands(cli, orch):
    rc, out = cli("network", "create", "a-net", "--project", "a", "--cidr", "10.10.0.0/24", "-o", "json")
    assert rc == 0 and json.loads(out)["gateway"] == "10.10.0.1", out
    rc, out = cli("network", "create", "x", "--project", "a", "--cidr", "10.20.0.0/30")
    assert rc == 1 and "cidr" in out, out
    rc, out = cli("network", "create", "pub", "--provider", "--shared", "--cidr", "192.0.2.0/24", "-o", "json")
    assert rc == 0 and json.loads(out)["shared"] is True, out
    rc, out = cli("network", "list")
    assert rc == 0 and "a-net" in out and "0/252" in out and "pub" in out, out
    orch.create_vm("v1", "a", "small", "tiny")
    _nic(orch, "v1", "a-net")
    rc, out = cli("network", "show", "a-net")
    assert rc == 0 and "v1 10.10.0.2 02:76:70:" in out and "1 used of 252" in out, out
    rc, out = cli("vm", "show", "v1")
    assert rc == 0 and "a-net 10.10.0.2 02:76:70:" in out and "groups: default" in out, out
    create = ("vm", "create", "v2", "--project", "a", "--offering", "small", "--template", "tiny")
    rc, out = cli(*create, "--network", "a-net", "--network", "pub:192.0.2.60", "--secgroup", "default")
    assert rc == 0, out
    rc, out = cli("vm", "show", "v2", "-o", "json")
    assert [(n["network"], n["ip"]) for n in json.loads(out)["nics"]] == [("a-net", "10.10.0.3"), ("pub", "192.0.2.60")]

    rc, out = cli("secgroup", "create", "web", "--project", "a", "-o", "json")
    assert rc == 0 and json.loads(out)["name"] == "web", out
    add = ("secgroup", "rule", "add", "web", "--project", "a", "--direction", "in", "--proto", "tcp", "--port", "22")
    rc, out = cli(*add, "--from", "0.0.0.0/0", "-o", "json")
    assert rc == 0, out
    rule_id = json.loads(out)["id"]
    rc, out = cli(*add, "--from", "0.0.0.0/0", "--from-group", "default")
    assert rc == 1 and "from_cidr" in out, out
    rc, out = cli("secgroup", "show", "web", "--project", "a")
    assert rc == 0 and f"#{rule_id} in tcp 22 from 0.0.0.0/0" in out, out
    rc, out = cli("vm", "secgroup", "add", "v1", "web")
    assert rc == 0 and "default, web" in out, out
    rc, out = cli("secgroup", "list", "--project", "a")
    assert rc == 0 and "web" in out and "default" in out, out
    rc, out = cli("vm", "secgroup", "remove", "v1", "web")
    assert rc == 0 and "web" not in out.split("NICs of v1")[1], out
    rc, out = cli("secgroup", "rule", "remove", "web", str(rule_id), "--project", "a")
    assert rc == 0, out
    rc, out = cli("secgroup", "delete", "web", "--project", "a")
    assert rc == 0, out
    rc, out = cli("network", "delete", "a-net")
    assert rc == 1 and "v1" in out, out
