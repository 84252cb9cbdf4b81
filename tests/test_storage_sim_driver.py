"""The sim driver's storage (drivers/simstorage.py): pools with capacity, volumes, disks that must exist
and that two running domains never open for writing, disk hot-plug with unconfirmed detaches, and
migrations that copy disks at a rate, with libvirt's refusals and failures.

The sim's durations (a copy at its rate, a late detach) are read on a fake clock (tests/fakeclock.py, the
`clock` fixture): exact whatever the machine's load. How fast the fabric itself is: bench/timing.py."""

import struct
import time

import pytest

from vmplane.core import driver as driver_base
from vmplane.core.driver import (
    DiskSpec,
    DomainSpec,
    DriverError,
    HostInfo,
    MigrationParams,
    PoolSpec,
)
from vmplane.hosts.drivers import sim as sim_module
from vmplane.hosts.drivers import simfabric as simfabric_module
from vmplane.hosts.drivers import simstorage as simstorage_module
from vmplane.hosts.drivers.sim import SimDriver
from vmplane.hosts.drivers.simfabric import SimFabric
from vmplane.hosts.drivers.simfaults import SimFaults
from vmplane.hosts.drivers.simstorage import SHARED, SHARED_ROOT

from . import fakeclock

LOCAL = PoolSpec("local", "/var/lib/vmplane/pools/local")
SHARED_POOL = PoolSpec("shared", SHARED_ROOT + "pool")
TIB = 1 << 20


@pytest.fixture
def fabric():
    f = SimFabric()
    f.disk_copy_rate_mib_s = None  # instant unless a test sets a rate
    yield f
    assert_usage_counted(f)
    f.close()


def assert_usage_counted(fabric):
    """The per-storage allocation the triggers keep == recounted from the files."""
    with fabric._lock:
        kept = dict(fabric._db.execute("SELECT storage, mib FROM used WHERE mib != 0").fetchall())
        counted = dict(
            fabric._db.execute(
                "SELECT storage, SUM(allocation_mib) FROM files GROUP BY storage HAVING SUM(allocation_mib) != 0"
            ).fetchall()
        )
    assert kept == counted


def hosts(fabric, *names, pools=(LOCAL, SHARED_POOL)):
    drivers = [SimDriver(n, HostInfo(16, 2400, 65536), fabric) for n in names]
    for d in drivers:
        for p in pools:
            d.define_pool(p)
    return drivers


@pytest.fixture
def clock(monkeypatch) -> fakeclock.FakeTime:
    """The sim driver's, its fabric's and its storage's clock, and the unplug wait's (drivers/base.py),
    moved only by their own sleeps and by the test."""
    fake = fakeclock.install(monkeypatch, sim_module, simfabric_module, simstorage_module, driver_base)
    monkeypatch.setattr(driver_base.confirm_unplug, "__defaults__", (fake.sleep,))  # its `pause`
    return fake


@pytest.fixture
def h1(fabric):
    return hosts(fabric, "h1")[0]


@pytest.fixture
def pair(fabric):
    return hosts(fabric, "h1", "h2")


def disk(volume, pool=LOCAL, target="vda", readonly=False, format="qcow2"):
    return DiskSpec(pool.name, volume, f"{pool.path}/{volume}", target, format, readonly)


def vm(name, *disks, memory=1024, image=""):
    return DomainSpec(name, 1, 1, memory, memory, image, disks=tuple(disks))


def image(driver, pool=LOCAL, name="base.qcow2", capacity=2048):
    """A template image in the pool and a root disk overlay on it."""
    return driver.create_volume(pool.name, name, capacity, "qcow2")


def overlay(driver, name, pool=LOCAL, capacity=8192, base="base.qcow2"):
    return driver.create_volume(
        pool.name, name, capacity, "qcow2", backing=f"{pool.path}/{base}", backing_format="qcow2"
    )


# -- pools ---------------------------------------------------------------------------------------------
def test_define_pool_is_idempotent_and_refuses_another_path_or_a_second_name_for_a_path(h1):
    assert h1.define_pool(LOCAL) == h1.pool_info("local")
    with pytest.raises(DriverError, match="already defined with path"):
        h1.define_pool(PoolSpec("local", "/elsewhere"))
    with pytest.raises(DriverError, match="Storage source conflict"):
        h1.define_pool(PoolSpec("again", LOCAL.path))
    h1.fabric.set_pool_state("h1", "local", "inactive")
    with pytest.raises(DriverError, match="not active"):
        h1.volumes("local")
    assert h1.define_pool(LOCAL).state == "running"  # an existing pool is started


