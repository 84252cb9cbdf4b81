"""API request latency by route template (vmplane_api_request_duration_seconds).

A plain ASGI middleware (as BearerAuth: no task group per request). The label is the matched route's
template (`/api/v1/vms/{name}`), never the raw path, so the number of series is bounded by the routes;
a request no route took (a 401 before routing, a 404) is labelled `unmatched`. The time is taken to the
response's headers: for a JSON answer that is its whole work, and a stream (server-sent events) counts
the time to open, not how long it stays open.
"""

from __future__ import annotations

from time import perf_counter

from prometheus_client import Histogram
from starlette.routing import Mount
from starlette.types import ASGIApp

from vmplane.plane.metrics import API_REQUEST_SECONDS

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
UNMATCHED = "unmatched"


def route_template(scope) -> str:
    """The template of the route that took the request, with the prefix of the mount it is under.
    FastAPI (0.16x) keeps included routers unflattened: scope["route"] is the router's own route
    (`/vms/{name}`), and the whole template (`/api/v1/vms/{name}`) is on the route context it records in
    the scope; Starlette's route is the fallback (tests/test_metrics.py pins the whole template)."""
    route = scope.get("route")
    context = scope.get("fastapi", {}).get("effective_route_context")
    path = getattr(context, "path_format", None) or getattr(route, "path", None)
    root, app_root = scope.get("root_path", ""), scope.get("app_root_path", "")
    prefix = root[len(app_root) :] if root.startswith(app_root) else root  # the mounts it went through
    if path is None or isinstance(route, Mount):  # a mount that answered itself (static files): its prefix
        return prefix or path or UNMATCHED
    return prefix + path


class RequestTiming:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._series: dict[tuple[str, str, int], Histogram] = {}  # the histogram's children, by labels

    def _observe(self, scope, status: int, seconds: float) -> None:
        method = scope.get("method", "")
        key = (method if method in METHODS else "other", route_template(scope), status // 100)
        child = self._series.get(key)
        if child is None:
            child = self._series[key] = API_REQUEST_SECONDS.labels(key[0], key[1], f"{key[2]}xx")
        child.observe(seconds)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = perf_counter()
        timed = False

        async def send_timed(message):
            nonlocal timed
            if not timed and message["type"] == "http.response.start":
                timed = True
                self._observe(scope, message["status"], perf_counter() - t0)
            await send(message)

        try:
            await self.app(scope, receive, send_timed)
        finally:
            if not timed:  # no answer was started: an error the server turns into a 500
                self._observe(scope, 500, perf_counter() - t0)
