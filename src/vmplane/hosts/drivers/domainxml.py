"""The libvirt domain XML of a VM, as a pure function of its spec (docs/design/scaling.md and
docs/operations/real-hosts.md).

Prepared for live scaling (the ceiling is above the current size) means `<vcpu current='N'>MAX`,
`<maxMemory slots=...>MAX` and a NUMA cell (libvirt needs one for memory hot-plug); otherwise current
== max and there is no maxMemory. Values are escaped: names are validated upstream, but the XML
never trusts them.

Disks are virtio-blk, `cache='none'` (O_DIRECT: the host's page cache is bypassed, so what the guest
flushed is on the file system, and a host that takes the domain over on shared storage can not read
stale cached pages; the pools are on ext4, which supports O_DIRECT; tmpfs does not) with `io='native'`
(Linux AIO, which needs O_DIRECT) and `discard='unmap'` (a guest's fstrim frees space in the pool).
A spec with `image == ""` boots from its first disk (`<boot dev='hd'/>`, no kernel); else the kernel
and initrd are booted directly and the disks are only data disks.

The guest CPU is the spec's `cpu_model` (core/cpumodels.py: the offering's, else the cluster's baseline or
named model): a named model exactly, or libvirt's host-model.

Every domain has the QEMU guest agent's channel (a virtio-serial port named org.qemu.guest_agent.0; libvirt
picks the host's socket path and knows whether an agent listens on it): a guest that runs `qemu-ga` answers
the driver's agent calls (libvirtagent.py), one that does not is simply without an agent.
"""

from __future__ import annotations

import re
from xml.sax.saxutils import escape, quoteattr

from vmplane.core.driver import DiskSpec, DomainSpec, NicSpec

MEMORY_SLOTS = 16
EMULATOR = "/usr/bin/qemu-system-x86_64"
CPU_MODEL = "qemu64"  # the default; `-cpu host` crashes under these machines' KVM backend (named models are portable)
HOST_MODEL = "host-model"
DISK_CACHE = "none"  # see the module docstring
# pcie-root-ports: on q35 every hot-plugged disk or NIC needs a free one; libvirt also puts the domain's own
# PCI devices on them (disks, NICs, balloon, SCSI and virtio-serial controllers): one more since the
# guest agent's virtio-serial controller came, so hot-plugs have as many free ports as before
HOTPLUG_PORTS = 5
AGENT_CHANNEL = "org.qemu.guest_agent.0"  # the port's name, which qemu-ga opens in the guest
DISK_FORMATS = ("qcow2", "raw")
CONSOLE_LOG_DIR = "/var/log/libvirt/qemu"  # each local host's own log folder (mounted in its namespace)


def console_log(domain: str) -> str:
    """Where QEMU writes what a domain's serial console printed (next to libvirt's `DOMAIN.log`)."""
    return f"{CONSOLE_LOG_DIR}/{domain}.console.log"


def cpu_open(model: str) -> list[str]:
    """The opening of a domain's <cpu> (its NUMA cell, if any, goes inside): a named model exactly, without a
    silent fallback to another (`check='none'`: libvirt does not re-check the CPU QEMU made, which under TCG
    differs in features QEMU emulates anyway), or `host-model` (the host's own CPU as libvirt describes it,
    checked partially: migration to a host with another CPU may be refused)."""
    if model == HOST_MODEL:
        return ["  <cpu mode='host-model' check='partial'>"]
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", model):
        raise ValueError(f"a CPU model is a name (letters, digits, _ . -) or host-model, not {model!r}")
    return ["  <cpu mode='custom' match='exact' check='none'>", f"    <model fallback='forbid'>{model}</model>"]


def disk_xml(disk: DiskSpec, indent: str = "") -> str:
    """One virtio disk as libvirt's <disk> element (also what attach and detach send)."""
    if disk.format not in DISK_FORMATS:
        raise ValueError(f"disk format must be one of {', '.join(DISK_FORMATS)}, not {disk.format!r}")
    if disk.device == "cdrom":  # on virtio-scsi (domain_xml adds the controller)
        if not re.fullmatch(r"sd[a-z]", disk.target):
            raise ValueError(f"a CD-ROM's target is sd + a letter (sda, ...), not {disk.target!r}")
        lines = [
            "<disk type='file' device='cdrom'>",
            f"  <driver name='qemu' type={quoteattr(disk.format)}/>",
            f"  <source file={quoteattr(disk.path)}/>",
            f"  <target dev={quoteattr(disk.target)} bus='scsi'/>",
            "  <readonly/>",
            "</disk>",
        ]
        return "\n".join(indent + line for line in lines)
    if not re.fullmatch(r"vd[a-z]{1,2}", disk.target):
        raise ValueError(f"a virtio disk target is vd + letters (vda, vdb, ...), not {disk.target!r}")
    lines = [
        "<disk type='file' device='disk'>",
        f"  <driver name='qemu' type={quoteattr(disk.format)} cache='{DISK_CACHE}' io='native' discard='unmap'/>",
        f"  <source file={quoteattr(disk.path)}/>",
        f"  <target dev={quoteattr(disk.target)} bus='virtio'/>",
    ]
    if disk.readonly:
        lines.append("  <readonly/>")
    lines.append("</disk>")
    return "\n".join(indent + line for line in lines)


