"""Lists an operator can use: sorting on whitelisted fields, paging and totals done in SQL, ids by prefix."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import SQLColumnExpression, func, select
from sqlalchemy.orm import Session
from sqlalchemy.sql import Select

from vmplane.core.errors import Conflict, Invalid, NotFound

MIN_PREFIX = 4  # shorter prefixes of an id are refused as ambiguous by nature
SHOWN_MATCHES = 5  # an ambiguous prefix names this many matches


@dataclass(frozen=True)
class Page:
    limit: int = 100
    offset: int = 0
    sort: str | None = None


def order_by(
    sort: str | None,
    fields: Mapping[str, SQLColumnExpression[Any]],
    default: str,
    tiebreak: SQLColumnExpression[Any],
) -> list[Any]:
    """ORDER BY clauses for `sort` ("name", "-name" for descending), a key of `fields`; anything else is a
    422 naming `sort` and the fields allowed. `tiebreak` keeps pages stable when values repeat."""
    sort = sort or default
    name = sort[1:] if sort.startswith("-") else sort
    if name not in fields:
        raise Invalid(
            f"sort: unknown field {name!r}; sort by one of {', '.join(fields)} ('-' before it for descending)",
            field="sort",
        )
    column = fields[name]
    return [column.desc() if sort.startswith("-") else column.asc(), tiebreak]


def run_page(
    session: Session,
    stmt: Select[Any],
    count_of: SQLColumnExpression[Any],
    conditions: list[Any],
    order: list[Any],
    page: Page,
    scalars: bool = True,
) -> tuple[list[Any], int]:
    """The page of `stmt` under `conditions` and its total, both counted by the database."""
    total = session.execute(select(func.count(count_of)).where(*conditions)).scalar_one()
    query = stmt.where(*conditions).order_by(*order).limit(page.limit).offset(page.offset)
    if scalars:
        return list(session.scalars(query).unique()), total
    return [dict(r._mapping) for r in session.connection().execute(query)], total


def like_prefix(prefix: str) -> str:
    return prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def by_prefix(
    session: Session, id_column: SQLColumnExpression[Any], prefix: str, noun: str, conditions: list[Any] | None = None
) -> str:
    """The one id that is `prefix` or starts with it (at least MIN_PREFIX characters); 404 when none,
    409 naming a few matches when several do. `conditions` scope the search (a member's project)."""
    conditions = list(conditions or [])
    exact = session.execute(select(id_column).where(id_column == prefix, *conditions)).scalar_one_or_none()
    if exact is not None:
        found: str = exact
        return found
    if len(prefix) < MIN_PREFIX:
        raise NotFound(
            f"{noun} {prefix} does not exist (a prefix of an id needs at least {MIN_PREFIX} characters)", field=noun
        )
    matches = list(
        session.execute(
            select(id_column)
            .where(id_column.like(like_prefix(prefix), escape="\\"), *conditions)
            .order_by(id_column)
            .limit(SHOWN_MATCHES + 1)
        ).scalars()
    )
    if not matches:
        raise NotFound(f"{noun} {prefix} does not exist", field=noun)
    if len(matches) > 1:
        more = " and more" if len(matches) > SHOWN_MATCHES else ""
        raise Conflict(
            f"{noun} id prefix {prefix} is ambiguous: it matches {', '.join(matches[:SHOWN_MATCHES])}"
            f"{more}; give more characters",
            field=noun,
        )
    only: str = matches[0]
    return only
