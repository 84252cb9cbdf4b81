"""Hostile input: schemathesis over every endpoint of the OpenAPI schema (no 5xx, every error in the
documented shape), and names built to break paths, XML and shells."""

import atexit
import json
import math
import shutil
import tempfile

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from vmplane.core.model import Offering, OfferingKind
from vmplane.core.settings import KEYS as SETTING_KEYS
from vmplane.orchestrator import InlineExecutor, Orchestrator
from vmplane.server import create_app
from vmplane.store import Database

from .stores import store_url

TOKEN = "hostile-admin"


def _seeded_app():
    """An API on sim hosts with one of everything, so that generated paths hit real objects too."""
    folder = tempfile.mkdtemp(prefix="vmplane-hostile-")
    atexit.register(shutil.rmtree, folder, True)
    db = Database(store_url(folder, "h.db"))
    db.migrate()
    o = Orchestrator(db, InlineExecutor())
    o.load()
    o.catalog.create_zone("z1")
    o.catalog.create_cluster("c1", "z1")
    for name in ("h1", "h2"):
        o.add_host(name, "c1", "sim", 16, 2400, 65536)
    o.catalog.create_offering(Offering("small", OfferingKind.fixed, vcpus=1, memory_mib=512, dynamic_scaling=True))
    o.catalog.create_template("t", "tiny-linux", dynamic_scaling=True)
    o.catalog.create_project("p", 64, 1 << 20, 100)
    o.create_vm("v1", "p", "small", "t", start=True)
    o.create_vm("v2", "p", "small", "t")
    o.catalog.ensure_admin_token("admin", TOKEN)
    return create_app(o)


APP = _seeded_app()
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)
ERROR_KEYS = {"error", "message", "field"}

# The value of PUT /settings/{key} is generated as strings, floats and infinities (JSON has no infinity:
# they go as the `Infinity` token Python's json reads), on real keys as often as not.
SETTING_VALUES = st.one_of(
    st.text(max_size=32),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(),
    st.sampled_from(
        [
            float("inf"),
            float("-inf"),
            float("nan"),
            1e308,
            -1e308,
            -1.0,
            0.0,
            "inf",
            "-inf",
            "nan",
            "Infinity",
            "1e308",
            "-1",
            "0",
            "abc",
            "",
        ]
    ),
)


def _is_put_setting(ctx) -> bool:
    op = ctx.operation
    return op is not None and op.method.upper() == "PUT" and op.path.endswith("/settings/{key}")


@schema.hook("flatmap_path_parameters")
def real_setting_keys(ctx, params):
    if not _is_put_setting(ctx) or not isinstance(params, dict):
        return st.just(params)
    return st.one_of(st.just(params), st.sampled_from(sorted(SETTING_KEYS)).map(lambda k: {**params, "key": k}))


@schema.hook("flatmap_body")
def setting_values_of_every_type(ctx, body):
    if not _is_put_setting(ctx) or not isinstance(body, dict):
        return st.just(body)
    scopes = st.sampled_from(
        [
            {"scope": "global", "scope_name": None},
            {"scope": "zone", "scope_name": "z1"},
            {"scope": "cluster", "scope_name": "c1"},
            {},
        ]
    )
    return st.tuples(SETTING_VALUES, scopes).map(lambda vs: {**body, **vs[1], "value": vs[0]})


def call(case, headers: dict | None = None):
    """case.call, except that a setting value of inf/-inf/nan (which JSON encoders refuse) is sent as
    the `Infinity` / `NaN` token, as a client written in Python or JavaScript would."""
    value = case.body.get("value") if isinstance(case.body, dict) else None
    if isinstance(value, float) and not math.isfinite(value):
        with TestClient(APP) as client:
            return client.request(
                case.method,
                case.formatted_path,
                content=json.dumps(case.body),
                headers={**(headers or {}), "Content-Type": "application/json"},
            )
    return case.call(headers=headers)


def check_shape(response) -> None:
    assert response.status_code < 500, f"{response.status_code}: {response.text[:300]}"
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == ERROR_KEYS and body.get("error") and body.get("message"), body


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_endpoint_answers_5xx_and_errors_have_the_documented_shape(case):
    check_shape(call(case, headers={"Authorization": f"Bearer {TOKEN}"}))


@schema.parametrize()
@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
def test_without_a_token_every_api_call_is_401(case):
    response = call(case)
    check_shape(response)
    if case.path.startswith("/api/"):
        assert response.status_code in (401, 405, 422), (case.method, case.path, response.status_code)


HOSTILE = [
    "a'b",
    'a"b',
    "<vm>",
    "a/b",
    "..",
    "../../etc/passwd",
    "a b",
    "a;rm -rf /",
    "$(reboot)",
    "`id`",
    "ä-unicode",
    "\u202eevil",
    "a\nb",
    "a\x00b",
    "x" * 10_000,
    "",
    "-leading",
    "trailing-",
    "UPPER",
    "%2e%2e",
]


@pytest.mark.parametrize("name", HOSTILE, ids=[repr(n)[:24] for n in HOSTILE])
def test_hostile_names_are_refused_before_they_reach_xml_paths_or_libvirt(name):
    with TestClient(APP, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        before = c.get("/api/v1/vms").json()
        for path, body in (
            ("/api/v1/vms", {"name": name, "project": "p", "offering": "small", "template": "t"}),
            ("/api/v1/projects", {"name": name, "vcpus": 1, "memory_mib": 1}),
            ("/api/v1/zones", {"name": name}),
            ("/api/v1/templates", {"name": "ok", "image": name or "<x>"}),
        ):
            r = c.post(path, json=body)
            assert r.status_code == 422, (path, name, r.status_code, r.text[:200])
            check_shape(r)
            assert r.json()["field"] in ("name", "image")
        assert c.get("/api/v1/vms").json() == before