def test_pools_report_their_storage_with_default_and_settable_capacity(fabric, pair):
    h1, h2 = pair
    assert h1.pool_info("local").capacity_mib == TIB
    assert h1.pool_info("shared").capacity_mib == 10 * TIB
    fabric.set_capacity("h1", 4096)
    fabric.set_capacity(SHARED, 100_000)
    assert (h1.pool_info("local").capacity_mib, h2.pool_info("local").capacity_mib) == (4096, TIB)
    assert h2.pool_info("shared").capacity_mib == 100_000
    h1.create_volume("local", "r", 1000, "raw")
    info = h1.pool_info("local")
    assert (info.allocation_mib, info.available_mib) == (1000, 3096)
    # a second pool on the same disk reports the same file system (as a libvirt dir pool)
    h1.define_pool(PoolSpec("other", "/srv/other"))
    assert h1.pool_info("other").available_mib == 3096
    with pytest.raises(DriverError, match="No space left on device"):
        h1.create_volume("other", "big", 4000, "raw")
    assert h1.volume("other", "big") is None


def test_remove_pool_leaves_its_files_and_an_unknown_pool_is_none(h1):
    h1.create_volume("local", "v", 10)
    h1.remove_pool("local")
    h1.remove_pool("local")  # absent is fine
    assert h1.pool_info("local") is None
    with pytest.raises(DriverError, match="Storage pool not found"):
        h1.volumes("local")
    h1.define_pool(LOCAL)
    assert [v.name for v in h1.volumes("local")] == ["v"]


def test_a_shared_path_is_one_storage_for_every_host_a_local_path_one_per_host(pair):
    h1, h2 = pair
    h1.create_volume("shared", "s", 100)
    h1.create_volume("local", "l", 100)
    assert h2.volume("shared", "s").path == SHARED_ROOT + "pool/s"
    assert h2.volume("local", "l") is None
    # a pool at another shared path on h2 sees nothing of this one
    h2.define_pool(PoolSpec("shared2", SHARED_ROOT + "other"))
    assert h2.volumes("shared2") == []


# -- volumes -------------------------------------------------------------------------------------------
def test_volumes_allocate_as_qcow2_overlays_and_raw_files_do(h1):
    base = image(h1)
    assert (base.format, base.capacity_mib, base.allocation_mib) == ("qcow2", 2048, 1)
    root = overlay(h1, "root.qcow2")
    assert (root.capacity_mib, root.allocation_mib, root.backing) == (8192, 1, f"{LOCAL.path}/base.qcow2")
    assert root.path == f"{LOCAL.path}/root.qcow2"
    raw = h1.create_volume("local", "data.raw", 300, "raw")
    assert raw.allocation_mib == 300
    assert h1.pool_info("local").allocation_mib == 302
    assert h1.create_volume("local", "data.raw", 999, "raw") == raw  # there already: returned as it is
    assert [v.name for v in h1.volumes("local")] == ["base.qcow2", "data.raw", "root.qcow2"]


def test_an_overlay_needs_its_backing_file_of_that_format(h1):
    with pytest.raises(DriverError, match="Cannot access backing file"):
        overlay(h1, "root.qcow2")
    h1.create_volume("local", "base.qcow2", 10, "raw")
    with pytest.raises(DriverError, match="not qcow2"):
        overlay(h1, "root.qcow2")
    with pytest.raises(DriverError, match="invalid volume name"):
        h1.create_volume("local", "a/b", 10)


def test_the_guest_writes_into_its_overlay_until_the_storage_is_full_then_it_pauses(fabric, h1):
    fabric.set_capacity("h1", 200)
    image(h1)
    overlay(h1, "root.qcow2", capacity=150)
    h1.start(vm("v", disk("root.qcow2")))
    assert h1.guest_write("v", "vda", 100) == 100
    assert h1.volume("local", "root.qcow2").allocation_mib == 101
    assert h1.guest_write("v", "vda", 500) == 50  # no more than the disk's capacity
    assert h1.domain("v").running
    h1.create_volume("local", "filler", 47, "raw")  # 1 MiB left on the disk
    h1.grow_disk("v", "vda", 400)
    assert h1.guest_write("v", "vda", 10) == 1
    info = h1.domain("v")
    assert (info.state, info.reason) == ("paused", "ioerror")


