"""Crash safety on sim hosts: the control plane is SIGKILLed at every crash point (its workload steered toward
it) and at random moments, and each restart must leave a consistent cluster (see tests/crashkit.py for the
workload, the schedule and the checks). One cycle of the schedule here, its seed `--seed N` (default
crashkit.DEFAULT_SEED); the long run (1,000 rounds, several seeds) is bench/crash.py. A failing run keeps its
evidence (store, sim hosts, seed and replay command, fault log) in the folder its message names."""

import pytest

from vmplane.core import failpoints

from . import crashkit


def test_a_kill_at_every_crash_point_and_at_random_moments_leaves_a_consistent_cluster(tmp_path, harness_seed, request):
    """One cycle of crashkit.schedule: a round armed at each crash point (its workload steps toward it) and
    crashkit.TIMED_KILLS kills at a random moment, in an order drawn from the seed; a share of the restarts
    recover with the next point armed (no check in between)."""
    report = crashkit.run(tmp_path, seed=harness_seed, log=print)
    crashkit.assert_clean(report, request.node.nodeid)
    missed = set(crashkit.crash_points()) - report.points_hit()
    assert not missed, f"crash points never reached (seed {report.seed}): {sorted(missed)}\n{report.fault_log()}"
    assert sum(1 for r in report.kills if r.kill == "timed") == crashkit.TIMED_KILLS, report.fault_log()
    assert any(r.vms < 0 for r in report.kills), "no restart recovered with a crash point armed"
    assert max(r.vms for r in report.rounds) >= 5  # the cluster was busy, not empty


def test_failpoint_specs_are_checked():
    assert failpoints.parse("start.admitted=2, stop.after-domain") == {"start.admitted": 2, "stop.after-domain": 1}
    with pytest.raises(ValueError, match=r"unknown failpoint 'start.nowhere'"):
        failpoints.parse("start.nowhere=1")


# -- findings of the crash harness, pinned --------------------------------------------------------------
GIB = 1024


def _sim_cluster(db, executor=None):
    from vmplane.core.model import Offering, OfferingKind
    from vmplane.orchestrator import InlineExecutor, Orchestrator

    from .conftest import add_sim_hosts

    o = Orchestrator(db, executor or InlineExecutor())
    o.load()
    o.catalog.create_zone("z1")
    o.catalog.create_cluster("c1", "z1")
    add_sim_hosts(o, 2, cores=8, memory_mib=8 * GIB)
    o.catalog.set_setting("enable.dynamic.scale.vm", "true", "zone", "z1")
    o.catalog.create_offering(Offering("one", OfferingKind.fixed, vcpus=1, memory_mib=GIB, dynamic_scaling=True))
    o.catalog.create_offering(Offering("two", OfferingKind.fixed, vcpus=2, memory_mib=2 * GIB, dynamic_scaling=True))
    o.catalog.create_template("t", "tiny-linux", dynamic_scaling=True)
    o.catalog.create_project("p", 8, 16 * GIB, 10)
    return o


def test_a_migration_whose_domain_is_on_neither_host_records_the_vm_stopped_not_running(db, monkeypatch):
    """Round 49 of seed 20261129 (CI): a VM migrating out of a host that lost power, settled once the
    host answered again (empty): the domain on neither host. It was recorded running on its source
    (for the next full sync to fix, 30 s later); now stopped at once, charge and claims given back."""
    from vmplane.core.driver import DriverError

    from .conftest import ledger_usage

    o = _sim_cluster(db)
    try:
        o.create_vm("v", "p", "one", "t", start=True)
        source = o.vm("v").host.name
        src = o.drivers[source]

        def dies(name, to, params, progress=None):  # the source loses power mid-copy, then answers again
            src.fabric.remove(source, name)
            raise DriverError(source, "migration: end of file while reading data")

        monkeypatch.setattr(src, "migrate", dies)
        mig = o.migrator.migrate("v")
        row = o.migrator.get(mig["id"])
        assert row["state"] == "failed" and "neither" in row["reason"], row
        vm = o.vm("v")
        assert vm.state == "stopped" and vm.host is None and vm.charged_vcpus == 0
        assert ledger_usage(o, "p").vcpus == 0 and all(h.used_memory_mib == 0 for h in o.hosts())
        assert o.audit() == []
    finally:
        o.close()


