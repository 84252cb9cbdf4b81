"""Minor items of the review "record vs hosts": each test fails without its fix."""

import pytest

from vmplane.core.model import Offering, OfferingKind
from vmplane.hosts.drivers.libvirt import dimms_to_release
from vmplane.hosts.localhosts import qemu_runs_domain

from .conftest import add_sim_hosts
from .conftest import ledger_usage as usage

GIB = 1024


# -- a stale pid file kills only the QEMU of its own domain -------------------------------------------


def _cmdline(*args: str) -> bytes:
    return b"\0".join(a.encode() for a in args) + b"\0"  # as /proc/PID/cmdline reads


def _qemu(name_arg: str) -> bytes:
    return _cmdline(
        "/usr/bin/qemu-system-x86_64",
        "-name",
        name_arg,
        "-S",
        "-machine",
        "pc-q35,accel=kvm",
        "-m",
        "size=262144k,slots=16,maxmem=8388608k",
        "-uuid",
        "0b1c9b4e-0000-0000-0000-000000000001",
    )


def test_the_qemu_of_the_pid_files_domain_is_ours():
    assert qemu_runs_domain(_qemu("guest=vmplane-web,debug-threads=on"), "vmplane-web")
    assert qemu_runs_domain(_qemu("vmplane-web"), "vmplane-web")  # older `-name NAME`
    assert qemu_runs_domain(_cmdline("/usr/libexec/qemu-kvm", "-name", "guest=vmplane-web"), "vmplane-web")
    assert qemu_runs_domain(_qemu("guest=vmplane-a,,b,debug-threads=on"), "vmplane-a,b")  # ",," is a comma


@pytest.mark.parametrize(
    "cmdline",
    [
        _qemu("guest=vmplane-other,debug-threads=on"),  # pid reused by another VM's QEMU (another host's)
        _qemu("guest=vmplane-web2,debug-threads=on"),  # a name that only starts like it
        _qemu("guest=vmplane-we,debug-threads=on"),
        _cmdline("/usr/bin/qemu-system-x86_64", "-machine", "q35"),  # a QEMU without a name
        _cmdline("/usr/bin/python3", "-c", "print('qemu-system -name guest=vmplane-web')"),  # not a QEMU
        _cmdline("/usr/bin/sleep", "-name", "guest=vmplane-web"),
        b"",  # a kernel thread / zombie
    ],
)
def test_a_reused_pid_is_not_ours(cmdline):
    assert not qemu_runs_domain(cmdline, "vmplane-web")


def test_kill_orphaned_qemu_spares_a_reused_pid(tmp_path, monkeypatch):
    from vmplane.hosts import localhosts

    run = tmp_path / "h1" / "run" / "qemu"
    run.mkdir(parents=True)
    (run / "vmplane-web.pid").write_text("4242")
    (run / "vmplane-db.pid").write_text("4343")
    proc = {4242: _qemu("guest=vmplane-other,debug-threads=on"), 4343: _qemu("guest=vmplane-db,debug-threads=on")}
    real_path = localhosts.Path

    class FakePath(type(real_path())):
        def read_bytes(self):
            parts = self.parts
            if parts[:2] == ("/", "proc") and parts[-1] == "cmdline":
                return proc[int(parts[2])]
            return super().read_bytes()

    killed = []
    monkeypatch.setattr(localhosts, "Path", FakePath)
    monkeypatch.setattr(localhosts.os, "kill", lambda pid, sig: killed.append(pid))
    monkeypatch.setattr(localhosts, "_zombie", lambda pid: False)  # the fake pids have no /proc/PID/stat
    host = type("H", (), {"dir": real_path(tmp_path / "h1")})()
    localhosts._kill_orphaned_qemu(host)
    assert killed == [4343]


# -- the DIMMs to unplug: an exact subset, the fewest --------------------------------------------------


def test_an_exact_subset_the_greedy_choice_misses():
    assert sorted(dimms_to_release([256, 256, 384], 512)) == [0, 1]  # greedy took 384, then refused


@pytest.mark.parametrize(
    "sizes,release,want",
    [
        ([256, 256, 384], 384, [2]),
        ([256, 256, 512], 512, [2]),  # one DIMM rather than two
        ([256, 256, 256], 256, [2]),  # the newest among equals
        ([256, 512, 768], 1280, [2, 1]),  # newest first: the order to unplug them
        ([128, 256, 384, 640], 1024, [3, 2]),
        ([256, 256], 0, []),
    ],
)
def test_dimms_to_release(sizes, release, want):
    assert dimms_to_release(sizes, release) == want


@pytest.mark.parametrize("sizes,release", [([256, 384], 512), ([], 256), ([256], 128), ([256], -256)])
def test_no_subset_is_a_refusal(sizes, release):
    assert dimms_to_release(sizes, release) is None


def test_many_dimms_are_fast():
    sizes = [128 * (1 + i % 5) for i in range(64)]
    picked = dimms_to_release(sizes, sum(sizes) - 128)
    assert picked is not None and sum(sizes[i] for i in picked) == sum(sizes) - 128


# -- a scale whose commit raised stays charged at the larger size, consistently -------------------------