def test_upload_records_the_source_size_and_a_qcow2_s_virtual_size(h1, tmp_path):
    raw = tmp_path / "t.raw"
    raw.write_bytes(b"\0" * (3 * (1 << 20) + 5))
    info = h1.upload_volume("local", "t.raw", str(raw), "raw")
    assert (info.format, info.capacity_mib, info.allocation_mib) == ("raw", 4, 4)
    qcow = tmp_path / "t.qcow2"
    qcow.write_bytes(b"QFI\xfb" + b"\0" * 20 + struct.pack(">Q", 5 << 30) + b"\0" * 100)
    info = h1.upload_volume("local", "t.qcow2", str(qcow), "qcow2")
    assert (info.capacity_mib, info.allocation_mib) == (5120, 1)
    with pytest.raises(DriverError, match="already in use"):
        h1.upload_volume("local", "t.qcow2", str(qcow), "qcow2")
    with pytest.raises(DriverError, match="cannot read"):
        h1.upload_volume("local", "x", str(tmp_path / "missing"), "raw")


def test_delete_and_resize_are_refused_while_a_running_domain_uses_the_volume(h1):
    image(h1)
    overlay(h1, "root.qcow2")
    h1.create_volume("local", "unused", 10)
    h1.delete_volume("local", "unused")
    h1.delete_volume("local", "unused")  # absent is fine
    h1.start(vm("v", disk("root.qcow2")))
    with pytest.raises(DriverError, match="in use by domain v on h1"):
        h1.delete_volume("local", "root.qcow2")
    with pytest.raises(DriverError, match="in use by domain v"):
        h1.delete_volume("local", "base.qcow2")  # the backing file of its disk
    with pytest.raises(DriverError, match="in use by running domain v"):
        h1.resize_volume("local", "root.qcow2", 10000)
    h1.grow_disk("v", "vda", 10000)  # live: blockResize
    assert h1.volume("local", "root.qcow2").capacity_mib == 10000
    with pytest.raises(DriverError, match="shrink"):
        h1.grow_disk("v", "vda", 100)
    h1.stop("v")
    assert h1.resize_volume("local", "root.qcow2", 12000).capacity_mib == 12000
    with pytest.raises(DriverError, match="shrink"):
        h1.resize_volume("local", "root.qcow2", 100)
    h1.delete_volume("local", "root.qcow2")
    h1.delete_volume("local", "base.qcow2")
    assert h1.volumes("local") == []


# -- domains with disks --------------------------------------------------------------------------------
def test_start_records_the_disks_and_refuses_a_file_the_host_does_not_see(pair):
    h1, h2 = pair
    image(h1)
    overlay(h1, "root.qcow2")
    h1.create_volume("local", "data", 100, "raw")
    spec = vm("v", disk("root.qcow2"), disk("data", target="vdb", format="raw"))
    with pytest.raises(DriverError, match="Cannot access storage file"):
        h2.start(spec)  # the same path on h2's own disk: no such file
    with pytest.raises(DriverError, match="no disk to boot from"):
        h1.start(vm("v"))
    h1.start(spec)
    assert h1.domain_disks("v") == {"vda": f"{LOCAL.path}/root.qcow2", "vdb": f"{LOCAL.path}/data"}
    assert h1.fabric.spec("h1", "v").disks == spec.disks
    with pytest.raises(DriverError, match="not raw"):
        h1.start(vm("w", disk("root.qcow2", format="raw")))


def test_never_two_writers_on_a_shared_file_even_across_hosts(fabric):
    h1, h2, h3 = hosts(fabric, "h1", "h2", "h3")
    image(h1, SHARED_POOL)
    overlay(h1, "root.qcow2", SHARED_POOL)
    h1.start(vm("a", disk("root.qcow2", SHARED_POOL)))
    for driver in (h2, h3, h1):
        with pytest.raises(DriverError, match=r"resource busy.*domain a on h1"):
            driver.start(vm("b", disk("root.qcow2", SHARED_POOL)))
    assert fabric.hosts_of("b") == []
    # read-only openers take no lease; a crashed (shut-off) domain holds none
    h2.start(vm("r", disk("root.qcow2", SHARED_POOL, readonly=True)))
    fabric.set_state("h1", "a", "shutoff", "crashed")
    h2.start(vm("b", disk("root.qcow2", SHARED_POOL)))
    with pytest.raises(DriverError, match=r"resource busy.*domain b on h2"):
        h1.start(vm("a", disk("root.qcow2", SHARED_POOL)))


