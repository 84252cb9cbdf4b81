"""The NoCloud seed image (hosts/seediso.py): an ISO labelled cidata with the seed's files under their exact
names, the same bytes for the same files. Read back with pycdlib, and with isoinfo/7z/blkid where installed."""

import io
import shutil
import subprocess

import pycdlib
import pytest

from vmplane.core import cloudinit as C
from vmplane.hosts.seediso import build_iso

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFh alice@laptop"
SEED = C.Seed(
    instance_id="vm-42",
    hostname="web-1",
    ssh_keys=(C.check_ssh_key(KEY),),
    user_data=b"#!/bin/sh\ntouch /marker\n",
    nics=(C.SeedNic(mac="02:76:70:00:00:07", address="10.10.0.5/24", gateway="10.10.0.1"),),
)
FILES = C.files(SEED)


def _open(image: bytes) -> pycdlib.PyCdlib:
    iso = pycdlib.PyCdlib()
    iso.open_fp(io.BytesIO(image))
    return iso


def _read(iso: pycdlib.PyCdlib, **path: str) -> bytes:
    out = io.BytesIO()
    iso.get_file_from_iso_fp(out, **path)
    return out.getvalue()


def test_the_image_is_labelled_cidata_in_both_volume_descriptors():
    iso = _open(build_iso(FILES))
    assert iso.pvd.volume_identifier.decode().strip() == "cidata"
    assert iso.joliet_vd.volume_identifier.decode("utf-16-be").strip() == "cidata"


def test_the_files_are_at_the_root_under_their_exact_rock_ridge_and_joliet_names():
    iso = _open(build_iso(FILES))
    assert set(FILES) == {"meta-data", "user-data", "network-config"}
    for name, content in FILES.items():
        assert _read(iso, rr_path=f"/{name}") == content
        assert _read(iso, joliet_path=f"/{name}") == content
    names = {child.rock_ridge.name() for child in iso.list_children(rr_path="/") if child.rock_ridge}
    assert {b"meta-data", b"user-data", b"network-config"} <= names
    # plain ISO 9660 readers see 8.3 names of the same contents
    assert _read(iso, iso_path="/METADATA.;1") == FILES["meta-data"]
    assert _read(iso, iso_path="/NETWORKC.;1") == FILES["network-config"]


def test_equal_files_give_equal_bytes_and_other_files_other_bytes():
    assert build_iso(dict(FILES)) == build_iso(dict(reversed(list(FILES.items()))))
    assert build_iso(FILES) != build_iso({**FILES, "user-data": b"#!/bin/sh\n"})


def test_names_that_share_an_8_3_name_stay_apart():
    files = {"meta-data": b"1", "meta-data-2": b"2", "META_DATA": b"3"}
    iso = _open(build_iso(files))
    for name, content in files.items():
        assert _read(iso, rr_path=f"/{name}") == content


@pytest.mark.parametrize("name", ["", "a/b", "..", "x" * 65])
def test_a_name_that_is_not_a_file_name_is_refused(name):
    with pytest.raises(ValueError, match="not a plain file name"):
        build_iso({name: b""})


def test_system_tools_read_the_label_and_files_where_installed(tmp_path):
    path = tmp_path / "seed.iso"
    path.write_bytes(build_iso(FILES))
    tools = [tool for tool in ("blkid", "isoinfo", "7z") if shutil.which(tool)]
    if not tools:
        pytest.skip("none of blkid, isoinfo, 7z is installed: pycdlib's reading above stands alone")
    if "blkid" in tools:
        label = subprocess.run(["blkid", "-o", "value", "-s", "LABEL", str(path)], capture_output=True, text=True)
        assert label.stdout.strip() == "cidata"
    if "isoinfo" in tools:
        out = subprocess.run(["isoinfo", "-R", "-i", str(path), "-x", "/meta-data"], capture_output=True, check=True)
        assert out.stdout == FILES["meta-data"]
    if "7z" in tools:
        listing = subprocess.run(["7z", "l", str(path)], capture_output=True, text=True, check=True).stdout
        assert "network-config" in listing
