"""Helpers for tests on real QEMU guests: a `vmplane up --driver libvirt` cluster and measurements."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from vmplane.hosts import localhosts

from .conftest import LiveServer


def require_libvirt() -> None:
    reason = localhosts.available()
    if reason:
        pytest.skip(f"real-QEMU test skipped: {reason}")


def libvirt_cluster(tmp_path: Path, hosts: int = 2) -> LiveServer:
    require_libvirt()
    live = LiveServer(tmp_path, hosts=hosts, driver="libvirt").start()
    with live.client() as c:
        # every local host sees this machine's 2 cores: overcommit so that a few guests fit
        c.put(
            "/settings/cpu.overprovisioning.factor", json={"value": "4", "scope": "cluster", "scope_name": "cluster1"}
        ).raise_for_status()
        c.post("/projects", json={"name": "p", "vcpus": 16, "memory_mib": 16384, "vms": 50}).raise_for_status()
    return live


def scalable_cluster(
    tmp_path: Path, max_vcpus: int, max_memory_mib: int, offerings: dict[str, tuple[int, str]]
) -> LiveServer:
    """A libvirt cluster whose VMs are prepared for live scaling up to the given ceiling, with the
    template `scalable` and fixed offerings {name: (vCPUs, memory)} that allow scaling."""
    server = libvirt_cluster(tmp_path)
    run_json(server, "setting", "set", "enable.dynamic.scale.vm", "true", "--zone", "zone1")
    run_json(server, "setting", "set", "kvm.cpu.dynamic.scaling.capacity", str(max_vcpus), "--cluster", "cluster1")
    run_json(
        server, "setting", "set", "kvm.memory.dynamic.scaling.capacity", str(max_memory_mib), "--cluster", "cluster1"
    )
    run_json(server, "template", "create", "scalable", "--image", "tiny-linux", "--dynamic-scaling")
    for name, (vcpus, memory) in offerings.items():
        run_json(
            server,
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
    return server


def run_json(live: LiveServer, *args: str) -> dict:
    r = live.cli(*args, "--output", "json")
    assert r.returncode == 0, f"{args}: {r.stdout} {r.stderr}"
    return json.loads(r.stdout)


def guest(live: LiveServer, vm: str, command: str, timeout: float = 120) -> str:
    r = live.cli("vm", "exec", vm, "--timeout", str(timeout), "--", command)
    assert r.returncode == 0, f"{command}: {r.stdout} {r.stderr}"
    return r.stdout


def host_of(live: LiveServer, name: str):
    """The LocalHost behind a registered host name of this cluster."""
    saved = json.loads((live.home / "hosts" / name / "host.json").read_text())
    return localhosts.describe(live.home / "hosts", name, saved["index"], saved["netns"])


def domains_on(live: LiveServer, host: str) -> list[str]:
    import libvirt

    conn = libvirt.open(host_of(live, host).uri)
    try:
        return sorted(d.name() for d in conn.listAllDomains())
    finally:
        conn.close()


def qemu_pids(domain: str, home: Path | None = None) -> list[int]:
    """QEMU processes whose command line names this domain (there must be at most one). With `home` (a
    cluster's `live.home`), only those of that cluster's local hosts: modules run side by side (-n 2) and
    another one's VM may have the same name."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            cmdline
            and cmdline[0].endswith(b"qemu-system-x86_64")
            and f"guest={domain},".encode() in b" ".join(cmdline)
            and (home is None or _in_cluster(int(entry), home))
        ):
            pids.append(int(entry))
    return pids


def _in_cluster(pid: int, home: Path) -> bool:
    """A process runs in the namespace of one of `home`'s local hosts: its /etc/libvirt is a bind mount of
    `home`/hosts/NAME/etc (mountinfo's root is relative to its file system, so a suffix of that path)."""
    try:
        mounts = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
    except OSError:
        return False
    for line in mounts:
        fields = line.split()
        if len(fields) > 4 and fields[4] == "/etc/libvirt" and "/hosts/" in fields[3]:
            return str(home).endswith(fields[3].rsplit("/hosts/", 1)[0])
    return False


def cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_use(pid: int, seconds: float = 4.0) -> float:
    """CPUs used by a process over `seconds` (1.0 = one full CPU), from utime + stime."""
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - c0) / (time.monotonic() - t0)


def domain_memory(live: LiveServer, host: str, vm: str) -> tuple[int, list[int]]:
    """What libvirt says of a VM's domain: (current memory MiB, [DIMM sizes MiB]) from the live XML."""
    import re

    import libvirt

    conn = libvirt.open(host_of(live, host).uri)
    try:
        dom = conn.lookupByName(f"vmplane-{vm}")
        xml = dom.XMLDesc(0)
        current = int(re.search(r"<currentMemory unit='KiB'>(\d+)<", xml).group(1)) // 1024
        dimms = [
            int(re.search(r"<size unit='KiB'>(\d+)</size>", d).group(1)) // 1024
            for d in re.findall(r"<memory model='dimm'.*?</memory>", xml, re.S)
        ]
        return current, dimms
    finally:
        conn.close()


def vms_of(live: LiveServer) -> list[dict]:
    body = run_json(live, "vm", "list", "--limit", "500")
    return body["items"] if isinstance(body, dict) and "items" in body else body


def record_agrees_with_host(live: LiveServer, vm: str) -> dict:
    """The record (`vm show`), the domain (live XML), the ledger (`project usage`) and the host's claims
    (`host show`, against the VMs placed there) agree; returns the record."""
    show = run_json(live, "vm", "show", vm)
    current, dimms = domain_memory(live, show["host"], vm)
    assert current == show["memory_mib"] == show["boot_memory_mib"] + sum(dimms), (show, current, dimms)
    usage = run_json(live, "project", "usage", show["project"])
    assert usage["consistent"], usage  # ledger == recomputed from records
    host = run_json(live, "host", "show", show["host"])
    placed = [v for v in vms_of(live) if v["host"] == show["host"] and v["state"] != "stopped"]
    assert (host["used_vcpus"], host["used_memory_mib"]) == (
        sum(v["vcpus"] for v in placed),
        sum(v["memory_mib"] + v["overhead_mib"] for v in placed),
    ), (host, placed)
    return show


def crash_at(live, point: str, action) -> None:
    """Restart the control plane with `point` armed (by SIGKILL: the hosts and guests keep running), do
    `action`, see the control plane die there, and start it again unarmed: it recovers."""
    live.stop("kill")
    live.extra_env = {"VMPLANE_FAILPOINTS": point}
    live.start()
    with live.client(timeout=120) as c:
        try:
            action(c)
        except httpx.TransportError:
            pass  # the control plane died while answering: that is the point
    code = live.proc.wait(180)
    assert code == -9, f"the control plane did not die at {point} (exit {code}): {live.log.read_text()[-2000:]}"
    live.extra_env = {}
    live.start()


