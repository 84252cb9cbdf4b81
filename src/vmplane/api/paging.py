"""Query parameters: unknown ones refused on every route; limit/offset/sort and X-Total-Count on lists."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Query, Request, Response

from ..errors import Invalid
from ..listing import Page

TOTAL_HEADER = "X-Total-Count"


def _query_names(route) -> frozenset[str]:
    names: set[str] = set()
    todo = [route.dependant]
    while todo:
        dependant = todo.pop()
        names.update(p.alias for p in dependant.query_params)
        todo.extend(dependant.dependencies)
    return frozenset(names)


def known_query_params(request: Request) -> None:
    """Refuse a query parameter the route does not declare (a typo such as ?stat=running would otherwise
    return everything): 422 `invalid` naming the parameter and the known ones."""
    if not request.query_params:
        return
    route = request.scope.get("route")
    if route is None or not hasattr(route, "dependant"):
        return
    known = getattr(route, "vmplane_query_names", None)
    if known is None:                       # computed once per route, kept on it
        known = route.vmplane_query_names = _query_names(route)
    for name in request.query_params.keys():
        if name not in known:
            choices = f"known: {', '.join(sorted(known))}" if known else "this route takes none"
            raise Invalid(f"{name}: unknown query parameter; {choices}", field=name)


def page_params(limit: Annotated[int, Query(ge=1, le=1000, description="at most this many (default 100)")] = 100,
                offset: Annotated[int, Query(ge=0, le=2**31 - 1, description="skip this many first")] = 0,
                sort: Annotated[str | None, Query(max_length=64, description=(
                    "a field to sort by, '-field' for descending (the route's fields: see a 422)"))] = None) -> Page:
    return Page(limit=limit, offset=offset, sort=sort)


Paging = Annotated[Page, Depends(page_params)]


def paged(response: Response, items: list, total: int) -> list:
    """The list as a JSON array (as before), its total in the X-Total-Count header."""
    response.headers[TOTAL_HEADER] = str(total)
    return items
