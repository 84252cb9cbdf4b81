"""Every admin object can be deleted once nothing uses it (409 `conflict` naming what does until then);
offerings and templates in use can be retired (no new VMs)."""

import pytest

from vmplane.core.model import Offering, OfferingKind

from .conftest import add_basics, add_sim_hosts

V = "/api/v1"


@pytest.fixture
def world(orch, api):
    add_sim_hosts(orch, 2)
    add_basics(orch)
    orch.catalog.create_project("p", 16, 65536, 20)
    return orch, api


def refused(r, *words):
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["error"] == "conflict" and all(w in body["message"] for w in words), body
    return body


def test_a_project_with_vms_or_tokens_is_kept_and_named(world):
    orch, api = world
    for i in range(7):
        orch.create_vm(f"v{i}", "p", "small", "tiny")
    refused(api.delete(f"{V}/projects/p"), "7 VMs", "v0", "v4", "...")
    for i in range(7):
        orch.delete_vm(f"v{i}")
    api.post(f"{V}/tokens", json={"name": "dev", "role": "member", "project": "p"})
    refused(api.delete(f"{V}/projects/p"), "1 token (dev)")
    assert api.delete(f"{V}/tokens/dev").status_code == 204
    assert api.delete(f"{V}/projects/p").status_code == 204
    assert api.get(f"{V}/projects/p").status_code == 404
    assert api.delete(f"{V}/projects/p").status_code == 404


def test_offering_and_template_in_use_are_kept_then_deleted(world):
    orch, api = world
    orch.create_vm("a", "p", "small", "tiny")
    refused(api.delete(f"{V}/offerings/small"), "offering small", "1 VM (a)")
    refused(api.delete(f"{V}/templates/tiny"), "template tiny", "1 VM (a)")
    assert api.delete(f"{V}/offerings/large").status_code == 204
    orch.delete_vm("a")
    assert api.delete(f"{V}/offerings/small").status_code == 204
    assert api.delete(f"{V}/templates/tiny").status_code == 204
    assert {o["name"] for o in api.get(f"{V}/offerings").json()} == {"ranged", "any"}
    # the catalog's cache forgot them: a new VM from them is a 404, not a VM on a deleted row
    r = api.post(f"{V}/vms", json={"name": "b", "project": "p", "offering": "small", "template": "tiny"})
    assert r.status_code == 404 and r.json()["field"] == "offering"


def test_a_deleted_offering_can_be_created_again(world):
    orch, api = world
    orch.create_vm("a", "p", "small", "tiny")  # caches small
    orch.delete_vm("a")
    api.delete(f"{V}/offerings/small")
    orch.catalog.create_offering(Offering("small", OfferingKind.fixed, vcpus=2, memory_mib=2048))
    orch.create_vm("b", "p", "small", "tiny")
    assert api.get(f"{V}/vms/b").json()["vcpus"] == 2


def test_retired_offering_and_template_refuse_new_vms_only(world):
    orch, api = world
    orch.create_vm("old", "p", "small", "tiny")
    r = api.post(f"{V}/offerings/small/retire")
    assert r.status_code == 200 and r.json()["retired"] is True
    assert {o["name"]: o["retired"] for o in api.get(f"{V}/offerings").json()}["small"] is True
    r = api.post(f"{V}/vms", json={"name": "new", "project": "p", "offering": "small", "template": "tiny"})
    refused(r, "offering small is retired")
    refused(api.post(f"{V}/offerings/small/retire"), "already retired")
    assert api.post(f"{V}/vms/old/start").status_code == 202  # the VM that uses it keeps it
    assert api.post(f"{V}/templates/tiny/retire").json()["retired"] is True
    assert api.get(f"{V}/templates/tiny").json() == {
        "name": "tiny",
        "image": "tiny-linux",
        "dynamic_scaling": False,
        "retired": True,
        "disk_image": None,
        "disk_format": None,
        "disk_mib": None,
        "checksum": None,
    }
    refused(
        api.post(f"{V}/vms", json={"name": "new", "project": "p", "offering": "large", "template": "tiny"}),
        "template tiny is retired",
    )
    assert api.get(f"{V}/vms/new").status_code == 404
    assert api.post(f"{V}/offerings/nope/retire").status_code == 404


