"""Backups on real QEMU guests (issue 32): incremental backups through libvirt's backup API of a VM's root disk
and 1 GiB data volume that transfer what was written, across a stop/start, a live migration and a control-plane
restart; a restore to a new VM that reads both disks as they were; retention that keeps every backup left
restorable. Its own cluster (test_storage_real.py holds the snapshots and clones), so that the two modules run
side by side under `--dist loadfile`."""

import subprocess

import pytest

from .realguest import guest, libvirt_cluster, run_json, wait_until
from .test_storage_real import md5, write_file


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = libvirt_cluster(tmp_path_factory.mktemp("backups"))
    run_json(server, "offering", "create", "disk", "--kind", "fixed", "--vcpus", "1", "--memory", "384MiB")
    yield server
    server.stop()


ROUNDS = 20
SHARED_DIR = "/var/lib/vmplane/shared/shared"  # the pool `shared`, as every host of the cluster sees it
BACKUP_DIR = "/var/lib/vmplane/shared/backup-bk"  # the backup store `bk`'s default directory


def same_bytes(live, a: str, b: str) -> bool:
    """Whether two disk files show a guest the same bytes (`qemu-img compare`: every sector, through each
    file's backing chain), read in a host's mount namespace (where the chains' paths resolve)."""
    pid = (live.home / "hosts" / "lv1" / "libvirtd.pid").read_text().strip()
    compare = ["nsenter", f"--target={pid}", "--mount", "qemu-img", "compare", "-U", a, b]
    r = subprocess.run(compare, capture_output=True, text=True)
    assert r.returncode in (0, 1), r.stderr  # 0: identical, 1: they differ, else: an error
    return r.returncode == 0


def mount_data(live, vm: str) -> None:
    """The 1 GiB data volume (vdb) mounted at /mnt/v once the guest sees it (waited for: a booting guest)."""
    wait_until(lambda: "vdb" in guest(live, vm, "cat /proc/partitions"), 60, f"{vm} to see vdb")
    guest(live, vm, "mkdir -p /mnt/v && mount /dev/vdb /mnt/v")


def incremental(live, vm: str, note: str) -> dict:
    """Write 16 MiB on the data volume, back up: incremental, at most 20 MiB transferred (issue 32's bound)."""
    write_file(live, vm, f"/mnt/v/{note}", 16)
    b = run_json(live, "backup", "create", vm)
    assert b["kind"] == "incremental" and b["written"] <= 20 << 20, (note, b)
    print(f"incremental after 16 MiB written ({note}): {b['written'] / 2**20:.1f} MiB transferred")
    return b


def test_incremental_backups_transfer_what_was_written_across_stop_start_migration_and_restart_and_restore_it(
    live,
):
    """Issue 32's acceptance: a VM with a 1 GiB data volume; after a full backup (both disks, one job), 16 MiB
    written on the data volume: the incremental transfers at most 20 MiB, and stays incremental after a
    stop/start, a live migration and a control-plane restart between two backups (the checkpoints defined
    again where the VM runs: their bitmaps are in the qcow2 files); a restore to a new VM has both disks as
    they were."""
    run_json(live, "backup", "store", "create", "bk", "--cluster", "cluster1")
    spec = ("--project", "p", "--offering", "disk", "--template", "tiny-linux", "--pool", "shared")
    run_json(live, "vm", "create", "saved", *spec, "--start")
    run_json(live, "volume", "create", "saved-data", "--project", "p", "--size", "1GiB", "--pool", "shared")
    run_json(live, "volume", "attach", "saved-data", "--vm", "saved")
    wait_until(lambda: "vdb" in guest(live, "saved", "cat /proc/partitions"), 60, "saved to see vdb")
    guest(live, "saved", "mke2fs -q /dev/vdb")
    mount_data(live, "saved")
    root_digest = write_file(live, "saved", "/data/before", 4)
    digest = write_file(live, "saved", "/mnt/v/before", 8)
    full = run_json(live, "backup", "create", "saved")
    assert (full["kind"], full["state"]) == ("full", "ready"), full
    assert [(d["device"], d["mode"]) for d in full["disks"]] == [("vda", "full"), ("vdb", "full")], full
    print(f"\nfull backup (root + 1 GiB data volume): {full['written'] >> 20} MiB transferred")

    inc = incremental(live, "saved", "w1")
    run_json(live, "vm", "stop", "saved", "--force")
    run_json(live, "vm", "start", "saved")
    mount_data(live, "saved")
    after_restart = incremental(live, "saved", "w2")
    m = run_json(live, "vm", "migrate", "saved")
    assert m["state"] == "succeeded", m
    after_move = incremental(live, "saved", "w3")
    live.stop("kill")  # the control plane restarts between two backups: the hosts and the guest keep running
    live.start()
    after_cp = incremental(live, "saved", "w4")
    assert run_json(live, "backup", "verify", str(after_cp["id"]))["ok"]

    restored = run_json(live, "backup", "restore", str(inc["id"]), "--to", "rebuilt", "--start")
    assert restored["vm"] == "rebuilt", restored
    mount_data(live, "rebuilt")
    assert md5(live, "rebuilt", "/data/before") == root_digest
    assert md5(live, "rebuilt", "/mnt/v/before") == digest
    assert "w1" in guest(live, "rebuilt", "ls /mnt/v") and "w2" not in guest(live, "rebuilt", "ls /mnt/v")
    # retention: the two newest kept; the older of them was built on a deleted one: made whole first
    pruned = run_json(live, "backup", "prune", "saved", "--keep-last", "2")
    assert pruned["kept"] == [after_move["id"], after_cp["id"]] and pruned["made_whole"] == [after_move["id"]]
    for kept in pruned["kept"]:
        assert run_json(live, "backup", "verify", str(kept))["ok"]
    assert after_restart["id"] in pruned["deleted"]
    # a snapshot puts a new file on each disk: the next backup is full (its checkpoint on the new files), then
    # incremental again
    run_json(live, "vm", "snapshot", "create", "saved", "s1")
    after_snapshot = run_json(live, "backup", "create", "saved")
    assert after_snapshot["kind"] == "full" and "snapshot" in after_snapshot["why"], after_snapshot
    write_file(live, "saved", "/mnt/v/w5", 4)
    last = run_json(live, "backup", "create", "saved")
    assert last["kind"] == "incremental"

    # 20 restores to new VMs, the four backups left in turn (whole, incremental on it, full, incremental): every
    # disk of each is byte for byte what its backup's chain shows
    backups = [run_json(live, "backup", "show", str(b)) for b in (*pruned["kept"], after_snapshot["id"], last["id"])]
    for n in range(ROUNDS):
        b = backups[n % len(backups)]
        run_json(live, "backup", "restore", str(b["id"]), "--to", f"r{n}")
        for d in b["disks"]:
            restored = run_json(live, "volume", "show", f"r{n}-root" if d["role"] == "root" else f"r{n}-{d['device']}")
            assert same_bytes(live, f"{BACKUP_DIR}/{d['file']}", f"{SHARED_DIR}/{restored['file']}"), (n, b["id"], d)
        # (kept: twenty stopped VMs cost nothing but their disks; the cluster goes with the module)
    assert run_json(live, "audit")["ok"]
    for vm in ("saved", "rebuilt"):
        run_json(live, "vm", "stop", vm, "--force")
        run_json(live, "vm", "delete", vm)
