"""The thaw guard (issue 30): a freeze of a guest's file systems is always thawed.

`LibvirtDriver.fs_freeze` starts this as a process of its own session before it freezes, and `fs_thaw` kills
it once it thawed. Left alone (the freeze's caller failed, hung, or the control plane was killed: the guard
is not its child any more), it thaws the guest itself `seconds` after it started, trying again for a few
seconds if the host or the agent is busy, then ends. Usage: python -m vmplane.hosts.thawguard URI DOMAIN SECONDS
"""

from __future__ import annotations

import sys
import time

import libvirt

RETRY_S = 5.0  # after the deadline: tries again this long (an agent busy with the freeze's end, a reconnect)


def thaw(uri: str, domain: str) -> bool:
    """Thaw `domain`'s file systems on `uri`; whether the agent took it (or the domain is gone: nothing to do)."""
    conn = None
    try:
        conn = libvirt.open(uri)
        conn.lookupByName(domain).fsThaw(None, 0)
        return True
    except libvirt.libvirtError as exc:
        return exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN
    finally:
        if conn is not None:
            try:
                conn.close()
            except libvirt.libvirtError:
                pass


def main(argv: list[str]) -> int:
    uri, domain, seconds = argv[0], argv[1], float(argv[2])
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)  # (libvirt prints every error otherwise)
    time.sleep(seconds)
    give_up = time.monotonic() + RETRY_S
    while not thaw(uri, domain):
        if time.monotonic() > give_up:
            print(f"thaw guard: could not thaw {domain} on {uri}", file=sys.stderr)
            return 1
        time.sleep(0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