def settled(live, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    with live.client() as c:
        while True:
            busy = [o for st in ("pending", "running") for o in c.get("/operations", params={"state": st}).json()]
            busy += c.get("/migrations", params={"active": True}).json()
            if not busy:
                return
            assert time.monotonic() < deadline, f"still in flight after {timeout} s: {busy}"
            time.sleep(0.5)


def wait_until(predicate, timeout: float, what: str):
    """Poll `predicate` until it returns a true value (returned); a generous bound, not a speed expected."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.5)
    return value


# -- a CPU cap, read where the kernel keeps it: under load a CPU share can only be bounded from above, while
# the cgroup's quota and its throttling counters say the same whatever else the machine runs


def cpu_cgroup(pid: int) -> Path:
    """The cgroup (v1, cpu controller) libvirt made for the domain of this QEMU process:
    /sys/fs/cgroup/cpu/machine/qemu-ID-NAME.libvirt-qemu/, holding the domain's whole-domain cap and,
    under vcpuN/, each vCPU thread's cap. QEMU's main thread sits in its emulator/ child."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            where = Path("/sys/fs/cgroup", controllers, path.lstrip("/"))
            return where.parent if where.name == "emulator" else where
    raise AssertionError(f"no cpu cgroup for process {pid}: {Path(f'/proc/{pid}/cgroup').read_text()}")


def cfs(cgroup: Path) -> tuple[int, int]:
    """(cpu.cfs_quota_us, cpu.cfs_period_us): a quota of -1 is no cap."""
    return int((cgroup / "cpu.cfs_quota_us").read_text()), int((cgroup / "cpu.cfs_period_us").read_text())


def cap_cpus(cgroup: Path) -> float | None:
    """The cgroup's cap in CPUs (quota / period); None when it has none (a quota of -1, or the kernel's
    largest, 2^44 - 1 us, which libvirt writes for 'unlimited')."""
    quota, period = cfs(cgroup)
    return None if quota < 0 or quota >= 2**44 - 1 else quota / period


def throttled(cgroup: Path) -> int:
    """How many periods the kernel held this cgroup back at its quota (cpu.stat nr_throttled)."""
    stat = dict(line.split() for line in (cgroup / "cpu.stat").read_text().splitlines())
    return int(stat["nr_throttled"])


def throttled_during(cgroup: Path, seconds: float = 3.0) -> int:
    """How many times the kernel held this cgroup back at its quota within a window of `seconds` (0 for a
    cgroup without a cap, whatever the machine's load: the window's length decides nothing)."""
    before = throttled(cgroup)
    time.sleep(seconds)
    return throttled(cgroup) - before


def vcpu_cpu_use(pid: int, seconds: float = 4.0) -> float:
    """CPUs used by a QEMU process's vCPU threads (those in its domain's vcpuN cgroups) over `seconds`."""
    group = cpu_cgroup(pid)
    tids = [t for d in group.glob("vcpu*") for t in (d / "tasks").read_text().split()]

    def used() -> float:
        return sum(cpu_seconds_of(Path(f"/proc/{pid}/task/{t}/stat")) for t in tids)

    c0, t0 = used(), time.monotonic()
    time.sleep(seconds)
    return (used() - c0) / (time.monotonic() - t0)


def cpu_seconds_of(stat_file: Path) -> float:
    stat = stat_file.read_text()
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy(live: LiveServer, vm: str, loops: int = 1) -> None:
    """Start `loops` endless shell loops in the guest (each keeps one vCPU busy); calm() ends them."""
    guest(
        live,
        vm,
        f"for i in $(seq {loops}); do (while :; do :; done) >/dev/null 2>&1 & echo $! >> /tmp/busy; done",
        timeout=240,
    )


CALM = "kill $(cat /tmp/busy 2>/dev/null) 2>/dev/null; rm -f /tmp/busy; true"  # the list goes: no pid is reused


def calm(live: LiveServer, vm: str) -> None:
    """End the loops busy() started (a busy guest would load the shared machine for the tests after)."""
    guest(live, vm, CALM)


def keypair(folder: Path, name: str) -> Path:
    """A new ed25519 key pair in `folder`: the private key's path (the public key beside it, .pub)."""
    key = folder / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{name}@vmplane", "-f", str(key)], check=True)
    return key


def ssh(key: Path, address: str, command: str) -> subprocess.CompletedProcess:
    """`ssh -i KEY root@ADDRESS COMMAND` from this machine, with this key only (no agent, no ~/.ssh keys),
    never prompting, trusting the guest's host key (new at each boot of a test guest)."""
    return subprocess.run(
        [
            *("ssh", "-i", str(key)),
            *("-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"),
            *("-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"),
            f"root@{address}",
            command,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
