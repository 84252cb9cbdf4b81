"""Usage graphs on sim hosts (issue 33): the sampler's rounds write points for every running VM, host and project
(rates right for a guest whose load is set), the tiers stay bounded and fold into means, a host that does not
answer leaves a gap (its pages still answer, drawn with the gap), a member sees its own VM's graph and not another
project's (404, as the pages do), and /metrics serves the latest values. Rounds are run by the test (no loop
thread): the sampler's `now` is given, so a day passes in no time."""

from __future__ import annotations

import re
import time

import pytest

from vmplane.core import stats as rules
from vmplane.core.stats import Point
from vmplane.hosts.drivers.simstats import set_guest_load
from vmplane.store import stats as store

from .ui_serverkit import ADMIN, ALPHA, build


@pytest.fixture
def con(db):
    console = build(db)
    yield console
    console.o.close()


def fabric(o):
    return next(iter(o.drivers.values())).fabric


def rounds(o, count: int, start: float, step: float = 60.0) -> list:
    """`count` sampling rounds `step` seconds apart (in the store's buckets), a few ms apart in fact."""
    done = []
    for i in range(count):
        done.append(o.stats.sample(start + i * step))
        time.sleep(0.002)  # the sim's counters grow with real time: readings apart
    return done


def vm_id(o, name: str) -> int:
    return o.vm(name).id


def series(o, kind: str, obj_id: int, tier=rules.FINE) -> list[tuple[int, Point]]:
    with o.db.read() as s:
        return store.series(s.connection(), kind, obj_id, tier, 0)


def test_points_appear_after_rounds_with_the_rates_of_the_guests_load(con):
    o = con.o
    set_guest_load(fabric(o), "vmplane-a2", 0.5)  # a2: 2 vCPUs, one kept busy
    now = time.time()
    first, _second = rounds(o, 2, now)
    assert first.hosts == 3 and not first.missed
    a2 = series(o, "vm", vm_id(o, "a2"))
    assert len(a2) == 2
    assert a2[0][1].cpu_pct is None and a2[0][1].mem_total_mib == 2048  # a first reading: levels only
    assert a2[1][1].cpu_pct == pytest.approx(50.0, abs=0.01)
    assert a2[1][1].cpu_cores == pytest.approx(1.0, abs=0.001)
    assert a2[1][1].disk_wr_bps > 0 and a2[1][1].net_tx_bps > 0
    host = o.vm("a2").host
    assert series(o, "host", host.id)[-1][1].cpu_cores >= 1.0  # the host's CPU counts its guest's
    alpha = o.catalog.project("alpha").id
    summed = series(o, "project", alpha)[-1][1]
    a1 = series(o, "vm", vm_id(o, "a1"))[-1][1]
    assert summed.cpu_cores == pytest.approx(a1.cpu_cores + a2[1][1].cpu_cores)  # running a1 and a2; a3 stopped
    assert summed.mem_total_mib == 1024 + 2048
    assert not series(o, "vm", vm_id(o, "a3"))  # stopped: no point


def test_a_restarted_guest_gives_no_rate_for_the_round_after_its_restart_never_a_negative_one(con):
    o = con.o
    now = time.time()
    rounds(o, 2, now)
    o.stop_vm("b1")
    o.start_vm("b1")  # a new QEMU: its counters start from zero again
    rounds(o, 2, now + 120)
    points = [p for _at, p in series(o, "vm", vm_id(o, "b1"))]
    assert [p.cpu_pct is None for p in points] == [True, False, True, False]
    assert all(p.cpu_pct is None or p.cpu_pct >= 0 for p in points)


def test_a_host_that_does_not_answer_leaves_a_gap_and_its_pages_still_answer(con):
    o = con.o
    host = o.vm("a1").host.name
    now = time.time()
    rounds(o, 2, now)
    fabric(o).fail_host(host, "network")
    missed = rounds(o, 2, now + 120)
    assert all(r.missed == [host] for r in missed)
    fabric(o).recover_host(host)
    rounds(o, 2, now + 240)
    buckets = [at for at, _p in series(o, "vm", vm_id(o, "a1"))]
    step = rules.FINE.step_s
    b0 = rules.bucket(now, rules.FINE)
    assert buckets == [b0, b0 + step, b0 + 4 * step, b0 + 5 * step]  # the two rounds it missed: a gap
    admin = con.client(ADMIN)
    page = admin.get("/ui/vms/a1")
    assert page.status_code == 200
    cpu = figure(page.text, "CPU")
    assert len(re.findall(r"<polyline ", cpu)) == 2  # drawn in two pieces, not across the gap
    assert admin.get(f"/ui/hosts/{host}").status_code == 200


def test_the_tiers_stay_bounded_over_a_month_and_coarse_points_are_the_means_of_their_minutes(db):
    now = 1_800_000_000.0
    with db.write() as s:
        conn = s.connection()
        for minute in range(26 * 60):  # 26 hours of a point a minute, cpu = the minute's number
            at = now + minute * 60
            store.write(conn, rules.FINE, rules.bucket(at, rules.FINE), [("vm", 1, Point(cpu_pct=float(minute)))])
            if minute % 10 == 9:
                store.fold(conn, rules.folded_bucket(at + 60))
        store.prune(conn, now + (26 * 60 - 1) * 60)  # at the last minute's reading
        assert store.per_object_max(conn, rules.FINE) <= rules.max_points(rules.FINE)
        coarse = store.series(conn, "vm", 1, rules.COARSE, 0)
        fine = store.series(conn, "vm", 1, rules.FINE, 0)
    assert len(fine) == rules.max_points(rules.FINE)  # the oldest two hours went
    first_at, first = coarse[0]
    minutes = [m for m in range(26 * 60) if first_at <= now + m * 60 < first_at + 600]
    assert first.cpu_pct == pytest.approx(sum(minutes) / len(minutes))
    with db.write() as s:
        conn = s.connection()
        store.prune(conn, now + 40 * 24 * 3600)  # a month and more later: nothing is kept
        assert store.rows(conn) == 0


