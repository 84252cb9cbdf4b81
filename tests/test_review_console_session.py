"""The console's session (review of 2026-12-02, N10): the cookie holds a server-side session id, never the
API token; it is Secure unless plain http is allowed (a browser on this machine, `--insecure-cookies`);
X-Forwarded-Proto is believed from the configured proxies only; logout and a revoked token end the session
on the server. And /metrics needs an admin's bearer token (review, minor item)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from vmplane.server import create_app
from vmplane.store.schema import ConsoleSession
from vmplane.ui.consolesessions import cookie_secure, hash_session, open_session, session_caller
from vmplane.ui.session import COOKIE

from .conftest import ADMIN_TOKEN, LiveServer
from .ui_serverkit import ADMIN, ALPHA, build, csrf


@pytest.fixture
def con(db):
    console = build(db)
    yield console
    console.o.close()


def _flags(set_cookie: str) -> set[str]:
    return {f.strip().lower() for f in set_cookie.split(";")[1:]}


def _value(set_cookie: str) -> str:
    return set_cookie.split(";")[0].split("=", 1)[1]


def _login(client: TestClient, token: str, **headers) -> str:
    r = client.post("/ui/login", data={"token": token}, headers=headers)
    assert r.status_code == 303, r.text
    return r.headers["set-cookie"]


def test_behind_a_proxy_the_cookie_is_secure_and_is_not_the_token(con):
    """The review's test: a browser at 10.0.0.9 through a TLS-ending load balancer that uvicorn does not trust."""
    c = TestClient(con.app, client=("10.0.0.9", 1234), follow_redirects=False)
    cookie = _login(c, ADMIN, **{"X-Forwarded-Proto": "https"})
    assert "secure" in _flags(cookie) and {"httponly", "samesite=strict", "path=/ui"} <= _flags(cookie)
    value = _value(cookie)
    assert value and value != ADMIN and ADMIN not in cookie
    with con.o.db.read() as s:  # the store keeps only the session id's hash
        rows = s.scalars(select(ConsoleSession)).all()
    assert [r.id_hash for r in rows] == [hash_session(value)] and all(value not in str(vars(r)) for r in rows)


def test_plain_http_from_another_machine_gets_a_secure_cookie_and_the_form_says_why(con):
    c = TestClient(con.app, client=("10.0.0.9", 1234), follow_redirects=False)
    assert "secure" in _flags(_login(c, ADMIN))
    assert 'data-note="plain-http"' in c.get("/ui/login").text
    local = TestClient(con.app, client=("127.0.0.1", 1234), follow_redirects=False)
    assert 'data-note="plain-http"' not in local.get("/ui/login").text


def test_insecure_cookies_lets_plain_http_carry_the_session_to_any_client(con):
    app = create_app(con.o, insecure_cookies=True)
    c = TestClient(app, client=("10.0.0.9", 1234), follow_redirects=False)
    cookie = _login(c, ALPHA)
    assert "secure" not in _flags(cookie) and ALPHA not in cookie
    assert c.get("/ui").status_code == 200  # the session works over http


def test_a_trusted_proxy_saying_https_makes_the_cookie_secure(con):
    """uvicorn's ProxyHeadersMiddleware, as `serve --forwarded-allow-ips` configures it: the proxy's word
    on the scheme is taken from the proxies named only."""
    app = create_app(con.o, insecure_cookies=True)
    trusted = TestClient(
        ProxyHeadersMiddleware(app, trusted_hosts="10.0.0.1"), client=("10.0.0.1", 1), follow_redirects=False
    )
    headers = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.5"}
    assert "secure" in _flags(_login(trusted, ALPHA, **headers))
    untrusted = TestClient(
        ProxyHeadersMiddleware(app, trusted_hosts="10.0.0.1"), client=("10.0.0.2", 1), follow_redirects=False
    )
    assert "secure" not in _flags(_login(untrusted, ALPHA, **headers))  # http, insecure allowed


@pytest.mark.parametrize(
    "scheme, client, headers, insecure, secure",
    [
        ("https", "127.0.0.1", {}, True, True),  # https: always
        ("http", "10.0.0.9", {}, False, True),  # plain http from elsewhere: Secure (not sent back)
        ("http", "10.0.0.9", {}, True, False),  # unless --insecure-cookies
        ("http", "127.0.0.1", {}, False, False),  # a browser on this machine
        ("http", "::1", {}, False, False),
        ("http", "localhost", {}, False, False),
        ("http", "127.0.0.1", {"x-forwarded-for": "10.0.0.9"}, False, True),  # a proxy on this machine
        ("http", "127.0.0.1", {"forwarded": "for=10.0.0.9"}, False, True),
        ("http", None, {}, False, True),
        ("http", "testclient", {}, False, True),
    ],
)
def test_the_cookie_rule(scheme, client, headers, insecure, secure):
    assert cookie_secure(scheme, client, headers, insecure) is secure


