"""cloud-init seeds on sim hosts (controllers/seeds.py): a VM created with keys, user data or a hostname
runs with its seed as a read-only CD-ROM made on its host; the seed is made again (not copied) on a
migration's target, at the same path; a project's keys go into its new VMs' seeds; bad input is refused
naming the field, with nothing made."""

import subprocess

import pytest

from vmplane.core import cloudinit as CI
from vmplane.core.errors import Invalid
from vmplane.store import ledger as L
from vmplane.store import seeds as SS

from .conftest import add_basics, add_sim_hosts


@pytest.fixture
def o(orch):
    """Two sim hosts, the usual offerings, project a."""
    o = orch
    add_sim_hosts(o, 2)
    add_basics(o)
    o.catalog.create_project("a", 100, 1 << 20, 100, count_overhead=False)
    return o


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    out = []
    for name in ("one", "two"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name)], check=True)
        out.append((folder / f"{name}.pub").read_text().strip())
    return out


def _seed_disk(o, vm):
    host = o.vm(vm).host.name
    spec = o.drivers[host].fabric.spec(host, o.domain_name(vm))
    return host, [d for d in spec.disks if d.device == "cdrom"]


def test_a_vm_with_a_key_runs_with_its_seed_which_a_migration_makes_again_on_the_target(o, keys):
    o.create_vm(
        "web", "a", "small", "tiny", start=True, ssh_keys=[keys[0]], hostname="Web-1", user_data=b"#!/bin/sh\necho hi\n"
    )
    host, (seed,) = _seed_disk(o, "web")
    assert (seed.target, seed.readonly, seed.format) == ("sda", True, "raw")
    with o.db.read() as s:
        expected = SS.seed_of(s.connection(), o.vm("web").id)
    assert expected.hostname == "web-1" and expected.ssh_keys == (keys[0],)
    assert seed.volume == f"vmp-seed-web-{CI.seed_id(expected)}.iso"
    assert o.drivers[host].domain_disks(o.domain_name("web")) == {}  # a CD-ROM is no volume
    other = "h2" if host == "h1" else "h1"
    o.migrator.migrate("web", other)
    _host, (moved,) = _seed_disk(o, "web")
    assert _host == other and moved.path == seed.path  # the same path, made there
    assert o.drivers[other].volume("vmplane-images", seed.volume) is not None
    assert o.audit() == []


def test_a_vm_without_keys_user_data_or_hostname_has_no_seed(o):
    o.create_vm("plain", "a", "small", "tiny", start=True)
    assert _seed_disk(o, "plain")[1] == []


def test_a_projects_keys_go_into_its_new_vms_unless_asked_not_to(o, keys):
    with o.db.transaction() as conn:
        SS.add_project_key(conn, L.lock_project(conn, name="a").id, "ops", keys[1])
    o.create_vm("with", "a", "small", "tiny", ssh_keys=[keys[0]])
    o.create_vm("without", "a", "small", "tiny", project_keys=False)
    assert o.vm("with").ssh_keys == [keys[0], keys[1]]
    assert o.vm("without").ssh_keys is None


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"ssh_keys": ["ssh-ed25519 not-base64!"]}, "ssh_keys"),
        ({"hostname": "-bad-"}, "hostname"),
        ({"user_data": b"#cloud-config\n: : :\n"}, "user_data"),
        ({"user_data": b"#!/bin/sh\n" + b"x" * (CI.USER_DATA_MAX + 1)}, "user_data"),
    ],
)
def test_bad_seed_input_is_refused_naming_the_field_and_nothing_is_made(o, kw, field):
    with pytest.raises(Invalid) as refused:
        o.create_vm("web", "a", "small", "tiny", start=True, **kw)
    assert refused.value.field == field
    assert o.vms() == []


def test_an_ha_restart_elsewhere_makes_the_seed_again_on_its_new_host(db, keys):
    from .test_ha_sim import close_ha_plane, fail, ha_plane, recovery, wait_for

    o = ha_plane(db)
    try:
        for other in ("h2", "h3"):
            o.set_host_state(other, "disabled")
        o.create_vm("keep", "p", "one", "t", start=True, ha_policy="restart", ssh_keys=[keys[0]])
        wait_for(lambda: o.vm("keep").state == "running", 60, "keep to run")
        for other in ("h2", "h3"):
            o.set_host_state(other, "enabled")
        _host, (seed,) = _seed_disk(o, "keep")
        fail(o, "h1", "power")
        o.ha.check()
        wait_for(lambda: recovery(o, "h1").state == "succeeded", 60, "the recovery")
        host, (again,) = _seed_disk(o, "keep")
        assert host in ("h2", "h3") and again.path == seed.path
        assert o.drivers[host].volume("vmplane-images", seed.volume) is not None
    finally:
        close_ha_plane(o)
