"""Review N6 (issue 26): a migration cancel taken by a control-plane process other than the one copying is
persisted and honoured: the copying process sees it and aborts, and the VM stays on its source. Two
processes on one PostgreSQL store (tests/multikit.py), sim hosts shared through one file, a slow copy."""

from __future__ import annotations

import itertools
import os
import sqlite3
import time

from .multikit import Planes

_databases = itertools.count(1)


def domains(tmp_path, vm: str) -> list[str]:
    """The hosts whose sim domain of `vm` is active (running or paused), from the shared file."""
    with sqlite3.connect(tmp_path / "sim-hosts") as db:
        return [
            h
            for (h,) in db.execute(
                "SELECT host FROM domains WHERE name = ? AND state NOT IN "
                "('shutoff', 'crashed', 'nostate') ORDER BY host",
                (f"vmplane-{vm}",),
            )
        ]


def wait_for(get, predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = get()
        if predicate(value):
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}: {value}"
        time.sleep(0.1)


def test_a_cancel_taken_by_another_process_aborts_the_copy_and_the_vm_stays(tmp_path, postgres):
    url = postgres.create_database(f"review_mig{os.getpid()}x{next(_databases)}")
    # 1 GiB at 16 MiB/s: about a minute of copy, which the cancel must cut short
    planes = Planes(tmp_path, url, count=2, lease_s=3.0, hosts=2, extra_env={"VMPLANE_SIM_COPY_RATE_MIB_S": "16"})
    try:
        planes.start()
        with planes[0].client() as c:
            c.post(
                "/offerings", json={"name": "one", "kind": "fixed", "vcpus": 1, "memory_mib": 1024}
            ).raise_for_status()
            c.post("/templates", json={"name": "t", "image": "tiny-linux"}).raise_for_status()
            c.post("/projects", json={"name": "p", "vcpus": 8, "memory_mib": 8192, "vms": 5}).raise_for_status()
            c.post(
                "/vms", json={"name": "x", "project": "p", "offering": "one", "template": "t", "start": True}
            ).raise_for_status()
            source = wait_for(lambda: c.get("/vms/x").json(), lambda v: v["state"] == "running", 60, "x to run")["host"]
            answer = c.post("/vms/x/migrate", json={})
            assert answer.status_code == 202, answer.text
            mig_id = answer.json()["id"]
            wait_for(
                lambda: c.get(f"/migrations/{mig_id}").json(),
                lambda m: m["state"] == "copying" and m["progress"] > 0,
                60,
                "the copy to run",
            )
            owner = wait_for(
                lambda: [r["name"] for r in c.get("/controllers").json() if r["migrations"]],
                lambda names: len(names) == 1,
                30,
                "the copying process",
            )[0]
        other = next(p for p in planes.processes if p.name != owner)
        with other.client() as c:
            answer = c.post("/vms/x/migrate/cancel")
            assert answer.status_code == 200, answer.text
            body = answer.json()
            assert body["state"] == "copying" and body["cancel_requested"] is True, body  # marked as cancelling
            row = wait_for(
                lambda: c.get(f"/migrations/{mig_id}").json(),
                lambda m: m["state"] not in ("queued", "copying", "checking"),
                40,
                "the migration to end",
            )
            assert row["state"] == "cancelled", row
            vm = c.get("/vms/x").json()
            assert vm["state"] == "running" and vm["host"] == source, vm
        assert domains(tmp_path, "x") == [source]  # on its source only: no copy, no incoming domain left
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{planes.logs()[-4000:]}") from None
    finally:
        planes.stop()