def test_a_failed_scale_that_leaves_its_vm_running_where_no_domain_is_settles_it_at_once(db, monkeypatch):
    """A scale's failure path puts the VM back to running without asking (its domain could not be read
    back: kept at the larger size); a host brought back meanwhile skipped it (an operation owned it).
    The operation's end now settles it from its host: its domain is gone, so it is stopped."""
    o = _sim_cluster(db)
    try:
        o.create_vm("v", "p", "one", "t", start=True)
        host = o.vm("v").host.name
        drv = o.drivers[host]

        def vanishes(name, memory_mib):
            drv.fabric.remove(host, name)
            raise RuntimeError("connection reset by peer")

        monkeypatch.setattr(drv, "set_memory", vanishes)
        o.scaler.scale("v", offering="two")
        vm = o.vm("v")
        assert vm.state == "stopped" and vm.charged_vcpus == 0 and o.audit() == []
    finally:
        o.close()


def test_an_ha_vm_that_fits_nowhere_is_in_error_right_after_its_last_attempt(db):
    """Round 107 of seed 20261129 (local): the last attempt failed, then the recovery waited its 30 s
    backoff before giving up (and a pass that only waited for a migration lengthened the backoff): the
    recovery was still in flight 30 s later. Now: attempts after 0, 1 and 3 s, then error at once (the waits
    the recovery asked for are recorded: no 10 or 30 s backoff before the error)."""
    from concurrent.futures import ThreadPoolExecutor

    from vmplane.core.model import HostState

    o = _sim_cluster(db, ThreadPoolExecutor(4))
    waits: list[float] = []  # the recovery's waits between its passes, in order
    wait = o.ha.recovery._wait
    o.ha.recovery._wait = lambda seconds: (waits.append(seconds), wait(seconds))[1]
    try:
        o.catalog.set_setting("vmplane.ha.grace", "0")
        o.create_vm("a", "p", "one", "t", start=True, ha_policy="restart")
        _until(lambda: o.vm("a").state == "running", lambda: o.vm("a"), 60)
        host = o.vm("a").host.name
        other = next(h for h in o.drivers if h != host)
        o.set_host_state(other, HostState.disabled)  # no room anywhere
        o.drivers[host].fabric.fail_host(host, "power")
        o.check_hosts()
        assert o.ha.check()
        _until(lambda: o.vm("a").state == "error", lambda: o.operations(state="running"), 120)
        # attempts after 0, 1 and 3 s; no backoff of 10 or 30 s waited before the error
        assert [w for w in waits if w >= 1] == [1.0, 3.0], waits
        assert o.vm("a").charged_vcpus == 0
    finally:
        o.drivers["h1"].fabric.recover_host("h1")
        o.drivers["h2"].fabric.recover_host("h2")
        o.close()


