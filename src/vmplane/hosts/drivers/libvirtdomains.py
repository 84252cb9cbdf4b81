"""The two rules about a libvirt domain's end that the driver and the local hosts' clean-up share."""

from __future__ import annotations

import libvirt


def is_absent(exc: libvirt.libvirtError) -> bool:
    """The one rule: only VIR_ERR_NO_DOMAIN says a domain is gone; any other error is "don't know"."""
    return exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN


def discard_domain(dom: libvirt.virDomain) -> None:
    """Destroy (if running) and undefine a domain, whatever state it is in. Only VIR_ERR_NO_DOMAIN
    means it is gone; any other error is raised (a QEMU stuck in D state is not gone)."""
    try:
        if dom.isActive():
            dom.destroy()
    except libvirt.libvirtError as exc:
        if is_absent(exc):
            return
        if dom.isActive():  # it stopped by itself meanwhile: fine; else the error stands
            raise
    try:
        dom.undefineFlags(0)
    except libvirt.libvirtError as exc:
        if not is_absent(exc):
            raise
