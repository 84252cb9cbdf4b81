"""The stack's own limit for bench/load.py: a minimal FastAPI app doing the same reads as vmplane's API.

GET /api/v1/vms/{name}: the bearer token checked the way vmplane checks it (its SHA-256 looked up in the
tokens table, one indexed query: a revoked token is refused at once), then the VM's row by name with
the names it refers to (project, offering, template, host, zone, cluster), as the same JSON object.
GET /api/v1/vms?limit=50: the first 50 VMs by name, the same objects, and the total in X-Total-Count.
GET /healthz: the same body shape as vmplane's, async as vmplane's (it reads no database: neither does
vmplane's).

Plain sqlite3, one connection per threadpool thread (opened once). Run by uvicorn with the settings of
`vmplane serve` (one worker, the default loop and HTTP parser, access log off):

    VMPLANE_DB=/path/load.db .venv/bin/uvicorn --app-dir bench minimal_app:app --port 8471 \
        --log-level warning --no-access-log
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import sqlite3
import threading

from fastapi import FastAPI, Header, HTTPException, Response

DB = os.environ["VMPLANE_DB"]
app = FastAPI()
_local = threading.local()

VM_SELECT = """
SELECT v.name, p.name AS project, o.name AS offering, t.name AS template, v.state, h.name AS host,
       v.vcpus, v.memory_mib, v.max_vcpus, v.max_memory_mib, v.overhead_mib,
       v.dynamically_scalable AS dynamic_scaling, coalesce(z.name, hz.name) AS zone, c.name AS cluster,
       v.boot_memory_mib, v.ha_policy, v.ha_priority, v.created_at
FROM vms v JOIN projects p ON p.id = v.project_id JOIN offerings o ON o.id = v.offering_id
JOIN templates t ON t.id = v.template_id LEFT JOIN hosts h ON h.id = v.host_id
LEFT JOIN zones z ON z.id = v.zone_id LEFT JOIN clusters c ON c.id = v.cluster_id
LEFT JOIN clusters hc ON hc.id = h.cluster_id LEFT JOIN zones hz ON hz.id = hc.zone_id
"""


def _db() -> sqlite3.Connection:
    conn = getattr(_local, "conn", None)
    if conn is None:
        conn = _local.conn = sqlite3.connect(DB, check_same_thread=False)
        conn.row_factory = sqlite3.Row
    return conn


def _vm(row: sqlite3.Row) -> dict:
    vm = dict(row)
    vm["dynamic_scaling"] = bool(vm["dynamic_scaling"])
    vm["created_at"] = dt.datetime.fromisoformat(vm["created_at"]).replace(tzinfo=dt.UTC).isoformat()
    return vm


def _check(authorization: str | None) -> None:
    kind, _, token = (authorization or "").partition(" ")
    if kind.lower() != "bearer" or not token:
        raise HTTPException(401, "unauthorized")
    digest = hashlib.sha256(token.strip().encode()).hexdigest()
    if _db().execute("SELECT name, role, project_id FROM tokens WHERE token_hash = ?", (digest,)).fetchone() is None:
        raise HTTPException(401, "unauthorized")


@app.get("/healthz")
async def healthz():  # no I/O: async, as vmplane's (no threadpool hop in either)
    return {
        "status": "ok",
        "version": "minimal",
        "hosts": 20,
        "recovery": {"done": True, "phase": "done", "pending_vms": 0},
    }


@app.get("/api/v1/vms/{name}")
def show_vm(name: str, authorization: str | None = Header(None)):
    _check(authorization)
    row = _db().execute(VM_SELECT + " WHERE v.name = ?", (name,)).fetchone()
    if row is None:
        raise HTTPException(404, "not found")
    return _vm(row)


@app.get("/api/v1/vms")
def list_vms(response: Response, limit: int = 100, offset: int = 0, authorization: str | None = Header(None)):
    _check(authorization)
    conn = _db()
    rows = conn.execute(VM_SELECT + " ORDER BY v.name LIMIT ? OFFSET ?", (limit, offset)).fetchall()
    response.headers["X-Total-Count"] = str(conn.execute("SELECT count(*) FROM vms").fetchone()[0])
    return [_vm(r) for r in rows]
