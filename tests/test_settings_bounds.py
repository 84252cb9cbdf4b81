"""Settings are typed and bounded: a refused value is a 422 naming the key, the value and the range, and
nothing is saved; `setting unset` goes back to the inherited value; a lower factor warns of hosts over capacity."""

import pytest
from typer.testing import CliRunner

from vmplane.core.settings import KEYS

from .conftest import ADMIN_TOKEN, add_basics, add_sim_hosts

BAD = [
    ("cpu.overprovisioning.factor", "inf"),
    ("cpu.overprovisioning.factor", "nan"),
    ("cpu.overprovisioning.factor", "1e308"),
    ("cpu.overprovisioning.factor", 1e308),
    ("cpu.overprovisioning.factor", 0),
    ("cpu.overprovisioning.factor", "-1"),
    ("cpu.overprovisioning.factor", 101),
    ("mem.overprovisioning.factor", "1e308"),
    ("mem.overprovisioning.factor", "default"),
    ("vmplane.overhead.ratio", "inf"),
    ("vmplane.overhead.ratio", 0.4),
    ("vmplane.overhead.ratio", 11),
    ("vmplane.migration.max.per.cluster", -1),
    ("vmplane.migration.max.per.cluster", "abc"),
    ("vmplane.migration.max.per.cluster", 1001),
    ("vmplane.migration.max.per.cluster", 2.5),
    ("vmplane.migration.max.outbound.per.host", 0),
    ("vmplane.vm.shutdown.timeout", -1),
    ("vmplane.host.check.interval", "inf"),
    ("vmplane.host.check.interval", 0),
    ("kvm.cpu.dynamic.scaling.capacity", -2),
    ("kvm.memory.dynamic.scaling.capacity", 2**31),
    ("enable.dynamic.scale.vm", "maybe"),
    ("enable.dynamic.scale.vm", 1),
    ("vmplane.placement.strategy", True),
]


def _stored(api):
    return {s["key"]: s["values"] for s in api.get("/api/v1/settings").json()}


@pytest.mark.parametrize("key,value", BAD)
def test_a_bad_value_is_422_naming_key_value_and_range_and_nothing_is_saved(api, key, value):
    scope = "zone" if KEYS[key].narrowest_scope == "zone" else "global"
    body = {"value": value, "scope": scope, "scope_name": "z1" if scope == "zone" else None}
    before = _stored(api)
    r = api.put(f"/api/v1/settings/{key}", json=body)
    assert r.status_code == 422, r.text
    error = r.json()
    assert error["error"] == "invalid" and error["field"] == "value"
    assert key in error["message"] and KEYS[key].range in error["message"]
    assert "literal" not in error["message"] and "convert" not in error["message"]
    assert _stored(api) == before


