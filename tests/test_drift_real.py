"""Drift on a real QEMU guest (TCG): a DIMM attached with virsh behind vmplane's back is reported by
`vmplane audit`, and `vmplane vm sync` adopts it, the charge and the host claim following."""

import json
import subprocess

import pytest

from .realguest import host_of, run_json, scalable_cluster


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = scalable_cluster(tmp_path_factory.mktemp("drift"), 2, 1024, {"f1": (1, "256MiB")})
    yield server
    server.stop()


def test_a_dimm_attached_with_virsh_is_reported_by_the_audit_and_adopted_by_vm_sync(live, tmp_path):
    vm = run_json(live, "vm", "create", "dr", "--project", "p", "--offering", "f1", "--template", "scalable", "--start")
    host = vm["host"]
    assert run_json(live, "audit")["ok"]
    usage0 = run_json(live, "project", "usage", "p")
    used0 = run_json(live, "host", "show", host)["used_memory_mib"]

    dimm = tmp_path / "dimm.xml"
    dimm.write_text("<memory model='dimm'><target><size unit='MiB'>256</size><node>0</node></target></memory>")
    virsh = subprocess.run(
        ["virsh", "-c", host_of(live, host).uri, "attach-device", "vmplane-dr", str(dimm), "--live"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert virsh.returncode == 0, virsh.stdout + virsh.stderr

    audit = live.cli("audit", "--output", "json")
    assert audit.returncode == 1, audit.stdout + audit.stderr
    assert f"vm dr: memory_mib is 512 on {host}, the record says 256" in json.loads(audit.stdout)["problems"]

    synced = run_json(live, "vm", "sync", "dr")
    assert synced["changes"] == [{"field": "memory_mib", "record": "256", "host": "512"}], synced
    assert run_json(live, "vm", "show", "dr")["memory_mib"] == 512
    usage1 = run_json(live, "project", "usage", "p")
    assert usage1["consistent"] and usage1["memory_mib"]["used"] - usage0["memory_mib"]["used"] >= 256
    assert run_json(live, "host", "show", host)["used_memory_mib"] - used0 >= 256
    assert run_json(live, "audit")["ok"]
    assert run_json(live, "vm", "sync", "dr")["in_sync"]
