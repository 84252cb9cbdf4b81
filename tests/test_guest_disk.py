"""The test guest's disk: the template's disk image and the modules the initramfs loads for it."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess

import pytest

from vmplane.hosts.guest import build


def _need(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None and shutil.which(t, path="/usr/sbin:/sbin") is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")


def test_the_root_disk_image_is_a_qcow2_holding_an_ext4_file_system_with_the_recipe(tmp_path, monkeypatch):
    _need("qemu-img", "mkfs.ext4", "debugfs")
    monkeypatch.setenv("VMPLANE_GUEST_CACHE", str(tmp_path / "cache"))
    image = build.root_disk_image()
    assert image == tmp_path / "cache" / "root.qcow2" and build.cached_root_disk() == image
    info = json.loads(
        subprocess.run(
            ["qemu-img", "info", "--output=json", str(image)], capture_output=True, text=True, check=True
        ).stdout
    )
    assert info["format"] == "qcow2" and info["virtual-size"] == build.ROOT_DISK_MIB << 20
    raw = tmp_path / "root.raw"
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(image), str(raw)], check=True)
    debugfs = shutil.which("debugfs") or shutil.which("debugfs", path="/usr/sbin:/sbin")
    template = subprocess.run(
        [debugfs, "-R", "cat /etc/vmplane-template", str(raw)], capture_output=True, text=True, check=True
    ).stdout
    assert f"recipe={build.recipe_hash()}" in template
    mtime = image.stat().st_mtime_ns
    assert build.root_disk_image().stat().st_mtime_ns == mtime  # built once
    (tmp_path / "cache" / "ROOT-RECIPE").write_text("older\n")  # the recipe changed: rebuilt
    assert build.cached_root_disk() is None
    assert build.root_disk_image() == image and build.cached_root_disk() == image


def _cpio_files(initrd) -> dict[str, bytes]:
    data, files, at = gzip.decompress(initrd.read_bytes()), {}, 0
    while True:
        fields = [int(data[at + 6 + 8 * i : at + 14 + 8 * i], 16) for i in range(13)]
        size, namesize = fields[6], fields[11]
        name = data[at + 110 : at + 110 + namesize - 1].decode()
        at += 110 + namesize + (-(110 + namesize) % 4)
        if name == "TRAILER!!!":
            return files
        files[name] = data[at : at + size]
        at += size + (-size % 4)


def test_the_initramfs_loads_the_disk_modules_after_their_dependencies():
    image = build.cached_image()
    if image is None:
        pytest.skip("the guest image is not built (python -m vmplane.hosts.guest.build)")
    files = _cpio_files(image.initrd)
    order = files["lib/modules/load-order"].decode().split()
    assert all(f"lib/modules/{m}.ko" in files for m in order)
    assert "virtio_blk" in order and "data" in {n for n in files if "/" not in n}
    for before, after in (("virtio_ring", "virtio"), ("virtio", "virtio_blk"), ("virtio", "virtio_pci")):
        assert order.index(before) < order.index(after), order
