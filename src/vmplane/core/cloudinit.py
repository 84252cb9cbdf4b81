"""The cloud-init NoCloud seed as pure rules: what an SSH public key, a hostname and user data must be, and the
three files of a seed (meta-data, user-data, network-config) made from a VM's record (issue 30).

The seed is data handed to the guest, so it is part of the VM's record and follows it to any host
(DESIGN.md section 11): the same record always gives the same bytes, and `seed_id` names them, so a host can
tell a seed it holds from a changed one. Building the ISO around these files is the hosts layer's.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
import re
import struct
from dataclasses import dataclass
from typing import Any

import yaml

from vmplane.core.errors import Invalid

USER_DATA_MAX = 64 * 1024  # bytes; NoCloud has no limit of its own, but a seed is rebuilt and copied to hosts
SSH_KEY_MAX = 16 * 1024  # characters of one key line (an RSA 16384-bit key is about 2.8 KiB)
HOSTNAME_MAX = 253
LABEL_MAX = 63
SEED_ID_CHARS = 16

# the key types OpenSSH accepts in authorized_keys today, with the number of SSH strings in each blob
# (the type itself included): DSA is gone from OpenSSH, certificates are not keys
_KEY_FIELDS = {
    "ssh-ed25519": 2,  # type, 32-byte key
    "ssh-rsa": 3,  # type, e, n
    "ecdsa-sha2-nistp256": 3,  # type, curve, point
    "ecdsa-sha2-nistp384": 3,
    "ecdsa-sha2-nistp521": 3,
    "sk-ssh-ed25519@openssh.com": 3,  # type, key, application
    "sk-ecdsa-sha2-nistp256@openssh.com": 4,  # type, curve, point, application
}
_PRIVATE_MARKERS = ("PRIVATE KEY-----", "PuTTY-User-Key-File", "---- BEGIN SSH2 ENCRYPTED PRIVATE KEY")
_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_UNSUPPORTED_USER_DATA = (
    "#cloud-boothook",
    "#include",
    "#part-handler",
    "#cloud-config-archive",
    "#cloud-config-jsonp",
    "#upstart-job",
    "Content-Type:",
    "MIME-Version:",
)
_SUPPORTED = "a #cloud-config YAML mapping or a #! script"
_MAC = re.compile(r"[0-9a-f]{2}(:[0-9a-f]{2}){5}")


def check_ssh_key(text: str, field: str = "ssh_keys") -> str:
    """One OpenSSH public key line (`TYPE BASE64 [COMMENT]`) whose blob is a key of the type it claims; returns
    it as `TYPE BASE64[ COMMENT]`."""
    line = str(text).strip()
    if any(marker in line for marker in _PRIVATE_MARKERS):
        raise Invalid(
            f"not an SSH public key: {field} is a private key; give the public one (the .pub file), and "
            "treat this private key as exposed",
            field=field,
        )
    if not line:
        raise Invalid(f"not an SSH public key: {field} is empty", field=field)
    if len(line) > SSH_KEY_MAX:
        raise Invalid(f"not an SSH public key: {field} is longer than {SSH_KEY_MAX} characters", field=field)
    if "\n" in line or "\r" in line:
        raise Invalid(f"not an SSH public key: {field} has several lines; give one key per {field}", field=field)
    parts = line.split(None, 2)
    key_type = parts[0]
    if key_type not in _KEY_FIELDS:
        raise Invalid(
            f"not an SSH public key: {field} starts with {_short(key_type)}, not a key type "
            f"({', '.join(_KEY_FIELDS)}; authorized_keys options are not taken)",
            field=field,
        )
    if len(parts) < 2:
        raise Invalid(f"not an SSH public key: {field} has a type ({key_type}) but no key after it", field=field)
    blob = _decode_blob(parts[1], field)
    _check_blob(blob, key_type, field)
    comment = parts[2].strip() if len(parts) > 2 else ""
    if _CONTROL.search(comment):
        raise Invalid(f"not an SSH public key: {field}'s comment has control characters", field=field)
    normal = f"{key_type} {base64.b64encode(blob).decode('ascii')}"
    return f"{normal} {comment}" if comment else normal


def _short(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _decode_blob(text: str, field: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise Invalid(f"not an SSH public key: {field}'s key {_short(text)} is not base64", field=field) from None


def _check_blob(blob: bytes, key_type: str, field: str) -> None:
    """The SSH wire format: each field a uint32 length and that many bytes; the first the key type, then the
    type's own fields and nothing after them."""
    strings = _ssh_strings(blob)
    if strings is None or not strings:
        raise Invalid(f"not an SSH public key: {field}'s key data is not in the SSH key format", field=field)
    inner = strings[0].decode("ascii", "replace")
    if inner != key_type:
        raise Invalid(
            f"not an SSH public key: {field} says {key_type} but its key data is {_short(inner)}", field=field
        )
    if len(strings) != _KEY_FIELDS[key_type]:
        raise Invalid(
            f"not an SSH public key: {field}'s {key_type} key data has {len(strings)} fields, not "
            f"{_KEY_FIELDS[key_type]}",
            field=field,
        )
    if key_type in ("ssh-ed25519", "sk-ssh-ed25519@openssh.com"):
        if len(strings[1]) != 32:
            raise Invalid(f"not an SSH public key: {field}'s ed25519 key is not 32 bytes", field=field)
    elif "ecdsa-sha2-" in key_type:
        curve = key_type.split("ecdsa-sha2-", 1)[1].split("@", 1)[0]
        if strings[1] != curve.encode():
            raise Invalid(f"not an SSH public key: {field}'s {key_type} key is on another curve", field=field)


