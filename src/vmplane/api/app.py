"""The FastAPI application: routers, error mapping, health and metrics."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from vmplane import __version__
from vmplane.api.deps import Admin, Caller, caller
from vmplane.api.errors import install_error_handlers
from vmplane.api.metricscollect import StateCollector
from vmplane.api.paging import StrictQueryRoute
from vmplane.api.routers import backups as backup_routes
from vmplane.api.routers import consoles as console_routes
from vmplane.api.routers import controllers as controller_routes
from vmplane.api.routers import events as event_routes
from vmplane.api.routers import (
    groups,
    hosts,
    images,
    offerings,
    operations,
    projectkeys,
    projects,
    settings,
    storage,
    tokens,
    vms,
    zones,
)
from vmplane.api.routers import networks as network_routes
from vmplane.api.routers import snapshots as snapshot_routes
from vmplane.api.routers import stats as stat_routes
from vmplane.api.schemas import ErrorBody
from vmplane.api.timing import RequestTiming
from vmplane.core.errors import VmplaneError
from vmplane.orchestrator import Orchestrator
from vmplane.store import events

# (typed as FastAPI's `responses` parameters)
ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (401, 403, 404, 409, 422, 500)}
PLAIN_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (422, 500)
}  # /healthz: no token
ERROR_CODES = (
    'Every error is `{"error", "message", "field"}` (`field` null where none): 401 `unauthorized`, '
    "403 `forbidden`, 404 `not_found` (also an unknown route), 405 `method_not_allowed`, 409 "
    "`already_exists` / `conflict` / `quota_exceeded` / `insufficient_capacity`, 422 `invalid` (a body "
    "field or a query parameter, unknown ones included), 500 `internal`. Lists take `limit`, `offset`, "
    "`sort` and filters, and give their total in the `X-Total-Count` header."
)


API = "/api/v1"


def openapi_with_bearer(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI schema with the bearer scheme on every /api operation and /metrics (BearerAuth checks it)."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)
        schema.setdefault("components", {}).setdefault("securitySchemes", {})["HTTPBearer"] = {
            "type": "http",
            "scheme": "bearer",
            "description": "a token from `vmplane up` or `vmplane token create`",
        }
        for path, operations in schema["paths"].items():
            if needs_bearer(path):
                for operation in operations.values():
                    operation["security"] = [{"HTTPBearer": []}]
        return schema  # (FastAPI.openapi keeps it as app.openapi_schema)
    return app.openapi_schema


def _unauthorized(message: str) -> JSONResponse:
    return JSONResponse(
        {"error": "unauthorized", "message": message, "field": None},
        status_code=401,
        headers={"WWW-Authenticate": "Bearer"},
    )


def needs_bearer(path: str) -> bool:
    """The API and /metrics (every project's names, quotas and usage, the hosts) need a bearer token;
    /healthz, /docs and the console (its own session cookie) do not."""
    return path.startswith("/api/") or path == "/metrics"


class BearerAuth:
    """Every /api call (and /metrics) needs a valid bearer token, checked before the request body is even
    read. A plain ASGI middleware (Starlette's BaseHTTPMiddleware costs a task group per request)."""

    def __init__(self, app, catalog):
        self.app = app
        self.catalog = catalog

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and needs_bearer(scope["path"]):
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            kind, _, token = header.partition(" ")
            if kind.lower() != "bearer" or not token.strip():
                return await _unauthorized("an Authorization: Bearer <token> header is required")(scope, receive, send)
            try:
                name, role, project_id = self.catalog.authenticate(token.strip())
            except VmplaneError as exc:
                return await _unauthorized(exc.message)(scope, receive, send)
            scope.setdefault("state", {})["caller"] = Caller(name, role, project_id)
            # what this request changes is recorded as caused by its token (work it leaves to executor
            # threads carries the cause on: Orchestrator._run, Migrator._run_guarded)
            with events.acting_as(events.user_cause(name)):
                return await self.app(scope, receive, send)
        await self.app(scope, receive, send)


def create_api(orch: Orchestrator, insecure_cookies: bool = False) -> FastAPI:
    """The REST API, /healthz and /metrics (server.create_app adds the web console). `insecure_cookies`:
    the console's session cookie may go over plain http from any client (`vmplane serve
    --insecure-cookies`; ui/consolesessions.py), not only to a browser on this machine."""
    # FastAPIOffline: /docs loads Swagger UI from the package, not a CDN (air-gapped control planes)
    app = FastAPIOffline(
        title="vmplane",
        version=__version__,
        responses=PLAIN_ERRORS,
        description="Control plane for KVM clusters: migration-neutral quotas, live scaling.\n\n" + ERROR_CODES,
    )
    app.router.route_class = StrictQueryRoute  # unknown query parameters refused (paging.py)
    app.openapi = lambda: openapi_with_bearer(app)  # type: ignore[method-assign]  # FastAPI's documented override
    app.state.orchestrator = orch
    app.state.insecure_cookies = insecure_cookies
    install_error_handlers(app)

    app.add_middleware(BearerAuth, catalog=orch.catalog)
    app.add_middleware(RequestTiming)  # outermost: refused requests are timed too

    @app.get("/healthz", tags=["health"], response_model=dict)
    async def healthz() -> JSONResponse:
        # async and answered as is: it reads two counters under a lock, no I/O (a sync endpoint would
        # cost a threadpool hop, and its `dict` response model another, on every probe). Registered
        # before the API: the router tries routes in order.
        return JSONResponse(
            {
                "status": "ok",
                "version": __version__,
                "hosts": len(orch.index),
                "recovery": orch.recovery.status(vms=False),
            }
        )

    # Each module straight on the app, not through one /api/v1 router: FastAPI matches nested routers
    # level by level on every request. vms first: the router tries routes in order and GET /vms/{name}
    # is the hottest read (these modules' paths do not overlap, so the order changes nothing else).
    for module in (
        vms,
        console_routes,
        snapshot_routes,
        backup_routes,
        zones,
        hosts,
        projects,
        offerings,
        images,
        settings,
        storage,
        groups,
        network_routes,
        projectkeys,
        operations,
        tokens,
        event_routes,
        controller_routes,
        stat_routes,
    ):
        app.include_router(module.router, prefix=API, responses=ERRORS)
    api = APIRouter(prefix=API, responses=ERRORS, route_class=StrictQueryRoute)

    def _project_of(vm: str) -> int | None:
        try:
            return orch.vm(vm).project_id
        except VmplaneError:
            return None

    @api.get("/recovery", tags=["health"])
    def recovery(who: Annotated[Caller, Depends(caller)]) -> dict:
        """Start-up recovery: done or not, its phase, and the VMs it has not finished with (operations on
        them are refused with 409 meanwhile). Members see their own project's VMs only."""
        status = orch.recovery.status()
        if not who.is_admin:
            status["vms"] = {k: v for k, v in status["vms"].items() if _project_of(k) == who.project_id}
            status["pending_vms"] = len(status["vms"])
        return status

    app.include_router(api)

    state = app.state.metrics_state = StateCollector(orch.plane)  # this app's: never on the process-wide registry

    @app.get("/metrics", tags=["health"], responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}, **ERRORS})
    def metrics(who: Admin) -> PlainTextResponse:
        """Prometheus metrics: events counted as they happen and the cluster's state read now
        (docs/operations/metrics.md). An admin's bearer token: Prometheus sends it with `authorization` in its
        scrape config (deploy/prometheus/vmplane-scrape.yml)."""
        return PlainTextResponse(generate_latest() + state.text().encode(), media_type=CONTENT_TYPE_LATEST)

    return app
