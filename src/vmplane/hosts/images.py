"""Template disk images: imported into the control plane's image store (format detected by `qemu-img
info`, sha256 kept), and uploaded through a host's driver into its image pool (the libvirt pool
`vmplane-images` at /var/lib/vmplane/images, which every host of a local cluster shares) before a root
disk is made on them: a root disk is a qcow2 overlay whose backing file is the image there.

`tiny-linux` names the test guest's root disk image, built from Debian packages on first use.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from vmplane.core import storagerules as R
from vmplane.core.driver import Driver, PoolSpec
from vmplane.core.errors import Invalid

BUILTIN = "tiny-linux"
FORMATS = ("qcow2", "raw")


@dataclass(frozen=True)
class ImageFacts:
    path: str  # in the control plane's image store (or the built-in name)
    format: str
    virtual_mib: int
    checksum: str | None


def store_dir() -> Path:
    home = os.environ.get("VMPLANE_HOME") or os.path.join(str(Path.home()), ".local", "share", "vmplane")
    return Path(os.environ.get("VMPLANE_IMAGE_STORE") or os.path.join(home, "images"))


def builtin_image() -> Path:
    from vmplane.hosts.guest import build

    return build.root_disk_image()


def builtin_facts() -> ImageFacts:
    from vmplane.hosts.guest import build

    return ImageFacts(BUILTIN, "qcow2", build.ROOT_DISK_MIB, None)


def _looks_like_a_disk(path: Path) -> bool:
    """qemu-img calls any file `raw`: a raw image must at least carry a boot sector, a partition table
    or a file system (ext2/3/4, XFS, or an ISO 9660 volume)."""
    with open(path, "rb") as f:
        head = f.read(64 * 1024 + 8)
    if len(head) >= 512 and head[510:512] == b"\x55\xaa":
        return True
    if len(head) >= 1082 and head[1080:1082] == b"\x53\xef":  # ext superblock magic
        return True
    if head[:4] == b"XFSB":
        return True
    return len(head) >= 32774 and head[32769:32774] == b"CD001"


def inspect(source: str) -> tuple[str, int]:
    """(format, virtual size in MiB) of an image file, or Invalid naming why it is not one."""
    path = Path(source)
    if not path.is_absolute() or not path.is_file():
        raise Invalid(f"image {source!r} is not a file on the control plane (give an absolute path)", field="image")
    out = subprocess.run(["qemu-img", "info", "--output=json", str(path)], capture_output=True, text=True)
    if out.returncode != 0:
        raise Invalid(f"image {source}: qemu-img can not read it: {out.stderr.strip()[:200]}", field="image")
    info = json.loads(out.stdout)
    fmt = info.get("format")
    if fmt not in FORMATS:
        raise Invalid(f"image {source} is {fmt}; vmplane takes qcow2 or raw images", field="image")
    if fmt == "raw" and not _looks_like_a_disk(path):
        raise Invalid(
            f"image {source} is not a disk image: no boot sector, partition table or file system "
            f"(qemu-img calls any file raw)",
            field="image",
        )
    if info.get("backing-filename"):
        raise Invalid(f"image {source} has a backing file; import a standalone image (qemu-img convert)", field="image")
    return fmt, max(1, -(-int(info["virtual-size"]) // (1 << 20)))


def import_image(name: str, source: str) -> ImageFacts:
    """Copy an image into the store under a name made of the template's name and its checksum."""
    fmt, virtual_mib = inspect(source)
    digest = hashlib.sha256()
    with open(source, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    checksum = digest.hexdigest()
    store = store_dir()
    store.mkdir(parents=True, exist_ok=True)
    target = store / f"{name}-{checksum[:12]}.{fmt}"
    if not target.exists():
        tmp = target.with_suffix(".part")
        shutil.copyfile(source, tmp)
        tmp.replace(target)
    return ImageFacts(str(target), fmt, virtual_mib, checksum)


def host_file(disk_image: str, fmt: str) -> str:
    """The image's file name in a host's image pool."""
    if disk_image == BUILTIN:
        from vmplane.hosts.guest import build

        return f"{BUILTIN}-{build.recipe_hash()}.{fmt}"
    return Path(disk_image).name


def ensure_on_host(driver: Driver, disk_image: str, fmt: str) -> str:
    """Make sure the host's image pool holds the image (uploaded through the driver if not); returns
    its path there, the backing file of a root disk."""
    driver.define_pool(PoolSpec(R.IMAGE_POOL, R.IMAGES_PATH))
    name = host_file(disk_image, fmt)
    found = driver.volume(R.IMAGE_POOL, name)
    if found is None and disk_image == BUILTIN and driver.kind == "sim":
        # a sim host runs no guest: the built-in image (built from Debian packages) is stood in for by a
        # volume of its size, so that sim clusters never need apt
        found = driver.create_volume(R.IMAGE_POOL, name, builtin_facts().virtual_mib, fmt)
    elif found is None:
        source = str(builtin_image()) if disk_image == BUILTIN else disk_image
        found = driver.upload_volume(R.IMAGE_POOL, name, source, fmt)
    return found.path


def template_disk(name: str, disk: str) -> ImageFacts:
    """The root-disk image of template `name`: the test guest's (`tiny-linux`) or the file `disk`, imported."""
    return builtin_facts() if disk == BUILTIN else import_image(name, disk)