def interface_xml(nic: NicSpec, indent: str = "") -> str:
    """One virtio NIC on its network's host bridge as libvirt's <interface> element (also what a hot-plug
    and an unplug send)."""
    if not re.fullmatch(r"([0-9a-f]{2}:){5}[0-9a-f]{2}", nic.mac):
        raise ValueError(f"a MAC is six lowercase hex pairs, not {nic.mac!r}")
    for what, name in (("bridge", nic.bridge), ("tap", nic.tap)):
        if not re.fullmatch(r"[a-z0-9]{1,15}", name):
            raise ValueError(f"a {what} name is 1-15 lowercase letters and digits, not {name!r}")
    lines = [
        "<interface type='bridge'>",
        f"  <mac address={quoteattr(nic.mac)}/>",
        f"  <source bridge={quoteattr(nic.bridge)}/>",
        f"  <target dev={quoteattr(nic.tap)}/>",
        "  <model type='virtio'/>",
    ]
    if nic.mtu is not None:
        lines.append(f"  <mtu size='{int(nic.mtu)}'/>")
    lines.append("</interface>")
    return "\n".join(indent + line for line in lines)


def domain_xml(
    spec: DomainSpec,
    kernel: str | None,
    initrd: str | None,
    cmdline: str | None,
    accel: str = "qemu",
    partition: str | None = None,
) -> str:
    """`kernel`/`initrd`/`cmdline` are for a direct kernel boot; all None when `spec.image` is "" (boot
    from the first disk)."""
    if accel not in ("qemu", "kvm"):
        raise ValueError(f"accel must be qemu (TCG) or kvm, not {accel!r}")
    from_disk = spec.image == ""
    if from_disk and not spec.disks:
        raise ValueError(f"{spec.name} boots from its first disk but has none")
    if from_disk != (kernel is None):
        raise ValueError("a kernel is booted exactly when the spec names an image")
    targets = [d.target for d in spec.disks]
    if len(set(targets)) != len(targets):
        raise ValueError(f"two disks of {spec.name} have the same target: {', '.join(targets)}")
    prepared = spec.prepared
    lines = [f"<domain type={quoteattr(accel)}>", f"  <name>{escape(spec.name)}</name>"]
    if prepared:
        lines.append(f"  <maxMemory slots='{MEMORY_SLOTS}' unit='MiB'>{spec.max_memory_mib}</maxMemory>")
    lines += [
        f"  <memory unit='MiB'>{spec.memory_mib}</memory>",
        f"  <currentMemory unit='MiB'>{spec.memory_mib}</currentMemory>",
    ]
    if prepared:
        lines.append(f"  <vcpu placement='static' current='{spec.vcpus}'>{spec.max_vcpus}</vcpu>")
    else:
        lines.append(f"  <vcpu placement='static'>{spec.vcpus}</vcpu>")
    if spec.cpu_cap is not None:
        lines.append(
            f"  <cputune><period>{spec.cpu_cap.period_us}</period><quota>{spec.cpu_cap.quota_us}</quota></cputune>"
        )
    if partition:
        lines.append(f"  <resource><partition>{escape(partition)}</partition></resource>")
    lines += ["  <os>", "    <type arch='x86_64' machine='q35'>hvm</type>"]
    if from_disk:
        lines.append("    <boot dev='hd'/>")
    else:
        assert kernel is not None and initrd is not None  # (a domain not booted from its disk boots these)
        lines += [
            f"    <kernel>{escape(kernel)}</kernel>",
            f"    <initrd>{escape(initrd)}</initrd>",
            f"    <cmdline>{escape(cmdline or '')}</cmdline>",
        ]
    lines += [
        "  </os>",
        "  <features><acpi/><apic/></features>",
        *cpu_open(spec.cpu_model),
    ]
    if prepared:
        lines.append(
            f"    <numa><cell id='0' cpus='0-{spec.max_vcpus - 1}' memory='{spec.memory_mib}' unit='MiB'/></numa>"
        )
    lines += [
        "  </cpu>",
        "  <on_poweroff>destroy</on_poweroff>",
        "  <on_reboot>restart</on_reboot>",  # a reboot inside the guest keeps the VM running
        "  <on_crash>destroy</on_crash>",
        "  <devices>",
        f"    <emulator>{EMULATOR}</emulator>",
    ]
    lines += [disk_xml(d, "    ") for d in spec.disks]
    if any(d.device == "cdrom" for d in spec.disks):  # (the Debian cloud kernel has no AHCI: no SATA CD-ROM)
        lines.append("    <controller type='scsi' index='0' model='virtio-scsi'/>")
    macs = [n.mac for n in spec.nics]
    if len(set(macs)) != len(macs):
        raise ValueError(f"two NICs of {spec.name} have the same MAC: {', '.join(macs)}")
    lines += [interface_xml(n, "    ") for n in spec.nics]
    lines.append("    <controller type='usb' model='none'/>")
    lines.append("    <controller type='pci' index='0' model='pcie-root'/>")
    lines += ["    <controller type='pci' model='pcie-root-port'/>"] * HOTPLUG_PORTS
    # The serial console is also logged by QEMU (appended across restarts), so a guest that panics or
    # powers off leaves its last words on its host (tests/evidence.py keeps log/qemu/*.log)
    serial = f"<log file={quoteattr(console_log(spec.name))} append='on'/><target port='0'/>"
    lines += [
        f"    <serial type='pty'>{serial}</serial>",
        "    <console type='pty'><target type='serial' port='0'/></console>",
        f"    <channel type='unix'><target type='virtio' name='{AGENT_CHANNEL}'/></channel>",
        "    <memballoon model='virtio'><stats period='5'/></memballoon>",
        "  </devices>",
        "</domain>",
    ]
    return "\n".join(lines) + "\n"
