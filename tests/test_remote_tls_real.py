"""Hosts added by `qemu+tls://` URI, as remote hosts are: local libvirtd daemons in their own network
namespaces listening with TLS on their namespace addresses (certificates made here with GnuTLS's
certtool), the control plane holding only their URIs. A real guest (TCG) starts, answers, live-migrates
peer to peer over TLS and scales up live; a daemon whose certificate comes from another CA is refused.
Then a host added by `qemu+ssh://` (an sshd in its namespaces) takes the guest, peer to peer over ssh."""

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from vmplane import tlscerts
from vmplane.core import hostnet as H
from vmplane.core.netfilter import Port
from vmplane.core.networks import Rule
from vmplane.hosts import hostnet, localhosts

from .conftest import LiveServer
from .realguest import guest, qemu_pids, run_json


def _unavailable() -> str | None:
    reason = localhosts.available() or tlscerts.available()
    if reason is None and not localhosts.netns_available():
        reason = "network namespaces (ip, root) are not available"
    return reason


def tls_clients(host) -> set[tuple[str, str]]:
    """(peer address, certificate's DN) of every client connected to HOST's daemon over TLS, asked
    through its admin socket (virt-admin)."""
    admin = ["virt-admin", "-c", f"libvirtd:///system?socket={host.dir / 'run' / 'libvirt-admin-sock'}"]
    listed = subprocess.run([*admin, "srv-clients-list", "libvirtd"], capture_output=True, text=True)
    found = set()
    for line in listed.stdout.splitlines()[2:]:
        fields = line.split()
        if len(fields) >= 2 and fields[1] == "tls":
            info = subprocess.run([*admin, "client-info", "libvirtd", fields[0]], capture_output=True, text=True)
            about = dict(map(str.strip, row.split(":", 1)) for row in info.stdout.splitlines() if ":" in row)
            if "sock_addr" in about:
                found.add((about["sock_addr"].rsplit(":", 1)[0], about.get("tls_x509_dname", "")))
    return found


class TLSCluster:
    def __init__(self, live: LiveServer, base: Path, hosts: list):
        self.live, self.base, self.hosts = live, base, hosts


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = _unavailable()
    if reason:
        print(f"TLS host tests skipped: {reason}")
        pytest.skip(f"real-QEMU TLS test skipped: {reason}")
    tmp = tmp_path_factory.mktemp("tls")
    base = tmp / "tlshosts"  # not the server's own hosts folder: these are "remote" to it
    live = None
    try:
        hosts = [localhosts.start(base, name, i, netns=True, tls=True) for i, name in enumerate(("tls1", "tls2"))]
        live = LiveServer(tmp, hosts=0, driver="libvirt").start()
        for host in hosts:
            assert host.uri.startswith(f"qemu+tls://{host.address}/system?pkipath=")
            run_json(live, "host", "add", host.name, "--cluster", "cluster1", "--uri", host.uri)  # + local-NAME
            assert run_json(live, "pool", "show", f"local-{host.name}")["host"] == host.name
        run_json(live, "pool", "create", "shared", "--kind", "shared", "--cluster", "cluster1")
        with live.client() as c:
            c.put(
                "/settings/cpu.overprovisioning.factor",
                json={"value": "4", "scope": "cluster", "scope_name": "cluster1"},
            ).raise_for_status()
        run_json(live, "project", "create", "p", "--vcpus", "8", "--memory", "8192")
        run_json(live, "setting", "set", "enable.dynamic.scale.vm", "true", "--zone", "zone1")
        run_json(live, "setting", "set", "kvm.cpu.dynamic.scaling.capacity", "2", "--cluster", "cluster1")
        run_json(live, "setting", "set", "kvm.memory.dynamic.scaling.capacity", "1024", "--cluster", "cluster1")
        run_json(live, "template", "create", "scalable", "--image", "tiny-linux", "--dynamic-scaling")
        for name, vcpus, memory in (("f1", 1, "256MiB"), ("f2", 2, "512MiB")):
            run_json(
                live,
                "offering",
                "create",
                name,
                "--kind",
                "fixed",
                "--vcpus",
                str(vcpus),
                "--memory",
                memory,
                "--dynamic-scaling",
            )
        yield TLSCluster(live, base, hosts)
    finally:
        if live is not None:
            live.stop()
        localhosts.stop_all(base)  # every daemon started here (the other CA's too) and the bridge


def test_hosts_are_registered_by_their_tls_uri_only(cluster):
    hosts = {h["name"]: h for h in run_json(cluster.live, "host", "list")}
    for host in cluster.hosts:
        assert hosts[host.name]["uri"] == host.uri and hosts[host.name]["uri"].startswith("qemu+tls://")
        assert hosts[host.name]["state"] == "enabled"


