"""Builds the test guest from Debian packages into a cache folder, once.

`linux-image-cloud-amd64` (the kernel and its virtio modules) and `busybox-static` are fetched with
`apt-get download` (no install), unpacked with `dpkg -x`, and turned into `vmlinuz` + `initrd.gz`.
The initramfs carries the virtio modules (PCI, balloon, memory, block, net) and whatever the kernel
needs for ext4 (built in on the cloud kernel), each with the modules it depends on, loaded in that order.
Its init mounts /dev/vda, when it holds a file system, at /data: the guest's persistent disk, and brings
each NIC up with a DHCP client in the background (busybox's udhcpc; `vmplane-guest: eth0 ADDR/LEN` on
the console once it holds a lease). It reads a cloud-init NoCloud seed (label cidata, an ISO 9660 CD-ROM
on virtio-scsi) in the background: hostname, SSH keys for root, user data (a `#!` script or a
`#cloud-config` subset); init.sh says which part of it.

It runs the QEMU guest agent: `qemu-ga` from Debian's `qemu-guest-agent` package, with the shared
libraries it needs (found by their ELF DT_NEEDED entries in the packages of AGENT_PACKAGES, fetched and
unpacked the same way) and the dynamic loader, on the virtio-serial port org.qemu.guest_agent.0 when
the domain has one (virtio_console). They add ~6 MiB to the initramfs (~2.6 MiB gzip'd).

It runs an SSH server: `dropbear` from Debian's `dropbear-bin` (its libraries found the same way, in the
packages of SSH_PACKAGES), on port 22, root only (the initramfs's /etc/passwd has no other user), with
the keys of /root/.ssh/authorized_keys (the seed's) and no password login. Its host keys are made at the
first connection (`-R`: a fresh ed25519 key at each boot, the guest's root being a RAM disk). It adds
~2 MiB to the initramfs (~0.9 MiB gzip'd).

`root.qcow2` (same folder, same recipe) is the test template's disk image: an ext4 file system made
with `mkfs.ext4 -d` (no loop mount) holding /etc/vmplane-template, converted with `qemu-img`. A VM's
root disk is a qcow2 overlay on it. The guest boots in ~3.5 s under TCG and answers commands on its
serial console (and, once qemu-ga runs, on its guest agent; once the seed gave keys, over SSH).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vmplane.hosts.guest.initramfs import write_initramfs

IMAGE_NAME = "tiny-linux"
# What the guest needs (their dependencies are found in the kernel's modules and added before them)
# virtio_scsi, sr_mod and isofs: the NoCloud seed, an ISO 9660 CD-ROM. The cloud kernel has no AHCI
# (CONFIG_SATA_AHCI is not set), so a CD-ROM on q35's SATA bus is never seen: it sits on virtio-scsi.
MODULES = ["virtio_pci", "virtio_balloon", "virtio_mem", "virtio_blk", "ext4", "virtio_net"]
MODULES += ["virtio_scsi", "sr_mod", "isofs"]
MODULES += ["virtio_console"]  # the guest agent's virtio-serial port (a module on the cloud kernel)
# The guest agent and the packages of every library it loads (a library missing from them fails the build)
AGENT_PACKAGES = ["qemu-guest-agent", "libglib2.0-0", "libnuma1", "libudev1", "liburing2", "libpcre2-8-0", "libc6"]
AGENT_BINARY = "usr/sbin/qemu-ga"
# The SSH server and the packages of the libraries it loads that AGENT_PACKAGES lacks (libc6 is there)
SSH_PACKAGES = ["dropbear-bin", "libtomcrypt1", "libtommath1", "libgmp10", "libcrypt1", "zlib1g"]
SSH_BINARY = "usr/sbin/dropbear"
# Root's entry (dropbear looks the user up, and takes only a shell /etc/shells lists); `x` with no
# /etc/shadow: no password matches it (and dropbear runs with -s, no password login at all).
ETC_FILES = {
    "etc/passwd": "root:x:0:0:root:/root:/bin/sh\n",
    "etc/group": "root:x:0:\n",
    "etc/shells": "/bin/sh\n",
}
LIB_DIRS = ["lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu"]  # where the packages put them (multiarch)
LOADER = "ld-linux-x86-64.so.2"  # the binaries' interpreter, at /lib64/ as their PT_INTERP says
ROOT_DISK_MIB = 256
# Needed for memory unplug (DIMM detach, virtio-mem shrink): hot-added memory must be movable.
KERNEL_CMDLINE = "console=ttyS0 panic=-1 quiet loglevel=1 memhp_default_state=online_movable no_timer_check"


@dataclass(frozen=True)
class GuestImage:
    kernel: Path
    initrd: Path
    cmdline: str = KERNEL_CMDLINE


def cache_dir() -> Path:
    base = os.environ.get("VMPLANE_GUEST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")), "vmplane", "guest"
    )
    return Path(base)


def recipe_hash() -> str:
    """Changes whenever the guest's init, its modules, its disk or the way it is packed changes: the
    cache is rebuilt then."""
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in ("init.sh", "initramfs.py", "build.py"):
        digest.update((here / name).read_bytes())
    return digest.hexdigest()[:16]


def _current(stamp: Path) -> bool:
    try:
        return stamp.read_text().strip() == recipe_hash()
    except OSError:
        return False


def cached_image() -> GuestImage | None:
    d = cache_dir()
    image = GuestImage(d / "vmlinuz", d / "initrd.gz")
    current = _current(d / "RECIPE")
    return image if current and image.kernel.exists() and image.initrd.exists() else None


def _kernel_package() -> str:
    out = subprocess.run(
        ["apt-cache", "depends", "linux-image-cloud-amd64"], capture_output=True, text=True, check=True
    ).stdout
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("Depends: linux-image-"):
            return line.split()[1]
    raise RuntimeError("apt-cache found no kernel behind linux-image-cloud-amd64 (run apt-get update)")


def _modinfo(ko: Path) -> dict[str, list[str]]:
    """The `.modinfo` section of a kernel module (an ELF64 file): {key: [values]}."""
    data = ko.read_bytes()
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(i: int) -> tuple[int, int, int]:  # (name offset, file offset, size)
        name, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        return name, offset, size

    _, names_at, _ = section(shstrndx)
    info: dict[str, list[str]] = {}
    for i in range(shnum):
        name, offset, size = section(i)
        if data[names_at + name : data.index(b"\0", names_at + name)] == b".modinfo":
            for entry in data[offset : offset + size].split(b"\0"):
                key, _, value = entry.decode(errors="replace").partition("=")
                if value:
                    info.setdefault(key, []).append(value)
    return info


def _norm(name: str) -> str:
    return name.replace("-", "_")


def resolve_modules(root: Path, wanted: list[str]) -> list[Path]:
    """The .ko files of `wanted` and of every module they depend on (`depends=`, and `softdep=` pre:
    entries), dependencies first; built-in modules (`modules.builtin`) need no file. The Debian
    package ships no modules.dep (depmod writes it at install): the modules' own `.modinfo` says it."""
    builtin = {_norm(Path(line).stem) for line in (root / "modules.builtin").read_text().split()}
    files = {_norm(Path(line).stem): root / line for line in (root / "modules.order").read_text().split()}
    order: list[Path] = []
    seen: set[str] = set()

    def visit(name: str, required: bool) -> None:
        name = _norm(name)
        if name in seen or name in builtin:
            return
        seen.add(name)
        if name not in files or not files[name].exists():
            if required:
                raise RuntimeError(f"kernel {root.name} has no module {name}")
            return
        info = _modinfo(files[name])
        for dep in ",".join(info.get("depends", [])).split(","):
            if dep:
                visit(dep, True)
        for soft in info.get("softdep", []):  # "pre: crc32c post: ..."
            pre = soft.split("post:")[0].removeprefix("pre:").split()
            for dep in pre:
                visit(dep, False)
        order.append(files[name])

    for name in wanted:
        visit(name, True)
    return order


