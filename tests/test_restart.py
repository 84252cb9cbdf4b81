"""The control plane keeps everything across a restart of its process (SQLite file)."""

import time

import pytest

# what the guest agent controller last read from a guest (`vm show`'s agent, guest_addresses) is an
# observation that moves on its own (asked every few seconds), not state a restart must keep
OBSERVED = ("agent", "guest_addresses")


def _state(c):
    state = {noun: c.get(f"/{noun}").json() for noun in ("hosts", "projects", "offerings", "templates", "vms")}
    state["vms"] = [{k: v for k, v in vm.items() if k not in OBSERVED} for vm in state["vms"]]
    return state


@pytest.mark.parametrize("how", ["term", "kill"])
def test_stop_and_start_the_api_process_keeps_all_state(live, how):
    with live.client() as c:
        c.post("/projects", json={"name": "p", "vcpus": 8, "memory_mib": 16384}).raise_for_status()
        c.post("/offerings", json={"name": "one", "kind": "fixed", "vcpus": 1, "memory_mib": 512}).raise_for_status()
        c.post("/templates", json={"name": "t", "image": "tiny-linux"}).raise_for_status()
        c.put("/settings/vmplane.placement.strategy", json={"value": "pack"}).raise_for_status()
        for i in range(3):
            c.post(
                "/vms", json={"name": f"run{i}", "project": "p", "offering": "one", "template": "t", "start": True}
            ).raise_for_status()
        c.post("/vms", json={"name": "idle", "project": "p", "offering": "one", "template": "t"}).raise_for_status()
        deadline = time.monotonic() + 60  # the starts run after their 202
        while sum(v["state"] == "running" for v in c.get("/vms").json()) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        before = _state(c)
    assert sum(v["state"] == "running" for v in before["vms"]) == 3

    live.stop(how)
    live.start()

    with live.client() as c:
        assert _state(c) == before
        assert c.get("/settings/vmplane.placement.strategy").json()["value"] == "pack"
        assert c.get("/audit").json() == {"ok": True, "problems": []}
        # still usable: the running VMs can be stopped and the stopped one started
        assert c.post("/vms/run0/stop").status_code == 202
        assert c.post("/vms/idle/start").status_code == 202
    r = live.cli("host", "list", "--output", "json")
    assert r.returncode == 0 and r.stdout.count('"name"') == 3  # no duplicate hosts from `up`


def test_serve_runs_the_api_alone_on_the_same_database(live, tmp_path):
    import subprocess
    import time

    import httpx

    from .conftest import ADMIN_TOKEN, VMPLANE, free_port

    with live.client() as c:
        c.post("/projects", json={"name": "kept", "vcpus": 1, "memory_mib": 512}).raise_for_status()
    live.stop()
    port = free_port()
    proc = subprocess.Popen(
        [VMPLANE, "serve", "--db", live.db_url, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(300):
            try:
                r = httpx.get(
                    f"http://127.0.0.1:{port}/api/v1/projects",
                    timeout=1,
                    headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                )
                break
            except httpx.TransportError:
                time.sleep(0.1)
        assert [p["name"] for p in r.json()] == ["kept"]
        assert (
            len(
                httpx.get(
                    f"http://127.0.0.1:{port}/api/v1/hosts",
                    timeout=5,
                    headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                ).json()
            )
            == 3
        )
    finally:
        proc.terminate()
        proc.wait(20)
