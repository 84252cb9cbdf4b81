"""Live migration with storage, real guests (TCG) between two local libvirtd hosts in their own network
namespaces: a guest with a data volume holding D MiB of written data (64, 256, 1024) on a local pool (the
disk is copied with the memory: VIR_MIGRATE_NON_SHARED_INC) and the same guest on the shared pool (nothing
copied), side by side in one run; plus the copy floor (bytes sent / measured loopback TCP rate).

usage: .venv/bin/python bench/storage.py [--sizes 64,256,1024] [--timeout 600]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import LocalCluster, table, write_section
from migration import loopback_mib_s

GUEST_MIB = 384


def exec_(c, vm: str, command: str, timeout_s: float = 600) -> str:
    r = c.post(f"/vms/{vm}/exec", json={"command": command, "timeout_s": timeout_s}, timeout=timeout_s + 30)
    r.raise_for_status()
    return r.json()["output"]


def wait_migration(c, mig: dict, timeout_s: float) -> dict:
    t0 = time.monotonic()
    while mig["state"] not in ("succeeded", "failed", "cancelled") and time.monotonic() - t0 < timeout_s:
        time.sleep(0.2)
        mig = c.get(f"/migrations/{mig['id']}").json()
    return mig


def one(c, kind: str, data_mib: int, timeout_s: float) -> dict:
    """A guest on lv1 with a volume of `data_mib` written data on the local pool or the shared one; migrated
    to lv2. Returns the migration's numbers and whether the data's checksum is the same after."""
    pool = "local-lv1" if kind == "local" else "shared"
    vm, vol = f"{kind}-{data_mib}", f"d-{kind}-{data_mib}"
    c.post(
        "/vms",
        json={"name": vm, "project": "b", "offering": "o", "template": "tiny-linux", "pool": pool, "start": True},
    ).raise_for_status()
    t0 = time.monotonic()
    while c.get(f"/vms/{vm}").json()["state"] != "running" and time.monotonic() - t0 < 300:
        time.sleep(0.5)
    c.post("/volumes", json={"name": vol, "project": "b", "size_mib": data_mib + 16, "pool": pool}).raise_for_status()
    c.post(f"/volumes/{vol}/attach", json={"vm": vm}).raise_for_status()
    exec_(c, vm, "while ! grep -q vdb /proc/partitions; do sleep 0.2; done", 60)
    exec_(c, vm, f"dd if=/dev/urandom of=/dev/vdb bs=1M count={data_mib} 2>/dev/null; sync")
    before = exec_(c, vm, f"dd if=/dev/vdb bs=1M count={data_mib} 2>/dev/null | md5sum").split()[0]
    r = c.post(f"/vms/{vm}/migrate", json={"to": "lv2"})
    r.raise_for_status()
    t0 = time.monotonic()
    mig = wait_migration(c, r.json(), timeout_s)
    wall = time.monotonic() - t0
    after = (
        exec_(
            c, vm, f"echo 3 > /proc/sys/vm/drop_caches; dd if=/dev/vdb bs=1M count={data_mib} 2>/dev/null | md5sum"
        ).split()[0]
        if mig["state"] == "succeeded"
        else "-"
    )
    stats = mig.get("stats") or {}
    c.post(f"/vms/{vm}/stop", json={"force": True})
    time.sleep(3)
    c.delete(f"/vms/{vm}")
    c.post(f"/volumes/{vol}/detach")
    c.delete(f"/volumes/{vol}")
    print(kind, data_mib, mig["state"], stats, flush=True)
    return {
        "state": mig["state"],
        "wall_s": wall,
        "total_ms": stats.get("total_ms"),
        "down_ms": stats.get("downtime_ms"),
        "disk_mib": (stats.get("disk_bytes") or 0) / (1 << 20),
        "mib": (stats.get("bytes") or 0) / (1 << 20),
        "same": before == after,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64,256,1024")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    floor_rate = loopback_mib_s()
    cluster = LocalCluster("libvirt", hosts=2)
    rows = []
    try:
        cluster.wait_ready()
        with cluster.client() as c:
            c.put("/settings/cpu.overprovisioning.factor", json={"value": "4"}).raise_for_status()
            c.post("/projects", json={"name": "b", "vcpus": 16, "memory_mib": 32768}).raise_for_status()
            c.post(
                "/offerings", json={"name": "o", "kind": "fixed", "vcpus": 1, "memory_mib": GUEST_MIB}
            ).raise_for_status()
            for size in sizes:
                for kind in ("local", "shared"):  # interleaved: both see the same machine state
                    r = one(c, kind, size, args.timeout)
                    floor = r["mib"] / floor_rate
                    rows.append(
                        [
                            f"{size} MiB",
                            kind,
                            r["state"],
                            f"{r['total_ms'] or 0:.0f}",
                            f"{r['wall_s']:.1f}",
                            f"{r['down_ms'] or 0:.0f}",
                            f"{r['disk_mib']:.0f}",
                            f"{r['mib']:.0f}",
                            f"{1000 * floor:.0f}",
                            "yes" if r["same"] else "NO",
                        ]
                    )
    finally:
        cluster.stop()
    body = table(
        [
            "data on the volume",
            "pool",
            "state",
            "libvirt total ms",
            "wall s (API)",
            "downtime ms",
            "disk MiB copied",
            "MiB sent",
            "copy floor ms",
            "data identical",
        ],
        rows,
    )
    body += (
        f"\n\nCopy floor: MiB sent / {floor_rate:.0f} MiB/s (measured TCP copy rate on loopback, 1 MiB writes). "
        f"Guest: tiny-linux, 1 vCPU / {GUEST_MIB} MiB, TCG, its root disk a qcow2 overlay in the same pool; the "
        f"data volume written from /dev/urandom, its md5 read in the guest before and after (page cache "
        f"dropped). 'local': the overlays are copied to lv2's local pool (NON_SHARED_INC, vmplane's TCG "
        f"migration policy); 'shared': the same files, nothing copied (VIR_MIGRATE_UNSAFE, see README). "
        f"Wall s: from the API call to the migration's end, the guest check included."
    )
    write_section("Live migration with storage (bench/storage.py)", body)


if __name__ == "__main__":
    main()
