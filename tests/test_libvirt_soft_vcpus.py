"""The libvirt driver's soft vCPU scale-down converges: the wait offlines again what the guest's own onliner
(guest/init.sh, a loop every 0.2 s) put back online, and ends only at a look that had nothing to undo.
Its guest console is faked here; tests/test_scaling_real.py scales real guests."""

import pytest

from vmplane.core.driver import DriverError
from vmplane.hosts.drivers import libvirt as lv
from vmplane.hosts.drivers.libvirtagent import AgentUnavailable


class Guest:
    """Answers the driver's offline-and-read command with scripted looks: (vCPUs online, how many it had
    to offline); records the commands."""

    def __init__(self, looks):
        self.looks, self.commands = list(looks), []

    def exec(self, _name, command, _timeout=30.0):
        self.commands.append(command)
        online, offlined = self.looks.pop(0) if len(self.looks) > 1 else self.looks[0]
        return f"noise\n{offlined}\n{'0' if online == 1 else f'0-{online - 1}'}\n"


def driver(guest: Guest, monkeypatch) -> lv.LibvirtDriver:
    d = lv.LibvirtDriver.__new__(lv.LibvirtDriver)  # no connection: only the console is used
    d.host = "h1"
    monkeypatch.setattr(d, "guest_exec", guest.exec, raising=False)
    monkeypatch.setattr(lv.time, "sleep", lambda _s: None)

    def no_agent(*_a, **_k):  # a guest without an agent: its vCPUs are read on its console
        raise AgentUnavailable("h1", "not connected")

    monkeypatch.setattr(d, "agent_online_vcpus", no_agent, raising=False)
    monkeypatch.setattr(d, "console_run", lambda n, c, t=30.0: (d.guest_exec(n, c, t), 0), raising=False)
    return d


def test_a_vcpu_the_onliner_put_back_is_offlined_again_until_a_look_finds_nothing_to_undo(monkeypatch):
    # the first look offlines cpu1, the onliner (which read the list just before it was written) onlines it
    # again, the next look offlines it once more, the last finds it offline
    guest = Guest([(1, 1), (2, 1), (1, 1), (1, 0)])
    driver(guest, monkeypatch)._wait_online("vm", 1, keep_off=["cpu1"])
    assert len(guest.commands) == 4 and not guest.looks[1:]
    # every look lists the vCPU for the onliner (written aside, then renamed) before it offlines it
    assert all(
        c.startswith(
            "printf '%s\\n' cpu1 > /run/vmplane-offline.new && mv /run/vmplane-offline.new /run/vmplane-offline;"
        )
        for c in guest.commands
    )


def test_a_look_that_had_to_offline_is_not_taken_for_the_lasting_state(monkeypatch):
    guest = Guest([(1, 1), (1, 0)])
    driver(guest, monkeypatch)._wait_online("vm", 1, keep_off=["cpu1"])
    assert len(guest.commands) == 2


def test_a_guest_that_never_settles_fails_naming_what_it_shows(monkeypatch):
    with pytest.raises(DriverError, match=r"shows 2 vCPUs online, not 1 \(1 of cpu1 came online again\)"):
        driver(Guest([(2, 1)]), monkeypatch)._wait_online("vm", 1, keep_off=["cpu1"], timeout_s=0)


def test_an_empty_keep_off_list_is_removed_and_the_wait_only_reads(monkeypatch):
    assert lv.LibvirtDriver._offline_list([]) == "rm -f /run/vmplane-offline"
    d = driver(Guest([(1, 0)]), monkeypatch)
    reads = iter(["0\n", "0-1\n"])
    monkeypatch.setattr(d, "guest_exec", lambda _n, _c, _t=30.0: next(reads), raising=False)
    d._wait_online("vm", 2)  # a hot-plugged vCPU the onliner brings up: read until it shows