def _ssh_strings(blob: bytes) -> list[bytes] | None:
    """The length-prefixed strings of an SSH blob; None when a length runs past the end."""
    strings: list[bytes] = []
    offset = 0
    while offset < len(blob):
        if offset + 4 > len(blob):
            return None
        (length,) = struct.unpack_from(">I", blob, offset)
        offset += 4
        if offset + length > len(blob):
            return None
        strings.append(blob[offset : offset + length])
        offset += length
    return strings


def check_hostname(text: str, field: str = "hostname") -> str:
    """An RFC 1123 hostname: dot-separated labels of 1-63 letters, digits and '-' (not at a label's ends), at
    most 253 characters; returned lowercased."""
    name = str(text).strip().lower()
    if not name:
        raise Invalid(f"{field} is empty: a hostname is like web-1 or web-1.example.org", field=field)
    if len(name) > HOSTNAME_MAX:
        raise Invalid(f"{field} {_short(name)} is longer than {HOSTNAME_MAX} characters", field=field)
    for label in name.split("."):
        if not _LABEL.fullmatch(label):
            raise Invalid(
                f"{field} {_short(name)} is not a hostname: each dot-separated part is 1 to {LABEL_MAX} of a-z, "
                "0-9 and '-', not starting or ending with '-'",
                field=field,
            )
    return name


def check_user_data(data: bytes, field: str = "user_data") -> bytes:
    """User data of at most USER_DATA_MAX bytes, UTF-8: a `#!` script, or `#cloud-config` and a YAML mapping.
    Returned unchanged."""
    if len(data) > USER_DATA_MAX:
        raise Invalid(
            f"{field} is {len(data)} bytes: at most {USER_DATA_MAX} ({USER_DATA_MAX // 1024} KiB)", field=field
        )
    if data[:2] == b"\x1f\x8b":
        raise Invalid(f"{field} is gzip-compressed: give it uncompressed ({_SUPPORTED})", field=field)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Invalid(f"{field} is not UTF-8 text (byte {exc.start}): give {_SUPPORTED}", field=field) from None
    first = text.lstrip("\ufeff").split("\n", 1)[0].rstrip()
    if first.startswith("#!"):
        return data
    if first == "#cloud-config":
        _cloud_config(text, field)
        return data
    for header in _UNSUPPORTED_USER_DATA:
        if first.lower().startswith(header.lower()):
            raise Invalid(f"{field} of kind {header} is not supported: give {_SUPPORTED}", field=field)
    raise Invalid(f"{field} starts with {_short(first)}: give {_SUPPORTED}", field=field)


def _cloud_config(text: str, field: str) -> dict[str, Any]:
    """The mapping of a #cloud-config text (an empty one is an empty mapping)."""
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        problem = getattr(exc, "problem", None) or "not YAML"
        raise Invalid(f"{field} is a #cloud-config that is not valid YAML{at}: {problem}", field=field) from None
    except RecursionError:
        raise Invalid(f"{field} is a #cloud-config nested too deeply to read", field=field) from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise Invalid(
            f"{field} is a #cloud-config whose YAML is a {type(loaded).__name__}, not a mapping (key: value)",
            field=field,
        )
    keys = loaded.get("ssh_authorized_keys")
    if keys is not None and not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise Invalid(f"{field}'s ssh_authorized_keys must be a list of key lines", field=field)
    return loaded