@pytest.fixture
def cluster(orch):
    add_sim_hosts(orch, 2, cores=8, memory_mib=8 * GIB)
    orch.catalog.set_setting("enable.dynamic.scale.vm", "true", "zone", "z1")
    orch.catalog.create_offering(Offering("f1", OfferingKind.fixed, vcpus=1, memory_mib=256, dynamic_scaling=True))
    orch.catalog.create_offering(Offering("f2", OfferingKind.fixed, vcpus=2, memory_mib=512, dynamic_scaling=True))
    orch.catalog.create_offering(Offering("f3", OfferingKind.fixed, vcpus=2, memory_mib=256, dynamic_scaling=True))
    orch.catalog.create_template("t", "tiny-linux", dynamic_scaling=True)
    orch.catalog.create_project("p", 16, 32 * GIB, 10, count_overhead=True)
    return orch


def _commit_raises_once(o, monkeypatch):
    real = o.scaler._commit
    calls = []

    def commit(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("the database went away")
        return real(*args, **kwargs)

    monkeypatch.setattr(o.scaler, "_commit", commit)
    return calls, real


def _sizes(o, name):
    vm = o.vm(name)
    dom = o.drivers[vm.host.name].domain(o.domain_name(name))
    return (vm.vcpus, vm.memory_mib), (dom.usable_vcpus, dom.memory_mib)


def test_a_scale_whose_commit_raised_stays_charged_at_the_larger_size(cluster, monkeypatch):
    o = cluster
    o.create_vm("v", "p", "f1", "t", start=True)
    calls, _ = _commit_raises_once(o, monkeypatch)
    op = o.operation(o.scaler.scale("v", offering="f2")["operation_id"])
    assert calls and op.state == "failed" and "the database went away" in op.message
    assert o.vm("v").state == "running"
    assert _sizes(o, "v") == ((2, 512), (2, 512))  # the domain grew: recorded, charged, claimed so
    usage(o, "p")  # ledger == recomputed
    assert o.audit() == []
    op_of = o.operation(o.scaler.scale("v", offering="f1")["operation_id"])  # and it can scale again
    assert op_of.state == "succeeded", op_of.message
    assert _sizes(o, "v") == ((1, 256), (1, 256)) and o.audit() == []


def test_a_shrink_whose_commit_raised_stays_at_the_larger_size(cluster, monkeypatch):
    o = cluster
    o.create_vm("v", "p", "f1", "t", start=True)
    assert o.operation(o.scaler.scale("v", offering="f2")["operation_id"]).state == "succeeded"
    before = usage(o, "p")
    _commit_raises_once(o, monkeypatch)
    op = o.operation(o.scaler.scale("v", offering="f1")["operation_id"])
    assert op.state == "failed"
    vm = o.vm("v")
    assert (vm.vcpus, vm.memory_mib) == (2, 512) and usage(o, "p") == before  # nothing given back unasked
    # the domain shrank, the record keeps the larger size: only the size drift shows, the ledger is clean
    assert o.audit() and all("the record says" in problem for problem in o.audit()), o.audit()


def test_mixed_scale_whose_commit_raised_is_charged_at_the_larger_of_each(cluster, monkeypatch):
    o = cluster
    o.catalog.create_offering(Offering("f4", OfferingKind.fixed, vcpus=1, memory_mib=512, dynamic_scaling=True))
    o.create_vm("v", "p", "f1", "t", start=True)
    assert o.operation(o.scaler.scale("v", offering="f4")["operation_id"]).state == "succeeded"  # a DIMM
    hosts = {h.name: (h.used_vcpus, h.used_memory_mib) for h in o.hosts()}
    _commit_raises_once(o, monkeypatch)
    op = o.operation(o.scaler.scale("v", offering="f3")["operation_id"])  # 1/512 -> 2/256
    assert op.state == "failed"
    vm = o.vm("v")
    assert (vm.vcpus, vm.memory_mib) == (2, 512)  # the larger of each
    assert usage(o, "p").vcpus == 2
    # the claim holds what it took for the larger size; only the size drift (the domain has 256 MiB) shows
    assert {h.name: (h.used_vcpus, h.used_memory_mib) for h in o.hosts()}[vm.host.name][0] == hosts[vm.host.name][0] + 1
    assert o.audit() and all("the record says" in problem for problem in o.audit()), o.audit()


# -- the audit reports a finding only if a fresh scan and read find it again ------------------------------


def test_an_operation_ending_between_the_scan_and_the_read_is_no_finding(cluster):
    o = cluster
    o.create_vm("v", "p", "f1", "t")
    last = list(o.drivers)[-1]  # scanned last: every host was scanned before the start ends
    driver = o.drivers[last]
    real = driver.domains
    calls = []

    def domains():
        seen = real()
        calls.append(len(seen))
        if len(calls) == 1:  # no host showed the domain; the start ends before the store is read
            o.start_vm("v")
        return seen

    driver.domains = domains
    assert o.vm("v").state == "stopped"
    problems = o.audit_hosts()
    assert o.vm("v").state == "running"
    assert problems == [], problems  # without the re-check: "running ... but no host runs it"
    assert len(calls) == 2  # one re-check
    del driver.domains
    assert o.audit() == []


def test_a_lasting_finding_is_still_reported(cluster):
    o = cluster
    o.create_vm("v", "p", "f1", "t", start=True)
    vm = o.vm("v")
    o.drivers[vm.host.name].domains = lambda: []  # the domain is gone behind vmplane's back
    assert o.audit_hosts() == [f"vm v: running on {vm.host.name} in the store, but no host runs it"]
