"""Guest networks on real QEMU guests and local libvirtd hosts, each in its own network namespace (issue 29):
two projects with the same CIDR, a VM of each on each of two hosts. Every guest gets its recorded address by
DHCP; a project's VMs reach each other across the hosts (VXLAN); no packet crosses between the projects; a
guest that takes another address can not send from it; a live migration keeps the address, the MAC and the
path."""

from __future__ import annotations

import re
import socket
import subprocess
import time

import pytest

from .realguest import guest, libvirt_cluster, wait_until

CIDR = "10.30.0.0/24"
# project a's VMs take the first free addresses; b's are asked for, in the same CIDR, so that a packet that
# crossed from one project to the other would find a guest there to answer it
VMS = {  # name: (project, network, address asked, anti-affinity group)
    "a1": ("a", "a-net", None, "a-apart"),
    "a2": ("a", "a-net", None, "a-apart"),
    "b1": ("b", "b-net", "10.30.0.12", "b-apart"),
    "b2": ("b", "b-net", "10.30.0.13", "b-apart"),
}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = libvirt_cluster(tmp_path_factory.mktemp("networks"))
    with server.client() as c:
        c.post("/offerings", json={"name": "net", "kind": "fixed", "vcpus": 1, "memory_mib": 256}).raise_for_status()
        for project in ("a", "b"):
            c.post("/projects", json={"name": project, "vcpus": 8, "memory_mib": 4096, "vms": 10}).raise_for_status()
            r = c.post("/networks", json={"name": f"{project}-net", "project": project, "cidr": CIDR})
            assert r.status_code == 201, r.text
            r = c.post(
                "/groups",
                json={"name": f"{project}-apart", "project": project, "policy": "anti-affinity", "hard": False},
            )
            assert r.status_code == 201, r.text
        for name, (project, network, ip, group) in VMS.items():
            body = {
                "name": name,
                "project": project,
                "offering": "net",
                "template": "tiny-linux",
                "start": True,
                "group": group,
                "networks": [f"{network}:{ip}" if ip else network],
            }
            r = c.post("/vms", json=body)
            assert r.status_code in (201, 202), r.text
    yield server
    server.stop()


def _vm(live, name: str) -> dict:
    with live.client() as c:
        r = c.get(f"/vms/{name}")
    r.raise_for_status()
    return r.json()


def _running(live, name: str) -> dict:
    return wait_until(lambda: (v := _vm(live, name))["state"] == "running" and v, 300, f"{name} running")


def _address(live, name: str) -> str:
    """The guest's own address on eth0, once DHCP gave it one."""

    def held():
        out = guest(live, name, "ip -4 -o addr show dev eth0 || true", timeout=30)
        found = re.search(r"inet (\d+\.\d+\.\d+\.\d+)/24", out)
        return found.group(1) if found else None

    return wait_until(held, 120, f"{name}'s DHCP lease")


def _pings(live, src: str, address: str, count: int = 3, source: str | None = None) -> int:
    """Replies `src` got to `count` pings of `address`."""
    via = f"-I {source} " if source else ""
    out = guest(live, src, f"ping -c {count} -W 2 {via}{address} 2>&1 || true", timeout=60)
    found = re.search(r"(\d+) packets received", out)
    assert found, out
    return int(found.group(1))


def test_each_guest_holds_its_recorded_address_and_a_projects_vms_reach_each_other_across_hosts(live):
    vms = {name: _running(live, name) for name in VMS}
    assert vms["a1"]["host"] != vms["a2"]["host"] and vms["b1"]["host"] != vms["b2"]["host"]
    for name, vm in vms.items():
        (nic,) = vm["nics"]
        assert _address(live, name) == nic["ip"], name
    recorded = {name: vm["nics"][0]["ip"] for name, vm in vms.items()}
    assert recorded["b1"] == "10.30.0.12" and recorded["b2"] == "10.30.0.13"
    assert _pings(live, "a1", recorded["a2"]) == 3
    assert _pings(live, "b2", recorded["b1"]) == 3


def test_no_packet_crosses_between_two_projects_with_the_same_cidr(live):
    recorded = {name: _running(live, name)["nics"][0]["ip"] for name in VMS}
    for name in VMS:
        _address(live, name)
    for src, dst in (("a1", "b1"), ("a1", "b2"), ("b1", "a2"), ("b2", "a1")):
        assert _pings(live, src, recorded[dst], count=2) == 0, f"{src} reached {dst}"


def test_a_guest_that_takes_another_address_can_not_send_from_it(live):
    a2 = _running(live, "a2")["nics"][0]["ip"]
    _address(live, "a1")
    guest(live, "a1", "ip addr add 10.30.0.77/24 dev eth0")
    try:
        assert _pings(live, "a1", a2, count=2, source="10.30.0.77") == 0
        assert _pings(live, "a1", a2, count=2) == 2  # its own address still works
    finally:
        guest(live, "a1", "ip addr del 10.30.0.77/24 dev eth0")


