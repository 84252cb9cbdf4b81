"""Maps every error to {"error", "message", "field"} once, for the whole app."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, IntegrityError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from vmplane.core.errors import VmplaneError


def _field_of(loc: tuple) -> str | None:
    names = [str(part) for part in loc if isinstance(part, str) and part not in ("body", "query", "path")]
    # pydantic adds the type tag of a union member ("int", "str") after the field name
    names = [n for n in names if n not in ("int", "str", "float", "bool", "function-after[...]")]
    return names[0] if names else None


def _is_name_length(error: dict) -> bool:
    ctx = error.get("ctx") or {}
    return (error.get("type") == "string_too_long" and ctx.get("max_length") == 63) or (
        error.get("type") == "string_too_short" and ctx.get("min_length") == 1
    )


def validation_body(errors: Sequence[Any]) -> dict[str, Any]:
    """pydantic's first complaint in the API's words: {"error": "invalid", "message", "field"} (the
    console words a form's errors with it too)."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    field = _field_of(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        message = "the request body is not valid JSON"
    elif first.get("type") == "extra_forbidden":
        message = f"{field}: unknown field"
    elif first.get("type") == "missing":
        message = f"{field}: field required"
    elif _is_name_length(first):  # the house rule for names, as check_name words it
        message = f"{field}: use 1-63 lowercase letters, digits and '-', starting and ending with a letter or digit"
    else:
        message = f"{field}: {first.get('msg')}" if field else str(first.get("msg"))
    return {"error": "invalid", "message": message, "field": field}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(VmplaneError)
    async def vmplane_error(_: Request, exc: VmplaneError):
        return JSONResponse(exc.as_dict(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        return JSONResponse(validation_body(exc.errors()), status_code=422)

    @app.exception_handler(IntegrityError)
    async def integrity_error(_: Request, exc: IntegrityError):
        # Two concurrent creates of one name on a database without a write lock (PostgreSQL).
        return JSONResponse(
            {"error": "already_exists", "message": "a record with this name already exists", "field": "name"},
            status_code=409,
        )

    @app.exception_handler(DataError)
    async def data_error(_: Request, exc: DataError):
        # a value the database refuses as data (PostgreSQL: a NUL character in text, a number out of its
        # column's range); its transaction rolled back whole: nothing changed
        reason = (str(exc.orig).splitlines() or [type(exc.orig).__name__])[0]
        return JSONResponse(
            {"error": "invalid", "message": f"a value was refused by the store: {reason}", "field": None},
            status_code=422,
        )

    @app.exception_handler(OperationalError)
    async def busy_error(_: Request, exc: OperationalError):
        # PostgreSQL chose this transaction as a deadlock's victim, or could not serialise it, or a lock it
        # waited for stayed held past lock_timeout (55P03, store/pgsessions.py): it was rolled back whole, so
        # nothing changed and the request may be sent again
        if getattr(exc.orig, "sqlstate", None) in ("40P01", "40001", "55P03"):
            return JSONResponse(
                {
                    "error": "conflict",
                    "message": "the store was busy with a conflicting request and "
                    "rolled this one back; nothing changed, retry",
                    "field": None,
                },
                status_code=409,
            )
        return JSONResponse(
            {"error": "internal", "message": f"internal error: {type(exc).__name__}", "field": None}, status_code=500
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = {
            400: "bad_request",
            401: "unauthorized",
            403: "forbidden",
            404: "not_found",
            405: "method_not_allowed",
        }.get(exc.status_code, "error")
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            path = request.url.path
            hint = (
                "; give the API's base URL, without /api/v1"
                if path.startswith("/api/v1/api/v1")
                else ""
                if path.startswith("/api/v1/")
                else "; the API is under /api/v1 (see /docs)"
            )
            message = f"no such route: {path}{hint}"
        elif exc.status_code == 405 and message == "Method Not Allowed":
            message = f"{request.method} is not allowed on {request.url.path}"
        return JSONResponse(
            {"error": code, "message": message, "field": None},
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception):
        # no log here: Starlette re-raises after this answer and the server logs the traceback once
        return JSONResponse(
            {"error": "internal", "message": f"internal error: {type(exc).__name__}", "field": None}, status_code=500
        )