def test_the_same_local_path_on_two_hosts_is_two_files(pair):
    h1, h2 = pair
    for h in pair:
        image(h)
        overlay(h, "root.qcow2")
    h1.start(vm("a", disk("root.qcow2")))
    h2.start(vm("b", disk("root.qcow2")))
    with pytest.raises(DriverError, match="resource busy"):
        h1.start(vm("c", disk("root.qcow2")))


def test_attach_and_a_confirmed_detach_on_a_running_domain(pair):
    h1, h2 = pair
    image(h1, SHARED_POOL)
    overlay(h1, "root.qcow2", SHARED_POOL)
    h1.create_volume("shared", "vol", 100)
    h1.start(vm("v", disk("root.qcow2", SHARED_POOL)))
    with pytest.raises(DriverError, match="is not running here"):
        h1.attach_disk("nope", disk("vol", SHARED_POOL, "vdb"))
    with pytest.raises(DriverError, match="already exists"):
        h1.attach_disk("v", disk("vol", SHARED_POOL, "vda"))
    with pytest.raises(DriverError, match="Cannot access storage file"):
        h1.attach_disk("v", disk("missing", SHARED_POOL, "vdb"))
    h1.attach_disk("v", disk("vol", SHARED_POOL, "vdb"))
    assert h1.domain_disks("v")["vdb"] == SHARED_ROOT + "pool/vol"
    with pytest.raises(DriverError, match="in use"):
        h1.delete_volume("shared", "vol")
    h2.create_volume("local", "root", 10)
    h2.start(vm("w", disk("root")))
    with pytest.raises(DriverError, match=r"resource busy.*domain v on h1"):
        h2.attach_disk("w", disk("vol", SHARED_POOL, "vdb"))
    h1.detach_disk("v", "vdb")
    assert list(h1.domain_disks("v")) == ["vda"]
    with pytest.raises(DriverError, match="no such disk"):
        h1.detach_disk("v", "vdb")
    h2.attach_disk("w", disk("vol", SHARED_POOL, "vdb"))  # the volume moves on to another VM
    assert h2.domain_disks("w") == {"vda": f"{LOCAL.path}/root", "vdb": SHARED_ROOT + "pool/vol"}


def test_a_detach_the_guest_never_completes_is_not_confirmed_one_it_completes_late_is(fabric, h1, clock):
    image(h1)
    overlay(h1, "root.qcow2")
    h1.create_volume("local", "vol", 100)
    h1.start(vm("v", disk("root.qcow2")))
    h1.attach_disk("v", disk("vol", target="vdb"))
    fabric.faults = SimFaults(seed=1, detach_never=1.0)
    with pytest.raises(DriverError, match="disk vdb of v still attached after 3 unplug requests"):
        h1.detach_disk("v", "vdb")
    assert "vdb" in h1.domain_disks("v")
    assert fabric.faults.counts["detach_never"] == 3
    fabric.faults = SimFaults(seed=1, detach_late=1.0, unplug_delay_s=(0.05, 0.1))
    h1.detach_disk("v", "vdb")  # completes within the wait
    assert "vdb" not in h1.domain_disks("v")
    h1.attach_disk("v", disk("vol", target="vdb"))
    fabric.faults = SimFaults(seed=1, detach_late=1.0, unplug_delay_s=(0.6, 0.7))
    with pytest.raises(DriverError, match="still attached"):
        h1.detach_disk("v", "vdb")  # later than vmplane waits (3 x 0.15 s) ...
    assert not fabric.settled() and "vdb" in h1.domain_disks("v")
    clock.advance(0.7)
    assert "vdb" not in h1.domain_disks("v")  # ... but it does complete
    assert fabric.settled()


