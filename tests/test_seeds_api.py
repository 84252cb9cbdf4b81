"""cloud-init seeds through the API and the CLI (sim hosts): a VM created with keys, user data and a
hostname; a project's keys; refusals naming the field with nothing made; members reach only their own."""

import subprocess

import pytest

from .conftest import add_basics, add_sim_hosts

API = "/api/v1"


@pytest.fixture
def cluster(orch, api):
    add_sim_hosts(orch, 1)
    add_basics(orch)
    for project in ("a", "b"):
        orch.catalog.create_project(project, 16, 65536, 20)
    member = api.post(f"{API}/tokens", json={"name": "m-a", "role": "member", "project": "a"}).json()["token"]
    return api, {"Authorization": f"Bearer {member}"}


@pytest.fixture(scope="module")
def key(tmp_path_factory):
    folder = tmp_path_factory.mktemp("key")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / "k")], check=True)
    return (folder / "k.pub").read_text().strip()


def _vm(name, **kw):
    return {"name": name, "project": "a", "offering": "small", "template": "tiny", **kw}


def test_a_vm_is_created_with_its_seed_and_a_projects_keys_join_it(cluster, orch, key):
    api, _member = cluster
    r = api.post(f"{API}/projects/a/keys", json={"name": "ops", "key": key + " ops@example"})
    assert r.status_code == 201, r.text
    assert [k["name"] for k in api.get(f"{API}/projects/a/keys").json()] == ["ops"]
    r = api.post(f"{API}/vms", json=_vm("web", hostname="web-1", user_data="#cloud-config\nruncmd: [touch /x]\n"))
    assert r.status_code == 201, r.text
    shown = api.get(f"{API}/vms/web").json()
    assert (shown["hostname"], shown["ssh_keys"]) == ("web-1", 1)
    vm = orch.vm("web")
    assert (vm.hostname, vm.ssh_keys, vm.user_data) == (
        "web-1",
        [key + " ops@example"],
        b"#cloud-config\nruncmd: [touch /x]\n",
    )
    r = api.post(f"{API}/vms", json=_vm("bare", project_keys=False))
    assert r.status_code == 201, r.text
    assert orch.vm("bare").ssh_keys is None
    assert api.delete(f"{API}/projects/a/keys/ops").status_code == 204
    assert api.get(f"{API}/projects/a/keys").json() == []


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"ssh_keys": ["ssh-rsa AAAA"]}, "ssh_keys"),
        ({"ssh_keys": ["-----BEGIN OPENSSH PRIVATE KEY-----"]}, "ssh_keys"),
        ({"hostname": "no_underscores"}, "hostname"),
        ({"user_data": "just text"}, "user_data"),
        ({"user_data": "#cloud-config\n- a list, not a mapping\n"}, "user_data"),
    ],
)
def test_bad_seed_input_is_a_4xx_naming_the_field_and_nothing_is_made(cluster, orch, extra, field):
    api, _member = cluster
    r = api.post(f"{API}/vms", json=_vm("web", **extra))
    assert r.status_code == 422 and r.json()["field"] == field, r.text
    assert orch.vms() == []


def test_project_keys_are_checked_and_a_member_reaches_only_its_own_projects(cluster, key):
    api, member = cluster
    r = api.post(f"{API}/projects/a/keys", json={"name": "k", "key": "ssh-ed25519 nope"})
    assert r.status_code == 422 and r.json()["field"] == "key"
    assert api.post(f"{API}/projects/a/keys", json={"name": "k", "key": key}, headers=member).status_code == 201
    r = api.post(f"{API}/projects/a/keys", json={"name": "k", "key": key})
    assert r.status_code == 409 and r.json()["field"] == "name"
    assert api.get(f"{API}/projects/b/keys", headers=member).status_code == 404
    assert api.delete(f"{API}/projects/a/keys/nope").status_code == 404
