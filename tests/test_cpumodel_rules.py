"""Guest CPU models (issue 33), the pure rules: the sim's baseline by the family table, the choice of a usable
baseline, who can not run a model, the effective model of a VM, names, and what the domain XML says."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vmplane.core import cpumodels as C
from vmplane.core.driver import DiskSpec, DomainSpec
from vmplane.hosts.drivers.domainxml import domain_xml

# the <cpu> of a real domain capabilities document of these machines under TCG (virttype qemu), shortened
DOMCAPS = """<domainCapabilities><cpu>
  <mode name='host-passthrough' supported='no'/>
  <mode name='host-model' supported='yes'>
    <model fallback='forbid'>EPYC</model><vendor>AMD</vendor>
    <feature policy='require' name='acpi'/><feature policy='disable' name='sha-ni'/>
  </mode>
  <mode name='custom' supported='yes'>
    <model usable='yes' vendor='unknown'>qemu64</model>
    <model usable='no' vendor='AMD'>EPYC</model>
    <model usable='yes' vendor='Intel'>Nehalem</model>
    <model usable='yes' vendor='Intel'>Westmere</model>
    <model usable='no' vendor='Intel'>SandyBridge</model>
  </mode>
</cpu></domainCapabilities>"""


def test_the_sim_baseline_is_the_oldest_family_and_unknown_families_get_the_default():
    assert C.family_baseline(["Haswell", "Westmere", "Broadwell"]) == "Westmere"
    assert C.family_baseline(["Haswell"]) == "Haswell"
    assert C.family_baseline([]) == C.DEFAULT
    assert C.family_baseline(["Haswell", "Zen9"]) == C.DEFAULT
    assert "Westmere" in C.runnable("Haswell") and "Broadwell" not in C.runnable("Haswell")
    assert set(C.GENERIC) <= set(C.runnable("Conroe"))


def test_a_baseline_no_host_runs_as_a_named_model_falls_back_to_the_newest_they_all_run_saying_why():
    usable = {"h1": ("qemu64", "Nehalem", "Westmere"), "h2": ("qemu64", "Nehalem", "Westmere", "Haswell")}
    assert C.choose_baseline("Westmere", usable) == ("Westmere", "")
    model, why = C.choose_baseline("EPYC", usable)
    assert model == "Westmere" and "EPYC" in why and "h1, h2" in why and "TCG" in why
    assert C.choose_baseline("EPYC", {"h1": ("qemu64",)})[0] == C.DEFAULT
    assert C.choose_baseline("x", {})[0] == C.DEFAULT


def test_who_can_not_run_a_model_hosts_that_never_said_are_not_counted_and_host_model_runs_anywhere():
    usable = {"h2": ("Westmere",), "h1": ("Westmere", "Haswell"), "old": None}
    assert C.cannot_run("Haswell", usable) == ["h2"]
    assert C.cannot_run("Westmere", usable) == []
    assert C.cannot_run(C.HOST_MODEL, usable) == []


def test_the_effective_model_is_the_offerings_then_the_clusters_then_its_baseline_then_the_default():
    assert C.effective("host-model", "Nehalem", "Westmere") == "host-model"
    assert C.effective(None, "Nehalem", "Westmere") == "Nehalem"
    assert C.effective(None, None, "Westmere") == "Westmere"
    assert C.effective(None, None, None) == "qemu64"


def test_names_a_cluster_takes_no_host_model_an_offering_does():
    assert C.check_offering_model(None) is None and C.check_offering_model("host-model") is None
    assert C.check_offering_model("Skylake-Client-IBRS") is None
    assert "cpu_model" in (C.check_offering_model("bad model!") or "")
    assert "host-model is for an offering" in (C.check_cluster_model("host-model") or "")
    assert C.check_cluster_model("Westmere") is None and C.check_cluster_model(None) is None


def _cpu_of(xml: str) -> str:
    start = xml.index("<cpu")
    return xml[start : xml.index("</cpu>") + 6]


@pytest.mark.parametrize("prepared", [False, True])
def test_the_domain_xml_has_the_specs_model_or_host_model(prepared):
    size = 2 if prepared else 1
    spec = DomainSpec(
        "vm", 1, size, 256, 256 * size, "", disks=(DiskSpec("p", "v", "/x/v", "vda"),), cpu_model="Westmere"
    )
    cpu = _cpu_of(domain_xml(spec, None, None, None))
    assert "<cpu mode='custom' match='exact' check='none'>" in cpu and ">Westmere</model>" in cpu
    assert ("<numa>" in cpu) == prepared
    cpu = _cpu_of(domain_xml(replace(spec, cpu_model="host-model"), None, None, None))
    assert cpu.startswith("<cpu mode='host-model'") and "<model" not in cpu
    assert ("<numa>" in cpu) == prepared
    with pytest.raises(ValueError, match="CPU model"):
        domain_xml(replace(spec, cpu_model="a'b"), None, None, None)
    assert ">qemu64</model>" in domain_xml(replace(spec, cpu_model=C.DEFAULT), None, None, None)


def test_a_libvirt_hosts_cpu_is_read_from_its_domain_capabilities():
    pytest.importorskip("libvirt")
    from vmplane.hosts.drivers.libvirtcpu import baseline_model, host_cpu_of

    cpu = host_cpu_of(DOMCAPS)
    assert cpu.model == "EPYC" and cpu.usable == ("qemu64", "Nehalem", "Westmere")
    assert cpu.xml.startswith('<cpu mode="custom" match="exact">') and "sha-ni" in cpu.xml
    assert baseline_model(cpu.xml) == "EPYC"