def test_faults_on_volume_calls_a_transient_error_and_an_error_after_the_effect(fabric, h1):
    fabric.faults = SimFaults(seed=3, transient=1.0, restart_s=(0.01, 0.02))
    with pytest.raises(DriverError, match="daemon restarting"):
        h1.create_volume("local", "v", 10)
    fabric.faults = None
    assert h1.volume("local", "v") is None
    time.sleep(0.05)  # the daemon's restart (at most 0.02 s of this clock) is over: a sleep lasts at least that
    fabric.faults = SimFaults(seed=3, partial=1.0)
    with pytest.raises(DriverError, match="after the change was made"):
        h1.create_volume("local", "v", 10)
    with pytest.raises(DriverError, match="after the change was made"):
        h1.delete_volume("local", "v")
    fabric.faults = None
    assert h1.volume("local", "v") is None


# -- migration with storage ----------------------------------------------------------------------------
def start_local(pair, name="v", written=100, memory=256):
    h1, h2 = pair
    for h in pair:
        image(h)
    overlay(h1, f"{name}.qcow2")
    h1.start(vm(name, disk(f"{name}.qcow2"), memory=memory))
    h1.guest_write(name, "vda", written)
    return h1, h2


def test_a_local_disk_must_be_copied_onto_an_overlay_already_on_the_target(pair):
    h1, h2 = start_local(pair)
    with pytest.raises(DriverError, match="Unsafe migration"):
        h1.migrate("v", h2, MigrationParams())
    with pytest.raises(DriverError, match="not on storage h1 and h2 share"):
        h1.migrate("v", h2, MigrationParams(shared_disks=True))
    with pytest.raises(DriverError, match="has no disk vdb"):
        h1.migrate("v", h2, MigrationParams(copy_disks=("vdb",)))
    with pytest.raises(DriverError, match="create the overlay of disk vda there first"):
        h1.migrate("v", h2, MigrationParams(copy_disks=("vda",)))
    overlay(h2, "v.qcow2", capacity=4096)
    with pytest.raises(DriverError, match="different sizes"):
        h1.migrate("v", h2, MigrationParams(copy_disks=("vda",)))
    h2.delete_volume("local", "v.qcow2")
    overlay(h2, "v.qcow2")
    assert h2.volume("local", "v.qcow2").allocation_mib == 1
    assert fabric_hosts(h1, "v") == ["h1"]
    stats = h1.migrate("v", h2, MigrationParams(copy_disks=("vda",)))
    assert fabric_hosts(h1, "v") == ["h2"]
    assert stats.extra["disk_bytes"] == 101 << 20
    assert stats.bytes_sent == (101 + 256) << 20
    assert h2.volume("local", "v.qcow2").allocation_mib == 101
    assert h1.volume("local", "v.qcow2").allocation_mib == 101  # the source's overlay is left
    assert h2.domain_disks("v") == {"vda": f"{LOCAL.path}/v.qcow2"}
    h1.delete_volume("local", "v.qcow2")  # no longer in use on h1
    with pytest.raises(DriverError, match="in use by domain v on h2"):
        h2.delete_volume("local", "v.qcow2")


def fabric_hosts(driver, name):
    return driver.fabric.hosts_of(name)


def test_a_disk_on_shared_storage_is_not_copied_and_must_not_be(pair, clock):
    h1, h2 = pair
    image(h1, SHARED_POOL)
    overlay(h1, "v.qcow2", SHARED_POOL)
    h1.start(vm("v", disk("v.qcow2", SHARED_POOL)))
    h1.guest_write("v", "vda", 500)
    with pytest.raises(DriverError, match="onto itself"):
        h1.migrate("v", h2, MigrationParams(copy_disks=("vda",)))
    h1.disk_copy_rate_mib_s = 1.0  # would take minutes: nothing is copied
    stats = h1.migrate("v", h2, MigrationParams(shared_disks=True))
    assert stats.extra["disk_bytes"] == 0 and stats.total_ms == 0 and clock.slept == []  # no time copying
    assert fabric_hosts(h1, "v") == ["h2"]
    with pytest.raises(DriverError, match=r"resource busy.*domain v on h2"):  # the lease went along
        h1.start(vm("w", disk("v.qcow2", SHARED_POOL)))