def test_non_finite_json_numbers_are_refused(api):
    for raw in ("Infinity", "NaN", "-Infinity", "1e400"):
        r = api.put(
            "/api/v1/settings/cpu.overprovisioning.factor",
            content=f'{{"value": {raw}}}',
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 422 and r.json()["field"] == "value", (raw, r.text)
    assert _stored(api)["cpu.overprovisioning.factor"] == []


def test_messages_people_can_act_on(api):
    r = api.put("/api/v1/settings/vmplane.migration.max.per.cluster", json={"value": "abc"})
    assert "must be an integer" in r.json()["message"]
    r = api.put("/api/v1/settings/cpu.overprovisioning.factor", json={"value": "default"})
    assert "must be a number" in r.json()["message"]
    r = api.put("/api/v1/settings/cpu.overprovisioning.factor", json={"value": "inf"})
    assert "finite" in r.json()["message"] and "(0, 100]" in r.json()["message"]


def test_json_numbers_booleans_and_strings_are_accepted_and_listed_typed(api):
    assert api.put("/api/v1/settings/cpu.overprovisioning.factor", json={"value": 2}).json()["value"] == 2.0
    assert api.put("/api/v1/settings/vmplane.migration.max.per.cluster", json={"value": "7"}).json()["value"] == 7
    r = api.put("/api/v1/settings/enable.dynamic.scale.vm", json={"value": True, "scope": "zone", "scope_name": "z1"})
    assert r.json()["value"] is True
    assert (
        api.put(
            "/api/v1/settings/kvm.cpu.dynamic.scaling.capacity",
            json={"value": -1, "scope": "cluster", "scope_name": "c1"},
        ).json()["value"]
        == -1
    )
    listed = {s["key"]: s for s in api.get("/api/v1/settings").json()}
    assert listed["cpu.overprovisioning.factor"]["values"] == [{"scope": "global", "scope_name": None, "value": 2.0}]
    assert listed["enable.dynamic.scale.vm"]["values"][0]["value"] is True
    assert listed["vmplane.migration.max.per.cluster"]["values"][0]["value"] == 7
    assert listed["cpu.overprovisioning.factor"]["range"] == "(0, 100]"


def test_a_value_stored_before_the_checks_is_ignored_not_a_500(orch, api):
    from vmplane.store.schema import Setting

    with orch.db.write() as s:
        s.add(Setting(key="cpu.overprovisioning.factor", scope="global", scope_name="", value="inf"))
    orch.catalog._settings_changed()
    assert api.get("/api/v1/settings/cpu.overprovisioning.factor").json()["value"] == 1.0
    assert api.get("/api/v1/settings").status_code == 200


def test_unset_goes_back_to_the_inherited_value_and_unsetting_twice_is_409(api):
    url = "/api/v1/settings/mem.overprovisioning.factor"
    api.put(url, json={"value": 1.2})
    api.put(url, json={"value": 1.5, "scope": "cluster", "scope_name": "c1"})
    r = api.delete(url, params={"scope": "cluster", "scope_name": "c1"})
    assert r.status_code == 200 and r.json()["value"] == 1.2 and r.json()["source"] == "global"
    r = api.delete(url, params={"scope": "cluster", "scope_name": "c1"})
    assert r.status_code == 409 and r.json()["error"] == "conflict" and "not set at cluster c1" in r.json()["message"]
    assert api.delete(url).json()["value"] == 1.0
    assert api.delete("/api/v1/settings/no.such.key").status_code == 404
    assert api.delete(url, params={"scope": "cluster", "scope_name": "nope"}).status_code == 404


def test_a_lower_factor_is_kept_but_names_the_hosts_now_over_capacity(orch, api):
    add_sim_hosts(orch, 2, cores=4, memory_mib=4096)
    add_basics(orch)
    orch.catalog.create_project("p", 64, 65536, 20)
    api.put("/api/v1/settings/mem.overprovisioning.factor", json={"value": 2, "scope": "cluster", "scope_name": "c1"})
    for i in range(3):
        orch.create_vm(f"v{i}", "p", "any", "tiny", vcpus=1, memory_mib=2048, start=True)
    r = api.put(
        "/api/v1/settings/mem.overprovisioning.factor", json={"value": 1.0, "scope": "cluster", "scope_name": "c1"}
    )
    assert r.status_code == 200 and r.json()["value"] == 1.0
    warnings = r.json()["warnings"]
    assert warnings and all("MiB allocated, capacity now 4096 MiB" in w for w in warnings)
    assert {w.split(":")[0] for w in warnings} <= {"h1", "h2"}
    ok = api.put("/api/v1/settings/cpu.overprovisioning.factor", json={"value": 1.0})
    assert ok.json()["warnings"] == []


@pytest.fixture
def cli(api, monkeypatch):
    """The CLI against the in-process API (its HTTP client is pointed at the TestClient's app)."""
    import httpx

    from vmplane.cli import app

    real_init = httpx.Client.__init__

    def init(self, *args, **kwargs):
        kwargs.pop("transport", None)
        real_init(self, *args, transport=api._transport, **kwargs)

    monkeypatch.setattr(httpx.Client, "__init__", init)
    runner = CliRunner()
    env = {"VMPLANE_API": "http://testserver", "VMPLANE_TOKEN": ADMIN_TOKEN}
    return lambda *args: runner.invoke(app, list(args), env=env)


def test_cli_accepts_negative_values_and_unsets(cli, api):
    r = cli("setting", "set", "kvm.cpu.dynamic.scaling.capacity", "-1", "--cluster", "c1", "-o", "json")
    assert r.exit_code == 0, r.output
    assert (
        api.get(
            "/api/v1/settings/kvm.cpu.dynamic.scaling.capacity", params={"scope": "cluster", "scope_name": "c1"}
        ).json()["value"]
        == -1
    )
    r = cli("setting", "set", "vmplane.migration.max.per.cluster", "-1", "-o", "json")
    assert r.exit_code == 1 and "1..1000" in r.output
    r = cli("setting", "unset", "kvm.cpu.dynamic.scaling.capacity", "--cluster", "c1", "-o", "json")
    assert r.exit_code == 0, r.output
    r = cli("setting", "unset", "kvm.cpu.dynamic.scaling.capacity", "--cluster", "c1", "-o", "json")
    assert r.exit_code == 1 and "conflict" in r.output


def test_cli_prints_the_over_capacity_warning(orch, cli):
    add_sim_hosts(orch, 1, cores=2, memory_mib=4096)
    add_basics(orch)
    orch.catalog.create_project("p", 64, 65536, 20)
    orch.catalog.set_setting("cpu.overprovisioning.factor", 4.0, "cluster", "c1")
    orch.create_vm("v", "p", "any", "tiny", vcpus=6, memory_mib=512, start=True)
    r = cli("setting", "set", "cpu.overprovisioning.factor", "1", "--cluster", "c1")
    assert r.exit_code == 0 and "h1: 6 vCPUs allocated, capacity now 2 vCPUs" in r.output, r.output