def test_a_migration_into_a_fenced_host_is_settled_by_its_recovery_before_it_ends(db, monkeypatch):
    """Round 117 of seed 99 (local): an HA VM migrating to a host that lost power; the copy's own settle
    could not ask the target (down, not yet fenced), and the recovery of the target only waited for the
    migrations out of it: it ended with this one still copying (the VM left migrating, two claims), for
    the settle loop to find later. Now the recovery settles it once the target is fenced."""
    from concurrent.futures import ThreadPoolExecutor

    from vmplane.core.driver import DriverError

    o = _sim_cluster(db, ThreadPoolExecutor(4))
    try:
        o.catalog.set_setting("vmplane.ha.grace", "0")
        o.create_vm("a", "p", "one", "t", start=True, ha_policy="restart")
        _until(lambda: o.vm("a").state == "running", lambda: o.vm("a"))
        source = o.vm("a").host.name
        target = next(h for h in o.drivers if h != source)
        src = o.drivers[source]

        def target_dies(name, to, params, progress=None):
            src.fabric.fail_host(target, "power")
            raise DriverError(source, "migration: connection reset by peer")

        monkeypatch.setattr(src, "migrate", target_dies)
        mig = o.migrator.migrate("a", to=target)
        _until(lambda: "does not answer" in o.migrator.get(mig["id"])["waiting_for"], lambda: o.migrator.get(mig["id"]))
        o.check_hosts()
        assert o.ha.check()  # the target holds an HA VM's claim: declared, fenced, recovered
        _until(lambda: _recoveries_over(o), lambda: [(x.kind, x.target, x.message) for x in o.operations()])
        row = o.migrator.get(mig["id"])
        assert row["state"] == "failed" and o.host(target).state == "fenced", row
        vm = o.vm("a")
        assert vm.state == "running" and vm.host.name == source and o.audit() == []
    finally:
        for h in ("h1", "h2"):
            o.drivers[h].fabric.recover_host(h)
        o.close()


def _until(predicate, what, timeout_s: float = 60.0) -> None:
    """Wait for `predicate` (a generous bound: the machine may be loaded; `what` says what was seen)."""
    import time

    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout_s, what()
        time.sleep(0.02)


def _recoveries_over(o) -> bool:
    # pending first: an operation that moves from pending to running between the two reads is seen in one
    return not (o.operations(state="pending") + o.operations(state="running"))


