"""Guest CPU models on sim hosts (issue 33, from the newcomer audit: every guest ran `qemu64`): a cluster's model
is the baseline of its hosts, recomputed as hosts join and leave, or a named model every host runs (else refused
naming the host); a VM gets its model at its start and keeps it while it runs; an offering's host-model or named
model reaches the domain; a live migration to a host that can not run the VM's model is refused before it starts."""

from __future__ import annotations

import pytest

from vmplane.core.model import HostState, Offering, OfferingKind

from .conftest import add_basics

C = "/api/v1/clusters"


def _create_on(o, host: str, *args) -> None:
    """A VM created and started on `host` (the cluster's other hosts disabled meanwhile)."""
    others = [h.name for h in o.hosts() if h.name != host]
    for name in others:
        o.host_admin.set_host_state(name, HostState.disabled)
    o.create_vm(*args, start=True)
    for name in others:
        o.host_admin.set_host_state(name, HostState.enabled)


def _spec(o, vm: str):
    host = o.vm(vm).host.name
    return o.drivers[host].fabric.spec(host, f"vmplane-{vm}")


@pytest.fixture
def mixed(orch, api):
    """Cluster c1 with a Haswell host (h1) and a Westmere host (h2), the basics, a project."""
    orch.add_host("h1", "c1", "sim", 16, 2400, 65536, cpu_model="Haswell")
    orch.add_host("h2", "c1", "sim", 16, 2400, 65536, cpu_model="Westmere")
    add_basics(orch)
    orch.catalog.create_project("p", 16, 65536, 20)
    return orch


def test_a_cluster_of_two_host_families_gets_the_older_familys_model_recomputed_as_hosts_join_and_leave(mixed, api):
    c = api.get(f"{C}/c1").json()
    assert (c["cpu_model"], c["cpu_baseline"], c["effective_cpu_model"]) == (None, "Westmere", "Westmere")
    assert api.get("/api/v1/hosts/h2").json()["cpu_model"] == "Westmere"
    mixed.add_host("h3", "c1", "sim", 16, 2400, 65536, cpu_model="Penryn")
    assert api.get(f"{C}/c1").json()["cpu_baseline"] == "Penryn"
    mixed.remove_host("h3")
    mixed.remove_host("h2")
    assert api.get(f"{C}/c1").json()["effective_cpu_model"] == "Haswell"  # only h1 (Haswell) left


def test_a_named_model_a_host_can_not_run_is_refused_naming_it_and_nothing_changes(mixed, api):
    r = api.patch(f"{C}/c1", json={"cpu_model": "Haswell"})
    assert (r.status_code, r.json()["field"]) == (409, "cpu_model"), r.text
    assert "host h2" in r.json()["message"] and "Haswell" in r.json()["message"]
    for bad, status in (("host-model", 422), ("no such!", 422)):
        r = api.patch(f"{C}/c1", json={"cpu_model": bad})
        assert (r.status_code, r.json()["field"]) == (status, "cpu_model"), r.text
    assert api.get(f"{C}/c1").json()["cpu_model"] is None
    r = api.patch(f"{C}/c1", json={"cpu_model": "Nehalem"})
    assert r.status_code == 200 and r.json()["effective_cpu_model"] == "Nehalem", r.text
    # a host joining that can not run the cluster's model is refused, naming the model
    r = api.post("/api/v1/hosts", json={"name": "h9", "cluster": "c1", "driver": "sim", "cores": 8, "cpu_mhz": 2000,
                                        "memory_mib": 8192, "cpu_model": "Conroe"})  # fmt: skip
    assert (r.status_code, r.json()["field"]) == (409, "cpu_model") and "Nehalem" in r.json()["message"], r.text
    assert api.get("/api/v1/hosts/h9").status_code == 404
    r = api.post(C, json={"name": "c2", "zone": "z1", "cpu_model": "Westmere"})
    assert r.status_code == 201 and r.json()["effective_cpu_model"] == "Westmere"


def test_a_started_vm_gets_the_clusters_model_and_keeps_it_while_it_runs(mixed, api):
    mixed.create_vm("web", "p", "small", "tiny", start=True)
    assert _spec(mixed, "web").cpu_model == "Westmere"
    assert mixed.vm("web").cpu_model == "Westmere"
    assert api.patch(f"{C}/c1", json={"cpu_model": "Nehalem"}).status_code == 200
    assert _spec(mixed, "web").cpu_model == "Westmere"  # running: its domain is left as it is
    mixed.stop_vm("web")
    mixed.start_vm("web")
    assert _spec(mixed, "web").cpu_model == "Nehalem" and mixed.vm("web").cpu_model == "Nehalem"
    assert api.patch(f"{C}/c1", json={"cpu_model": None}).json()["effective_cpu_model"] == "Westmere"


def test_an_offerings_host_model_reaches_the_domain_and_migration_to_another_cpu_is_refused(mixed, api):
    r = api.post("/api/v1/offerings", json={"name": "native", "kind": "fixed", "vcpus": 1, "memory_mib": 1024,
                                            "cpu_model": "host-model"})  # fmt: skip
    assert r.status_code == 201 and r.json()["cpu_model"] == "host-model", r.text
    assert api.get("/api/v1/offerings/native").json()["cpu_model"] == "host-model"
    assert api.get("/api/v1/offerings/small").json()["cpu_model"] is None
    bad = api.post("/api/v1/offerings", json={"name": "bad", "kind": "fixed", "vcpus": 1, "memory_mib": 1024,
                                              "cpu_model": "a b"})  # fmt: skip
    assert (bad.status_code, bad.json()["field"]) == (422, "cpu_model")
    _create_on(mixed, "h1", "fast", "p", "native", "tiny")
    assert _spec(mixed, "fast").cpu_model == "host-model"
    r = api.post("/api/v1/vms/fast/migrate", json={"to": "h2"})
    assert r.status_code == 409 and "host-model" in r.text and "h2" in r.text and "Haswell" in r.text, r.text
    assert mixed.vm("fast").host.name == "h1"


def test_a_vm_of_a_named_model_migrates_only_to_a_host_that_runs_it(mixed, api):
    mixed.catalog.create_offering(Offering("hw", OfferingKind.fixed, vcpus=1, memory_mib=1024, cpu_model="Haswell"))
    _create_on(mixed, "h1", "hw1", "p", "hw", "tiny")
    assert _spec(mixed, "hw1").cpu_model == "Haswell"
    r = api.post("/api/v1/vms/hw1/migrate", json={"to": "h2"})
    assert r.status_code == 409 and "h2 can not run CPU model Haswell" in r.text, r.text
    # a start on a host that can not run the offering's model is refused by the host, naming it
    _create_on(mixed, "h2", "hw2", "p", "hw", "tiny")
    assert mixed.vm("hw2").state != "running"
    ops = api.get("/api/v1/operations", params={"vm": "hw2"}).json()
    assert any("Haswell is not usable on this host" in (op.get("error") or op.get("message") or "") for op in ops), ops
