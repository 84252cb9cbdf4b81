"""Which VMs are prepared for live scaling, and with which ceiling: the orchestrator's decision at start,
turned into domain XML (every combination of the four switches; the two capacity settings)."""

import itertools

import pytest

from vmplane.core.domain import spec_of
from vmplane.core.driver import CpuCap
from vmplane.core.model import Offering, OfferingKind
from vmplane.core.scaling import ScalingFlags, cpu_cap
from vmplane.hosts.drivers.domainxml import domain_xml
from vmplane.store import ledger as L

from .conftest import add_sim_hosts


def started_spec(orch, vm_name):
    with orch.db.read() as s:
        return spec_of(L.vm_row(s.connection(), name=vm_name))


@pytest.fixture
def cluster(orch):
    add_sim_hosts(orch, 1, cores=16, memory_mib=65536)
    orch.catalog.create_project("p", 100, 10**6, 100)
    return orch


@pytest.mark.parametrize("zone,offering,template,vm", list(itertools.product([False, True], repeat=4)))
def test_prepared_only_when_the_zone_setting_and_all_three_flags_are_on(cluster, zone, offering, template, vm):
    cluster.catalog.set_setting("enable.dynamic.scale.vm", str(zone).lower(), "zone", "z1")
    cluster.catalog.create_offering(
        Offering("o", OfferingKind.fixed, vcpus=1, memory_mib=512, dynamic_scaling=offering)
    )
    cluster.catalog.create_template("t", "tiny-linux", dynamic_scaling=template)
    cluster.create_vm("v", "p", "o", "t", dynamically_scalable=vm, start=True)
    spec = started_spec(cluster, "v")
    xml = domain_xml(spec, "/k", "/i", "console=ttyS0")
    prepared = zone and offering and template and vm
    assert spec.prepared == prepared
    if prepared:
        assert (spec.max_vcpus, spec.max_memory_mib) == (16, 65536)  # the host's capacity
        assert "<vcpu placement='static' current='1'>16</vcpu>" in xml
        assert "<maxMemory slots='16' unit='MiB'>65536</maxMemory>" in xml
        assert "<numa><cell id='0' cpus='0-15' memory='512' unit='MiB'/></numa>" in xml
    else:
        assert (spec.max_vcpus, spec.max_memory_mib) == (1, 512)
        assert "<vcpu placement='static'>1</vcpu>" in xml
        assert "maxMemory" not in xml and "<numa>" not in xml
    off = ScalingFlags(zone, offering, template, vm).first_off()
    assert (off is None) == prepared


@pytest.mark.parametrize(
    "cpu_setting,memory_setting,expected",
    [
        (4, 2048, (4, 2048)),  # > 0: the settings
        (0, 0, (16, 65536)),  # 0 or -1: the host's cores and memory
        (-1, -1, (16, 65536)),
        (8, 0, (8, 65536)),
    ],
)
def test_ceiling_comes_from_the_capacity_settings_or_the_host(cluster, cpu_setting, memory_setting, expected):
    cluster.catalog.set_setting("enable.dynamic.scale.vm", "true", "zone", "z1")
    cluster.catalog.set_setting("kvm.cpu.dynamic.scaling.capacity", str(cpu_setting), "cluster", "c1")
    cluster.catalog.set_setting("kvm.memory.dynamic.scaling.capacity", str(memory_setting), "cluster", "c1")
    cluster.catalog.create_offering(Offering("o", OfferingKind.fixed, vcpus=1, memory_mib=512, dynamic_scaling=True))
    cluster.catalog.create_template("t", "tiny-linux", dynamic_scaling=True)
    cluster.create_vm("v", "p", "o", "t", start=True)
    spec = started_spec(cluster, "v")
    assert (spec.max_vcpus, spec.max_memory_mib) == expected
    assert cluster.vm("v").max_vcpus == expected[0] and cluster.vm("v").max_memory_mib == expected[1]


def test_offering_cpu_cap_becomes_cputune_with_cloudstacks_formula(cluster):
    cluster.catalog.create_offering(
        Offering("capped", OfferingKind.fixed, vcpus=2, memory_mib=512, cpu_speed_mhz=600, cpu_cap=True)
    )
    cluster.catalog.create_template("t", "tiny-linux")
    cluster.create_vm("v", "p", "capped", "t", start=True)
    spec = started_spec(cluster, "v")  # sim host at 2400 MHz: 600 / 2400 = 0.25
    assert spec.cpu_cap == CpuCap(period_us=10000, quota_us=2500)
    assert "<cputune><period>10000</period><quota>2500</quota></cputune>" in domain_xml(spec, "/k", "/i", "c")


@pytest.mark.parametrize(
    "vm_mhz,host_mhz,cap",
    [
        (1000, 2000, CpuCap(10000, 5000)),
        (650, 2600, CpuCap(10000, 2500)),
        (3000, 2000, CpuCap(10000, 10000)),  # capped at one whole CPU
        (100, 2600, CpuCap(25000, 1000)),  # 0.04 -> quota 400 < 1000: quota 1000, period 1000/0.04
        (10, 2600, CpuCap(100000, 1000)),  # 0.01 (rounded up from 0.0038): period 100,000
    ],
)
def test_cpu_cap_formula(vm_mhz, host_mhz, cap):
    assert cpu_cap(vm_mhz, host_mhz) == cap


def test_names_are_escaped_in_xml():
    from vmplane.core.driver import DomainSpec

    xml = domain_xml(DomainSpec("a<b>&'\"", 1, 1, 256, 256, "x"), "/k'<", "/i", "x&y")
    assert "<name>a&lt;b&gt;&amp;'\"</name>" in xml and "/k'&lt;" in xml and "x&amp;y" in xml
