"""The usage graphs' points in the store (issue 33): a round of points written, the fine tier folded into the
coarse one, old buckets pruned, and a series or the latest values read (core/stats.py has the rules).

Every write is an upsert on the whole key (kind, object, tier, bucket): a round written twice, by a retry or by
two control-plane processes that both sampled a host during a lease's hand-over, leaves one point (the later
reading). A fold recomputes its coarse bucket from the fine points, and a prune deletes by bucket: both can
run any number of times. Nothing here needs to run once cluster-wide.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Select, and_, delete, func, literal_column, null, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from vmplane.core import stats as rules
from vmplane.core.names import domain_name
from vmplane.core.stats import FIELDS, Point, Tier
from vmplane.store.schema import Host, Project, StatSample, Vm

T = StatSample.__table__
KEY = ("kind", "obj_id", "tier", "bucket")
_C, _V, _H = T.c, Vm.__table__.c, Host.__table__.c


def _upsert(conn: Connection, source: Select[Any] | None = None) -> Any:
    """INSERT ... ON CONFLICT (key) DO UPDATE SET every value, for SQLite and PostgreSQL alike."""
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    stmt = dialect.insert(T)
    if source is not None:
        stmt = stmt.from_select([*KEY, *FIELDS], source)
    return stmt.on_conflict_do_update(index_elements=list(KEY), set_={f: stmt.excluded[f] for f in FIELDS})


def write(conn: Connection, tier: Tier, bucket: int, points: Iterable[tuple[str, int, Point]]) -> int:
    """Write one round's points ((kind, object id, point)) into `bucket` of `tier`; how many."""
    rows = [
        {"kind": kind, "obj_id": obj_id, "tier": tier.name, "bucket": bucket, **_values(p)}
        for kind, obj_id, p in points
    ]
    if rows:
        conn.execute(_upsert(conn), rows)
    return len(rows)


def _values(p: Point) -> dict[str, float | None]:
    return {f: getattr(p, f) for f in FIELDS}


def fold(conn: Connection, bucket: int) -> None:
    """The coarse bucket starting at `bucket`: the mean of the fine points of its span, per object."""
    fine = (
        select(
            _C.kind,
            _C.obj_id,
            literal_column(f"'{rules.COARSE.name}'").label("tier"),
            literal_column(str(int(bucket))).label("bucket"),
            *(func.avg(_C[f]).label(f) for f in FIELDS),
        )
        .where(
            and_(_C.tier == rules.FINE.name, _C.bucket >= bucket, _C.bucket < bucket + rules.COARSE.step_s),
        )
        .group_by(_C.kind, _C.obj_id)
    )
    conn.execute(_upsert(conn, fine))


def prune(conn: Connection, now: float) -> int:
    """Delete every tier's buckets older than it keeps; how many rows went."""
    gone = 0
    for tier in rules.TIERS:
        result = conn.execute(delete(T).where(_C.tier == tier.name, _C.bucket < rules.oldest_kept(now, tier)))
        gone += result.rowcount or 0
    return gone


def forget(conn: Connection, kind: str, ids: Iterable[int]) -> None:
    """Delete every point of these objects of `kind`."""
    conn.execute(delete(T).where(_C.kind == kind, _C.obj_id.in_(list(ids))))


def series(conn: Connection, kind: str, obj_id: int, tier: Tier, since: int) -> list[tuple[int, Point]]:
    """One object's points of `tier` from bucket `since` on, oldest first."""
    rows = conn.execute(
        select(_C.bucket, *(_C[f] for f in FIELDS))
        .where(_C.kind == kind, _C.obj_id == obj_id, _C.tier == tier.name, _C.bucket >= since)
        .order_by(_C.bucket)
    )
    return [(int(bucket), Point(*values)) for bucket, *values in rows]


def latest(conn: Connection, kind: str, since: int) -> dict[int, tuple[int, Point]]:
    """Per object of `kind`, its newest fine point from bucket `since` on."""
    out: dict[int, tuple[int, Point]] = {}
    rows = conn.execute(
        select(_C.obj_id, _C.bucket, *(_C[f] for f in FIELDS))
        .where(_C.tier == rules.FINE.name, _C.bucket >= since, _C.kind == kind)
        .order_by(_C.bucket)
    )
    for obj_id, bucket, *values in rows:
        out[obj_id] = (int(bucket), Point(*values))
    return out


def domains(conn: Connection) -> dict[tuple[int, str], tuple[int, int]]:
    """(host id, domain name) -> (VM id, project id) of every VM placed on a host."""
    rows = conn.execute(select(_V.host_id, _V.name, _V.id, _V.project_id).where(_V.host_id.is_not(None)))
    return {(host_id, domain_name(name)): (vm_id, project_id) for host_id, name, vm_id, project_id in rows}


def host_ids(conn: Connection) -> dict[str, int]:
    return dict(conn.execute(select(_H.name, _H.id)).tuples().all())


def rows(conn: Connection, tier: Tier | None = None) -> int:
    """How many points the store holds (of one tier)."""
    stmt = select(func.count()).select_from(T)
    if tier is not None:
        stmt = stmt.where(_C.tier == tier.name)
    return int(conn.execute(stmt).scalar_one())


def per_object_max(conn: Connection, tier: Tier) -> int:
    """The most points one object holds in `tier` (bounded by rules.max_points)."""
    counts = select(func.count().label("n")).where(_C.tier == tier.name).group_by(_C.kind, _C.obj_id).subquery()
    return int(conn.execute(select(func.coalesce(func.max(counts.c.n), 0))).scalar_one())


def sum_projects(conn: Connection, bucket: int) -> int:
    """Each project's fine point of `bucket`: the sum of its VMs' points there (whichever process wrote them);
    how many projects. A percentage is not summed: a project's CPU is in cores."""
    summed = (
        select(
            literal_column("'project'").label("kind"),
            _V.project_id,
            literal_column(f"'{rules.FINE.name}'").label("tier"),
            literal_column(str(int(bucket))).label("bucket"),
            *((null() if f == "cpu_pct" else func.sum(_C[f])).label(f) for f in FIELDS),
        )
        .select_from(T.join(Vm.__table__, _V.id == _C.obj_id))
        .where(_C.kind == "vm", _C.tier == rules.FINE.name, _C.bucket == bucket)
        .group_by(_V.project_id)
    )
    return conn.execute(_upsert(conn, summed)).rowcount or 0


def forget_gone(conn: Connection, bucket: int) -> int:
    """Delete the points of the VMs, hosts and projects that had a point in the coarse bucket `bucket` (the one
    just folded) and no longer exist: an object deleted while it was sampled goes at the next fold, without
    reading every object's points (a SQLite id may be given again: a new VM must not inherit old graphs). One
    missed (no fold of that bucket) goes with its last bucket's pruning, 31 days on. How many objects."""
    gone = 0
    for kind, ids in (("vm", _V.id), ("host", _H.id), ("project", Project.__table__.c.id)):
        there = select(_C.obj_id).where(_C.tier == rules.COARSE.name, _C.bucket == bucket, _C.kind == kind)
        missing = conn.execute(there.where(_C.obj_id.not_in(select(ids)))).scalars().all()
        if missing:
            forget(conn, kind, missing)
            gone += len(missing)
    return gone