def elf_needed(data: bytes) -> list[str]:
    """The DT_NEEDED entries (sonames) of an ELF64 file: its .dynamic section read against the string
    table it links to."""
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needed = []
    for _name, kind, _flags, _addr, offset, size, link, *_rest in sections:
        if kind != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[link][4]
        for at in range(offset, offset + size, 16):
            tag, value = struct.unpack_from("<qQ", data, at)
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                start = strtab + value
                needed.append(data[start : data.index(b"\0", start)].decode())
    return needed


def _tree_file(tree: Path, path: str) -> Path:
    """`path` inside an unpacked package tree, its symbolic links followed inside the tree (an absolute
    target is the tree's, not this machine's)."""
    p = tree / path.lstrip("/")
    for _ in range(16):
        if not p.is_symlink():
            return p
        target = os.readlink(p)
        p = tree / target.lstrip("/") if target.startswith("/") else p.parent / target
    raise RuntimeError(f"too many symbolic links behind {path} in {tree}")


def binary_files(tree: Path, binaries: list[str]) -> list[tuple[str, int, bytes]]:
    """`binaries` (paths in the unpacked packages' tree) for the initramfs, with every library they load
    (recursively, each once, in /lib/x86_64-linux-gnu under its soname) and the loader in /lib64, as
    (path, mode, data)."""
    files = [(f"lib64/{LOADER}", 0o100755, _tree_file(tree, f"lib64/{LOADER}").read_bytes())]
    seen: set[str] = {LOADER}
    todo: list[str] = []
    for path in binaries:
        data = _tree_file(tree, path).read_bytes()
        files.append((path, 0o100755, data))
        todo += elf_needed(data)
    while todo:
        soname = todo.pop(0)
        if soname in seen:
            continue
        seen.add(soname)
        found = [f for d in LIB_DIRS if (f := _tree_file(tree, f"{d}/{soname}")).is_file()]
        if not found:
            raise RuntimeError(f"{soname} is needed and no package of AGENT_PACKAGES, SSH_PACKAGES has it: add it")
        data = found[0].read_bytes()
        files.append((f"lib/x86_64-linux-gnu/{soname}", 0o100755, data))
        todo += elf_needed(data)
    return files


