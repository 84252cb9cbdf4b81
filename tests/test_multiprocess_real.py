"""Two control-plane processes on PostgreSQL over real libvirt hosts: the one that runs a live migration
of a real guest is killed (SIGKILL) mid-copy; the other settles it by asking both hosts (libvirtd carries
the copy on alone) and the guest runs exactly once, where the store says, with the audit clean."""

import time

from .conftest import LiveServer
from .multikit import Process
from .realguest import domains_on, guest, qemu_pids, require_libvirt, run_json, settled
from .test_multiprocess import new_database

LEASE_S = 3.0


def test_a_process_killed_mid_migration_of_a_real_guest_leaves_it_once_where_the_other_says(tmp_path, postgres):
    require_libvirt()
    _, url = new_database(postgres)
    live = LiveServer(tmp_path, hosts=2, db_url=url, driver="libvirt").start(
        "--lease", str(LEASE_S), "--name", "plane-0"
    )
    other = None
    try:
        with live.client() as c:
            c.put(
                "/settings/cpu.overprovisioning.factor",
                json={"value": "4", "scope": "cluster", "scope_name": "cluster1"},
            ).raise_for_status()
            c.post("/projects", json={"name": "p", "vcpus": 16, "memory_mib": 16384, "vms": 50}).raise_for_status()
        run_json(live, "offering", "create", "c1", "--kind", "fixed", "--vcpus", "1", "--memory", "512MiB")
        run_json(
            live, "vm", "create", "k1", "--project", "p", "--offering", "c1", "--template", "tiny-linux", "--start"
        )
        other = Process(tmp_path, 1, url, LEASE_S, {**live.env, "VMPLANE_FAILPOINTS": "migrate.mid-copy"}, 0)
        other.start()
        with live.client() as c:
            source = c.get("/vms/k1").json()["host"]
        with other.client(timeout=30) as c1:
            # a copy slow enough that its progress is reported before it ends, whatever the machine's load
            # (an idle guest's memory otherwise crosses between two polls: no mid-copy, no kill)
            answer = c1.post("/vms/k1/migrate", json={"bandwidth_mib_s": 4})
            assert answer.status_code < 300, answer.text
            mig = answer.json()
        other.proc.wait(300)  # it killed itself while the memory was being copied
        assert other.proc.returncode == -9
        died = time.monotonic()
        with live.client() as c:
            while c.get(f"/migrations/{mig['id']}").json()["state"] not in ("succeeded", "failed", "cancelled"):
                assert time.monotonic() - died < 300
                time.sleep(0.2)
            took = time.monotonic() - died
            row = c.get(f"/migrations/{mig['id']}").json()
            settled(live)
            vm = c.get("/vms/k1").json()
            assert c.get("/audit").json() == {"ok": True, "problems": []}
        print(
            f"migration of the killed process settled by the other {took:.1f} s after the kill "
            f"(lease {LEASE_S:g} s): {row['state']} ({row['reason']})"
        )
        assert vm["state"] == "running"
        assert vm["host"] == (row["target"] if row["state"] == "succeeded" else source)
        assert len(qemu_pids("vmplane-k1", live.home)) == 1  # one QEMU
        assert [h for h in ("lv1", "lv2") if "vmplane-k1" in domains_on(live, h)] == [vm["host"]]
        assert guest(live, "k1", "nproc").split()[0] == "1"
    finally:
        if other is not None:
            other.stop()
        live.stop()
