"""`vm reboot` on simulated hosts (issue 33, from the newcomer audit): the guest asked, or reset with force; the
VM keeps running and the request is an event of it; a stopped VM or a host that does not answer is refused
(409 naming why), nothing changed."""

from __future__ import annotations

import pytest

from .conftest import add_basics, add_sim_hosts

V = "/api/v1/vms"


@pytest.fixture
def cluster(orch, api):
    add_sim_hosts(orch, 2)
    add_basics(orch)
    orch.catalog.create_project("p", 8, 16384, 10)
    orch.create_vm("web", "p", "small", "tiny", start=True)
    orch.create_vm("off", "p", "small", "tiny")
    return orch


def test_a_reboot_asks_the_guest_or_resets_it_and_the_vm_keeps_running(cluster, api):
    o = cluster
    host = o.vm("web").host.name
    r = api.post(f"{V}/web/reboot")
    assert r.status_code == 200 and r.json() == {"vm": "web", "host": host, "how": "asked through its guest agent"}
    r = api.post(f"{V}/web/reboot", json={"force": True})
    assert r.status_code == 200 and r.json()["how"] == "reset (forced)"
    assert o.vm("web").state == "running" and o.drivers[host].domain("vmplane-web").running
    messages = [e["message"] for e in api.get("/api/v1/events", params={"vm": "web"}).json()]
    assert "reboot: reset (forced)" in messages and "reboot: asked through its guest agent" in messages
    assert o.audit() == []


def test_a_stopped_vm_or_a_host_that_does_not_answer_is_refused_naming_why(cluster, api):
    o = cluster
    r = api.post(f"{V}/off/reboot")
    assert (r.status_code, r.json()["field"]) == (409, "state") and "only a running VM" in r.text
    host = o.vm("web").host.name
    o.drivers[host].fabric.fail_host(host, "network", 60)
    r = api.post(f"{V}/web/reboot")
    assert (r.status_code, r.json()["field"]) == (409, "vm") and "was not rebooted" in r.text, r.text
    assert o.vm("web").state == "running"
    r = api.post(f"{V}/web/reboot", json={"force": "yes please"})
    assert (r.status_code, r.json()["field"]) == (422, "force")