def test_nics_hot_plugged_into_running_guests_get_their_addresses_and_are_unplugged_on_request(live):
    """A second network of project a; a NIC on it hot-plugged into a1 and a2 (on two hosts): each guest
    brings it up by DHCP and they reach each other over it; then a1's is unplugged on request."""
    for name in ("a1", "a2"):
        _address(live, name)
    with live.client() as c:
        r = c.post("/networks", json={"name": "a-two", "project": "a", "cidr": "10.31.0.0/24"})
        assert r.status_code == 201, r.text
        macs = {}
        for name, ip in (("a1", "10.31.0.41"), ("a2", "10.31.0.42")):
            r = c.post(f"/vms/{name}/nics", json={"network": "a-two", "ip": ip})
            assert r.status_code == 201, r.text
            macs[name] = r.json()["mac"]
    assert [n["state"] for n in _vm(live, "a1")["nics"]] == ["attached", "attached"]
    assert _address_on(live, "a1", "eth1") == "10.31.0.41"
    assert _address_on(live, "a2", "eth1") == "10.31.0.42"
    assert _pings(live, "a2", "10.31.0.41") == 3
    with live.client() as c:
        r = c.delete(f"/vms/a1/nics/{macs['a1']}")
        assert r.status_code == 204, r.text
    assert [n["mac"] for n in _vm(live, "a1")["nics"]] == [_vm(live, "a1")["nics"][0]["mac"]]
    assert "eth1" not in guest(live, "a1", "ls /sys/class/net", timeout=30)
    assert _pings(live, "a2", "10.31.0.41", count=2) == 0


def test_a_live_migration_keeps_the_address_the_mac_and_the_path(live):
    before = {name: _running(live, name) for name in ("a1", "a2")}
    for name in before:
        _address(live, name)
    with live.client() as c:
        r = c.post("/vms/a2/migrate", json={"to": before["a1"]["host"]})
        assert r.status_code == 202, r.text
        migration = r.json()["id"]
    done = wait_until(
        lambda: (m := _get(live, f"/migrations/{migration}"))["state"] in ("succeeded", "failed") and m,
        300,
        "migration",
    )
    assert done["state"] == "succeeded", done
    after = _running(live, "a2")
    assert after["host"] == before["a1"]["host"]
    assert after["nics"] == before["a2"]["nics"]  # the same MAC, address and groups
    assert _pings(live, "a1", after["nics"][0]["ip"]) == 3
    assert _address(live, "a2") == after["nics"][0]["ip"]
    assert _pings(live, "a1", _running(live, "b1")["nics"][0]["ip"], count=2) == 0  # still apart from b


def _get(live, path: str) -> dict:
    with live.client() as c:
        r = c.get(path)
    r.raise_for_status()
    return r.json()


# -- a provider network: reached from this machine, through its security groups ------------------------------
PROVIDER = "10.40.0.0/24"  # its gateway, 10.40.0.1, is this machine's side of the hosts' switch


def _tcp(address: str, port: int, timeout: float = 3) -> str | None:
    """What a TCP server at address:port says first; None when nothing answers within `timeout`."""
    try:
        with socket.create_connection((address, port), timeout=timeout) as s:
            s.settimeout(5)
            return s.recv(100).decode().strip()
    except OSError:
        return None


def test_a_vm_on_the_provider_network_answers_this_machine_on_the_ports_its_groups_open(live):
    with live.client() as c:
        r = c.post("/networks", json={"name": "pub", "provider": True, "shared": True, "cidr": PROVIDER})
        assert r.status_code == 201, r.text
        assert c.post("/secgroups", json={"name": "web", "project": "a"}).status_code == 201
        for rule in (
            {"direction": "in", "proto": "tcp", "port": "8080", "from_cidr": "10.40.0.1/32"},
            {"direction": "in", "proto": "icmp", "from_cidr": "0.0.0.0/0"},
            {"direction": "out", "proto": "any", "from_cidr": "0.0.0.0/0"},
        ):
            assert c.post("/secgroups/a/web/rules", json=rule).status_code == 201
        body = {"name": "p1", "project": "a", "offering": "net", "template": "tiny-linux", "start": True}
        r = c.post("/vms", json={**body, "networks": ["pub"], "secgroups": ["web"]})
        assert r.status_code in (201, 202), r.text
    address = _running(live, "p1")["nics"][0]["ip"]
    assert _address_on(live, "p1", "eth0") == address
    for port in (8080, 8081):
        guest(live, "p1", f"(nc -ll -p {port} -e /bin/echo open-{port} </dev/null >/dev/null 2>&1 &)")
    ping = subprocess.run(["ping", "-c", "3", "-W", "2", address], capture_output=True, text=True)
    assert ping.returncode == 0, ping.stdout
    assert wait_until(lambda: _tcp(address, 8080), 30, "port 8080 opened by the group") == "open-8080"
    assert _tcp(address, 8081) is None  # the group does not open it
    with live.client() as c:
        rule = {"direction": "in", "proto": "tcp", "port": "8081", "from_cidr": "10.40.0.1/32"}
        r = c.post("/secgroups/a/web/rules", json=rule)
        assert r.status_code == 201, r.text
        rule_id = r.json()["id"]
    t0 = time.monotonic()
    wait_until(lambda: _tcp(address, 8081) == "open-8081", 10, "the new rule on the running VM")
    opened_s = time.monotonic() - t0
    with live.client() as c:
        assert c.delete(f"/secgroups/a/web/rules/{rule_id}").status_code == 204
    t0 = time.monotonic()
    # (probed with a short connect timeout: a filtered port answers nothing, and the probe's own wait would
    # count in the time printed)
    wait_until(lambda: _tcp(address, 8081, timeout=0.5) is None, 15, "the removed rule on the running VM")
    closed_s = time.monotonic() - t0
    print(f"\n  a rule reached the running VM in {opened_s:.2f} s, its removal in {closed_s:.2f} s")


def _address_on(live, name: str, nic: str) -> str:
    def held():
        out = guest(live, name, f"ip -4 -o addr show dev {nic} || true", timeout=30)
        found = re.search(r"inet (\d+\.\d+\.\d+\.\d+)/", out)
        return found.group(1) if found else None

    return wait_until(held, 120, f"{name}'s DHCP lease on {nic}")
