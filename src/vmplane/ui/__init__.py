"""The web console at /ui: server-rendered pages (Jinja2) made live with htmx and server-sent events,
served by the API process with the API's authentication and rules (docs/operations/console.md)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from vmplane.core.errors import VmplaneError
from vmplane.ui import actions, auth, bulk, consolesocket, forms, manage, netpages, pages, stream
from vmplane.ui.render import HERE, is_htmx, render
from vmplane.ui.session import LoginRequired


def install(app: FastAPI) -> None:
    app.mount("/ui/static", StaticFiles(directory=str(HERE / "static")), name="ui-static")
    for module in (auth, stream, actions, bulk, forms, manage, pages, netpages, consolesocket):
        app.include_router(module.router)

    @app.exception_handler(LoginRequired)
    async def login_required(request: Request, exc: LoginRequired):
        if is_htmx(request) or request.url.path == "/ui/stream":
            return Response(status_code=401, headers={"HX-Redirect": "/ui/login"})
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(
            f"/ui/login?next={target}" if request.url.path != "/ui" else "/ui/login", status_code=303
        )

    # the API's error handlers answer JSON; under /ui the same words are shown as a page or a fragment
    for kind in (VmplaneError, RequestValidationError, StarletteHTTPException):
        _as_html(app, kind)


def _as_html(app: FastAPI, kind: type[Exception]) -> None:
    # (the API's handlers are coroutines: api/errors.py)
    api_handler = cast("Callable[[Request, Exception], Awaitable[Response]]", app.exception_handlers[kind])

    async def handler(request: Request, exc: Exception):
        response = await api_handler(request, exc)
        if not request.url.path.startswith("/ui") or request.url.path.startswith("/ui/static"):
            return response
        error = json.loads(bytes(response.body))
        name = "fragments/error.html" if is_htmx(request) else "error_page.html"
        return render(request, name, status_code=response.status_code, error=error)

    app.add_exception_handler(kind, handler)