def test_retiring_in_another_process_is_seen_at_once(world, db):
    from vmplane.orchestrator import InlineExecutor, Orchestrator

    orch, api = world
    orch.create_vm("warm", "p", "small", "tiny")  # this process caches small and tiny
    other = Orchestrator(db, InlineExecutor(), name="other")
    other.load()
    try:
        other.catalog.retire(type(other.catalog.offering("small")), "small")
    finally:
        other.close()
    refused(
        api.post(f"{V}/vms", json={"name": "new", "project": "p", "offering": "small", "template": "tiny"}), "retired"
    )


def test_zone_and_cluster_are_kept_while_they_hold_something_and_take_their_settings(world):
    _orch, api = world
    api.post(f"{V}/zones", json={"name": "z2"})
    api.post(f"{V}/clusters", json={"name": "c2", "zone": "z2"})
    api.post(f"{V}/hosts", json={"name": "x1", "cluster": "c2", "cores": 4, "cpu_mhz": 2000, "memory_mib": 4096})
    api.put(f"{V}/settings/cpu.overprovisioning.factor", json={"value": 3, "scope": "cluster", "scope_name": "c2"})
    api.put(f"{V}/settings/enable.dynamic.scale.vm", json={"value": True, "scope": "zone", "scope_name": "z2"})
    refused(api.delete(f"{V}/zones/z2"), "zone z2", "1 cluster (c2)")
    refused(api.delete(f"{V}/clusters/c2"), "cluster c2", "1 host (x1)")
    assert api.delete(f"{V}/hosts/x1").status_code == 204
    assert api.delete(f"{V}/clusters/c2").status_code == 204
    assert api.delete(f"{V}/zones/z2").status_code == 204
    listed = {s["key"]: s["values"] for s in api.get(f"{V}/settings").json()}
    assert listed["cpu.overprovisioning.factor"] == [] and listed["enable.dynamic.scale.vm"] == []
    # a new zone or cluster of the same name starts with no settings
    api.post(f"{V}/zones", json={"name": "z2"})
    api.post(f"{V}/clusters", json={"name": "c2", "zone": "z2"})
    got = api.get(f"{V}/settings/cpu.overprovisioning.factor", params={"scope": "cluster", "scope_name": "c2"})
    assert got.json()["value"] == 1.0 and got.json()["source"] == "default"


def test_a_host_holding_anything_is_kept_and_an_empty_one_leaves_driver_and_index(world):
    orch, api = world
    orch.create_vm("a", "p", "small", "tiny", start=True)
    host = orch.vm("a").host.name
    other = ({"h1", "h2"} - {host}).pop()
    refused(api.delete(f"{V}/hosts/{host}"), f"host {host}", "1 VM (a)")
    assert orch.migrator.migrate("a", to=other)["state"] == "succeeded"  # inline: done at once
    refused(api.delete(f"{V}/hosts/{other}"), "1 VM (a)")
    assert api.delete(f"{V}/hosts/{host}").status_code == 204  # its finished migration goes too
    assert api.post(f"{V}/vms/a/stop", json={"force": True}).status_code == 202
    assert api.delete(f"{V}/hosts/{other}").status_code == 204
    assert "h1" not in orch.index and "h2" not in orch.index and not orch.drivers
    assert api.get(f"{V}/hosts").json() == []
    assert api.get(f"{V}/hosts/h1").status_code == 404
    # the name can be used again, and placement sees the new host
    api.post(f"{V}/hosts", json={"name": "h1", "cluster": "c1", "cores": 4, "cpu_mhz": 2000, "memory_mib": 8192})
    assert api.post(f"{V}/vms/a/start").status_code == 202
    assert orch.vm("a").host.name == "h1"


def test_a_host_with_an_active_migration_is_kept(world):
    orch, api = world
    orch.create_vm("a", "p", "small", "tiny", start=True)
    with orch.db.write() as s:  # a migration in flight towards the other host
        from sqlalchemy import select

        from vmplane.store.schema import Host, Migration, Vm

        vm = s.scalars(select(Vm).where(Vm.name == "a")).unique().one()
        target = s.scalars(select(Host).where(Host.id != vm.host_id)).unique().first()
        s.add(
            Migration(
                id="m-1",
                vm_id=vm.id,
                vm_name="a",
                project_id=vm.project_id,
                source_host_id=vm.host_id,
                target_host_id=target.id,
                source=vm.host.name,
                target=target.name,
                cluster="c1",
                state="copying",
            )
        )
        name = target.name
    refused(api.delete(f"{V}/hosts/{name}"), "1 active migration of VM (a)")


from .test_settings_bounds import cli  # noqa: E402, F401  (the CLI against the in-process API)