@dataclass(frozen=True)
class SeedNic:
    """A NIC as the guest sees it: its MAC, its address with the network's prefix, and the network's gateway."""

    mac: str
    address: str  # ADDRESS/PREFIX, e.g. 10.10.0.5/24
    gateway: str | None


@dataclass(frozen=True)
class Seed:
    """What a VM's seed holds, all taken from its record (keys, hostname, user data already checked; NICs in
    slot order)."""

    instance_id: str
    hostname: str
    ssh_keys: tuple[str, ...]
    user_data: bytes | None
    nics: tuple[SeedNic, ...]


def files(seed: Seed) -> dict[str, bytes]:
    """The three files of the NoCloud seed, by their names on the seed image. Deterministic: the same seed
    gives the same bytes."""
    return {
        "meta-data": _meta_data(seed),
        "network-config": _network_config(seed.nics),
        "user-data": _user_data(seed),
    }


def seed_id(seed: Seed) -> str:
    """A short digest of the seed's files: names the seed image on hosts, so a changed seed gets a new name."""
    digest = hashlib.sha256()
    for name, content in sorted(files(seed).items()):
        digest.update(f"{name}\0{len(content)}\0".encode())
        digest.update(content)
    return digest.hexdigest()[:SEED_ID_CHARS]


def _dump(value: Any) -> bytes:
    # sorted keys for equal bytes; no line folding, so each key line stays on one line for simple readers
    # (the small test guest's NoCloud reader is a shell script); ASCII only, as YAML reads some characters
    # (U+0085) as line breaks: the rest are escaped
    text = yaml.safe_dump(value, sort_keys=True, default_flow_style=False, allow_unicode=False, width=1 << 20)
    return text.encode("utf-8")


def _meta_data(seed: Seed) -> bytes:
    return _dump({"instance-id": seed.instance_id, "local-hostname": seed.hostname, "public-keys": list(seed.ssh_keys)})


def _user_data(seed: Seed) -> bytes:
    """The user data given; without any, a #cloud-config with the keys and the hostname. A given #cloud-config
    gets the keys merged into its ssh_authorized_keys; a script is kept as is (cloud-init reads the keys from
    meta-data's public-keys)."""
    if seed.user_data is None:
        config: dict[str, Any] = {"hostname": seed.hostname}
    else:
        text = seed.user_data.decode("utf-8")
        if not text.lstrip("\ufeff").startswith("#cloud-config") or not seed.ssh_keys:
            return seed.user_data
        config = dict(_cloud_config(text, "user_data"))
    if seed.ssh_keys:
        given = list(config.get("ssh_authorized_keys") or [])
        config["ssh_authorized_keys"] = given + [key for key in seed.ssh_keys if key not in given]
        # the keys must open root too (`ssh root@IP`, issue 30): cloud-init's default puts a "log in as the
        # default user" stub in root's authorized_keys. A user data that says otherwise wins.
        config.setdefault("disable_root", False)
    return b"#cloud-config\n" + _dump(config)


def _network_config(nics: tuple[SeedNic, ...]) -> bytes:
    """Network config version 2: each NIC matched by its MAC and named ethN in slot order, its address static
    (no DHCP is needed where a network has none), the default route through the first gateway only."""
    ethernets: dict[str, Any] = {}
    routed = False
    for index, nic in enumerate(nics):
        mac = nic.mac.strip().lower()
        if not _MAC.fullmatch(mac):
            raise Invalid(f"NIC {index} has MAC {nic.mac!r}, not like 02:76:70:00:00:01", field="network")
        try:
            if "/" not in nic.address:
                raise ValueError("no prefix")
            interface = ipaddress.IPv4Interface(nic.address)
            gateway = ipaddress.IPv4Address(nic.gateway) if nic.gateway else None
        except ValueError:
            raise Invalid(
                f"NIC {index} has address {nic.address!r} and gateway {nic.gateway!r}, not like 10.10.0.5/24 "
                "and 10.10.0.1",
                field="network",
            ) from None
        name = f"eth{index}"
        entry: dict[str, Any] = {
            "match": {"macaddress": mac},
            "set-name": name,
            "addresses": [interface.with_prefixlen],
            "dhcp4": False,
        }
        if gateway is not None and not routed:
            entry["routes"] = [{"to": "default", "via": str(gateway)}]
            routed = True
        ethernets[name] = entry
    return _dump({"version": 2, "ethernets": ethernets})
