"""Reading the event log as an operator does (issue 33's audit): `--since` takes a span back from now (`30m`,
`1h`, `2d`) and dates as well as ids and timestamps; the CLI shows one line per object per task (a stop was
five rows) and who asked for each operation, when."""

from __future__ import annotations

import datetime as dt

import pytest

from vmplane.core.errors import Invalid
from vmplane.core.eventfold import fold
from vmplane.core.since import parse_since

from .conftest import add_basics, add_sim_hosts
from .ui_serverkit import ADMIN, build, csrf, text

NOW = dt.datetime(2026, 12, 7, 12, 0, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    "text,moment",
    [
        ("42", 42),
        ("90s", NOW - dt.timedelta(seconds=90)),
        ("30m", NOW - dt.timedelta(minutes=30)),
        ("1h", NOW - dt.timedelta(hours=1)),
        (" 2D ", NOW - dt.timedelta(days=2)),
        ("1w", NOW - dt.timedelta(days=7)),
        ("2026-12-01", dt.datetime(2026, 12, 1, tzinfo=dt.UTC)),
        ("2026-12-01T08:30:00+01:00", dt.datetime(2026, 12, 1, 7, 30, tzinfo=dt.UTC)),
        ("2026-12-01 08:30", dt.datetime(2026, 12, 1, 8, 30, tzinfo=dt.UTC)),  # no offset: UTC
    ],
)
def test_since_takes_ids_spans_dates_and_timestamps(text, moment):
    assert parse_since(text, NOW) == moment


@pytest.mark.parametrize("text", ["1y", "-1h", "h", "yesterday", "1.5h", "2026-13-01"])
def test_a_since_that_is_none_of_them_is_refused_naming_the_forms(text):
    with pytest.raises(Invalid) as refused:
        parse_since(text, NOW)
    assert refused.value.field == "since" and "30m, 1h, 2d" in str(refused.value)


def _row(i, kind, subject, old, new, cause="user a", second=0, message=""):
    at = (NOW + dt.timedelta(seconds=second)).isoformat()
    return {"id": i, "at": at, "kind": kind, "subject": subject, "old_state": old, "new_state": new, "cause": cause,
            "message": message}  # fmt: skip


def test_one_task_is_one_line_per_object_and_other_causes_or_later_changes_stay_apart():
    stop = [  # oldest first, as written by a stop
        _row(1, "operation", "op1", None, "pending"),
        _row(2, "vm", "web", "running", "stopping"),
        _row(3, "operation", "op1", "pending", "running"),
        _row(4, "vm", "web", "stopping", "stopped", message="stopped"),
        _row(5, "operation", "op1", "running", "succeeded", second=1),
        _row(6, "vm", "web", "stopped", "starting", cause="user b", second=2),  # another's start
        _row(7, "vm", "web", "starting", "running", cause="user b", second=500),  # much later: apart
    ]
    shown = fold(list(reversed(stop)))  # listed newest first
    assert [(r["subject"], r["states"]) for r in shown] == [
        ("web", ["starting", "running"]),
        ("web", ["stopped", "starting"]),
        ("op1", [None, "pending", "running", "succeeded"]),
        ("web", ["running", "stopping", "stopped"]),
    ]
    assert shown[3]["message"] == "stopped" and shown[3]["id"] == 4 and shown[2]["id"] == 5


def test_operations_say_who_asked_and_events_take_a_span(orch, api):
    add_sim_hosts(orch, 1)
    add_basics(orch)
    orch.catalog.create_project("p", 8, 16384, 10)
    orch.catalog.create_token("dev", "member", "p", token="dev-token-1234567890")
    member = {"Authorization": "Bearer dev-token-1234567890"}
    body = {"name": "web", "project": "p", "offering": "small", "template": "tiny", "start": True}
    assert api.post("/api/v1/vms", json=body, headers=member).status_code == 202
    assert api.post("/api/v1/vms/web/stop", json={"force": True}).status_code == 202
    ops = api.get("/api/v1/operations").json()
    assert [(o["kind"], o["requested_by"]) for o in ops] == [("stop", "user admin"), ("start", "user dev")]
    assert api.get(f"/api/v1/operations/{ops[1]['id'][:8]}").json()["requested_by"] == "user dev"
    assert len(api.get("/api/v1/events", params={"since": "1h"}).json()) >= 6
    assert api.get("/api/v1/events", params={"since": "2999-01-01"}).json() == []
    bad = api.get("/api/v1/events", params={"since": "yesterday"})
    assert bad.status_code == 422 and bad.json()["field"] == "since"


def test_the_consoles_vm_page_and_pane_show_a_stop_as_one_line_per_object_and_the_events_page_every_change(db):
    con = build(db)
    try:
        admin = con.client(ADMIN)
        assert admin.post("/ui/vms/a1/stop", data={"force": "on", "csrf": csrf(ADMIN)}).status_code == 200
        card = text(admin.get("/ui/vms/a1").text.split("<h2>Events</h2>")[1])
        assert card.count("running → stopping → stopped") == 1, card
        assert "- → pending → running → succeeded" in card and card.count("stopping → stopped") == 1
        pane = text(admin.get("/ui/f/events?pane=1").text)
        assert "vm a1 running → stopping → stopped" in pane, pane
        log = text(admin.get("/ui/events").text)
        assert "running → stopping" in log and "stopping → stopped" in log  # the log itself: each change
    finally:
        con.o.close()