def timed_migration(fabric, clock, names, written, rate):
    """A migration copying the disk `vda` (`written` MiB + its 1 MiB overlay) at `rate`: the sim clock's
    seconds it took, its stats and its progress reports."""
    h1, h2 = hosts(fabric, *names)
    start_local((h1, h2), written=written)
    overlay(h2, "v.qcow2")
    h1.disk_copy_rate_mib_s = rate
    seen = []
    t0 = clock.monotonic()
    stats = h1.migrate("v", h2, MigrationParams(copy_disks=("vda",)), lambda p, m: seen.append((p, m)))
    return clock.monotonic() - t0, stats, seen


def test_the_disk_copy_takes_disk_bytes_over_the_rate_and_progress_counts_them(fabric, clock):
    small, _, _ = timed_migration(fabric, clock, ("a1", "a2"), written=19, rate=400)  # 20 MiB
    large, stats_large, seen = timed_migration(fabric, clock, ("b1", "b2"), written=119, rate=400)  # 120 MiB
    assert small == pytest.approx(20 / 400) and large == pytest.approx(120 / 400)
    assert stats_large.extra["disk_bytes"] == 120 << 20
    assert any("of 120 MiB of disks" in m for _, m in seen)
    assert seen[-1] == (100, "switched over")
    assert [p for p, _ in seen] == sorted(p for p, _ in seen)
    # the migration bandwidth caps the mirror too; the memory copy comes after the disks
    h1, h2 = hosts(fabric, "c1", "c2")
    start_local((h1, h2), written=19, memory=100)
    overlay(h2, "v.qcow2")
    h1.disk_copy_rate_mib_s = 10_000
    h1.copy_rate_mib_s = 1000  # 0.1 s of memory
    t0 = clock.monotonic()
    h1.migrate("v", h2, MigrationParams(copy_disks=("vda",), bandwidth_mib_s=200))  # 0.1 s of disk (not 0.002)
    assert clock.monotonic() - t0 == pytest.approx(20 / 200 + 100 / 1000)


def test_the_fabric_rate_is_the_default_for_every_driver(fabric, clock):
    fabric.disk_copy_rate_mib_s = 500
    h1, h2 = hosts(fabric, "h1", "h2")
    start_local((h1, h2), written=99)
    overlay(h2, "v.qcow2")
    t0 = clock.monotonic()
    h1.migrate("v", h2, MigrationParams(copy_disks=("vda",)))
    assert clock.monotonic() - t0 == pytest.approx(100 / 500)


def test_the_knobs_can_come_from_the_environment(monkeypatch, clock):
    """For a sim cluster in its own process (`vmplane up --driver sim`), whose fabric a test can't reach."""
    monkeypatch.setenv("VMPLANE_SIM_LOCAL_POOL_MIB", "1000")
    monkeypatch.setenv("VMPLANE_SIM_SHARED_POOL_MIB", "3000")
    monkeypatch.setenv("VMPLANE_SIM_DISK_COPY_RATE_MIB_S", "0")  # 0: disks copy at once
    fabric = SimFabric()
    h1, h2 = hosts(fabric, "h1", "h2")
    assert (h1.pool_info("local").capacity_mib, h1.pool_info("shared").capacity_mib) == (1000, 3000)
    start_local((h1, h2), written=900)
    overlay(h2, "v.qcow2")
    t0 = clock.monotonic()
    h1.migrate("v", h2, MigrationParams(copy_disks=("vda",)))
    assert clock.monotonic() - t0 == 0 and clock.slept == []  # 900 MiB copied at once: no time
    fabric.close()


def test_an_aborted_disk_copy_leaves_the_target_overlay_partly_written(fabric, pair, clock):
    h1, h2 = start_local(pair, written=199)
    overlay(h2, "v.qcow2")
    h1.disk_copy_rate_mib_s = 1000  # 0.2 s

    def abort_once_under_way(percent, message):  # the cancel comes while the disk is being copied
        if 0 < percent < 100:
            h1.abort_migration("v")

    with pytest.raises(DriverError, match="cancelled"):
        h1.migrate("v", h2, MigrationParams(copy_disks=("vda",)), abort_once_under_way)
    assert fabric_hosts(h1, "v") == ["h1"]
    assert 1 < h2.volume("local", "v.qcow2").allocation_mib < 200