def test_a_guest_starts_on_a_tls_host_and_answers(cluster):
    vm = run_json(
        cluster.live, "vm", "create", "tv", "--project", "p", "--offering", "f1", "--template", "scalable", "--start"
    )
    assert vm["host"] in ("tls1", "tls2") and vm["state"] == "running"
    assert guest(cluster.live, "tv", "nproc").strip().splitlines()[-1] == "1"
    guest(cluster.live, "tv", "echo over-tls > /tmp/marker")


def test_the_guest_live_migrates_peer_to_peer_over_tls(cluster):
    live = cluster.live
    source = run_json(live, "vm", "show", "tv")["host"]
    target = "tls2" if source == "tls1" else "tls1"
    source_host, target_host = (next(h for h in cluster.hosts if h.name == n) for n in (source, target))
    seen: set = set()
    done = threading.Event()

    def watch():  # the source daemon's own connection to the target daemon, while it migrates
        while not done.is_set():
            seen.update(tls_clients(target_host))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    r = live.cli("vm", "migrate", "tv", "--to", target, "--output", "json", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    mig = json.loads(r.stdout)
    deadline = time.monotonic() + 180
    while mig["state"] not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, mig
        time.sleep(0.5)
        mig = run_json(live, "migration", "show", mig["id"])
    done.set()
    watcher.join(10)
    assert mig["state"] == "succeeded", mig
    # peer to peer over TLS: the source daemon connected from its own address with the client certificate
    assert any(address == source_host.address for address, _ in seen), seen
    assert run_json(live, "vm", "show", "tv")["host"] == target
    assert guest(live, "tv", "cat /tmp/marker").strip().splitlines()[-1] == "over-tls"  # the same guest
    assert len(qemu_pids("vmplane-tv")) == 1


def test_the_guest_scales_up_live_on_a_tls_host(cluster):
    live = cluster.live
    up0 = float(guest(live, "tv", "cut -d' ' -f1 /proc/uptime").split()[-1])
    r = live.cli("vm", "scale", "tv", "--offering", "f2", "--output", "json", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert (out["vcpus"], out["memory_mib"]) == (2, 512)
    nproc, up1 = guest(live, "tv", "nproc; cut -d' ' -f1 /proc/uptime").split()[-2:]
    assert int(nproc) == 2 and float(up1) > up0  # grew without a reboot
    assert run_json(live, "audit")["ok"]


def test_a_host_added_by_ssh_uri_takes_the_guest_peer_to_peer_over_ssh(cluster):
    live = cluster.live
    if not os.access(localhosts.SSHD, os.X_OK):
        print(f"ssh host test skipped: no sshd at {localhosts.SSHD}")
        pytest.skip(f"no sshd at {localhosts.SSHD} (openssh-server, or VMPLANE_SSHD)")
    host = localhosts.start(cluster.base, "ssh3", 2, netns=True, ssh=True)
    assert host.uri.startswith(f"qemu+ssh://root@{host.address}/system?")
    run_json(live, "host", "add", "ssh3", "--cluster", "cluster1", "--uri", host.uri)  # and its pool local-ssh3
    source = next(h for h in cluster.hosts if h.name == run_json(live, "vm", "show", "tv")["host"])
    r = live.cli("vm", "migrate", "tv", "--to", "ssh3", "--wait", "--output", "json", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    show = run_json(live, "vm", "show", "tv")
    assert show["host"] == "ssh3" and show["vcpus"] == 2
    assert guest(live, "tv", "cat /tmp/marker; nproc").split()[-2:] == ["over-tls", "2"]
    # peer to peer over ssh: the source daemon itself logged in, from its own address
    assert f"Accepted publickey for root from {source.address} " in (host.dir / "ssh" / "sshd.log").read_text()
    run_json(live, "vm", "stop", "tv", "--force")
    assert run_json(live, "vm", "show", "tv")["state"] == "stopped" and qemu_pids("vmplane-tv") == []
    assert run_json(live, "audit")["ok"]


def test_a_remote_hosts_networks_are_applied_over_its_ssh_key_and_read_back(cluster):
    """The host step of guest networks on a host reached only by ssh (hosts/hostnet.ssh_runner, with the key
    and ssh command of its qemu+ssh URI): bridge, VXLAN, filter and DHCP server made, read back over ssh and
    seen in its namespace; an empty plan removes them all (no orphan)."""
    if not os.access(localhosts.SSHD, os.X_OK):
        print(f"ssh network test skipped: no sshd at {localhosts.SSHD}")
        pytest.skip(f"no sshd at {localhosts.SSHD} (openssh-server, or VMPLANE_SSHD)")
    host = localhosts.start(cluster.base, "ssh3", 2, netns=True, ssh=True)  # (adopted when it runs already)
    run = hostnet.ssh_runner("ssh3", host.ssh_uri)
    state = f"/run/vmplane-test-{os.getpid()}/net"
    net = H.NetworkView(0xFFF1, "z", "10.77.0.0/24")
    plan = H.plan("ssh3", "z", {"ssh3": host.address, "peer": "10.88.0.99"}, [net])
    port = Port("vmpt2fff1", "vmpnfff1", "02:76:70:02:ff:f1", "10.77.0.5", ("g1",))
    dhcp = H.Dhcp("vmpnfff1", "10.77.0.0/24", None, (("02:76:70:02:ff:f1", "10.77.0.5"),))
    want = H.HostNetworks(plan, (port,), {"g1": (Rule("in", "any", group="g1"),)}, {"g1": ("10.77.0.5",)}, (dhcp,))
    try:
        applied = hostnet.apply_all("ssh3", run, state, want)
        assert applied.commands > 0 and applied.filtered == 1
        assert hostnet.apply("ssh3", run, plan, want.ports, want.rules, want.members).commands == 0  # read back
        local = hostnet.netns_runner("ssh3", host.netns)
        names = {link.name for link in hostnet.held(local)[0]}
        assert {"vmpnfff1", "vmpxfff1"} <= names
        assert "vmpt2fff1" in local(["nft", "list", "table", "bridge", "vmplane"], None)
        pid = int(run(["cat", f"{state}/vmpnfff1.pid"], None))  # (in the sshd's own mount namespace)
        assert b"--interface=vmpnfff1" in Path(f"/proc/{pid}/cmdline").read_bytes()
    finally:
        hostnet.apply_all("ssh3", run, state, H.HostNetworks(H.plan("ssh3", "z", {"ssh3": host.address}, [])))
    assert not {"vmpnfff1", "vmpxfff1"} & {link.name for link in hostnet.held(local)[0]}
    assert not Path(f"/proc/{pid}").exists() or b"dnsmasq" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    run(["rm", "-rf", f"/run/vmplane-test-{os.getpid()}"], None)


def test_a_host_whose_certificate_comes_from_another_ca_is_refused(cluster):
    other_ca = tlscerts.make_ca(cluster.base.parent / "other-ca", "someone else's CA")
    rogue = localhosts.start(cluster.base, "rogue", 3, netns=True, tls=True, tls_ca=other_ca)
    try:
        with cluster.live.client() as c:
            r = c.post("/hosts", json={"name": "rogue", "cluster": "cluster1", "driver": "libvirt", "uri": rogue.uri})
            body = r.json()
            assert (r.status_code, body["error"], body["field"]) == (422, "invalid", "uri"), r.text
            message = body["message"]
            print(f"refused: {message}")
            assert "rogue" in message and rogue.uri in message and "not trusted" in message, message
            assert "rogue" not in {h["name"] for h in c.get("/hosts").json()}
        r = cluster.live.cli("host", "add", "rogue", "--cluster", "cluster1", "--uri", rogue.uri)
        assert r.returncode != 0 and "not trusted" in r.stdout + r.stderr, r.stdout + r.stderr
    finally:
        localhosts.stop(rogue)


def test_remote_uris_are_passed_to_the_source_daemon_as_added_and_name_the_incoming_address():
    """No daemon needed: what the driver makes of qemu+tls:// and qemu+ssh:// URIs for a migration."""
    pytest.importorskip("libvirt")
    from vmplane.hosts.drivers.libvirt import LibvirtDriver

    tls = LibvirtDriver("h", "qemu+tls://kvm2.example.com/system?pkipath=/etc/vmplane/pki")
    ssh = LibvirtDriver("h", "qemu+ssh://root@kvm3.example.com:2222/system?keyfile=/root/.ssh/id_ed25519")
    assert tls.p2p_uri() == tls.uri and ssh.p2p_uri() == ssh.uri
    assert (tls.incoming_address(), ssh.incoming_address()) == ("kvm2.example.com", "kvm3.example.com")


def test_a_refused_certificate_is_named_in_the_error():
    from vmplane.hosts.drivers.libvirt import probe_words

    stderr = (
        "2026-12-01 05:49:27.039+0000: 23949: warning : virNetTLSContextCheckCertificate:1086 : Certificate "
        "check failed Certificate failed validation: The certificate hasn't got a known issuer.\n"
        "error: failed to connect to the hypervisor\n"
        "error: authentication failed: Failed to verify peer's certificate\n"
    )
    assert probe_words(stderr) == (
        "authentication failed: Failed to verify peer's certificate (The certificate "
        "hasn't got a known issuer.): the host's certificate is not trusted"
    )
