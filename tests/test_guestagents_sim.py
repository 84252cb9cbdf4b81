"""The guest agent controller on sim hosts (controllers/guestagents.py): a running VM's agent state and
its guest's addresses reach `vm show` and `vm list`; a silenced agent is `none` with no addresses; a
stopped VM shows nothing; an address the guest holds that the record does not is drift in the audit."""

import time

import pytest
from fastapi.testclient import TestClient

from vmplane.api.views import vm_body
from vmplane.server import create_app
from vmplane.store import ledger as L
from vmplane.store import networks as NW

from .conftest import ADMIN_TOKEN, add_basics, add_sim_hosts


@pytest.fixture
def o(orch):
    """Two sim hosts, the usual offerings, project a."""
    o = orch
    add_sim_hosts(o, 2)
    add_basics(o)
    o.catalog.create_project("a", 100, 1 << 20, 100, count_overhead=False)
    with o.db.transaction() as conn:
        zone_id = next(z.id for z in o.catalog.zones() if z.name == "z1")
        NW.create_network(
            conn, "a-net", "isolated", zone_id, "10.10.0.0/24", project_id=L.lock_project(conn, name="a").id
        )
    return o


def _check(o, vm):
    o.guest_agents.check_host(o.vm(vm).host.name, force=True)
    return vm_body(o.db, vm)


def test_a_running_vms_agent_and_addresses_are_shown_beside_the_recorded_ones(o):
    o.create_vm("web", "a", "small", "tiny", start=True, networks=[("a-net", None)])
    body = vm_body(o.db, "web")
    assert (body["agent"], body["guest_addresses"]) == (None, None)  # not asked yet
    body = _check(o, "web")
    assert body["agent"] == "connected"
    assert body["guest_addresses"] == ["eth0 10.10.0.2/24"] and body["nics"][0]["ip"] == "10.10.0.2"
    listed = {v["name"]: v for v in o_list(o)}
    assert (listed["web"]["agent"], listed["web"]["guest_addresses"]) == ("connected", ["eth0 10.10.0.2/24"])


def o_list(o):
    o.catalog.ensure_admin_token("admin", ADMIN_TOKEN)
    with TestClient(create_app(o), headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as client:
        r = client.get("/api/v1/vms")
    assert r.status_code == 200, r.text
    return r.json()


def test_a_silent_agent_is_none_without_addresses_and_a_stopped_vm_shows_nothing(o):
    o.create_vm("web", "a", "small", "tiny", start=True)
    assert _check(o, "web")["agent"] == "connected"
    host = o.vm("web").host.name
    o.drivers[host].fabric.silence_agent(o.domain_name("web"))
    body = _check(o, "web")
    assert (body["agent"], body["guest_addresses"]) == ("none", None)
    o.stop_vm("web")
    body = vm_body(o.db, "web")
    assert (body["state"], body["agent"], body["guest_addresses"]) == ("stopped", None, None)


def test_an_address_the_guest_set_by_hand_is_drift_in_the_audit(o, monkeypatch):
    o.create_vm("web", "a", "small", "tiny", start=True, networks=[("a-net", None)])
    host = o.vm("web").host.name
    _check(o, "web")
    assert not [p for p in o.audit() if "guest" in p]
    driver = o.drivers[host]
    real = driver.agent_interfaces

    def by_hand(name, timeout_s=5.0):  # the guest's own `ip addr add`: its agent reports it
        return [i._replace(addresses=i.addresses + ["10.10.0.99/24"]) if i.name == "eth0" else i
                for i in real(name, timeout_s)]  # fmt: skip

    monkeypatch.setattr(driver, "agent_interfaces", by_hand)
    assert "eth0 10.10.0.99/24" in _check(o, "web")["guest_addresses"]
    mac = vm_body(o.db, "web")["nics"][0]["mac"]
    assert f"vm web: NIC {mac}: the guest's eth0 also holds 10.10.0.99, not recorded" in o.audit()


def test_a_pass_asks_the_most_overdue_first_and_no_more_than_its_budget(o, monkeypatch):
    from vmplane.controllers import guestagents

    monkeypatch.setattr(guestagents, "ASKS_PER_PASS", 1)
    for name in ("a1", "a2"):
        o.create_vm(name, "a", "small", "tiny", start=True)
    o.guest_agents.reconcile()
    shown = [vm_body(o.db, n)["agent"] for n in ("a1", "a2")]
    assert sorted(shown, key=str) == [None, "connected"]  # one asked this pass (a budget of one)
    o.guest_agents.reconcile()
    assert [vm_body(o.db, n)["agent"] for n in ("a1", "a2")] == ["connected", "connected"]


def test_a_nic_plugged_since_the_last_answer_is_asked_for_at_once(o):
    o.create_vm("web", "a", "small", "tiny", start=True)
    o.guest_agents.reconcile()
    assert vm_body(o.db, "web")["guest_addresses"] == []  # connected, no NIC
    o.nics.add("web", "a-net")
    time.sleep(1.0)  # (a second after its last ask: the pass's pace)
    o.guest_agents.reconcile()  # due in 30 s, but the record has a NIC the guest has not shown yet
    assert vm_body(o.db, "web")["guest_addresses"] == ["eth0 10.10.0.2/24"]
