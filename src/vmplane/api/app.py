"""The FastAPI application: routers, error mapping, health and metrics."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .. import __version__
from ..errors import VmplaneError
from ..orchestrator import Orchestrator
from .deps import Caller
from .errors import install_error_handlers
from .routers import hosts, offerings, operations, projects, settings, vms, zones
from .schemas import ErrorBody

ERRORS = {code: {"model": ErrorBody} for code in (401, 403, 404, 409, 422)}


def _unauthorized(message: str) -> JSONResponse:
    return JSONResponse({"error": "unauthorized", "message": message}, status_code=401,
                        headers={"WWW-Authenticate": "Bearer"})


def create_app(orch: Orchestrator) -> FastAPI:
    app = FastAPI(title="vmplane", version=__version__, responses=ERRORS,
                  description="Control plane for KVM clusters: migration-neutral quotas, live scaling.")
    app.state.orchestrator = orch
    install_error_handlers(app)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        """Every /api call needs a valid bearer token, checked before the request body is even parsed."""
        if request.url.path.startswith("/api/"):
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                return _unauthorized("an Authorization: Bearer <token> header is required")
            try:
                row = orch.catalog.authenticate(token.strip())
            except VmplaneError as exc:
                return _unauthorized(exc.message)
            request.state.caller = Caller(row.name, row.role, row.project_id)
        return await call_next(request)
    api = APIRouter(prefix="/api/v1")
    for module in (zones, hosts, projects, offerings, settings, vms, operations):
        api.include_router(module.router)
    app.include_router(api)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict:
        return {"status": "ok", "version": __version__, "hosts": len(orch.index)}

    @app.get("/metrics", tags=["health"], response_class=PlainTextResponse)
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
