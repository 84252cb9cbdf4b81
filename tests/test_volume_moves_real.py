"""`volume move` and cold migration on real QEMU guests (issue 32): a running guest's data volume moved live to
another pool by a block copy (the guest keeps reading what it wrote), then the stopped VM migrated cold to the
other host, its local disks copied between the hosts' pools; it starts there with its data. Its own cluster."""

import pytest

from .realguest import guest, libvirt_cluster, run_json, wait_until
from .test_backups_real import mount_data
from .test_storage_real import md5, write_file


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = libvirt_cluster(tmp_path_factory.mktemp("moves"))
    run_json(server, "offering", "create", "disk", "--kind", "fixed", "--vcpus", "1", "--memory", "384MiB")
    yield server
    server.stop()


def test_a_volume_moves_live_and_its_stopped_vm_migrates_cold_with_its_local_disks(live):
    spec = ("--project", "p", "--offering", "disk", "--template", "tiny-linux", "--pool", "local-lv1", "--start")
    run_json(live, "vm", "create", "mover", *spec)
    assert run_json(live, "vm", "show", "mover")["host"] == "lv1"
    run_json(live, "volume", "create", "mover-data", "--project", "p", "--size", "64MiB", "--pool", "shared")
    run_json(live, "volume", "attach", "mover-data", "--vm", "mover")
    wait_until(lambda: "vdb" in guest(live, "mover", "cat /proc/partitions"), 60, "mover to see vdb")
    guest(live, "mover", "mke2fs -q /dev/vdb")
    mount_data(live, "mover")
    digest = write_file(live, "mover", "/mnt/v/marker", 4)
    root_digest = write_file(live, "mover", "/data/marker", 4)
    before = run_json(live, "volume", "show", "mover-data")

    moved = run_json(live, "volume", "move", "mover-data", "--pool", "local-lv1")  # live: a block copy, a pivot
    assert (moved["pool"], moved["state"], moved["vm"]) == ("local-lv1", "attached", "mover"), moved
    assert moved["file"] != before["file"]
    assert md5(live, "mover", "/mnt/v/marker") == digest  # the guest reads the new file, with what it wrote
    guest(live, "mover", "echo after > /mnt/v/after; sync")
    assert run_json(live, "audit")["ok"]

    run_json(live, "vm", "stop", "mover", "--force")
    cold = run_json(live, "vm", "migrate", "mover", "--to", "lv2")
    assert (cold["state"], cold["target"]) == ("succeeded", "lv2"), cold
    assert sorted(cold["copied"]) == ["mover-data", "mover-root"], cold
    assert run_json(live, "vm", "show", "mover")["state"] == "stopped"
    assert {run_json(live, "volume", "show", v)["pool"] for v in ("mover-data", "mover-root")} == {"local-lv2"}
    run_json(live, "vm", "start", "mover")
    assert run_json(live, "vm", "show", "mover")["host"] == "lv2"
    mount_data(live, "mover")
    assert md5(live, "mover", "/mnt/v/marker") == digest and "after" in guest(live, "mover", "cat /mnt/v/after")
    assert md5(live, "mover", "/data/marker") == root_digest
    assert run_json(live, "audit")["ok"]
