"""Small promises of the API an operator meets early: house wording for names, docs without a CDN."""


def test_a_name_too_long_is_refused_in_the_house_words(api):
    r = api.post("/api/v1/projects", json={"name": "p" * 64, "vcpus": 1, "memory_mib": 1024})
    body = r.json()
    assert r.status_code == 422 and body["field"] == "name"
    assert "1-63 lowercase letters" in body["message"] and "String should" not in body["message"]


def test_the_docs_page_needs_no_cdn(api):
    page = api.get("/docs")
    assert page.status_code == 200 and "cdn." not in page.text
    script = next(part.split('"')[0] for part in page.text.split('src="')[1:] if "swagger-ui-bundle" in part)
    assert api.get(script).status_code == 200


def test_metrics_count_migrations_scales_and_drains(orch, api):
    from vmplane.core.model import Offering, OfferingKind

    from .conftest import add_sim_hosts

    def counted(text: str, prefix: str) -> float:
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))

    add_sim_hosts(orch, 3)
    orch.catalog.create_offering(
        Offering(
            "dyn",
            OfferingKind.custom_constrained,
            min_vcpus=1,
            max_vcpus=4,
            min_memory_mib=256,
            max_memory_mib=8192,
            dynamic_scaling=True,
        )
    )
    orch.catalog.create_template("dt", "tiny-linux", dynamic_scaling=True)
    api.put("/api/v1/settings/enable.dynamic.scale.vm", json={"value": True, "scope": "zone", "scope_name": "z1"})
    orch.catalog.create_project("p", 64, 65536, 10)
    before = api.get("/metrics").text
    orch.create_vm("m1", "p", "dyn", "dt", vcpus=1, memory_mib=1024, start=True)
    assert api.post("/api/v1/vms/m1/migrate", json={}).status_code == 202
    assert api.post("/api/v1/vms/m1/scale", json={"vcpus": 2, "memory_mib": 1024}).status_code == 202
    host = api.get("/api/v1/vms/m1").json()["host"]
    assert api.post(f"/api/v1/hosts/{host}/maintenance", json={"action": "enter"}).status_code == 200
    after = api.get("/metrics").text
    for series in (
        'vmplane_migrations_total{result="succeeded"}',
        'vmplane_operations_total{kind="scale",state="succeeded"}',
        'vmplane_operations_total{kind="drain",state="succeeded"}',
    ):
        assert counted(after, series) > counted(before, series), series