def test_a_copy_error_mid_copy_leaves_the_domain_here_and_the_target_overlay_partly_written(fabric, pair):
    h1, h2 = start_local(pair, written=199)
    overlay(h2, "v.qcow2")
    fabric.faults = SimFaults(seed=5, disk_copy_error=1.0)
    with pytest.raises(DriverError, match=r"copying its disks to h2 failed after .* Input/output error"):
        h1.migrate("v", h2, MigrationParams(copy_disks=("vda",)))
    fabric.faults = None
    assert fabric_hosts(h1, "v") == ["h1"] and h1.domain("v").running
    assert 1 < h2.volume("local", "v.qcow2").allocation_mib < 200
    h1.migrate("v", h2, MigrationParams(copy_disks=("vda",)))  # again, on the partial overlay
    assert h2.volume("local", "v.qcow2").allocation_mib == 200


def test_a_target_that_runs_out_of_space_fails_the_copy(fabric, pair):
    h1, h2 = start_local(pair, written=199)
    overlay(h2, "v.qcow2")
    fabric.set_capacity("h2", 52)  # 2 MiB used (the image, the overlay): 50 MiB left
    with pytest.raises(DriverError, match="failed after 51 of 200 MiB: No space left on device"):
        h1.migrate("v", h2, MigrationParams(copy_disks=("vda",)))
    assert h2.pool_info("local").available_mib == 0
    assert fabric_hosts(h1, "v") == ["h1"]


def test_a_lost_connection_copy_goes_on_and_completes_the_disks(fabric, pair):
    h1, h2 = start_local(pair, written=49)
    overlay(h2, "v.qcow2")
    fabric.faults = SimFaults(seed=2, lost_connection=1.0, copy_delay_s=(0.01, 0.02))
    with pytest.raises(DriverError, match="connection was lost"):
        h1.migrate("v", h2, MigrationParams(copy_disks=("vda",)))
    fabric.faults = None
    deadline = time.monotonic() + 60
    while h1.migration_active("v"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert fabric_hosts(h1, "v") == ["h2"]
    assert h2.volume("local", "v.qcow2").allocation_mib == 50
    assert h2.domain_disks("v") == {"vda": f"{LOCAL.path}/v.qcow2"}


def test_a_failed_post_copy_leaves_the_disks_on_both_then_on_the_target(fabric, pair):
    h1, h2 = start_local(pair, written=9)
    overlay(h2, "v.qcow2")
    fabric.faults = SimFaults(seed=2, postcopy_failed=1.0)
    with pytest.raises(DriverError, match="post-copy failed"):
        h1.migrate("v", h2, MigrationParams(copy_disks=("vda",), postcopy=True))
    fabric.faults = None
    assert h1.domain_disks("v") == h2.domain_disks("v")
    h1.resume_postcopy("v", h2, MigrationParams())
    assert fabric_hosts(h1, "v") == ["h2"]
    h1.delete_volume("local", "v.qcow2")


# -- the fabric: across processes, at scale --------------------------------------------------------
def test_storage_lives_in_the_fabric_file_shared_by_processes(tmp_path):
    a, b = SimFabric(tmp_path / "f.sim-hosts"), SimFabric(tmp_path / "f.sim-hosts")
    try:
        (ha,) = hosts(a, "h1")
        (hb,) = hosts(b, "h2")
        a.set_capacity(SHARED, 5000)
        assert hb.pool_info("shared").capacity_mib == 5000
        ha.create_volume("shared", "root", 100)
        ha.start(vm("v", disk("root", SHARED_POOL)))
        with pytest.raises(DriverError, match="resource busy"):
            hb.start(vm("w", disk("root", SHARED_POOL)))
        assert hb.volume("shared", "root").allocation_mib == 1
    finally:
        a.close()
        b.close()


def test_thousands_of_hosts_with_local_pools_and_disks(fabric):
    """How long this takes: bench/timing.py ('sim fabric: 2000 hosts')."""
    drivers = [SimDriver(f"h{i}", HostInfo(16, 2400, 65536), fabric) for i in range(2000)]
    for i, d in enumerate(drivers):
        d.define_pool(LOCAL)
        d.create_volume("local", "root", 8192)
        d.start(vm(f"v{i}", disk("root")))
    free = [d.pool_info("local").available_mib for d in drivers]
    assert free == [TIB - 1] * 2000
