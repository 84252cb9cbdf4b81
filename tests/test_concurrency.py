"""Admission is atomic: concurrent starts through the REST API never overrun a quota."""

from concurrent.futures import ThreadPoolExecutor

import httpx


def test_200_concurrent_starts_against_a_quota_for_50_start_exactly_50(live):
    with live.client() as c:
        # 3 sim hosts x 16 cores = 48 vCPUs: overcommit CPU so that the quota is the only limit
        c.put("/settings/cpu.overprovisioning.factor", json={"value": "4"}).raise_for_status()
        c.post("/projects", json={"name": "p", "vcpus": 50, "memory_mib": 1 << 20, "vms": 200}).raise_for_status()
        c.post("/offerings", json={"name": "one", "kind": "fixed", "vcpus": 1, "memory_mib": 256}).raise_for_status()
        c.post("/templates", json={"name": "t", "image": "tiny-linux"}).raise_for_status()
        for i in range(200):
            c.post("/vms", json={"name": f"v{i}", "project": "p", "offering": "one", "template": "t"}).raise_for_status()

    def start(i):
        with httpx.Client(base_url=live.url + "/api/v1", timeout=120,
                          headers={"Authorization": f"Bearer {live.env['VMPLANE_TOKEN']}"}) as c:
            return c.post(f"/vms/v{i}/start")

    with ThreadPoolExecutor(max_workers=100) as pool:
        results = list(pool.map(start, range(200)))
    codes = sorted(r.status_code for r in results)
    odd = [r.text for r in results if r.status_code not in (202, 409)]
    assert codes.count(202) == 50 and codes.count(409) == 150, (codes, odd[:3])
    assert all(r.json()["error"] == "quota_exceeded" and r.json()["field"] == "vcpus"
               for r in results if r.status_code == 409)

    with live.client() as c:
        for r in results:
            if r.status_code == 202:
                op = r.json()["operation"]["id"]
                for _ in range(200):
                    if c.get(f"/operations/{op}").json()["state"] == "succeeded":
                        break
        vms = c.get("/vms").json()
        assert sum(v["state"] == "running" for v in vms) == 50
        usage = c.get("/projects/p/usage").json()
        assert usage["vcpus"]["used"] == 50 and usage["consistent"] is True
        assert c.get("/audit").json() == {"ok": True, "problems": []}
