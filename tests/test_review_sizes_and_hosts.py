"""Sizes and local hosts (review of 2026-12-02, issue 26): one rule for every size flag (a plain number is MiB,
as `--help`, the README and the API's `*_mib` fields say), and the hosts of `vmplane up` sharing this
machine's memory honestly (together at most its memory less the control plane's reserve)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import typer

from vmplane.cli import app
from vmplane.hosts import localhosts

from .conftest import VMPLANE, LiveServer
from .realguest import require_libvirt

RULE = "a plain number of MiB"


def run_json(live, *args):
    r = live.cli(*args, "--output", "json")
    assert r.returncode == 0, f"{args}: {r.stdout} {r.stderr}"
    return json.loads(r.stdout)


def _options(command, path: str = ""):
    """Every option of every command, with the command's path (typer's own click: duck-typed)."""
    if hasattr(command, "commands"):
        for name, sub in command.commands.items():
            yield from _options(sub, f"{path} {name}".strip())
    else:
        for param in command.params:
            if param.param_type_name == "option":
                yield path, param


# -- sizes ---------------------------------------------------------------------------------------------
def test_every_size_flag_states_the_one_rule_in_its_help():
    sizes = [(path, opt) for path, opt in _options(typer.main.get_command(app)) if opt.metavar == "SIZE"]
    flags = {f"{path} {opt.opts[0]}" for path, opt in sizes}
    assert {
        "project create --storage",
        "project create --memory",
        "project quota --storage",
        "volume create --size",
        "volume resize --size",
        "vm create --root-disk",
        "offering create --root-disk",
        "host add --memory",
        "up --host-memory",
    } <= flags
    wrong = {f"{path} {opt.opts[0]}": opt.help for path, opt in sizes if RULE not in (opt.help or "")}
    assert wrong == {}
    assert not any("(GiB, TiB)" in (opt.help or "") for _, opt in sizes)


def test_project_create_storage_20_is_20_mib_as_its_help_says(live):
    r = live.cli("project", "create", "--help")
    words = " ".join(re.sub(r"[│╭╮╰╯─]", " ", r.stdout).split())  # the help's box, unwrapped
    assert (
        r.returncode == 0
        and f"storage quota (the provisioned size of its volumes and root disks): 512MiB, 16GiB, 1TiB, or {RULE}"
        in words
    )
    p = run_json(live, "project", "create", "sp", "--vcpus", "1", "--memory", "1024", "--storage", "20")
    assert p["quota"]["storage_mib"] == 20 and p["quota"]["memory_mib"] == 1024
    p = run_json(live, "project", "create", "sg", "--vcpus", "1", "--memory", "1GiB", "--storage", "20GiB")
    assert p["quota"]["storage_mib"] == 20 * 1024
    assert run_json(live, "project", "quota", "sp", "--storage", "30")["quota"]["storage_mib"] == 30
    r = live.cli("project", "create", "sd", "--vcpus", "1", "--memory", "1024", "--storage", "20GB")
    assert r.returncode == 2 and "--storage" in r.stderr and "ambiguous" in r.stderr
    r = live.cli("project", "show", "sd", "--output", "json")
    assert r.returncode == 1  # nothing was created


# -- local hosts share the machine ---------------------------------------------------------------------
@pytest.mark.parametrize("total", [2048, 4096, 24105, 24576, 65536, 1024 * 1024])
@pytest.mark.parametrize("hosts", [1, 2, 3, 7])
def test_the_hosts_shares_add_up_to_at_most_the_machine_less_the_reserve(total, hosts):
    each = localhosts.host_memory_mib(total, hosts)
    reserve = max(1024, total // 10)
    assert each * hosts <= total - reserve and each * hosts > total - reserve - hosts  # evenly, nothing lost
    assert localhosts.host_memory_mib(total, hosts, each) == each  # asking the share is fine
    with pytest.raises(ValueError, match="at most"):
        localhosts.host_memory_mib(total, hosts, each + 1)


def test_the_machines_memory_is_the_kernels_memtotal():
    assert localhosts.machine_memory_mib("MemFree: 10 kB\nMemTotal:       24683008 kB\n") == 24104


def test_up_refuses_host_memory_beyond_the_machine_before_starting_anything(tmp_path):
    require_libvirt()
    home = tmp_path / "home"
    r = subprocess.run(
        [VMPLANE, "up", "--driver", "libvirt", "--hosts", "3", "--host-memory", "1TiB"],
        env={"VMPLANE_HOME": str(home), "PATH": "/usr/bin:/bin", "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "--host-memory" in r.stderr and "at most" in r.stderr, r.stderr
    assert not (home / "hosts").exists()


def test_up_on_libvirt_shares_the_memory_and_host_memory_overrides_it(tmp_path):
    """Two libvirtd hosts (no guest booted): together at most the machine less the reserve, split evenly;
    restarted with --host-memory, the same hosts report that."""
    require_libvirt()
    total = localhosts.machine_memory_mib()
    live = LiveServer(tmp_path, hosts=2, driver="libvirt").start()
    try:
        hosts = run_json(live, "host", "list")
        assert [h["name"] for h in hosts] == ["lv1", "lv2"]
        memory = [run_json(live, "host", "show", h["name"])["memory_mib"] for h in hosts]
        assert memory[0] == memory[1] == localhosts.host_memory_mib(total, 2)
        assert sum(memory) <= total - max(1024, total // 10)
        assert [h["memory_capacity_mib"] for h in hosts] == memory  # host list shows it (factor 1)
    finally:
        live.stop()
    live.start("--host-memory", "2GiB")
    try:
        assert [h["memory_capacity_mib"] for h in run_json(live, "host", "list")] == [2048, 2048]
    finally:
        live.stop()


def test_up_with_sim_hosts_takes_host_memory(tmp_path):
    live = LiveServer(tmp_path, hosts=2).start("--host-memory", "8GiB")
    try:
        assert [h["memory_capacity_mib"] for h in run_json(live, "host", "list")] == [8192, 8192]
    finally:
        live.stop()