def build(force: bool = False) -> GuestImage:
    """Build (or find) the guest image; safe to call concurrently from several processes."""
    existing = cached_image()
    if existing and not force:
        return existing
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=d) as tmp_name:
        tmp = Path(tmp_name)
        package = _kernel_package()
        version = package.removeprefix("linux-image-")
        subprocess.run(
            ["apt-get", "download", package, "busybox-static", *AGENT_PACKAGES, *SSH_PACKAGES],
            cwd=tmp,
            check=True,
            capture_output=True,
        )
        debs = {p.name.split("_")[0]: p for p in tmp.glob("*.deb")}
        subprocess.run(["dpkg", "-x", str(debs[package]), str(tmp / "k")], check=True)
        subprocess.run(["dpkg", "-x", str(debs["busybox-static"]), str(tmp / "bb")], check=True)
        # one tree: a library's links may point into another package's files
        for name in AGENT_PACKAGES + SSH_PACKAGES:
            subprocess.run(["dpkg", "-x", str(debs[name]), str(tmp / "bins")], check=True)
        modules = resolve_modules(tmp / "k" / "lib" / "modules" / version, MODULES)
        write_initramfs(
            tmp / "initrd.gz",
            tmp / "bb" / "bin" / "busybox",
            Path(__file__).with_name("init.sh"),
            modules,
            [
                *binary_files(tmp / "bins", [AGENT_BINARY, SSH_BINARY]),
                *((path, 0o100644, text.encode()) for path, text in ETC_FILES.items()),
            ],
        )
        shutil.copy(tmp / "k" / "boot" / f"vmlinuz-{version}", tmp / "vmlinuz")
        (tmp / "initrd.gz").replace(d / "initrd.gz")
        (tmp / "vmlinuz").replace(d / "vmlinuz")
        (d / "VERSION").write_text(f"{package}\n")
        (d / "RECIPE").write_text(recipe_hash() + "\n")
    return GuestImage(d / "vmlinuz", d / "initrd.gz")


def cached_root_disk() -> Path | None:
    path = cache_dir() / "root.qcow2"
    return path if _current(cache_dir() / "ROOT-RECIPE") and path.exists() else None


def build_root_disk(force: bool = False) -> Path:
    """Build (or find) `root.qcow2`, the test template's disk: ext4 with /etc/vmplane-template."""
    existing = cached_root_disk()
    if existing and not force:
        return existing
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    recipe = recipe_hash()
    with tempfile.TemporaryDirectory(dir=d) as tmp_name:
        tmp = Path(tmp_name)
        tree = tmp / "tree"
        (tree / "etc").mkdir(parents=True)
        (tree / "etc" / "vmplane-template").write_text(f"image={IMAGE_NAME}\nrecipe={recipe}\n")
        raw = tmp / "root.raw"
        with open(raw, "wb") as f:
            f.truncate(ROOT_DISK_MIB << 20)
        # -E root_owner: the tree is the builder's, the file system root belongs to the guest's root
        subprocess.run(
            ["mkfs.ext4", "-q", "-F", "-L", "vmplane-root", "-E", "root_owner=0:0", "-d", str(tree), str(raw)],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            ["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(tmp / "root.qcow2")],
            check=True,
            capture_output=True,
        )
        (tmp / "root.qcow2").replace(d / "root.qcow2")
        (d / "ROOT-RECIPE").write_text(recipe + "\n")
    return d / "root.qcow2"


def root_disk_image() -> Path:
    """The test template's disk image (qcow2), built on first use."""
    return cached_root_disk() or build_root_disk()


if __name__ == "__main__":
    image = build(force=True)
    disk = build_root_disk(force=True)
    print(
        f"{IMAGE_NAME}: {image.kernel} ({image.kernel.stat().st_size >> 20} MiB), "
        f"{image.initrd} ({image.initrd.stat().st_size >> 10} KiB), {disk} ({disk.stat().st_size >> 10} KiB)"
    )
