"""Query parameters: unknown ones refused on every route; limit/offset/sort and X-Total-Count on lists."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Query, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from vmplane.core.errors import Invalid
from vmplane.store.listing import Page

TOTAL_HEADER = "X-Total-Count"


def _query_names(route) -> frozenset[str]:
    names: set[str] = set()
    todo = [route.dependant]
    while todo:
        dependant = todo.pop()
        names.update(p.alias for p in dependant.query_params)
        todo.extend(dependant.dependencies)
    return frozenset(names)


class StrictQueryRoute(APIRoute):
    """Refuses a query parameter the route does not declare (a typo such as ?stat=running would otherwise
    return everything): 422 `invalid` naming the parameter and the known ones. A route class rather than
    an app-wide dependency: FastAPI solves each dependency on every request, this costs nothing when the
    request has no query string (the hot reads). Every router of the API and the console uses it."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        known = _query_names(self)

        async def strict(request: Request):
            if request.scope.get("query_string"):
                for name, value in request.query_params.multi_items():
                    if name not in known:
                        choices = f"known: {', '.join(sorted(known))}" if known else "this route takes none"
                        raise Invalid(f"{name}: unknown query parameter; {choices}", field=name)
                    if "\x00" in value:  # no store keeps it (PostgreSQL refuses it in text): no name has it
                        raise Invalid(f"{name}: must not contain a NUL character", field=name)
            if "\x00" in request.scope["path"]:
                raise Invalid("the path must not contain a NUL character", field=None)
            return await handler(request)

        return strict


async def page_params(
    limit: Annotated[int, Query(ge=1, le=1000, description="at most this many (default 100)")] = 100,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1, description="skip this many first")] = 0,
    sort: Annotated[
        str | None,
        Query(
            max_length=64, description=("a field to sort by, '-field' for descending (the route's fields: see a 422)")
        ),
    ] = None,
) -> Page:
    return Page(limit=limit, offset=offset, sort=sort)  # (async: no threadpool hop, as in deps.py)


Paging = Annotated[Page, Depends(page_params)]


def paged_json(items: list[dict], total: int) -> JSONResponse:
    """paged() for a list already in its JSON form, answered as is (no second validation against the
    route's response model, which FastAPI runs in the threadpool: another hop per request)."""
    return JSONResponse(items, headers={TOTAL_HEADER: str(total)})


def paged(response: Response, items: list, total: int) -> list:
    """The list as a JSON array (as before), its total in the X-Total-Count header."""
    response.headers[TOTAL_HEADER] = str(total)
    return items
