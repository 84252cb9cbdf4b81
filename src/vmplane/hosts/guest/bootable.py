"""A bootable disk image of the test guest, for tests of templates that boot a disk image as it is.

`bootable.raw` (in the guest cache folder) is a whole-disk ("superfloppy", no partition table) ext3 file
system holding the test guest's `vmlinuz` and `initrd.gz` (from build.py) and an EXTLINUX boot loader
whose `extlinux.conf` boots them with the test guest's cmdline plus `vmplane_boot=extlinux`; EXTLINUX
adds `BOOT_IMAGE=/vmlinuz`. SeaBIOS loads the file system's boot sector (EXTLINUX's), which loads
`ldlinux.sys`, the kernel and the initramfs. The guest's init mounts /dev/vda, the boot disk itself, at
/data: what the guest writes there is on the VM's root disk.

Why ext3: syslinux 6.04 fails to read the kernel from the ext4 file system `mkfs.ext4 -d` makes ("I/O
error"), and the init mounts /dev/vda with `-o commit=1`, which ext4 refuses for a file system without
a journal (ext2). EXTLINUX is taken from the Debian packages `extlinux` and `syslinux-common`, fetched
with `apt-get download` and unpacked with `dpkg -x` (not installed); `extlinux --install` needs the file
system mounted: the builder loop-mounts it (root only) and detaches its own loop device afterwards.

Not part of the test guest's normal path: only tests (and benches) of bootable disk images build it.
"""

from __future__ import annotations

import hashlib
import subprocess
import tempfile
from pathlib import Path

from vmplane.hosts.guest import build

DISK_MIB = 64
IMAGE_FILE = "bootable.raw"
STAMP = "BOOTABLE-RECIPE"
BOOT_MARKER = "vmplane_boot=extlinux"  # on the kernel's command line only when EXTLINUX booted it
PACKAGES = ("extlinux", "syslinux-common")
EXTLINUX_CONF = f"""DEFAULT linux
PROMPT 0
TIMEOUT 0
LABEL linux
  KERNEL /vmlinuz
  INITRD /initrd.gz
  APPEND {build.KERNEL_CMDLINE} {BOOT_MARKER}
"""


class BootLoaderUnavailable(RuntimeError):
    """The boot loader's packages could not be fetched (no apt, no network, no package lists)."""


def recipe_hash() -> str:
    """Changes with the test guest's recipe (its kernel and initramfs) and with this builder."""
    digest = hashlib.sha256(build.recipe_hash().encode())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()[:16]


def cached_bootable() -> Path | None:
    path = build.cache_dir() / IMAGE_FILE
    try:
        current = (build.cache_dir() / STAMP).read_text().strip() == recipe_hash()
    except OSError:
        return None
    return path if current and path.exists() else None


def fetch_boot_loader(folder: Path) -> Path:
    """Unpack the boot loader's packages under `folder`; returns the `extlinux` program."""
    got = subprocess.run(["apt-get", "download", *PACKAGES], cwd=folder, capture_output=True, text=True)
    if got.returncode != 0:
        raise BootLoaderUnavailable(f"apt-get download {' '.join(PACKAGES)} failed: {got.stderr.strip()[-300:]}")
    for deb in folder.glob("*.deb"):
        subprocess.run(["dpkg", "-x", str(deb), str(folder / "x")], check=True, capture_output=True)
    program = folder / "x" / "usr" / "bin" / "extlinux"
    if not program.exists():
        raise BootLoaderUnavailable(f"the {PACKAGES[0]} package holds no usr/bin/extlinux")
    return program


def _install_boot_loader(extlinux: Path, raw: Path, mountpoint: Path) -> None:
    """`extlinux --install` on the file system of `raw`, loop-mounted at `mountpoint`; the loop device
    made here is unmounted and detached by name whatever happens."""
    loop = subprocess.run(["losetup", "--find", "--show", str(raw)], capture_output=True, text=True, check=True)
    device = loop.stdout.strip()
    try:
        mountpoint.mkdir(exist_ok=True)
        subprocess.run(["mount", "-t", "ext3", device, str(mountpoint)], check=True, capture_output=True)
        try:
            subprocess.run([str(extlinux), "--install", str(mountpoint)], check=True, capture_output=True)
        finally:
            subprocess.run(["umount", str(mountpoint)], check=True, capture_output=True)
    finally:
        subprocess.run(["losetup", "--detach", device], check=True, capture_output=True)


def build_bootable(force: bool = False) -> Path:
    """Build (or find) `bootable.raw`; safe to call concurrently (built aside, then renamed)."""
    existing = cached_bootable()
    if existing and not force:
        return existing
    guest = build.cached_image() or build.build()
    d = build.cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    recipe = recipe_hash()
    with tempfile.TemporaryDirectory(dir=d) as tmp_name:
        tmp = Path(tmp_name)
        extlinux = fetch_boot_loader(tmp)
        tree = tmp / "tree"
        tree.mkdir()
        (tree / "vmlinuz").write_bytes(guest.kernel.read_bytes())
        (tree / "initrd.gz").write_bytes(guest.initrd.read_bytes())
        (tree / "extlinux.conf").write_text(EXTLINUX_CONF)
        (tree / "etc").mkdir()
        (tree / "etc" / "vmplane-bootable").write_text(f"recipe={recipe}\n")
        raw = tmp / IMAGE_FILE
        with open(raw, "wb") as f:
            f.truncate(DISK_MIB << 20)
        subprocess.run(
            ["mkfs.ext3", "-q", "-F", "-L", "vmplane-boot", "-E", "root_owner=0:0", "-d", str(tree), str(raw)],
            check=True,
            capture_output=True,
        )
        _install_boot_loader(extlinux, raw, tmp / "mnt")
        raw.replace(d / IMAGE_FILE)
        (d / STAMP).write_text(recipe + "\n")
    return d / IMAGE_FILE


def bootable_image() -> Path:
    """The bootable disk image (raw), built on first use."""
    return cached_bootable() or build_bootable()


if __name__ == "__main__":
    path = build_bootable(force=True)
    print(f"{path} ({DISK_MIB} MiB raw, {path.stat().st_blocks * 512 >> 10} KiB allocated)")
