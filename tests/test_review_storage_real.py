"""Review N2 on real QEMU guests: a file that an older VM of the same name left on a pool (a migration's
copy its host did not delete in time, named as every root disk was named before file names were
unique) is never the disk of a new VM of that name in another project. Tenant A writes a marker to its
disk; the copy stays behind on the pool; tenant B's VM of the same name must not find the marker."""

import json

import libvirt
import pytest

from .realguest import guest, host_of, libvirt_cluster, run_json

MARKER = "tenant-A-secret-4711"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = libvirt_cluster(tmp_path_factory.mktemp("review-storage"))
    run_json(server, "offering", "create", "disk", "--kind", "fixed", "--vcpus", "1", "--memory", "384MiB")
    run_json(server, "project", "create", "tenant-b", "--vcpus", "2", "--memory", "2GiB", "--storage", "1GiB")
    yield server
    server.stop()


def clone(pool, source: str, name: str) -> None:
    """A copy of volume `source` of the pool, named `name` (libvirt's vol-clone)."""
    src = pool.storageVolLookupByName(source)
    pool.createXMLFrom(
        f"<volume><name>{name}</name><capacity>{src.info()[1]}</capacity>"
        f"<target><format type='qcow2'/></target></volume>",
        src,
        0,
    )


def test_a_new_vm_of_a_deleted_vm_s_name_never_gets_the_file_it_left(live):
    run_json(
        live,
        "vm",
        "create",
        "web1",
        "--project",
        "p",
        "--offering",
        "disk",
        "--template",
        "tiny-linux",
        "--pool",
        "local-lv1",
        "--start",
    )
    guest(live, "web1", f"echo {MARKER} > /data/marker && sync")
    # forced: the data is synced, and the guest's init ignores ACPI, so a clean stop would wait out
    # vmplane.vm.shutdown.timeout (30 s) and then force it anyway
    run_json(live, "vm", "stop", "web1", "--force")
    conn = libvirt.open(host_of(live, "lv1").uri)
    try:
        pool = conn.storagePoolLookupByName("local-lv1")
        pool.refresh(0)
        root = next(n for n in pool.listVolumes() if n.startswith("vmp-web1-root"))
        clone(pool, root, "vmp-web1-left.qcow2")  # what a copy left behind holds: A's disk
        assert live.cli("vm", "delete", "web1").returncode == 0
        clone(pool, "vmp-web1-left.qcow2", "vmp-web1-root.qcow2")  # at the name every root disk once had
        pool.storageVolLookupByName("vmp-web1-left.qcow2").delete(0)
        audit = live.cli("audit", "--output", "json")
        assert audit.returncode == 1, audit.stdout  # `vmplane audit || alert`
        problems = json.loads(audit.stdout)["problems"]
        assert any("pool local-lv1 on lv1 holds vmp-web1-root.qcow2" in p for p in problems), problems

        run_json(
            live,
            "vm",
            "create",
            "web1",
            "--project",
            "tenant-b",
            "--offering",
            "disk",
            "--template",
            "tiny-linux",
            "--pool",
            "local-lv1",
            "--start",
        )
        seen = guest(live, "web1", "cat /data/marker 2>/dev/null; echo end")
        assert MARKER not in seen  # B's disk is its own: A's data is not there
        pool.refresh(0)
        assert "vmp-web1-root.qcow2" in pool.listVolumes()  # the leftover was left alone, for the operator
        pool.storageVolLookupByName("vmp-web1-root.qcow2").delete(0)
    finally:
        conn.close()
    assert run_json(live, "audit")["ok"]
