"""cloud-init seeds on real guests (issue 30): a VM created with an SSH key, a hostname and user data through
vmplane runs with its NoCloud seed as a read-only CD-ROM (virtio-scsi); the small test guest reads it (sets
its hostname, installs the key, runs the user data); a live migration makes the seed again on the target
at the same path, and the guest keeps running there."""

from __future__ import annotations

import subprocess

import pytest

from .realguest import guest, libvirt_cluster, wait_until


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = libvirt_cluster(tmp_path_factory.mktemp("seeds"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def key(tmp_path_factory):
    folder = tmp_path_factory.mktemp("key")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / "k")], check=True)
    return (folder / "k.pub").read_text().strip()


def _vm(live, name: str) -> dict:
    with live.client() as c:
        r = c.get(f"/vms/{name}")
    r.raise_for_status()
    return r.json()


def test_the_guest_reads_its_seed_and_keeps_it_through_a_live_migration(live, key):
    with live.client() as c:
        c.post("/offerings", json={"name": "s", "kind": "fixed", "vcpus": 1, "memory_mib": 256}).raise_for_status()
        body = {
            "name": "seeded",
            "project": "p",
            "offering": "s",
            "template": "tiny-linux",
            "start": True,
            "hostname": "seeded-one",
            "ssh_keys": [key],
            "user_data": "#!/bin/sh\necho from-user-data > /tmp/user-data-ran\n",
        }
        r = c.post("/vms", json=body)
        assert r.status_code in (201, 202), r.text
    wait_until(lambda: _vm(live, "seeded")["state"] == "running", 300, "seeded running")
    said: list[str] = []

    def user_data_ran() -> bool:  # a guest still booting on a loaded machine may not answer one exec in time
        r = live.cli("vm", "exec", "seeded", "--timeout", "30", "--", "cat /tmp/user-data-ran 2>/dev/null || true")
        said.append(r.stdout + r.stderr)
        return r.returncode == 0 and "from-user-data" in r.stdout

    try:
        wait_until(user_data_ran, 180, "the user data run")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the guest's last answers: {said[-3:]}") from None
    assert guest(live, "seeded", "hostname").split()[-1] == "seeded-one"
    assert key.split()[1] in guest(live, "seeded", "cat /root/.ssh/authorized_keys")
    before = _vm(live, "seeded")["host"]
    with live.client() as c:
        r = c.post("/vms/seeded/migrate", json={})
        assert r.status_code == 202, r.text
        migration = r.json()["id"]
        done = wait_until(
            lambda: (m := c.get(f"/migrations/{migration}").json())["state"] in ("succeeded", "failed") and m,
            300,
            "the migration",
        )
    assert done["state"] == "succeeded", done
    assert _vm(live, "seeded")["host"] != before
    assert guest(live, "seeded", "cat /tmp/user-data-ran; hostname").split()[-2:] == ["from-user-data", "seeded-one"]
    assert "sr0" in guest(live, "seeded", "ls /dev")  # the CD-ROM came along (made again on the target)