def test_logout_ends_the_session_on_the_server(con):
    c = con.client(ADMIN)
    value = c.cookies[COOKIE]
    thief = TestClient(con.app, client=("127.0.0.1", 1), follow_redirects=False, cookies={COOKIE: value})
    assert thief.get("/ui").status_code == 200  # a copy of the cookie works while the session lives
    r = c.post("/ui/logout", data={"csrf": csrf(ADMIN)})
    assert (r.status_code, r.headers["location"]) == (303, "/ui/login")
    r = thief.get("/ui/vms")  # ... and not after the logout
    assert (r.status_code, r.headers["location"]) == (303, "/ui/login?next=/ui/vms")
    assert thief.get("/ui/stream?once=true").status_code == 401
    with con.o.db.read() as s:
        assert s.scalars(select(ConsoleSession)).all() == []
    assert con.api(ADMIN).get("/api/v1/vms").status_code == 200  # the token itself lives on


def test_revoking_the_token_ends_its_sessions_and_a_new_token_of_that_name_does_not_revive_them(con):
    alpha, other = con.client(ALPHA), con.client(ALPHA)
    assert alpha.get("/ui").status_code == 200 and other.get("/ui").status_code == 200
    con.o.catalog.revoke_token("alpha-user")
    with con.o.db.read() as s:
        assert len(s.scalars(select(ConsoleSession)).all()) == 0  # gone with the token
    con.o.catalog.create_token("alpha-user", "member", "alpha", token=ALPHA)
    for c in (alpha, other):
        r = c.get("/ui/vms")
        assert (r.status_code, r.headers["location"]) == (303, "/ui/login?next=/ui/vms")


def test_a_session_ends_at_its_expiry(con):
    old = dt.datetime(2020, 1, 1)
    sid = open_session(con.o.db, ALPHA, now=old)
    assert session_caller(con.o.db, sid, now=old)["name"] == "alpha-user"
    assert session_caller(con.o.db, sid) is None
    c = TestClient(con.app, client=("127.0.0.1", 1), follow_redirects=False, cookies={COOKIE: sid})
    assert c.get("/ui").status_code == 303


def test_the_token_itself_as_a_cookie_is_no_session(con):
    c = TestClient(con.app, client=("127.0.0.1", 1), follow_redirects=False, cookies={COOKIE: ADMIN})
    assert c.get("/ui").status_code == 303


# -- /metrics ------------------------------------------------------------------------------------
def test_metrics_need_an_admins_bearer_token(con):
    anonymous = TestClient(con.app)
    r = anonymous.get("/metrics")
    assert r.status_code == 401 and r.json()["error"] == "unauthorized" and r.headers["www-authenticate"] == "Bearer"
    assert anonymous.get("/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
    r = con.api(ALPHA).get("/metrics")
    assert r.status_code == 403 and "vmplane_project_quota" not in r.text
    r = con.api(ADMIN).get("/metrics")
    assert r.status_code == 200 and 'vmplane_project_quota{project="beta"' in r.text
    security = con.app.openapi()["paths"]["/metrics"]["get"]["security"]
    assert security == [{"HTTPBearer": []}]


# -- the serve flags reach uvicorn ---------------------------------------------------------------------
def test_up_believes_forwarded_headers_only_from_the_proxies_it_is_told(tmp_path):
    live = LiveServer(tmp_path, hosts=0).start("--insecure-cookies", "--forwarded-allow-ips", "10.9.9.9")
    try:
        with httpx.Client(base_url=live.url) as c:
            r = c.post("/ui/login", data={"token": ADMIN_TOKEN}, headers={"X-Forwarded-Proto": "https"})
            assert r.status_code == 303
            # 127.0.0.1 is not a proxy it was told of: the scheme stays http; --insecure-cookies: no Secure
            assert "secure" not in _flags(r.headers["set-cookie"]) and ADMIN_TOKEN not in r.headers["set-cookie"]
            assert c.get("/metrics").status_code == 401
            assert c.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).status_code == 200
    finally:
        live.stop()


def test_the_sample_scrape_config_authenticates_as_prometheus_would(con, tmp_path):
    """deploy/prometheus/vmplane-scrape.yml: promtool accepts it (its token file and rules in place), and
    the header Prometheus builds from its `authorization` (type and credentials) opens /metrics."""
    import shutil
    import subprocess

    import yaml

    deploy = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
    config = yaml.safe_load((deploy / "vmplane-scrape.yml").read_text())
    [job] = config["scrape_configs"]
    auth = job["authorization"]
    con.o.catalog.create_token("prometheus", "admin", None, token="scrape-token")
    token_file = tmp_path / "vmplane-token"
    token_file.write_text("scrape-token\n")
    r = TestClient(con.app).get(
        job["metrics_path"], headers={"Authorization": f"{auth['type']} {token_file.read_text().strip()}"}
    )
    assert r.status_code == 200 and "vmplane_hosts" in r.text
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (scripts/setup.sh --test installs prometheus)")
    auth["credentials_file"] = str(token_file)
    shutil.copy(deploy / "vmplane-alerts.yml", tmp_path)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    check = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
