"""cloud-init NoCloud seed rules (core/cloudinit.py): SSH public keys, hostnames, user data, and the seed's
meta-data, user-data and network-config files."""

import base64
import dataclasses
import subprocess

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from vmplane.core import cloudinit as C
from vmplane.core.errors import Invalid


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Key pairs made by ssh-keygen: {type: (public line, private text)}."""
    folder = tmp_path_factory.mktemp("keys")
    made = {}
    for kind, extra in (("ed25519", []), ("rsa", ["-b", "2048"]), ("ecdsa", ["-b", "384"])):
        path = folder / kind
        subprocess.run(
            ["ssh-keygen", "-q", "-t", kind, *extra, "-N", "", "-C", f"alice@{kind}", "-f", str(path)], check=True
        )
        made[kind] = ((folder / f"{kind}.pub").read_text(), path.read_text())
    return made


@pytest.mark.parametrize("kind", ["ed25519", "rsa", "ecdsa"])
def test_a_public_key_made_by_ssh_keygen_is_taken_as_one_normal_line(keys, kind):
    public = keys[kind][0]
    line = C.check_ssh_key("  " + public + "\n")
    assert line == public.strip()
    assert line.endswith(f"alice@{kind}")
    assert C.check_ssh_key(line) == line  # normal form is a fixed point


def test_a_key_without_comment_and_a_comment_with_spaces_are_kept(keys):
    key_type, blob, _ = keys["ed25519"][0].split(None, 2)
    assert C.check_ssh_key(f"{key_type} {blob}") == f"{key_type} {blob}"
    assert C.check_ssh_key(f"{key_type}\t{blob}   my laptop key ") == f"{key_type} {blob} my laptop key"


@pytest.mark.parametrize("kind", ["ed25519", "rsa"])
def test_a_private_key_pasted_by_mistake_is_refused_saying_so(keys, kind):
    with pytest.raises(Invalid, match="private key") as err:
        C.check_ssh_key(keys[kind][1], field="ssh_keys[0]")
    assert err.value.field == "ssh_keys[0]"
    assert "not an SSH public key" in err.value.message


def test_a_blob_of_another_type_than_it_claims_is_refused(keys):
    _, blob, _ = keys["ed25519"][0].split(None, 2)
    with pytest.raises(Invalid, match="says ssh-rsa but its key data is 'ssh-ed25519'"):
        C.check_ssh_key(f"ssh-rsa {blob} x")


def test_an_ecdsa_key_claiming_another_curve_is_refused(keys):
    _, blob, _ = keys["ecdsa"][0].split(None, 2)
    with pytest.raises(Invalid, match="not an SSH public key"):
        C.check_ssh_key(f"ecdsa-sha2-nistp256 {blob}")


def _wire(*fields: bytes) -> str:
    return base64.b64encode(b"".join(len(f).to_bytes(4, "big") + f for f in fields)).decode()


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty"),
        ("hello world", "not a key type"),
        ("ssh-ed25519", "no key after it"),
        ("ssh-ed25519 not*base64!", "not base64"),
        ("ssh-ed25519 " + base64.b64encode(b"\x00\x00\x00\xffshort").decode(), "SSH key format"),
        ("ssh-ed25519 " + _wire(b"ssh-ed25519", b"x" * 31), "not 32 bytes"),
        ("ssh-ed25519 " + _wire(b"ssh-ed25519", b"x" * 32, b"extra"), "3 fields, not 2"),
        ("ssh-dss " + _wire(b"ssh-dss", b"p", b"q", b"g", b"y"), "not a key type"),
        ('command="ls" ssh-ed25519 ' + _wire(b"ssh-ed25519", b"x" * 32), "options are not taken"),
        ("ssh-ed25519 " + _wire(b"ssh-ed25519", b"x" * 32) + " a\x00b", "control characters"),
        ("ssh-ed25519 " + _wire(b"ssh-ed25519", b"x" * 32) + "\nssh-ed25519 AAAA", "several lines"),
    ],
)
def test_what_is_not_an_ssh_public_key_is_refused_naming_the_field_and_why(text, why):
    with pytest.raises(Invalid, match=why) as err:
        C.check_ssh_key(text)
    assert err.value.field == "ssh_keys"
    assert err.value.message.startswith("not an SSH public key")


def test_a_wellformed_wire_blob_is_a_key():
    line = "ssh-ed25519 " + _wire(b"ssh-ed25519", bytes(range(32)))
    assert C.check_ssh_key(line) == line


@pytest.mark.parametrize(
    ("text", "expected"),
    [("web-1", "web-1"), ("Web-1.Example.ORG", "web-1.example.org"), ("1a", "1a"), ("a" * 63, "a" * 63)],
)
def test_a_hostname_is_taken_lowercased(text, expected):
    assert C.check_hostname(text) == expected


@pytest.mark.parametrize(
    "text",
    ["", "-web", "web-", "web_1", "a..b", "a.", "a" * 64, ".".join(["a" * 63] * 4), "wéb", "web 1", "web/1"],
)
def test_what_is_not_a_hostname_is_refused_naming_the_field(text):
    with pytest.raises(Invalid) as err:
        C.check_hostname(text, field="hostname")
    assert err.value.field == "hostname"


_LABELS = st.from_regex(r"\A[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\Z")


@given(st.lists(_LABELS, min_size=1, max_size=4).map(".".join).filter(lambda name: len(name) <= 253))
def test_any_valid_hostname_round_trips_and_its_upper_case_too(name):
    assert C.check_hostname(name) == name
    assert C.check_hostname(name.upper()) == name


def test_user_data_is_capped_in_size():
    script = b"#!/bin/sh\n" + b"#" * (C.USER_DATA_MAX - 10)
    assert C.check_user_data(script) == script
    with pytest.raises(Invalid, match="at most 65536") as err:
        C.check_user_data(script + b"#")
    assert err.value.field == "user_data"


@pytest.mark.parametrize(
    "data",
    [
        b"#!/bin/sh\ntouch /marker\n",
        b"#!/usr/bin/env python3\nprint(1)\n",
        b"#cloud-config\n",
        b"#cloud-config\r\na: 1\r\n",
    ],
)
def test_a_script_or_a_cloud_config_is_taken_unchanged(data):
    assert C.check_user_data(data) is data


def test_a_cloud_config_mapping_is_taken():
    data = b"#cloud-config\nruncmd:\n  - [touch, /marker]\nssh_authorized_keys: []\n"
    assert C.check_user_data(data) == data


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"#cloud-config\na: b: c\n", "not valid YAML at line 2, column 5: mapping values"),
        (b"#cloud-config\n- a\n- b\n", "list, not a mapping"),
        (b"#cloud-config\nssh_authorized_keys: ssh-ed25519 AAAA\n", "must be a list"),
        (b"#cloud-config\n" + b"[" * 1000 + b"]" * 1000, "nested too deeply"),
    ],
)
def test_a_cloud_config_that_is_not_a_yaml_mapping_is_refused_saying_why(data, why):
    with pytest.raises(Invalid, match=why) as err:
        C.check_user_data(data)
    assert err.value.field == "user_data"


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"#!/bin/sh\necho \xff\n", "not UTF-8"),
        (b"#cloud-boothook\necho hi\n", "#cloud-boothook is not supported"),
        (b"Content-Type: multipart/mixed; boundary=x\n\n--x--\n", "Content-Type: is not supported"),
        (b"#include\nhttp://example.org/x\n", "#include is not supported"),
        (b"\x1f\x8b\x08\x00", "gzip"),
        (b"just text\n", "starts with 'just text'"),
        (b"", "starts with ''"),
    ],
)
def test_user_data_that_is_neither_cloud_config_nor_a_script_is_refused_saying_what_is_supported(data, why):
    with pytest.raises(Invalid, match=why) as err:
        C.check_user_data(data)
    assert err.value.field == "user_data"
    assert "a #cloud-config YAML mapping or a #! script" in err.value.message


KEY_A = "ssh-ed25519 " + _wire(b"ssh-ed25519", b"a" * 32) + " alice@laptop"
KEY_B = "ssh-ed25519 " + _wire(b"ssh-ed25519", b"b" * 32) + " bob@desk"
NICS = (
    C.SeedNic(mac="02:76:70:00:00:07", address="10.10.0.5/24", gateway=None),
    C.SeedNic(mac="02:76:70:00:00:08", address="192.0.2.9/29", gateway="192.0.2.14"),
    C.SeedNic(mac="02:76:70:00:00:09", address="198.51.100.20/24", gateway="198.51.100.1"),
)
SEED = C.Seed(instance_id="vm-42", hostname="web-1", ssh_keys=(KEY_A, KEY_B), user_data=None, nics=NICS[:2])


def _load(content: bytes):
    return yaml.safe_load(content.decode())


def test_meta_data_has_the_instance_the_hostname_and_the_keys():
    meta = _load(C.files(SEED)["meta-data"])
    assert meta == {"instance-id": "vm-42", "local-hostname": "web-1", "public-keys": [KEY_A, KEY_B]}


def test_without_user_data_the_seed_brings_a_cloud_config_with_the_keys_and_the_hostname():
    user = C.files(SEED)["user-data"]
    assert user.startswith(b"#cloud-config\n")
    config = _load(user)
    assert config["ssh_authorized_keys"] == [KEY_A, KEY_B]
    assert config["hostname"] == "web-1"
    assert config["disable_root"] is False  # `ssh root@IP` works with the keys


def test_each_key_stays_on_one_line_for_simple_readers():
    long_key = "ssh-ed25519 " + _wire(b"ssh-ed25519", b"c" * 32) + " " + "a-very-long-comment " * 10
    content = C.files(dataclasses.replace(SEED, ssh_keys=(long_key.strip(),)))
    for name in ("meta-data", "user-data"):
        assert any(line.endswith(long_key.strip()) for line in content[name].decode().splitlines()), name


def test_a_given_cloud_config_gets_the_keys_merged_into_its_own():
    given_data = b"#cloud-config\nruncmd:\n  - [touch, /marker]\nssh_authorized_keys:\n  - " + KEY_B.encode() + b"\n"
    user = C.files(dataclasses.replace(SEED, user_data=given_data))["user-data"]
    config = _load(user)
    assert user.startswith(b"#cloud-config\n")
    assert config["runcmd"] == [["touch", "/marker"]]
    assert config["ssh_authorized_keys"] == [KEY_B, KEY_A]  # its own first, no duplicate


def test_a_given_cloud_config_that_keeps_root_closed_is_obeyed():
    user = C.files(dataclasses.replace(SEED, user_data=b"#cloud-config\ndisable_root: true\n"))["user-data"]
    assert _load(user)["disable_root"] is True


def test_a_given_script_is_kept_as_is_and_the_keys_go_only_in_meta_data():
    script = b"#!/bin/sh\ntouch /marker\n"
    content = C.files(dataclasses.replace(SEED, user_data=script))
    assert content["user-data"] == script
    assert _load(content["meta-data"])["public-keys"] == [KEY_A, KEY_B]


def test_network_config_names_two_nics_by_mac_in_slot_order_with_static_addresses():
    config = _load(C.files(dataclasses.replace(SEED, nics=NICS))["network-config"])
    assert config["version"] == 2
    eth = config["ethernets"]
    assert sorted(eth) == ["eth0", "eth1", "eth2"]
    assert eth["eth0"] == {
        "match": {"macaddress": "02:76:70:00:00:07"},
        "set-name": "eth0",
        "addresses": ["10.10.0.5/24"],
        "dhcp4": False,
    }
    assert eth["eth1"]["match"] == {"macaddress": "02:76:70:00:00:08"}
    assert eth["eth1"]["set-name"] == "eth1"
    assert eth["eth1"]["addresses"] == ["192.0.2.9/29"]
    # only the first NIC with a gateway gets the default route
    assert eth["eth1"]["routes"] == [{"to": "default", "via": "192.0.2.14"}]
    assert "routes" not in eth["eth2"]


def test_a_vm_without_nics_has_an_empty_network_config():
    assert _load(C.files(dataclasses.replace(SEED, nics=()))["network-config"]) == {"version": 2, "ethernets": {}}


@pytest.mark.parametrize(
    "nic",
    [
        C.SeedNic(mac="nonsense", address="10.0.0.5/24", gateway=None),
        C.SeedNic(mac="02:76:70:00:00:07", address="10.0.0.5", gateway=None),
        C.SeedNic(mac="02:76:70:00:00:07", address="10.0.0.5/24", gateway="x"),
    ],
)
def test_a_nic_record_that_is_not_an_address_is_refused(nic):
    with pytest.raises(Invalid) as err:
        C.files(dataclasses.replace(SEED, nics=(nic,)))
    assert err.value.field == "network"


def test_the_same_seed_gives_the_same_bytes_and_id():
    again = C.Seed("vm-42", "web-1", (KEY_A, KEY_B), None, NICS[:2])
    assert C.files(again) == C.files(SEED)
    assert C.seed_id(again) == C.seed_id(SEED)
    assert len(C.seed_id(SEED)) == C.SEED_ID_CHARS
    assert int(C.seed_id(SEED), 16) >= 0


@pytest.mark.parametrize(
    "change",
    [
        {"instance_id": "vm-43"},
        {"hostname": "web-2"},
        {"ssh_keys": (KEY_A,)},
        {"ssh_keys": (KEY_B, KEY_A)},
        {"user_data": b"#!/bin/sh\n"},
        {"nics": NICS[:1]},
        {"nics": (dataclasses.replace(NICS[0], address="10.10.0.6/24"), NICS[1])},
        {"nics": (dataclasses.replace(NICS[0], gateway="10.10.0.1"), NICS[1])},
    ],
)
def test_any_change_to_the_seed_changes_its_id(change):
    assert C.seed_id(dataclasses.replace(SEED, **change)) != C.seed_id(SEED)


@given(
    st.text(max_size=40),
    st.lists(st.sampled_from([KEY_A, KEY_B]), unique=True).map(tuple),
)
def test_files_parse_back_to_what_the_seed_says_for_any_instance_id(instance_id, ssh_keys):
    seed = dataclasses.replace(SEED, instance_id=instance_id, ssh_keys=ssh_keys)
    meta = _load(C.files(seed)["meta-data"])
    assert meta["instance-id"] == instance_id
    assert meta["public-keys"] == list(ssh_keys)
    assert C.files(seed) == C.files(dataclasses.replace(seed))
