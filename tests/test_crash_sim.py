"""Crash safety on sim hosts: the control plane is SIGKILLed at every crash point and at random
moments of a random workload, at least 100 times, and each restart must leave a consistent cluster
(see tests/crashkit.py for the workload and the checks). The long run is bench/crash.py."""

import pytest

from vmplane import failpoints

from . import crashkit


def test_more_than_100_kills_at_every_crash_point_leave_a_consistent_cluster(tmp_path):
    report = crashkit.run(tmp_path, rounds=135, seed=20261129, log=print)      # (HA: its points are missed more)
    assert report.problems() == []
    assert len(report.kills) >= 100
    assert report.points_hit() == set(crashkit.crash_points()), "a crash point was never reached by the workload"
    assert sum(1 for r in report.kills if r.kill == "timed") >= 20
    assert max(r.vms for r in report.rounds) >= 10      # the cluster was busy, not empty


def test_failpoint_specs_are_checked():
    assert failpoints.parse("start.admitted=2, stop.after-domain") == {"start.admitted": 2, "stop.after-domain": 1}
    with pytest.raises(ValueError, match="unknown failpoint 'start.nowhere'"):
        failpoints.parse("start.nowhere=1")
