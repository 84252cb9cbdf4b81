"""`vm exec`: what a command given to the API becomes on the guest's console, and what its answer means.

Pure rules, used by the libvirt driver (drivers/libvirt.py, `guest_run`) and the API:
- an argv (a list: `vm exec NAME -- ARG ARG...` sends one) keeps its argument boundaries, as `kubectl
  exec` does: each argument is quoted for the guest's POSIX shell (`argv_line`); a string is a shell
  command line, run by `sh -c` in the guest (`vm exec NAME -- 'LINE'`, one argument, sends one);
- the command travels in base64 over the console (`exec_lines`), so that any byte, a quote or a newline
  arrives as sent and a long command spans several console lines (a tty line holds at most 4095);
- a line the guest prints by itself while a command runs (`vmplane-guest: eth0 ADDR`, a NIC's lease) is
  dropped from the command's output;
- the runner (the driver's) prints a timeout marker when it killed the command at its time limit;
  `exec_result` turns that into a DriverError that says so, with the output so far.
"""

from __future__ import annotations

import base64
import shlex

from vmplane.core.driver import DriverError

# A migration's (and an HA restart's) guest check, run through the guest agent: the guest's uptime and how
# many kernel errors its log holds; a guest without an agent is checked from outside (NO_SHELL).
HEALTH_COMMAND = "cut -d' ' -f1 /proc/uptime; dmesg | grep -c -E 'Oops|BUG:|general protection|Kernel panic' || true"
NO_SHELL = "-"  # the uptime field of a check made without the guest: its domain runs and its vCPUs advance
VAR = "_vmpc"  # the console shell's variable that holds a long command's base64 while it arrives
GUEST_NOTICE = "vmplane-guest: "  # a line the test guest prints on its console by itself (a NIC's lease)


def argv_line(argv: list[str]) -> str:
    """The shell line that runs exactly `argv` (no word splitting, no globbing, no expansion)."""
    return shlex.join(argv)


def command_line(command: str | list[str]) -> str:
    """The API's `command`: a list is an argv, a string a shell line as it is."""
    return argv_line(command) if isinstance(command, list) else command


def cli_command(args: list[str]) -> str | list[str]:
    """What `vm exec NAME -- ARGS...` sends: two or more arguments are an argv, each kept whole (as
    `kubectl exec`); a single one is a shell line, as ssh runs it (`vm exec web1 -- 'nproc; free -m'`)."""
    return args[0] if len(args) == 1 else list(args)


def exec_lines(command: str, tag: str, limit_s: int, runner: str, chunk: int) -> list[str]:
    """The console lines that run `command` under `runner` (args: seconds, base64, tag) between the
    begin and end markers of `tag`; a base64 longer than `chunk` arrives first in VAR, piece by piece."""
    encoded = base64.b64encode(command.encode()).decode()
    lines = []
    if len(encoded) > chunk:
        pieces = [encoded[i : i + chunk] for i in range(0, len(encoded), chunk)]
        lines = [f"{VAR}={pieces[0]}\n"] + [f"{VAR}=${{{VAR}}}{p}\n" for p in pieces[1:]]
        encoded = f'"${VAR}"'
    # the quotes in the markers keep an echoed command line from matching them
    lines.append(
        f"echo __VMP''_B{tag}__; sh -c '{runner}' vmp {limit_s} {encoded} {tag}; "
        f"echo __VMP''_E{tag}_$?__; unset {VAR}\n"
    )
    return lines


def exec_result(output: bytes, code: int, tag: str, command: str, host: str) -> tuple[str, int]:
    """(output, exit code) of a command's answer between its markers; DriverError when the runner
    killed it at its time limit. Lines the guest printed by itself meanwhile (GUEST_NOTICE) are not the
    command's."""
    text = output.decode(errors="replace").replace("\r", "")
    text = "".join(line for line in text.splitlines(keepends=True) if not line.startswith(GUEST_NOTICE))
    marker = f"\n__VMP_T{tag}__\n"
    if marker in text:
        so_far = text.split(marker)[0]
        raise DriverError(
            host,
            f"{command!r} did not end in time: it was stopped in the guest; its output so far: {so_far[-300:]!r}",
        )
    return text, code


def judged(out: str, took_s: float) -> tuple[bool, str]:
    """A guest check's answer (HEALTH_COMMAND's, or NO_SHELL's) in words: (healthy, what was seen)."""
    lines = [line for line in out.split() if line]
    if len(lines) < 2 or lines[-1] != "0":
        return False, f"kernel errors in dmesg ({lines[-1] if lines else '?'} lines)"
    if lines[0] == NO_SHELL:
        return True, "answered without a guest agent: the domain runs and its vCPUs advance"
    return True, f"answered after {took_s:.1f} s, uptime {lines[0]} s, no kernel errors"
