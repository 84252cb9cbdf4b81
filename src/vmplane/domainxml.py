"""The libvirt domain XML of a VM, as a pure function of its spec (DESIGN sections 5 and 8).

Prepared for live scaling (the ceiling is above the current size) means `<vcpu current='N'>MAX`,
`<maxMemory slots=...>MAX` and a NUMA cell (libvirt needs one for memory hot-plug); otherwise current
== max and there is no maxMemory. Values are escaped: names are validated upstream, but the XML
never trusts them.
"""

from __future__ import annotations

from xml.sax.saxutils import escape, quoteattr

from .drivers.base import DomainSpec

MEMORY_SLOTS = 16
EMULATOR = "/usr/bin/qemu-system-x86_64"
CPU_MODEL = "qemu64"         # `-cpu host` crashes under these machines' KVM backend; a named model is portable


def domain_xml(spec: DomainSpec, kernel: str, initrd: str, cmdline: str, accel: str = "qemu",
               partition: str | None = None) -> str:
    if accel not in ("qemu", "kvm"):
        raise ValueError(f"accel must be qemu (TCG) or kvm, not {accel!r}")
    prepared = spec.prepared
    lines = [f"<domain type={quoteattr(accel)}>",
             f"  <name>{escape(spec.name)}</name>"]
    if prepared:
        lines.append(f"  <maxMemory slots='{MEMORY_SLOTS}' unit='MiB'>{spec.max_memory_mib}</maxMemory>")
    lines += [f"  <memory unit='MiB'>{spec.memory_mib}</memory>",
              f"  <currentMemory unit='MiB'>{spec.memory_mib}</currentMemory>"]
    if prepared:
        lines.append(f"  <vcpu placement='static' current='{spec.vcpus}'>{spec.max_vcpus}</vcpu>")
    else:
        lines.append(f"  <vcpu placement='static'>{spec.vcpus}</vcpu>")
    if spec.cpu_cap is not None:
        lines.append(f"  <cputune><period>{spec.cpu_cap.period_us}</period>"
                     f"<quota>{spec.cpu_cap.quota_us}</quota></cputune>")
    if partition:
        lines.append(f"  <resource><partition>{escape(partition)}</partition></resource>")
    lines += ["  <os>",
              "    <type arch='x86_64' machine='q35'>hvm</type>",
              f"    <kernel>{escape(kernel)}</kernel>",
              f"    <initrd>{escape(initrd)}</initrd>",
              f"    <cmdline>{escape(cmdline)}</cmdline>",
              "  </os>",
              "  <features><acpi/><apic/></features>",
              "  <cpu mode='custom' match='exact' check='none'>",
              f"    <model fallback='forbid'>{CPU_MODEL}</model>"]
    if prepared:
        lines.append(f"    <numa><cell id='0' cpus='0-{spec.max_vcpus - 1}' memory='{spec.memory_mib}' "
                     f"unit='MiB'/></numa>")
    lines += ["  </cpu>",
              "  <on_poweroff>destroy</on_poweroff>",
              "  <on_reboot>destroy</on_reboot>",
              "  <on_crash>destroy</on_crash>",
              "  <devices>",
              f"    <emulator>{EMULATOR}</emulator>",
              "    <controller type='usb' model='none'/>",
              "    <serial type='pty'><target port='0'/></serial>",
              "    <console type='pty'><target type='serial' port='0'/></console>",
              "    <memballoon model='virtio'><stats period='5'/></memballoon>",
              "  </devices>",
              "</domain>"]
    return "\n".join(lines) + "\n"
