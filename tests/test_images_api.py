"""Images uploaded through the API and the CLI (issue 30): streamed, their sha256 and qemu-img's view checked,
registered by name; a refused upload registers and keeps nothing; templates are made from them, and an
image in use is not deleted."""

import hashlib
import io
import json
import shutil
import subprocess

import pycdlib
import pytest

from .conftest import add_basics, add_sim_hosts, in_process_cli

API = "/api/v1"
pytestmark = pytest.mark.skipif(shutil.which("qemu-img") is None, reason="needs qemu-img")


@pytest.fixture
def store(orch, tmp_path, monkeypatch):
    """The control plane's image store (its own folder), beside sim hosts and a project."""
    folder = tmp_path / "image-store"
    monkeypatch.setenv("VMPLANE_IMAGE_STORE", str(folder))
    add_sim_hosts(orch, 2)
    add_basics(orch)
    orch.catalog.create_project("a", 16, 65536, 20)
    orch.pools.create("shared", "shared", cluster="c1")  # for the root disks of VMs from an image
    return folder


def qcow2(tmp_path, name="disk.qcow2", size="64M"):
    path = tmp_path / name
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(path), size], check=True)
    return path


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def upload(api, name, data: bytes, digest: str | None = None, **headers):
    sent = {"Content-Type": "application/octet-stream", "X-Image-Sha256": digest or sha(data), **headers}
    return api.post(
        f"{API}/images/{name}", content=iter([data[i : i + 65536] for i in range(0, len(data), 65536)]), headers=sent
    )


def _ok(response, status=200):
    assert response.status_code == status, response.text
    return response.json() if response.content else None


def _refused(response, status, field):
    assert response.status_code == status, response.text
    assert response.json()["field"] == field, response.text


def _files(folder):
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_an_uploaded_qcow2_is_checked_and_registered_once(api, store, tmp_path):
    data = qcow2(tmp_path).read_bytes()
    image = _ok(upload(api, "debian", data), 201)
    assert (image["name"], image["format"], image["virtual_mib"]) == ("debian", "qcow2", 64)
    assert (image["sha256"], image["size_bytes"]) == (sha(data), len(data))
    assert _files(store) == [f"debian-{sha(data)[:12]}.qcow2"] and (store / _files(store)[0]).read_bytes() == data
    assert _ok(api.get(f"{API}/images/debian")) == image
    assert [i["name"] for i in _ok(api.get(f"{API}/images"))] == ["debian"]
    # restartable: the same file again is a no-op, another file under the name a 409 naming it
    assert _ok(upload(api, "debian", data), 200) == image
    _refused(upload(api, "debian", qcow2(tmp_path, "other.qcow2", "32M").read_bytes()), 409, "name")
    assert _files(store) == [f"debian-{sha(data)[:12]}.qcow2"]


