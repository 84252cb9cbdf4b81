"""Tokens can be listed and revoked; a revoked token is refused at once by every process on the store."""

from fastapi.testclient import TestClient

from vmplane.orchestrator import InlineExecutor, Orchestrator
from vmplane.server import create_app

from .conftest import ADMIN_TOKEN

V = "/api/v1"


def bearer(token):
    return {"Authorization": f"Bearer {token}"}


def setup_tokens(api):
    for p in ("a", "b"):
        api.post(f"{V}/projects", json={"name": p, "vcpus": 1, "memory_mib": 1024})
    return {
        name: api.post(f"{V}/tokens", json={"name": name, "role": "member", "project": p}).json()["token"]
        for name, p in (("a1", "a"), ("a2", "a"), ("b1", "b"))
    }


def test_admin_lists_every_token_without_secrets_a_member_its_projects(api):
    secrets = setup_tokens(api)
    listed = api.get(f"{V}/tokens").json()
    assert [(t["name"], t["role"], t["project"]) for t in listed] == [
        ("a1", "member", "a"),
        ("a2", "member", "a"),
        ("admin", "admin", None),
        ("b1", "member", "b"),
    ]
    assert all(set(t) == {"name", "role", "project", "created_at"} for t in listed)
    assert all(t["created_at"].endswith(("+00:00", "Z")) for t in listed)
    text = api.get(f"{V}/tokens").text
    assert not any(s in text for s in secrets.values()) and ADMIN_TOKEN not in text
    mine = api.get(f"{V}/tokens", headers=bearer(secrets["a1"])).json()
    assert [t["name"] for t in mine] == ["a1", "a2"]


def test_a_member_revokes_only_its_projects_tokens(api):
    secrets = setup_tokens(api)
    r = api.delete(f"{V}/tokens/b1", headers=bearer(secrets["a1"]))
    assert r.status_code == 404 and r.json()["error"] == "not_found"
    assert api.delete(f"{V}/tokens/admin", headers=bearer(secrets["a1"])).status_code == 404
    assert api.get(f"{V}/projects/b", headers=bearer(secrets["b1"])).status_code == 200
    assert api.delete(f"{V}/tokens/a2", headers=bearer(secrets["a1"])).status_code == 204
    assert api.get(f"{V}/projects/a", headers=bearer(secrets["a2"])).status_code == 401
    assert api.delete(f"{V}/tokens/a1", headers=bearer(secrets["a1"])).status_code == 204  # itself
    assert api.get(f"{V}/projects/a", headers=bearer(secrets["a1"])).status_code == 401
    assert api.delete(f"{V}/tokens/b1").status_code == 204  # admin: any
    assert api.delete(f"{V}/tokens/b1").status_code == 404


def test_the_last_admin_token_is_kept(api):
    r = api.delete(f"{V}/tokens/admin")
    assert r.status_code == 409 and "last admin token" in r.json()["message"]
    other = api.post(f"{V}/tokens", json={"name": "admin2", "role": "admin"}).json()["token"]
    assert api.delete(f"{V}/tokens/admin").status_code == 204
    assert api.get(f"{V}/zones").status_code == 401
    assert api.get(f"{V}/zones", headers=bearer(other)).status_code == 200


def test_a_revoked_token_is_refused_at_once_by_another_process(orch, api, db):
    secrets = setup_tokens(api)
    other = Orchestrator(db, InlineExecutor(), name="other")  # a second control plane on the same SQLite file
    other.load()
    try:
        with TestClient(create_app(other)) as second:
            assert second.get(f"{V}/projects/a", headers=bearer(secrets["a1"])).status_code == 200  # seen once
            assert api.delete(f"{V}/tokens/a1").status_code == 204  # here
            r = second.get(f"{V}/projects/a", headers=bearer(secrets["a1"]))
            assert r.status_code == 401 and r.json()["error"] == "unauthorized"
            assert second.get(f"{V}/projects/a", headers=bearer(secrets["a2"])).status_code == 200
    finally:
        other.close()


def test_an_admin_token_of_a_project_is_refused(api):
    api.post(f"{V}/projects", json={"name": "acme", "vcpus": 1, "memory_mib": 1024})
    r = api.post(f"{V}/tokens", json={"name": "z", "role": "admin", "project": "acme"})
    assert r.status_code == 422 and r.json()["field"] == "project"
    assert "z" not in {t["name"] for t in api.get(f"{V}/tokens").json()}


def test_max_concurrent_migrations_zero_is_unlimited_in_create_and_quota(api):
    p = api.post(f"{V}/projects", json={"name": "p", "vcpus": 1, "memory_mib": 1, "max_concurrent_migrations": 0})
    assert p.status_code == 201 and p.json()["max_concurrent_migrations"] is None
    q = api.patch(f"{V}/projects/p/quota", json={"max_concurrent_migrations": 3}).json()
    assert q["max_concurrent_migrations"] == 3
    assert (
        api.patch(f"{V}/projects/p/quota", json={"max_concurrent_migrations": 0}).json()["max_concurrent_migrations"]
        is None
    )