def test_cli_lifecycle_commands(world, cli):  # noqa: F811
    orch, api = world
    assert cli("offering", "retire", "small", "-o", "json").exit_code == 0
    r = cli("offering", "delete", "large")
    assert r.exit_code == 0 and "offering large deleted" in r.output
    assert cli("template", "create", "t2", "--image", "tiny-linux", "--dynamic-scaling", "-o", "json").exit_code == 0
    assert api.get(f"{V}/templates/t2").json()["dynamic_scaling"] is True
    assert cli("token", "create", "dev", "--project", "p", "-o", "json").exit_code == 0
    r = cli("token", "list", "-o", "json")
    assert r.exit_code == 0 and '"dev"' in r.output and "token_hash" not in r.output
    r = cli("project", "delete", "p")
    assert r.exit_code == 1 and "1 token (dev)" in r.output
    assert cli("token", "revoke", "dev").exit_code == 0
    assert cli("project", "delete", "p").exit_code == 0
    assert cli("host", "delete", "h2").exit_code == 0 and "h2" not in orch.index
    assert cli("cluster", "delete", "c1").exit_code == 1
    r = cli("setting", "set", "cpu.overprovisioning.factor", "inf")
    assert r.exit_code == 1 and "finite" in r.output


def test_an_offering_another_process_retired_or_made_again_is_read_from_the_store(world):
    """This process's cache of offerings is not the truth: another control-plane process (here a second
    catalog on the same store) may retire an offering, or delete it and make a new one under its name;
    a new VM is checked against the store in its own admission."""
    from vmplane.store import lifecycle
    from vmplane.store.catalog import Catalog

    orch, api = world
    other = Catalog(orch.db)
    orch.create_vm("a", "p", "small", "tiny")  # this process caches small (1 vCPU)
    orch.delete_vm("a")
    other.retire(type(orch.catalog.offering("small")), "small")
    r = api.post(f"{V}/vms", json={"name": "b", "project": "p", "offering": "small", "template": "tiny"})
    refused(r, "offering small is retired")
    lifecycle.delete_offering(other, "small")
    other.create_offering(Offering("small", OfferingKind.fixed, vcpus=2, memory_mib=2048))
    assert orch.create_vm("b", "p", "small", "tiny", start=True).operation_id
    assert api.get(f"{V}/vms/b").json()["vcpus"] == 2
    orch.catalog.offering("large")  # cached here, deleted there
    lifecycle.delete_offering(other, "large")
    r = api.post(f"{V}/vms", json={"name": "c", "project": "p", "offering": "large", "template": "tiny"})
    assert r.status_code == 404 and r.json()["field"] == "offering", r.text
    # made again under its name with the same id (SQLite reuses the highest rowid after a delete): the
    # cached one is another offering; the new VM gets the store's
    other.create_offering(Offering("newest", OfferingKind.fixed, vcpus=1, memory_mib=1024))
    cached = orch.catalog.offering("newest")
    lifecycle.delete_offering(other, "newest")
    remade = other.create_offering(Offering("newest", OfferingKind.fixed, vcpus=3, memory_mib=3072))
    assert orch.catalog.offering("newest") is cached and (remade.id == cached.id or not orch.db.is_sqlite)
    orch.create_vm("d", "p", "newest", "tiny")
    assert api.get(f"{V}/vms/d").json()["vcpus"] == 3
    assert orch.audit() == []


def test_a_create_whose_offering_keeps_changing_gives_up_with_409_after_a_few_reads(world, monkeypatch):
    """Each admission that finds its offering changed reads it again; one that keeps finding it so (another
    process remaking it each time) ends with a 409 naming the field, nothing created, not a loop."""
    from vmplane.controllers.vms import OUTDATED_TRIES
    from vmplane.store.catalog import Outdated

    orch, api = world
    checks = []

    def always_changed(conn, o, t):
        checks.append(o.name)
        raise Outdated(f"offering {o.name} changed")

    monkeypatch.setattr(orch.catalog, "check_new_vm", always_changed)
    r = api.post(f"{V}/vms", json={"name": "z", "project": "p", "offering": "small", "template": "tiny"})
    assert refused(r, f"changed {OUTDATED_TRIES} times", "nothing was created")["field"] == "offering"
    assert checks == ["small"] * OUTDATED_TRIES
    monkeypatch.undo()
    assert api.get(f"{V}/vms/z").status_code == 404 and orch.audit() == []