def test_a_truncated_or_corrupted_upload_is_refused_and_nothing_is_kept(api, store, tmp_path):
    data = qcow2(tmp_path).read_bytes()
    _refused(upload(api, "cut", data[: len(data) // 2], sha(data)), 422, "sha256")
    _refused(upload(api, "bent", data[:-1] + b"\x01", sha(data)), 422, "sha256")
    _refused(upload(api, "cut", data, "not-a-sha"), 422, "sha256")
    _refused(
        api.post(f"{API}/images/cut", content=data, headers={"Content-Type": "application/octet-stream"}), 422, "sha256"
    )
    _refused(upload(api, "cut", data, **{"Content-Type": "application/json"}), 422, "body")
    _refused(upload(api, "Bad_Name", data), 422, "name")
    assert _ok(api.get(f"{API}/images")) == [] and _files(store) == []
    _refused(api.get(f"{API}/images/cut"), 404, "image")


def _iso() -> bytes:
    iso = pycdlib.PyCdlib()
    iso.new(interchange_level=3, vol_ident="DATA")
    iso.add_fp(io.BytesIO(b"hello\n"), 6, "/HELLO.TXT;1")
    out = io.BytesIO()
    iso.write_fp(out)
    iso.close()
    return out.getvalue()


def test_a_file_that_is_no_disk_image_is_refused_naming_image(api, store, tmp_path):
    _refused(upload(api, "notes", b"just some text\n" * 1000), 422, "image")
    _refused(upload(api, "cdrom", _iso()), 422, "image")
    overlay = tmp_path / "overlay.qcow2"
    base = qcow2(tmp_path)
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "qcow2", str(overlay)], check=True
    )
    _refused(upload(api, "overlay", overlay.read_bytes()), 422, "image")  # a backing file: not standalone
    assert _ok(api.get(f"{API}/images")) == [] and _files(store) == []


def test_a_member_may_not_upload_list_or_delete_images(api, store, tmp_path):
    member = api.post(f"{API}/tokens", json={"name": "m", "role": "member", "project": "a"}).json()["token"]
    as_member = {"Authorization": f"Bearer {member}"}
    data = qcow2(tmp_path).read_bytes()
    _refused(upload(api, "mine", data, **as_member), 403, None)
    assert _ok(api.get(f"{API}/images")) == [] and _files(store) == []
    _ok(upload(api, "debian", data), 201)
    for method, path in (("GET", "/images"), ("GET", "/images/debian"), ("DELETE", "/images/debian")):
        _refused(api.request(method, API + path, headers=as_member), 403, None)
    _ok(api.get(f"{API}/images/debian"))


def test_a_template_from_an_image_runs_vms_and_keeps_the_image_until_it_goes(api, store, tmp_path, orch):
    data = qcow2(tmp_path).read_bytes()
    image = _ok(upload(api, "debian", data), 201)
    both = {"name": "t2", "image": "tiny-linux", "from_image": "debian"}
    _refused(api.post(f"{API}/templates", json=both), 422, "from_image")
    _refused(api.post(f"{API}/templates", json={"name": "t2", "from_image": "nowhere"}), 422, "from_image")
    _refused(api.post(f"{API}/templates", json={"name": "t2"}), 422, "image")
    template = _ok(api.post(f"{API}/templates", json={"name": "deb", "from_image": "debian"}), 201)
    assert (template["image"], template["disk_image"], template["disk_format"]) == ("", image["file"], "qcow2")
    assert (template["disk_mib"], template["checksum"]) == (64, image["sha256"])
    vm = {"name": "v1", "project": "a", "offering": "small", "template": "deb", "start": True}
    assert _ok(api.post(f"{API}/vms", json=vm), 202)["operation"]["state"] == "succeeded"  # (executed inline)
    assert _ok(api.get(f"{API}/vms/v1"))["state"] == "running"
    # the image went to the VM's host's image pool under its name in the store
    host = orch.drivers[_ok(api.get(f"{API}/vms/v1"))["host"]]
    assert host.volume("vmplane-images", image["file"].rsplit("/", 1)[1]) is not None
    refused = api.delete(f"{API}/images/debian")
    _refused(refused, 409, "image")
    assert "deb" in refused.json()["message"]
    _ok(api.post(f"{API}/vms/v1/stop", json={"force": True}), 202)
    _ok(api.delete(f"{API}/vms/v1"), 204)
    _ok(api.delete(f"{API}/templates/deb"), 204)
    _ok(api.delete(f"{API}/images/debian"), 204)
    assert _files(store) == [] and _ok(api.get(f"{API}/images")) == []
    _refused(api.delete(f"{API}/images/debian"), 404, "image")


@pytest.fixture
def cli(api, store, monkeypatch):
    """The CLI against the in-process API (as tests/test_networks_api.py points it)."""
    return in_process_cli(api, monkeypatch)


def test_image_commands_upload_list_show_and_delete(cli, store, tmp_path):
    path = qcow2(tmp_path)
    rc, out = cli("image", "upload", "debian", str(path), "-o", "json")
    assert rc == 0, out
    image = json.loads(out[out.index("{") :])
    assert (image["sha256"], image["format"]) == (hashlib.sha256(path.read_bytes()).hexdigest(), "qcow2")
    rc, out = cli("image", "upload", "debian", str(path))
    assert rc == 0 and "uploaded already" in out, out
    rc, out = cli("image", "upload", "debian", str(qcow2(tmp_path, "other.qcow2", "32M")))
    assert rc == 1 and "already_exists" in out and "name" in out, out
    rc, out = cli("image", "upload", "notes", str(tmp_path / "disk.qcow2"), "-o", "json")
    assert rc == 0, out
    text = tmp_path / "notes.txt"
    text.write_text("not an image\n")
    rc, out = cli("image", "upload", "notes2", str(text))
    assert rc == 1 and "image" in out, out
    rc, out = cli("image", "list")
    assert rc == 0 and "debian" in out and "notes" in out and "qcow2" in out, out
    rc, out = cli("template", "create", "deb", "--from-image", "debian", "-o", "json")
    assert rc == 0 and json.loads(out)["disk_image"] == image["file"], out
    rc, out = cli("image", "delete", "debian")
    assert rc == 1 and "deb" in out, out
    rc, out = cli("image", "delete", "notes")
    assert rc == 0 and "deleted" in out, out
    rc, out = cli("image", "show", "debian", "-o", "json")  # (a table folds a long digest at the terminal's width)
    assert rc == 0 and json.loads(out)["sha256"] == image["sha256"], out
