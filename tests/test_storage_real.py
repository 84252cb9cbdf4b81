"""Disks that keep their data, on real QEMU guests through vmplane: root disks across stop/start and live
migrations (local pool: the disk copied; shared pool: the same file), volumes hot-plugged, formatted,
moved to another VM; the storage quota at 100 % during a disk-copying migration."""

import time

import pytest

from .realguest import domains_on, guest, libvirt_cluster, run_json, wait_until

FILE_MIB = 64


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = libvirt_cluster(tmp_path_factory.mktemp("storage"))
    run_json(server, "offering", "create", "disk", "--kind", "fixed", "--vcpus", "1", "--memory", "384MiB")
    yield server
    server.stop()


def md5(live, vm: str, path: str) -> str:
    out = guest(live, vm, f"sync; echo 3 > /proc/sys/vm/drop_caches; md5sum {path}")
    return out.split()[0]


def write_file(live, vm: str, path: str, mib: int = FILE_MIB) -> str:
    guest(live, vm, f"dd if=/dev/urandom of={path} bs=1M count={mib} 2>/dev/null; sync")
    return md5(live, vm, path)


def volume(live, name: str) -> dict:
    return run_json(live, "volume", "show", name)


def _files_once_written(live, vm: str, timeout: float = 120) -> list[str]:
    """/data's files once the guest's writer wrote one (waited for, not slept: a loaded machine is slow)."""
    deadline = time.monotonic() + timeout
    while True:
        files = guest(live, vm, "ls /data").split()
        if any(f.startswith("w") for f in files) or time.monotonic() > deadline:
            return files
        time.sleep(1)


