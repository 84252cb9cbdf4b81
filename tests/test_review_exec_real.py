"""`vm exec` on a real guest (review of 2026-12-02, issue 26): argument boundaries kept as `kubectl exec`
keeps them, an empty standard input, and a command that outlives its timeout stopped in the guest so that
the next `vm exec` finds the console's shell free. One booted guest for the module."""

import json

import pytest

from .realguest import libvirt_cluster, run_json


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = libvirt_cluster(tmp_path_factory.mktemp("exec"), hosts=1)
    run_json(server, "offering", "create", "one", "--kind", "fixed", "--vcpus", "1", "--memory", "256MiB")
    run_json(server, "vm", "create", "h1", "--project", "p", "--offering", "one", "--template", "tiny-linux", "--start")
    yield server
    server.stop()


def vm_exec(live, *argv: str, timeout: float = 120):
    return live.cli(
        "vm", "exec", "h1", "--output", "json", "--timeout", str(timeout), "--", *argv, timeout=timeout + 60
    )


def test_arguments_keep_their_boundaries_as_kubectl_exec_keeps_them(live):
    r = vm_exec(live, "sh", "-c", "echo a; echo b")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["output"].split() == ["a", "b"]
    r = vm_exec(live, "printf", "[%s]\\n", "two words", "it's", "$HOME", "*")  # nothing split or expanded
    assert json.loads(r.stdout)["output"].splitlines() == ["[two words]", "[it's]", "[$HOME]", "[*]"]
    r = vm_exec(live, "echo one; exit 3")  # a single argument is a shell line, as ssh runs it
    assert r.returncode == 3 and json.loads(r.stdout)["output"] == "one\n"


def test_a_command_that_reads_its_input_gets_an_empty_one(live):
    # dd with no arguments reads standard input to its end: an empty input ends it at once
    r = vm_exec(live, "sh", "-c", "dd; echo dd-exit=$?", timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    output = json.loads(r.stdout)["output"]
    assert "0+0 records in" in output and "dd-exit=0" in output
    assert json.loads(vm_exec(live, "cat").stdout) == {"output": "", "exit_code": 0}


def test_a_command_past_its_timeout_is_stopped_and_the_next_exec_works(live):
    r = vm_exec(live, "sh", "-c", "echo started; sleep 300; echo never", timeout=5)
    body = json.loads(r.stdout)
    assert r.returncode == 1 and body["error"] == "conflict" and body["field"] == "command", body
    assert "did not end in time" in body["message"] and "started" in body["message"], body
    assert json.loads(vm_exec(live, "echo", "free").stdout) == {"output": "free\n", "exit_code": 0}
    # nothing of it is left running in the guest
    ps = json.loads(vm_exec(live, "ps").stdout)["output"]
    assert "sleep 300" not in ps, ps
