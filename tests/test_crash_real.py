"""Crash safety on real hosts: `vmplane up --driver libvirt` is SIGKILLed at crash points of a start,
a live scale, a live migration (mid-copy: libvirtd carries the copy on alone) and a stop, then started
again. Each time: every VM runs exactly once (one QEMU), on the host the store says, its guest answers
at the size the store says, and the audit (ledger, claims, store against libvirt) is clean."""

import pytest

from .realguest import (
    crash_at,
    domain_memory,
    domains_on,
    guest,
    qemu_pids,
    run_json,
    scalable_cluster,
    settled,
)

BOOT_MEMTOTAL: dict[str, int] = {}  # each guest's MemTotal without DIMMs, seen at its first check


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = scalable_cluster(tmp_path_factory.mktemp("crash"), 2, 1024, {"c1": (1, "512MiB"), "c2": (2, "640MiB")})
    yield server
    server.stop()


def consistent(live) -> dict:
    """The checks after a restart; returns the VMs by name."""
    settled(live)
    with live.client() as c:
        audit = c.get("/audit").json()
        vms = {v["name"]: v for v in c.get("/vms").json()}
    assert audit["ok"], audit["problems"]
    for name, vm in vms.items():
        domain = f"vmplane-{name}"
        if vm["state"] == "running":
            assert len(qemu_pids(domain, live.home)) == 1, f"{name}: QEMU processes {qemu_pids(domain, live.home)}"
            assert [h for h in ("lv1", "lv2") if domain in domains_on(live, h)] == [vm["host"]]
            out = guest(live, name, "nproc; grep MemTotal /proc/meminfo").split()
            assert int(out[0]) == vm["vcpus"], f"{name}: the guest has {out[0]} vCPUs, the store {vm['vcpus']}"
            # memory too: the domain (live XML) has the store's size, and the guest sees every DIMM of it
            current, dimms = domain_memory(live, vm["host"], name)
            assert current == vm["memory_mib"] == vm["boot_memory_mib"] + sum(dimms), (name, vm, current, dimms)
            base = int(out[2]) - sum(dimms) * 1024
            assert BOOT_MEMTOTAL.setdefault(name, base) == base, (
                f"{name}: the guest's MemTotal {out[2]} KiB is not its boot MemTotal + DIMMs {dimms}"
            )
        else:
            assert qemu_pids(domain, live.home) == [], f"{name} is {vm['state']} but QEMU runs"
    return vms


def test_kills_mid_start_scale_migration_and_stop_leave_every_guest_once_where_the_store_says(live):
    crash_at(
        live,
        "start.after-domain",
        lambda c: c.post(
            "/vms", json={"name": "k1", "project": "p", "offering": "c1", "template": "scalable", "start": True}
        ),
    )
    vms = consistent(live)
    assert vms["k1"]["state"] == "running"  # the start was finished, not done twice

    crash_at(live, "scale.after-memory", lambda c: c.post("/vms/k1/scale", json={"offering": "c2"}))
    vms = consistent(live)
    assert (vms["k1"]["vcpus"], vms["k1"]["memory_mib"]) == (2, 640)  # resumed: the vCPU step was redone too

    source = vms["k1"]["host"]
    crash_at(live, "migrate.mid-copy", lambda c: c.post("/vms/k1/migrate", json={}))
    vms = consistent(live)
    [mig] = run_json(live, "migration", "list", "--vm", "k1")[:1]
    print(f"migration killed mid-copy: {mig['state']} ({mig['reason']}), {mig['stats']}")
    # libvirtd finished (or failed) the copy on its own; the restart followed its outcome
    assert vms["k1"]["host"] == (mig["target"] if mig["state"] == "succeeded" else source), mig

    crash_at(live, "stop.before-domain", lambda c: c.post("/vms/k1/stop", json={"force": True}))
    vms = consistent(live)
    assert vms["k1"]["state"] == "stopped"