def wait_gone_copy(live, name: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        v = volume(live, name)
        if v["copy_to"] is None or time.monotonic() > deadline:
            return v
        time.sleep(0.5)


def test_a_file_on_the_root_disk_survives_stop_start_and_a_local_pool_migration_at_full_storage_quota(live):
    run_json(live, "project", "create", "full", "--vcpus", "2", "--memory", "2GiB", "--storage", "256MiB")
    run_json(
        live,
        "vm",
        "create",
        "keeper",
        "--project",
        "full",
        "--offering",
        "disk",
        "--template",
        "tiny-linux",
        "--pool",
        "local-lv1",
        "--start",
    )
    assert run_json(live, "project", "usage", "full")["storage_mib"]["percent"] == 100.0
    assert "/dev/vda" in guest(live, "keeper", "grep ' /data ' /proc/mounts")
    digest = write_file(live, "keeper", "/data/f")
    # forced: the data is synced, and the guest's init ignores ACPI, so a clean stop would wait out
    # vmplane.vm.shutdown.timeout (30 s) and then force it anyway
    run_json(live, "vm", "stop", "keeper", "--force")
    run_json(live, "vm", "start", "keeper")
    assert md5(live, "keeper", "/data/f") == digest  # it kept its data across stop/start
    # the guest writes while its disk is copied to lv2 (VIR_MIGRATE_NON_SHARED_INC)
    guest(
        live,
        "keeper",
        "(i=0; while [ $i -lt 40 ]; do dd if=/dev/urandom of=/data/w$i bs=1M count=1 "
        "2>/dev/null; sync; i=$((i+1)); sleep 0.1; done) >/dev/null 2>&1 &",
    )
    m = run_json(live, "vm", "migrate", "keeper", "--to", "lv2")
    assert m["state"] == "succeeded", m
    assert m["stats"]["disk_bytes"] >= FILE_MIB * 1024 * 1024, m["stats"]
    assert run_json(live, "vm", "show", "keeper")["host"] == "lv2"
    assert md5(live, "keeper", "/data/f") == digest  # identical after the copy
    files = _files_once_written(live, "keeper")  # the writer wrote across the copy
    assert "f" in files and any(f.startswith("w") for f in files)
    root = wait_gone_copy(live, "keeper-root")
    assert (root["pool"], root["copy_to"]) == ("local-lv2", None)  # the source's copy deleted once checked
    assert run_json(live, "project", "usage", "full")["storage_mib"]["used"] == 256  # never charged twice
    assert run_json(live, "audit")["ok"]
    run_json(live, "vm", "stop", "keeper", "--force")
    run_json(live, "vm", "delete", "keeper")
    assert run_json(live, "project", "usage", "full")["storage_mib"]["used"] == 0


def test_a_file_survives_a_shared_pool_migration(live):
    run_json(
        live,
        "vm",
        "create",
        "sharer",
        "--project",
        "p",
        "--offering",
        "disk",
        "--template",
        "tiny-linux",
        "--pool",
        "shared",
        "--start",
    )
    digest = write_file(live, "sharer", "/data/f")
    source = run_json(live, "vm", "show", "sharer")["host"]
    m = run_json(live, "vm", "migrate", "sharer")
    assert m["state"] == "succeeded", m
    assert m["stats"].get("disk_bytes", 0) == 0  # the same file: nothing copied
    assert run_json(live, "vm", "show", "sharer")["host"] != source
    assert md5(live, "sharer", "/data/f") == digest
    assert volume(live, "sharer-root")["pool"] == "shared"
    run_json(live, "vm", "stop", "sharer", "--force")


def test_a_volume_is_hot_plugged_formatted_detached_live_and_keeps_its_data_on_another_vm(live):
    for vm in ("va", "vb"):
        run_json(
            live,
            "vm",
            "create",
            vm,
            "--project",
            "p",
            "--offering",
            "disk",
            "--template",
            "tiny-linux",
            "--pool",
            "shared",
            "--start",
        )
    run_json(live, "volume", "create", "data", "--project", "p", "--size", "128MiB")
    v = run_json(live, "volume", "attach", "data", "--vm", "va")
    assert (v["state"], v["device"]) == ("attached", "vdb")
    deadline = time.monotonic() + 30
    while "vdb" not in guest(live, "va", "cat /proc/partitions") and time.monotonic() < deadline:
        time.sleep(0.5)
    guest(live, "va", "mke2fs -q /dev/vdb && mkdir -p /mnt/v && mount /dev/vdb /mnt/v")
    digest = write_file(live, "va", "/mnt/v/f", 16)
    guest(live, "va", "umount /mnt/v")
    v = run_json(live, "volume", "detach", "data")  # confirmed by libvirt, never assumed
    assert (v["state"], v["vm"]) == ("available", None)
    assert "vdb" not in guest(live, "va", "cat /proc/partitions")
    run_json(live, "volume", "attach", "data", "--vm", "vb")
    deadline = time.monotonic() + 30
    while "vdb" not in guest(live, "vb", "cat /proc/partitions") and time.monotonic() < deadline:
        time.sleep(0.5)
    guest(live, "vb", "mkdir -p /mnt/v && mount /dev/vdb /mnt/v")
    assert md5(live, "vb", "/mnt/v/f") == digest
    r = live.cli("volume", "delete", "data")
    assert r.returncode != 0 and "only an available" in r.stdout + r.stderr  # refused while attached
    for vm in ("va", "vb"):
        run_json(live, "vm", "stop", vm, "--force")
        run_json(live, "vm", "delete", vm)
    assert volume(live, "data")["state"] == "available"  # it outlives both VMs
    r = live.cli("volume", "delete", "data")
    assert r.returncode == 0, r.stdout + r.stderr
    assert all(not d.startswith("vmplane-v") for h in ("lv1", "lv2") for d in domains_on(live, h))
    assert run_json(live, "audit")["ok"]


def test_a_marker_is_back_after_snapshot_overwrite_stop_revert_start_and_the_chain_live_migrates(live):
    """Issue 32's acceptance: write a marker, snapshot (live), overwrite it, live-migrate with the snapshot
    (a shared pool: nothing copied), stop, revert, start: the marker is back. Each overlay is charged."""
    run_json(live, "project", "create", "snaps", "--vcpus", "2", "--memory", "2GiB", "--storage", "2GiB")
    spec = ("--project", "snaps", "--offering", "disk", "--template", "tiny-linux", "--pool", "shared", "--start")
    run_json(live, "vm", "create", "snapper", *spec)
    root_mib = volume(live, "snapper-root")["size_mib"]
    guest(live, "snapper", "echo before > /data/marker; sync")
    snap = run_json(live, "vm", "snapshot", "create", "snapper", "s1")
    assert (snap["state"], snap["live"]) == ("ready", True) and snap["pause_ms"] is not None, snap
    assert run_json(live, "project", "usage", "snaps")["storage_mib"]["used"] == 2 * root_mib
    guest(live, "snapper", "echo after > /data/marker; sync")

    source = run_json(live, "vm", "show", "snapper")["host"]
    m = run_json(live, "vm", "migrate", "snapper")
    assert m["state"] == "succeeded" and m["stats"].get("disk_bytes", 0) == 0, m
    assert run_json(live, "vm", "show", "snapper")["host"] != source
    assert guest(live, "snapper", "cat /data/marker").strip() == "after"  # the chain's top, intact

    run_json(live, "vm", "stop", "snapper", "--force")
    reverted = run_json(live, "vm", "snapshot", "revert", "snapper", "s1")
    assert reverted["state"] == "ready", reverted
    run_json(live, "vm", "start", "snapper")
    assert guest(live, "snapper", "cat /data/marker").strip() == "before"
    assert [s["name"] for s in run_json(live, "vm", "snapshot", "list", "snapper")] == ["s1"]
    assert run_json(live, "audit")["ok"]
    # a linked clone of what s1 kept, taken while the source runs: an empty overlay on s1's base
    clone = run_json(live, "vm", "clone", "snapper", "twin", "--snapshot", "s1", "--start")
    assert clone["vm"]["project"] == "snaps" and clone["linked"], clone
    guest(live, "twin", "true")  # booted
    assert guest(live, "twin", "cat /data/marker").strip() == "before"
    # s1 deleted while both run: its base stays unmerged (the clone reads it); the source writes on
    r = live.cli("vm", "snapshot", "delete", "snapper", "s1")
    assert r.returncode == 0, r.stdout + r.stderr
    guest(live, "snapper", "echo source-later > /data/marker; sync")
    assert guest(live, "twin", "sync; echo 3 > /proc/sys/vm/drop_caches; cat /data/marker").strip() == "before"
    assert run_json(live, "project", "usage", "snaps")["storage_mib"]["used"] == 3 * root_mib
    assert run_json(live, "audit")["ok"]
    run_json(live, "vm", "stop", "twin", "--force")
    run_json(live, "vm", "delete", "twin")
    # nothing reads the base any more: the settle pass merges the chain live (block commit and pivot), one
    # file charged again
    wait_until(lambda: run_json(live, "project", "usage", "snaps")["storage_mib"]["used"] == root_mib, 120,
               "snapper's chain merged once its clone went")  # fmt: skip
    assert guest(live, "snapper", "cat /data/marker").strip() == "source-later"
    assert run_json(live, "audit")["ok"]

    run_json(live, "vm", "stop", "snapper", "--force")
    run_json(live, "vm", "delete", "snapper")
    assert run_json(live, "project", "usage", "snaps")["storage_mib"]["used"] == 0
    assert run_json(live, "audit")["ok"]