def test_a_shorter_interval_overwrites_its_minute_and_folding_runs_once_per_coarse_bucket(con):
    o = con.o
    start = rules.bucket(time.time(), rules.COARSE) + 5.0
    done = rounds(o, 31, start, step=20.0)  # three rounds a minute for ten minutes, then one in the next bucket
    assert len(series(o, "vm", vm_id(o, "a1"))) == 11
    assert [r.folded for r in done].count(True) == 2  # at the first round, and once the bucket was complete
    ((at, point),) = series(o, "vm", vm_id(o, "a1"), rules.COARSE)  # the ten minutes, folded
    minutes = [p.mem_used_mib for b, p in series(o, "vm", vm_id(o, "a1")) if at <= b < at + rules.COARSE.step_s]
    assert len(minutes) == 10 and point.mem_used_mib == pytest.approx(sum(minutes) / 10)


def test_a_deleted_vms_points_go_at_the_next_fold(con):
    o = con.o
    start = rules.bucket(time.time(), rules.COARSE) + 5.0
    rounds(o, 2, start)
    gone = vm_id(o, "b1")
    o.stop_vm("b1")
    o.delete_vm("b1")
    assert series(o, "vm", gone)  # kept until its bucket is folded
    rounds(o, 1, start + 600)  # the next 10 minutes: b1's bucket folded, and b1 is no more
    assert not series(o, "vm", gone) and not series(o, "vm", gone, rules.COARSE)
    assert series(o, "vm", vm_id(o, "a1"), rules.COARSE)


def test_a_member_sees_its_own_vms_graph_and_not_another_projects(con):
    o = con.o
    rounds(o, 2, time.time())
    alpha = con.client(ALPHA)
    page = alpha.get("/ui/vms/a1")
    assert page.status_code == 200
    cpu = figure(page.text, "CPU")
    assert 'role="img"' in cpu and "<title>CPU: used " in cpu and "% (latest)" in cpu
    assert 'viewBox="0 0 300 80" width="100%"' in cpu  # never wider than the screen
    assert alpha.get("/ui/vms/b1").status_code == 404
    assert (
        alpha.get("/ui/projects/alpha").status_code == 200
        and 'data-graph="CPU (its VMs)"' in alpha.get("/ui/projects/alpha").text
    )
    assert alpha.get("/ui/projects/beta").status_code == 404
    api = con.api(ALPHA)
    own = api.get("/api/v1/vms/a1/stats")
    assert own.status_code == 200 and own.json()["latest"]["cpu_pct"] is not None
    assert api.get("/api/v1/vms/b1/stats").status_code == 404
    assert api.get("/api/v1/hosts/h1/stats").status_code == 403


def test_the_range_switches_the_graphs_span_and_a_bad_one_is_refused(con):
    admin = con.client(ADMIN)
    rounds(con.o, 2, time.time())
    assert "last day" in admin.get("/ui/vms/a1?range=day").text
    assert "last month" in admin.get("/ui/hosts/h1?range=month").text
    assert "No usage sampled yet" in admin.get("/ui/vms/a3").text
    assert con.api(ADMIN).get("/api/v1/vms/a1/stats?range=year").status_code == 422


def test_metrics_serve_each_vms_and_hosts_latest_values(con):
    o = con.o
    set_guest_load(fabric(o), "vmplane-a1", 0.25)
    rounds(o, 2, time.time())
    text = con.api(ADMIN).get("/metrics").text
    cpu = re.search(r'^vmplane_vm_cpu_percent\{vm="a1"\} (\S+)$', text, re.M)
    assert cpu and float(cpu.group(1)) == pytest.approx(25.0, abs=0.01)
    assert re.search(r'^vmplane_vm_memory_used_bytes\{vm="b1"\} \S+$', text, re.M)
    assert re.search(r'^vmplane_host_cpu_percent\{host="h\d"\} \S+$', text, re.M)
    assert 'vm="a3"' not in text  # stopped: no series


def figure(page: str, title: str) -> str:
    m = re.search(rf'<figure [^>]*data-graph="{re.escape(title)}">(.*?)</figure>', page, re.S)
    assert m, f"no graph {title}"
    return m.group(1)


def test_a_chart_breaks_its_line_at_a_missing_bucket_and_scales_to_a_round_top():
    from vmplane.ui import charts

    series = [(0, Point(cpu_pct=10.0)), (60, Point(cpu_pct=50.0)), (180, Point(cpu_pct=100.0))]
    c = charts.chart("CPU", [("used", "cpu_pct")], charts.percent, 100.0, series, 0, 240, 60)
    (line,) = c.lines
    assert line.segments == ["0.0,72.0 75.0,40.0", "225.0,0.0 300.0,0.0"]  # a gap at 120; a lone point: a dash
    assert c.summary == "CPU: used 100.0 % (latest)"
    mem = charts.chart(
        "Memory", [("used", "mem_used_mib")], charts.mib, None, [(0, Point(mem_used_mib=3000.0))], 0, 60, 60
    )
    assert mem.top == "5.0 GiB"  # (not 4.9: 5,000 MiB)
    assert charts.nice(0) == 1.0 and charts.nice(3.2) == 5.0 and charts.nice(120) == 200.0
