"""Builds the test guest from Debian packages into a cache folder, once.

`linux-image-cloud-amd64` (the kernel and its virtio modules) and `busybox-static` are fetched with
`apt-get download` (no install), unpacked with `dpkg -x`, and turned into `vmlinuz` + `initrd.gz`.
The guest boots in ~3.5 s under TCG and answers commands on its serial console.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .initramfs import write_initramfs

IMAGE_NAME = "tiny-linux"
MODULES = ["virtio_ring", "virtio", "virtio_pci_legacy_dev", "virtio_pci_modern_dev", "virtio_pci", "virtio_balloon",
           "virtio_mem"]
# Needed for memory unplug (DIMM detach, virtio-mem shrink): hot-added memory must be movable.
KERNEL_CMDLINE = "console=ttyS0 panic=-1 quiet loglevel=1 memhp_default_state=online_movable"


@dataclass(frozen=True)
class GuestImage:
    kernel: Path
    initrd: Path
    cmdline: str = KERNEL_CMDLINE


def cache_dir() -> Path:
    base = os.environ.get("VMPLANE_GUEST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")), "vmplane", "guest")
    return Path(base)


def recipe_hash() -> str:
    """Changes whenever the guest's init or the way it is packed changes: the cache is rebuilt then."""
    import hashlib

    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in ("init.sh", "initramfs.py"):
        digest.update((here / name).read_bytes())
    digest.update(" ".join(MODULES).encode())
    return digest.hexdigest()[:16]


def cached_image() -> GuestImage | None:
    d = cache_dir()
    image = GuestImage(d / "vmlinuz", d / "initrd.gz")
    try:
        current = (d / "RECIPE").read_text().strip() == recipe_hash()
    except OSError:
        current = False
    return image if current and image.kernel.exists() and image.initrd.exists() else None


def _kernel_package() -> str:
    out = subprocess.run(["apt-cache", "depends", "linux-image-cloud-amd64"], capture_output=True, text=True,
                         check=True).stdout
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("Depends: linux-image-"):
            return line.split()[1]
    raise RuntimeError("apt-cache found no kernel behind linux-image-cloud-amd64 (run apt-get update)")


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
        subprocess.run(["apt-get", "download", package, "busybox-static"], cwd=tmp, check=True,
                       capture_output=True)
        debs = {p.name.split("_")[0]: p for p in tmp.glob("*.deb")}
        subprocess.run(["dpkg", "-x", str(debs[package]), str(tmp / "k")], check=True)
        subprocess.run(["dpkg", "-x", str(debs["busybox-static"]), str(tmp / "bb")], check=True)
        virtio = tmp / "k" / "lib" / "modules" / version / "kernel" / "drivers" / "virtio"
        modules = [virtio / f"{m}.ko" for m in MODULES]
        missing = [m.name for m in modules if not m.exists()]
        if missing:
            raise RuntimeError(f"kernel {version} lacks modules {missing}")
        write_initramfs(tmp / "initrd.gz", tmp / "bb" / "bin" / "busybox", Path(__file__).with_name("init.sh"), modules)
        shutil.copy(tmp / "k" / "boot" / f"vmlinuz-{version}", tmp / "vmlinuz")
        (tmp / "initrd.gz").replace(d / "initrd.gz")
        (tmp / "vmlinuz").replace(d / "vmlinuz")
        (d / "VERSION").write_text(f"{package}\n")
        (d / "RECIPE").write_text(recipe_hash() + "\n")
    return GuestImage(d / "vmlinuz", d / "initrd.gz")


if __name__ == "__main__":
    image = build(force=True)
    print(f"{IMAGE_NAME}: {image.kernel} ({image.kernel.stat().st_size >> 20} MiB), "
          f"{image.initrd} ({image.initrd.stat().st_size >> 10} KiB)")
