"""Backups on real QEMU guests (issue 32): incremental backups through libvirt's backup API that transfer
what was written, across a stop/start and a live migration; a restore to a new VM that reads the data as it
was; retention that keeps every backup left restorable. Its own cluster (test_storage_real.py holds the
snapshots and clones), so that the two modules run side by side under `--dist loadfile`."""

import pytest

from .realguest import guest, libvirt_cluster, run_json
from .test_storage_real import md5, write_file


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = libvirt_cluster(tmp_path_factory.mktemp("backups"))
    run_json(server, "offering", "create", "disk", "--kind", "fixed", "--vcpus", "1", "--memory", "384MiB")
    yield server
    server.stop()


def test_incremental_backups_transfer_what_was_written_across_stop_start_and_migration_and_restore_it(live):
    """Issue 32's acceptance (root disk): after a full backup, 16 MiB written: the incremental transfers at most
    20 MiB, and stays incremental after a stop/start and a live migration (the checkpoints defined again where
    the VM runs: their bitmaps are in the qcow2 file); a restore to a new VM reads the file as it was."""
    run_json(live, "backup", "store", "create", "bk", "--cluster", "cluster1")
    spec = ("--project", "p", "--offering", "disk", "--template", "tiny-linux", "--pool", "shared")
    run_json(live, "vm", "create", "saved", *spec, "--start")
    digest = write_file(live, "saved", "/data/before", 8)
    full = run_json(live, "backup", "create", "saved")
    assert (full["kind"], full["state"]) == ("full", "ready") and full["sha256"], full

    write_file(live, "saved", "/data/w1", 16)
    inc = run_json(live, "backup", "create", "saved")
    assert inc["kind"] == "incremental" and inc["written"] <= 20 << 20, inc
    print(f"\nfull backup: {full['written'] >> 20} MiB; incremental after 16 MiB written: {inc['written'] / 2**20:.1f}")

    run_json(live, "vm", "stop", "saved", "--force")
    run_json(live, "vm", "start", "saved")
    write_file(live, "saved", "/data/w2", 16)
    after_restart = run_json(live, "backup", "create", "saved")
    assert after_restart["kind"] == "incremental" and after_restart["written"] <= 20 << 20, after_restart

    m = run_json(live, "vm", "migrate", "saved")
    assert m["state"] == "succeeded", m
    write_file(live, "saved", "/data/w3", 16)
    after_move = run_json(live, "backup", "create", "saved")
    assert after_move["kind"] == "incremental" and after_move["written"] <= 20 << 20, after_move
    assert run_json(live, "backup", "verify", str(after_move["id"]))["ok"]

    restored = run_json(live, "backup", "restore", str(inc["id"]), "--to", "rebuilt", "--start")
    assert restored["vm"] == "rebuilt", restored
    guest(live, "rebuilt", "true")
    assert md5(live, "rebuilt", "/data/before") == digest
    assert "w1" in guest(live, "rebuilt", "ls /data") and "w2" not in guest(live, "rebuilt", "ls /data")
    # retention: the two newest kept; the older of them was built on a deleted one: made whole first
    pruned = run_json(live, "backup", "prune", "saved", "--keep-last", "2")
    assert pruned["kept"] == [after_restart["id"], after_move["id"]] and pruned["made_whole"] == [after_restart["id"]]
    for kept in pruned["kept"]:
        assert run_json(live, "backup", "verify", str(kept))["ok"]
    # a snapshot puts a new file on the disk: the next backup is full (its checkpoint on the new file), then
    # incremental again
    run_json(live, "vm", "snapshot", "create", "saved", "s1")
    after_snapshot = run_json(live, "backup", "create", "saved")
    assert after_snapshot["kind"] == "full" and "snapshot" in after_snapshot["why"], after_snapshot
    write_file(live, "saved", "/data/w4", 4)
    assert run_json(live, "backup", "create", "saved")["kind"] == "incremental"
    assert run_json(live, "audit")["ok"]
    for vm in ("saved", "rebuilt"):
        run_json(live, "vm", "stop", vm, "--force")
        run_json(live, "vm", "delete", vm)