def test_a_queued_migration_into_a_host_fenced_and_powered_on_again_is_not_copied_there(db, monkeypatch):
    """Round 48 of seed 20261129 (stop 26's first run): an HA VM ran on two hosts. Likely path: its
    migration into a host F waited in the queue while F failed, was fenced and was powered on again (empty)
    with the store still saying fenced; the pump then copied the VM into F, where F's recovery takes
    everything for off. Now a migration into or out of a host recorded down, fencing or fenced is never
    copied: it ends failed, its target claim given back."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from vmplane.core.model import HostState

    from .conftest import add_sim_hosts

    o = _sim_cluster(db, ThreadPoolExecutor(4))
    try:
        add_sim_hosts(o, 1, cores=8, memory_mib=8 * GIB, prefix="x")
        o.catalog.set_setting("vmplane.ha.grace", "0")
        o.catalog.set_setting("vmplane.migration.max.per.cluster", "1", "cluster", "c1")
        for h in ("h2", "x1"):
            o.set_host_state(h, HostState.disabled)
        o.create_vm("a", "p", "one", "t", start=True, ha_policy="restart")
        o.create_vm("b", "p", "one", "t", start=True)
        _until(lambda: {o.vm("a").state, o.vm("b").state} == {"running"}, lambda: o.vms())
        for h in ("h2", "x1"):
            o.set_host_state(h, HostState.enabled)
        source, release = o.drivers["h1"], threading.Event()
        real = source.migrate

        def held(name, to, params, progress=None):  # b's copy holds the cluster's only slot
            if name.endswith("-b"):
                release.wait(10)
            return real(name, to, params, progress)

        monkeypatch.setattr(source, "migrate", held)
        o.migrator.migrate("b", to="x1")
        queued = o.migrator.migrate("a", to="h2")
        assert queued["state"] == "queued"
        fabric = source.fabric
        fabric.fail_host("h2", "power")
        o.check_hosts()
        assert o.ha.check()  # h2 holds an HA VM's target claim: declared, fenced
        _until(lambda: o.host("h2").state == "fenced", lambda: o.host("h2"))
        fabric.recover_host("h2")  # powered on again, empty; the store still says fenced
        release.set()
        _until(lambda: not o.migrator.list(active_only=True), lambda: o.migrator.list())
        row = o.migrator.get(queued["id"])
        assert row["state"] == "failed" and "its target h2 is fenced" in row["reason"], row
        assert fabric.hosts_of("vmplane-a") == ["h1"]
        _until(lambda: _recoveries_over(o), lambda: o.operations(state="running"))
        o.check_hosts()  # h2 answers, its recovery is over: back
        vm = o.vm("a")
        assert (vm.state, vm.host.name, o.host("h2").state) == ("running", "h1", "enabled")
        assert fabric.hosts_of("vmplane-a") == ["h1"] and o.audit() == []
    finally:
        for h in ("h1", "h2", "x1"):
            o.drivers[h].fabric.recover_host(h)
        o.close()


def test_a_recovery_asks_its_fenced_host_that_answers_again_and_restarts_only_what_does_not_run_there(db, monkeypatch):
    """The recovery took everything on its fenced host for off, without asking. A host powered on again
    while its recovery runs answers: what it runs then (started there after its fence) is recorded
    running and not restarted elsewhere, so it never runs twice; what it does not run is restarted."""
    from concurrent.futures import ThreadPoolExecutor

    o = _sim_cluster(db, ThreadPoolExecutor(4))
    try:
        o.catalog.set_setting("vmplane.ha.grace", "0")
        for name in ("a", "b"):
            o.create_vm(name, "p", "one", "t", start=True, ha_policy="restart")
        _until(lambda: {o.vm("a").state, o.vm("b").state} == {"running"}, lambda: o.vms())
        host = o.vm("a").host.name
        fabric = o.drivers[host].fabric
        if o.vm("b").host.name != host:
            o.migrator.migrate("b", to=host)
            _until(lambda: o.vm("b").host.name == host and o.vm("b").state == "running", lambda: o.vm("b"))
        spec = fabric.spec(host, "vmplane-a")
        recovery = o.ha.recovery
        fenced = recovery._fenced

        def fenced_then_powered_on(op_id, h, how):
            done = fenced(op_id, h, how)
            fabric.recover_host(h)  # powered on again, empty, before the recovery restarts anything
            assert fabric.put(h, spec)  # and `a` runs there again (as a copy landing there would)
            return done

        monkeypatch.setattr(recovery, "_fenced", fenced_then_powered_on)
        fabric.fail_host(host, "power")
        o.check_hosts()
        assert o.ha.check()
        _until(lambda: _recoveries_over(o), lambda: o.operations(state="running"))
        other = next(h for h in o.drivers if h != host)
        assert fabric.hosts_of("vmplane-a") == [host] and fabric.hosts_of("vmplane-b") == [other]
        assert (o.vm("a").state, o.vm("a").host.name) == ("running", host)
        assert (o.vm("b").state, o.vm("b").host.name) == ("running", other)
        assert o.host(host).state == "down"  # it runs `a`: back to the monitor, not left fenced
        monkeypatch.undo()
        fabric.fail_host(host, "power")  # and fails again before the monitor brought it back:
        o.check_hosts()  # declared and fenced again, `a` restarted (never stranded
        assert o.ha.check()  # unknown on a fenced host that nothing declares again)
        _until(lambda: _recoveries_over(o), lambda: o.operations(state="running"))
        assert fabric.hosts_of("vmplane-a") == [other] and (o.vm("a").state, o.vm("a").host.name) == ("running", other)
        fabric.recover_host(host)
        o.check_hosts()
        assert o.host(host).state == "enabled" and o.audit() == []
    finally:
        for h in ("h1", "h2"):
            o.drivers[h].fabric.recover_host(h)
        o.close()


def test_a_migration_into_a_fenced_host_powered_on_again_is_settled_by_asking_it(db, monkeypatch):
    """A copy's settle took a fenced target for off without asking it. Powered on again while its recovery
    runs, the target is asked like any host: a VM that landed there (the copy libvirt carried on) is found
    there and recorded running there, once; not recorded stopped while it runs."""
    from concurrent.futures import ThreadPoolExecutor

    from vmplane.core.driver import DriverError

    o = _sim_cluster(db, ThreadPoolExecutor(4))
    try:
        o.catalog.set_setting("vmplane.ha.grace", "0")
        o.create_vm("a", "p", "one", "t", start=True, ha_policy="restart")
        _until(lambda: o.vm("a").state == "running", lambda: o.vm("a"))
        source = o.vm("a").host.name
        target = next(h for h in o.drivers if h != source)
        src, fabric = o.drivers[source], o.drivers[source].fabric

        def target_dies(name, to, params, progress=None):
            fabric.fail_host(target, "power")
            raise DriverError(source, "migration: connection reset by peer")

        monkeypatch.setattr(src, "migrate", target_dies)
        recovery = o.ha.recovery
        fenced = recovery._fenced

        def fenced_then_landed(op_id, h, how):
            done = fenced(op_id, h, how)
            fabric.recover_host(h)  # powered on again, and the domain lands there
            assert fabric.move("vmplane-a", source, h)
            return done

        monkeypatch.setattr(recovery, "_fenced", fenced_then_landed)
        mig = o.migrator.migrate("a", to=target)
        _until(lambda: "does not answer" in o.migrator.get(mig["id"])["waiting_for"], lambda: o.migrator.get(mig["id"]))
        o.check_hosts()
        assert o.ha.check()
        _until(
            lambda: _recoveries_over(o) and not o.migrator.list(active_only=True),
            lambda: (o.operations(state="running"), o.migrator.list()),
        )
        assert o.migrator.get(mig["id"])["state"] == "succeeded"
        assert fabric.hosts_of("vmplane-a") == [target]
        assert (o.vm("a").state, o.vm("a").host.name) == ("running", target)
        assert o.host(target).state == "down"
        o.check_hosts()
        assert o.host(target).state == "enabled" and o.audit() == []
    finally:
        for h in ("h1", "h2"):
            o.drivers[h].fabric.recover_host(h)
        o.close()


def test_a_hot_plug_cut_short_on_a_host_that_then_fails_is_settled_from_the_vms_new_host(orch, monkeypatch):
    """Round 101 of seed 20261129 (CI, stop 23): the control plane died between recording a hot-plug
    (`attaching`) and asking the host; the host failed, so the next start's recovery could not ask it and
    left the volume attaching (unknown is not absent); HA then fenced the host and restarted the VM
    elsewhere. The storage-settle pass after that (its loop runs every 10 s) reads the new host back."""
    from .test_storage_sim import setup

    class Killed(BaseException):
        """The process dying at the crash point (nothing after it runs)."""

    setup(orch, shared=True)
    orch.catalog.set_setting("vmplane.ha.grace", "0")
    orch.create_vm("a", "p", "small", "disk", start=True, ha_policy="restart")
    orch.volumes.create("data", "p", 512)
    host = orch.vm("a").host.name
    fabric = orch.drivers[host].fabric

    def dies_before_asking(name):
        if name == "volume.before-attach":
            raise Killed(name)

    monkeypatch.setattr(failpoints, "hit", dies_before_asking)
    with pytest.raises(Killed):
        orch.volumes.attach("data", "a")
    monkeypatch.undo()
    try:
        fabric.fail_host(host, "network")
        assert orch.storage_settle.run_once(min_age_s=0) == []
        assert orch.volumes.row("data").state == "attaching"  # its host does not answer: not guessed
        orch.check_hosts()
        assert orch.ha.check()
        _until(lambda: orch.vm("a").state == "running" and orch.vm("a").host.name != host, lambda: orch.vm("a"))
        vm = orch.vm("a")
        assert orch.storage_settle.run_once(min_age_s=0) == ["data"]
        v = orch.volumes.row("data")
        assert (v.state, v.vm_name) == ("attached", "a")
        assert any(p.endswith(v.file_name) for p in orch.drivers[vm.host.name].domain_disks("vmplane-a").values())
        assert orch.audit() == []
    finally:
        fabric.recover_host(host)
