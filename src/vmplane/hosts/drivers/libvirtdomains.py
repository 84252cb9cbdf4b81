"""The two rules about a libvirt domain's end that the driver and the local hosts' clean-up share."""

from __future__ import annotations

import libvirt

# a domain's checkpoints (issue 32: incremental backups) are metadata vmplane keeps itself and defines again
# where the domain runs: an undefine drops libvirt's copy (the bitmaps stay in the qcow2 files), which libvirt
# otherwise refuses ("cannot delete inactive domain with N checkpoints")
UNDEFINE_FLAGS = libvirt.VIR_DOMAIN_UNDEFINE_CHECKPOINTS_METADATA | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA


def is_absent(exc: libvirt.libvirtError) -> bool:
    """The one rule: only VIR_ERR_NO_DOMAIN says a domain is gone; any other error is "don't know"."""
    return exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN


def undefine(dom: libvirt.virDomain) -> None:
    """Undefine with the checkpoint and snapshot metadata (UNDEFINE_FLAGS); a driver that knows neither (libvirt's
    test driver) is asked without them."""
    try:
        dom.undefineFlags(UNDEFINE_FLAGS)
    except libvirt.libvirtError as exc:
        if "unsupported flags" not in (exc.get_error_message() or ""):
            raise
        dom.undefineFlags(0)


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
        undefine(dom)
    except libvirt.libvirtError as exc:
        if not is_absent(exc):
            raise
