"""Local libvirtd "hosts" on this machine, for `vmplane up` and the tests.

Each host is a libvirtd in its own mount namespace with its own /etc, /run, /var/lib, /var/cache and
/var/log libvirt folders (kept under BASE/NAME; its /run on a tmpfs, run_dir()) and its own host_uuid,
so several of them run side by side and can live-migrate to each other. With `netns=True` each also gets
its own network namespace on a private bridge (10.88.0.0/24), so migration streams cross a veth as between
real hosts.

Storage: each host's namespace sees three folders at the same paths as every other host (the paths
libvirt's pools and the domains' disks use), kept here on the control-plane side:
  LOCAL_PATH   /var/lib/vmplane/local   <- BASE/NAME/local   this host's own disk (its local pool)
  SHARED_PATH  /var/lib/vmplane/shared  <- BASE/shared       one folder for every host of BASE: the model
                                                             of an NFS export (shared pools are subfolders)
  IMAGES_PATH  /var/lib/vmplane/images  <- BASE/images       the image store (template images)
`storage_dirs(base, name)` gives the control-plane folder behind each.

Never two writers: every host runs libvirt's `virtlockd` (started in its namespace before libvirtd,
its socket at /run/libvirt/virtlockd-sock there, its log in the host's log folder) and libvirtd uses
the `lockd` lock manager with automatic disk leases and the *direct* lockspace: no
`file_lockspace_dir`, virtlockd takes an fcntl lock on each writable disk file itself. A bind mount
shows the same inode, so two hosts opening one shared disk conflict (as fcntl locks on a real NFS
export would), while two hosts' local disks at the same path are different files and do not (an
indirect lockspace, one lease file per sha256 of the *path*, would take those for one disk, and a
local-pool migration copies a disk to the very same path on the target). libvirt releases a
domain's leases when the source pauses at the end of a live migration and takes them when the
target resumes, so migrations on a shared disk work with the locks.

A host outlives the process that started it (as a hypervisor outlives a control-plane restart): a
later `start()` of the same name adopts the running daemon. `stop()` destroys its domains and kills
the daemon by its pid; namespaces, bridges and folders made here are removed by name.

Each host also runs a heartbeat writer (`vmplane.heartbeat`, in its namespaces) onto the shared
folder, SHARED_PATH/.heartbeat/NAME, as a remote host heartbeats onto shared storage: the second
liveness signal of high availability (liveness.py). `fail(host, mode)` is the nemesis that breaks a
host as a power cut, a crashed daemon or a lost network would, and `recover(host)` undoes it.

TLS (`tls=True`, network namespaces only): the daemon also listens with TLS on its namespace address
(libvirtd `--listen`, `listen_tls = 1`, port 16514, client certificates verified against its CA), with
certificates made by `tlscerts` (GnuTLS certtool): a CA in BASE/tls/ca, a client certificate in
BASE/tls/client (cacert.pem, clientcert.pem, clientkey.pem) and the host's server certificate (its
address in the SAN) in BASE/NAME/etc/pki. Its `uri` is then `qemu+tls://ADDRESS/system?pkipath=
BASE/tls/client`, as a remote host is added; the unix socket stays for this module's own calls
(`local_uri`). The control plane reaches the namespace addresses through an uplink, a veth from this
machine's network namespace onto the bridge (UPLINK_ADDRESS). Peer-to-peer migration passes the
target's URI to the source daemon, which reads the same pkipath in its own mount namespace (BASE must
not lie under /run or /var/lib, /var/cache, /var/log, which the namespaces cover with their own).

ssh (`ssh=True`, network namespaces only): an OpenSSH server runs in the host's namespaces on its
address (port 22, root by key only), so its `uri` is `qemu+ssh://root@ADDRESS/system?keyfile=
BASE/ssh/id_ed25519&command=BASE/ssh/ssh&no_tty=1`: libvirt runs `virt-ssh-helper` over ssh, which
reaches the daemon's socket in that namespace. BASE/ssh/ssh is `ssh` with this cluster's own
known_hosts (the hosts' keys, checked strictly), so nothing is written to root's ~/.ssh. sshd wants its
privilege-separation user `sshd`: it sees a copy of /etc/passwd with one (bind-mounted in a mount
namespace of its own), this machine's is not changed. The server is SSHD, or VMPLANE_SSHD.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

LIBVIRTD = "/usr/sbin/libvirtd"
VIRTLOCKD = "/usr/sbin/virtlockd"
LOCAL_PATH = "/var/lib/vmplane/local"
SHARED_PATH = "/var/lib/vmplane/shared"
IMAGES_PATH = "/var/lib/vmplane/images"
BRIDGE = "vmpbr0"
SUBNET = "10.88.0"
UPLINK_ADDRESS = f"{SUBNET}.254"  # this machine's address on the bridge of TLS hosts
TLS_PORT = 16514
SSHD = os.environ.get("VMPLANE_SSHD") or shutil.which("sshd") or "/usr/sbin/sshd"
_NS_COVERED = ("/run", "/var/lib", "/var/cache", "/var/log")  # tmpfs of their own in each namespace


def _tag(base: Path) -> str:
    """Short tag of a hosts folder, so that two clusters on one machine name their namespaces apart."""
    import hashlib

    return hashlib.sha1(str(base.resolve()).encode()).hexdigest()[:4]


def switch_ns(base: Path) -> str:
    return f"vmp{_tag(base)}-sw"


# -- the machine's memory, shared between its local hosts --------------------------------------------
RESERVE_MIB = 1024  # kept for the control plane (and the daemons): at least this, or 10 %


def machine_memory_mib(meminfo: str | None = None) -> int:
    """This machine's memory (the kernel's MemTotal, which libvirt reports for every local host)."""
    text = meminfo if meminfo is not None else Path("/proc/meminfo").read_text()
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def shareable_mib(total_mib: int) -> int:
    """What the local hosts may report in all: the machine's memory less the control plane's reserve
    (1 GiB or 10 %, the larger)."""
    return max(0, total_mib - max(RESERVE_MIB, total_mib // 10))


def host_memory_mib(total_mib: int, hosts: int, asked_mib: int | None = None) -> int:
    """Each local host's memory: the shareable memory split evenly, or `asked_mib` (`vmplane up
    --host-memory`) when the hosts' sum fits in it; ValueError otherwise (it would promise memory the
    machine does not have)."""
    room = shareable_mib(total_mib)
    if asked_mib is None:
        return room // max(hosts, 1)
    if asked_mib * hosts > room:
        raise ValueError(
            f"{hosts} host(s) of {asked_mib} MiB need {asked_mib * hosts} MiB; this machine has "
            f"{total_mib} MiB, of which {room} MiB can go to local hosts (the rest is kept for the "
            f"control plane): at most {room // max(hosts, 1)} MiB each"
        )
    return asked_mib


def available() -> str | None:
    """None when local libvirt hosts can run here, else the reason they can not."""
    if shutil.which("qemu-system-x86_64") is None:
        return "qemu-system-x86_64 is not installed"
    if not os.path.exists(LIBVIRTD) or not os.path.exists(VIRTLOCKD):
        return "libvirtd or virtlockd is not installed"
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return "unshare or nsenter (util-linux) is missing"
    if os.geteuid() != 0:
        return "local libvirt hosts need root (mount namespaces, QEMU as root)"
    try:
        import libvirt  # noqa: F401
    except ImportError:
        return "the libvirt-python package is not installed"
    return None


@dataclass(frozen=True)
class LocalHost:
    name: str
    dir: Path
    netns: str | None
    address: str  # where QEMU listens for incoming migrations
    tls: bool = False  # the daemon also listens with TLS on `address`; `uri` is then qemu+tls://
    ssh: bool = False  # an sshd runs on `address`; `uri` is then qemu+ssh:// (unless tls)

    @property
    def socket(self) -> Path:
        return self.dir / "run" / "libvirt-sock"

    @property
    def local_uri(self) -> str:
        # "+unix" matters: a plain qemu:///system?socket= destination is refused as "the same host"
        return f"qemu+unix:///system?socket={self.socket}"

    @property
    def uri(self) -> str:
        """How the control plane adds this host: the unix socket, or over TLS as a remote host."""
        if self.tls:
            return f"qemu+tls://{self.address}/system?pkipath={client_pki(self.dir.parent)}"
        if self.ssh:
            return self.ssh_uri
        return self.local_uri

    @property
    def ssh_uri(self) -> str:
        keys = ssh_dir(self.dir.parent)
        return f"qemu+ssh://root@{self.address}/system?keyfile={keys / 'id_ed25519'}&command={keys / 'ssh'}&no_tty=1"

    def sshd_pid(self) -> int | None:
        """The pid of this host's sshd, if it runs (checked against its command line)."""
        try:
            pid = int((self.dir / "ssh" / "sshd.pid").read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return None
        if str(self.dir / "ssh" / "sshd_config").encode() not in cmdline or _zombie(pid):
            return None
        return pid

    @property
    def pid_file(self) -> Path:
        return self.dir / "libvirtd.pid"

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        if stat[stat.rfind(")") + 2] == "Z":  # killed but not yet reaped: a zombie is not a daemon
            return None
        if stat[stat.find("(") + 1 : stat.rfind(")")] != "libvirtd":
            return None  # a stale pid that is now another process (or start.sh before its exec)
        return pid

    def lockd_pid(self) -> int | None:
        """The pid of this host's virtlockd (it writes its pid file under run/), if it runs."""
        try:
            pid = int((self.dir / "run" / "virtlockd.pid").read_text().strip())
            if Path(f"/proc/{pid}/comm").read_text().strip() != "virtlockd" or _zombie(pid):
                return None  # a killed virtlockd not reaped yet (its parent is init) is gone
            return pid
        except (OSError, ValueError):
            return None

    def heartbeat_pid(self) -> int | None:
        """The pid of this host's heartbeat writer, if it runs (its pid file checked against its command
        line: a stale pid may belong to anything now)."""
        try:
            pid = int((self.dir / "run" / "heartbeat.pid").read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return None
        if b"vmplane.heartbeat" not in cmdline or _zombie(pid):
            return None
        return pid

    def running(self) -> bool:
        return self.pid() is not None and not _stopped(self.pid()) and self.socket.exists() and _answers(self)


def _state(pid: int) -> str:
    """The process state letter of /proc/PID/stat ("R", "S", "T" stopped, "Z" zombie), "" when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat[stat.rfind(")") + 2]


def _zombie(pid: int) -> bool:
    return _state(pid) in ("Z", "X", "")


def _stopped(pid: int | None) -> bool:
    return pid is not None and _state(pid) in ("T", "t")


def from_uri(uri: str | None) -> LocalHost | None:
    """The local host behind a libvirt URI (its socket lies in BASE/NAME/run, beside host.json; a TLS
    host's pkipath is BASE/tls/client and its address is its namespace's), or None when the URI is not
    one of these hosts: the fence agent and the liveness signal find it this way."""
    from urllib.parse import parse_qs, urlparse

    if not uri:
        return None
    parsed = urlparse(uri)
    query = parse_qs(parsed.query)
    socket = query.get("socket", [None])[0]
    if socket:
        return _saved(Path(socket).parent.parent)
    pki = query.get("pkipath", [None])[0]
    key = query.get("keyfile", [None])[0]
    base = None
    if parsed.scheme == "qemu+tls" and pki and Path(pki).name == "client" and Path(pki).parent.name == "tls":
        base = Path(pki).parent.parent
    elif parsed.scheme == "qemu+ssh" and key and Path(key).parent.name == "ssh":
        base = Path(key).parent.parent
    if base is not None:
        for folder in sorted(base.iterdir()) if base.is_dir() else []:
            host = _saved(folder)
            if host is not None and (host.tls or host.ssh) and host.address == parsed.hostname:
                return host
    return None


def _saved(folder: Path) -> LocalHost | None:
    try:
        saved = json.loads((folder / "host.json").read_text())
        return describe(
            folder.parent, folder.name, saved["index"], saved["netns"], saved.get("tls", False), saved.get("ssh", False)
        )
    except (OSError, ValueError, KeyError):
        return None


def tls_dir(base: Path) -> Path:
    """BASE/tls: the CA (ca/) and the client certificate (client/) of a hosts folder's TLS hosts."""
    return base / "tls"


def ssh_dir(base: Path) -> Path:
    """BASE/ssh: the control plane's key (id_ed25519), the hosts' keys (known_hosts) and `ssh`, the
    command a qemu+ssh URI names (ssh with that known_hosts)."""
    return base / "ssh"


def _ensure_ssh(host: LocalHost, base: Path) -> None:
    """Keys and configuration of the host's sshd, and the cluster's client key and known_hosts."""
    keys = ssh_dir(base)
    keys.mkdir(parents=True, exist_ok=True)
    if not (keys / "id_ed25519").exists():
        subprocess.run(
            [
                "ssh-keygen",
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                "vmplane-control-plane",
                "-f",
                str(keys / "id_ed25519"),
            ],
            check=True,
            capture_output=True,
        )
    (keys / "ssh").write_text(
        f"#!/bin/sh\nexec ssh -o UserKnownHostsFile={keys / 'known_hosts'} "
        f'-o StrictHostKeyChecking=yes -o BatchMode=yes "$@"\n'
    )
    os.chmod(keys / "ssh", 0o755)
    own = host.dir / "ssh"
    own.mkdir(parents=True, exist_ok=True)
    if not (own / "ssh_host_ed25519_key").exists():
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(own / "ssh_host_ed25519_key")],
            check=True,
            capture_output=True,
        )
    public = (own / "ssh_host_ed25519_key.pub").read_text().split()[:2]
    known = keys / "known_hosts"
    lines = [
        line
        for line in (known.read_text().splitlines() if known.exists() else [])
        if line.split(" ", 1)[0] != host.address
    ]
    known.write_text("\n".join(lines + [f"{host.address} {' '.join(public)}"]) + "\n")
    shutil.copyfile(keys / "id_ed25519.pub", own / "authorized_keys")
    os.chmod(own / "authorized_keys", 0o600)
    passwd = Path("/etc/passwd").read_text()
    if not any(line.startswith("sshd:") for line in passwd.splitlines()):
        passwd = passwd.rstrip("\n") + "\nsshd:x:65534:65534:sshd privilege separation:/run/sshd:/usr/sbin/nologin\n"
    (own / "passwd").write_text(passwd)
    (own / "sshd_config").write_text(
        f"ListenAddress {host.address}\nHostKey {own / 'ssh_host_ed25519_key'}\nPidFile none\n"
        f"AuthorizedKeysFile {own / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
        "LogLevel VERBOSE\n"
    )


def _ensure_sshd(host: LocalHost) -> None:
    """Start the host's sshd in its namespaces unless it runs (in a mount namespace of its own, where
    /etc/passwd has the `sshd` user)."""
    pid = host.pid()
    if not host.ssh or pid is None or host.sshd_pid() is not None:
        return
    own = host.dir / "ssh"
    script = (
        f"mount --make-rprivate /; mount --bind {own / 'passwd'} /etc/passwd; mkdir -p /run/sshd; "
        f"chmod 755 /run/sshd; exec {SSHD} -D -f {own / 'sshd_config'} -E {own / 'sshd.log'}"
    )
    cmd = ["nsenter", f"--target={pid}", "--mount", "--net", "unshare", "-m", "bash", "-c", script]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True
    )
    (own / "sshd.pid").write_text(str(proc.pid))  # nsenter, unshare and bash exec: the same pid
    import socket

    deadline = time.monotonic() + 10
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with socket.create_connection((host.address, 22), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    log = (own / "sshd.log").read_text(errors="replace")[-1000:] if (own / "sshd.log").exists() else ""
    raise RuntimeError(f"sshd of host {host.name} did not come up: {log}")


def client_pki(base: Path) -> Path:
    """The folder a TLS host's URI names as pkipath: cacert.pem, clientcert.pem, clientkey.pem."""
    return tls_dir(base) / "client"


def heartbeat_path(base: Path, name: str) -> Path:
    """Where host NAME's heartbeat lands on the control-plane side (SHARED_PATH/.heartbeat/NAME inside)."""
    return base / "shared" / ".heartbeat" / name


def storage_dirs(base: Path, name: str) -> dict[str, Path]:
    """The control-plane folders behind a host's LOCAL_PATH, SHARED_PATH and IMAGES_PATH."""
    return {LOCAL_PATH: base / name / "local", SHARED_PATH: base / "shared", IMAGES_PATH: base / "images"}


def _host_uuid(name: str, base: Path) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"vmplane-local-host:{base}:{name}"))


def _ensure_certs(host: LocalHost, base: Path, ca: Path | None) -> None:
    """The cluster's CA and client certificate (made once per hosts folder), and the host's server
    certificate (for its address), signed by CA (default: the cluster's own, BASE/tls/ca)."""
    from vmplane import tlscerts

    own_ca = tlscerts.make_ca(tls_dir(base) / "ca", f"vmplane local hosts CA ({base.name})")
    if not (client_pki(base) / "clientcert.pem").exists():
        tlscerts.make_client_cert(own_ca, client_pki(base), "vmplane-control-plane")
    pki = host.dir / "etc" / "pki"
    signer = Path(ca) if ca is not None else own_ca
    if (pki / "servercert.pem").exists() and (pki / "signer").exists() and (pki / "signer").read_text() == str(signer):
        return
    tlscerts.make_server_cert(signer, pki, [host.address, host.name])
    # QEMU's names for the same certificate (it serves incoming and, with tls_www_client, makes outgoing
    # migration streams) when a migration asks for VIR_MIGRATE_TLS
    (pki / "qemu").mkdir(exist_ok=True)
    for ours, qemus in (
        ("cacert.pem", "ca-cert.pem"),
        ("servercert.pem", "server-cert.pem"),
        ("serverkey.pem", "server-key.pem"),
        ("servercert.pem", "client-cert.pem"),
        ("serverkey.pem", "client-key.pem"),
    ):
        shutil.copyfile(pki / ours, pki / "qemu" / qemus)
        os.chmod(pki / "qemu" / qemus, 0o600 if "key" in qemus else 0o644)
    (pki / "signer").write_text(str(signer))


def _tls_config(host: LocalHost) -> str:
    """libvirtd.conf lines of a daemon that listens with TLS on its address (started with --listen)."""
    if not host.tls:
        return ""
    pki = "/etc/libvirt/pki"  # BASE/NAME/etc/pki, as the daemon's mount namespace shows it
    return (
        f'listen_tls = 1\nlisten_tcp = 0\nlisten_addr = "{host.address}"\ntls_port = "{TLS_PORT}"\n'
        f'auth_tls = "none"\ntls_no_verify_certificate = 0\n'
        f'ca_file = "{pki}/cacert.pem"\ncert_file = "{pki}/servercert.pem"\nkey_file = "{pki}/serverkey.pem"\n'
    )


def run_dir(host: LocalHost) -> Path:
    """Where a host's /run/libvirt really is: on /dev/shm (a tmpfs), as /run is on a real host; BASE/NAME/run
    is a link to it. libvirtd fsyncs a domain's status file there while it handles the events of a
    migration's switch-over, with the guest paused: on this machine's disk, under I/O from other work, a
    fsync took 0.8-2.1 s and the guest's downtime grew from ~10 ms to 2.3 s (97 s once in CI)."""
    return Path("/dev/shm") / f"vmplane-{_tag(host.dir.parent)}" / host.name / "run"


def _link_run_dir(host: LocalHost) -> None:
    run, target = host.dir / "run", run_dir(host)
    target.mkdir(parents=True, exist_ok=True)
    os.chmod(target.parent.parent, 0o700)
    if run.is_symlink() and run.resolve() == target:
        return
    if run.is_symlink() or run.is_file():
        run.unlink()
    elif run.is_dir():
        shutil.rmtree(run)  # a stopped host's, from before the link: nothing of it runs
    run.symlink_to(target)


def _remove_run_dir(host: LocalHost) -> None:
    shutil.rmtree(run_dir(host).parent, ignore_errors=True)
    with contextlib.suppress(OSError):
        run_dir(host).parent.parent.rmdir()  # the cluster's folder, once its last host is gone


def capabilities_cache() -> Path:
    """This machine's copy of libvirt's QEMU capabilities cache (the XML libvirtd writes after probing the
    QEMU binary, 3-8 s of its first call), shared by every local host: VMPLANE_CAPS_CACHE, or
    ~/.cache/vmplane/libvirt-qemu-capabilities."""
    return Path(
        os.environ.get("VMPLANE_CAPS_CACHE")
        or os.path.join(
            os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")), "vmplane", "libvirt-qemu-capabilities"
        )
    )


def _host_capabilities(host: LocalHost) -> Path:
    return host.dir / "cache" / "qemu" / "capabilities"


def _seed_capabilities(host: LocalHost) -> None:
    """A new host starts with the machine's probed QEMU capabilities, so its first call does not probe QEMU
    again. libvirtd checks each cached file (QEMU's and its own build times and versions, the kernel, the
    CPU microcode) and probes afresh whatever no longer matches, so a stale copy costs only the probe."""
    cached, own = capabilities_cache(), _host_capabilities(host)
    if own.exists() and any(own.iterdir()):
        return
    with contextlib.suppress(OSError):
        own.mkdir(parents=True, exist_ok=True)
        for f in cached.glob("*.xml"):
            shutil.copy2(f, own / f.name)


def _keep_capabilities(host: LocalHost) -> None:
    """Copy what the host probed into the machine's cache (for the next host), if newer there."""
    with contextlib.suppress(OSError):
        files = list(_host_capabilities(host).glob("*.xml"))
        if not files:
            return
        cached = capabilities_cache()
        cached.mkdir(parents=True, exist_ok=True)
        for f in files:
            target = cached / f.name
            if not target.exists() or target.stat().st_mtime < f.stat().st_mtime:
                tmp = target.with_suffix(".tmp")
                shutil.copy2(f, tmp)
                os.replace(tmp, target)


def _write_config(host: LocalHost, base: Path) -> None:
    # log/qemu: QEMU writes each domain's console log there (domainxml.console_log) before libvirtd made it
    for sub in ("etc/qemu", "lib", "cache", "log/qemu"):
        (host.dir / sub).mkdir(parents=True, exist_ok=True)
    _seed_capabilities(host)
    _link_run_dir(host)
    mounts = storage_dirs(base, host.name)
    for folder in mounts.values():
        folder.mkdir(parents=True, exist_ok=True)
    os.chmod(host.dir, 0o700)  # the socket inside is root's alone
    (host.dir / "etc" / "libvirtd.conf").write_text(
        f'host_uuid = "{_host_uuid(host.name, base)}"\n'
        'unix_sock_rw_perms = "0700"\nunix_sock_ro_perms = "0700"\n'
        'auth_unix_rw = "none"\nauth_unix_ro = "none"\n'
        'log_outputs = "3:file:/var/log/libvirt/libvirtd.log"\n' + _tls_config(host)
    )
    (host.dir / "etc" / "qemu.conf").write_text(
        'user = "root"\ngroup = "root"\ndynamic_ownership = 0\nremember_owner = 0\nsecurity_driver = "none"\n'
        'stdio_handler = "file"\nnamespaces = [ ]\nlock_manager = "lockd"\n'
        # libvirt refuses loopback addresses here: a host in its own network namespace listens on its
        # own address; a host sharing this machine's network listens on all (the URI picks 127.0.0.1)
        + (
            f'migration_address = "{host.address}"\nmigration_host = "{host.address}"\n'
            if host.netns
            else 'migration_address = "0.0.0.0"\n'
        )
        # a migration asked with VIR_MIGRATE_TLS encrypts its data stream too (QEMU's own TLS, these files)
        + ('migrate_tls_x509_cert_dir = "/etc/libvirt/pki/qemu"\nmigrate_tls_x509_verify = 1\n' if host.tls else "")
    )
    # leases on every disk, taken on the disk files themselves (see the module's docstring); domains
    # without disks need none
    (host.dir / "etc" / "qemu-lockd.conf").write_text("auto_disk_leases = 1\nrequire_lease_for_disks = 0\n")
    (host.dir / "etc" / "virtlockd.conf").write_text('log_outputs = "3:file:/var/log/libvirt/virtlockd.log"\n')
    (host.dir / "etc" / "libvirt.conf").write_text("")
    binds = "\n".join(f"mount --bind {folder} {path}" for path, folder in mounts.items())
    (host.dir / "start.sh").write_text(f"""set -e
mount --make-rprivate /
for d in /run /var/lib /var/cache /var/log; do mount -t tmpfs tmpfs $d; done
mkdir -p /run/libvirt /run/lock /var/lib/libvirt /var/cache/libvirt /var/log/libvirt /etc/libvirt {" ".join(mounts)}
mount --bind {host.dir}/etc /etc/libvirt
mount --bind {host.dir}/run /run/libvirt
mount --bind {host.dir}/lib /var/lib/libvirt
mount --bind {host.dir}/cache /var/cache/libvirt
mount --bind {host.dir}/log /var/log/libvirt
{binds}
{_LOCKD_START}
echo $$ > {host.pid_file}
exec {LIBVIRTD} -f /etc/libvirt/libvirtd.conf -p /run/libvirt/libvirtd.pid{" --listen" if host.tls else ""}
""")


# virtlockd daemonizes once its socket is ready (`-d`) and writes its pid under run/; libvirtd's lockd
# plugin finds it at /run/libvirt/virtlockd-sock. One that still runs (libvirtd died, its guests and their
# leases live on) is kept: it holds those leases, and the new libvirtd reaches it through the same socket;
# a zombie (killed, not yet reaped) is not
_LOCKD_START = (
    "p=$(cat /run/libvirt/virtlockd.pid 2>/dev/null || true); "
    'if [ -z "$p" ] || [ "$(cat /proc/$p/comm 2>/dev/null)" != virtlockd ] '
    "|| grep -qs '^State:[[:space:]]*[ZX]' /proc/$p/status; then "
    f"rm -f /run/libvirt/virtlockd-sock; {VIRTLOCKD} -d -f /etc/libvirt/virtlockd.conf "
    "-p /run/libvirt/virtlockd.pid; fi"
)


def _ensure_lockd(host: LocalHost) -> None:
    """Start virtlockd again in the namespace of an adopted libvirtd whose virtlockd died."""
    pid = host.pid()
    if pid is None or host.lockd_pid() is not None:
        return
    subprocess.run(
        ["nsenter", f"--target={pid}", "--mount", "bash", "-c", _LOCKD_START], check=True, capture_output=True
    )


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _netns_exists(name: str) -> bool:
    return os.path.exists(f"/run/netns/{name}")


def _ensure_switch(base: Path) -> str:
    sw = switch_ns(base)
    if not _netns_exists(sw):
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", sw, "link", "set", BRIDGE, "up")
        _ip("-n", sw, "link", "set", "lo", "up")
    return sw


def _ensure_netns(base: Path, host: LocalHost, index: int) -> None:
    assert host.netns is not None  # (called for a host made with netns=True)
    if _netns_exists(host.netns):
        return
    sw = _ensure_switch(base)
    _ip("netns", "add", host.netns)
    tag = _tag(base)
    host_end, switch_end = f"v{tag}h{index}", f"v{tag}s{index}"
    _ip("link", "add", host_end, "type", "veth", "peer", "name", switch_end)
    _ip("link", "set", host_end, "netns", host.netns)
    _ip("link", "set", switch_end, "netns", sw)
    _ip("-n", sw, "link", "set", switch_end, "master", BRIDGE)
    _ip("-n", sw, "link", "set", switch_end, "up")
    _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host_end)
    _ip("-n", host.netns, "link", "set", host_end, "up")
    _ip("-n", host.netns, "link", "set", "lo", "up")


def _ensure_uplink(base: Path) -> None:
    """A veth from this machine's network namespace onto the bridge, UPLINK_ADDRESS/24 on this side: the
    control plane reaches TLS hosts at their namespace addresses as it would reach remote hosts."""
    sw = _ensure_switch(base)
    tag = _tag(base)
    here, there = f"v{tag}up", f"v{tag}us"
    if os.path.exists(f"/sys/class/net/{here}"):
        return
    route = _ip("route", "show", f"{SUBNET}.0/24", check=False).stdout.strip()
    if route:
        raise RuntimeError(
            f"{SUBNET}.0/24 is already routed on this machine ({route}): another cluster of "
            f"TLS hosts runs; stop it first"
        )
    _ip("link", "add", here, "type", "veth", "peer", "name", there)
    _ip("link", "set", there, "netns", sw)
    _ip("-n", sw, "link", "set", there, "master", BRIDGE)
    _ip("-n", sw, "link", "set", there, "up")
    _ip("addr", "add", f"{UPLINK_ADDRESS}/24", "dev", here)
    _ip("link", "set", here, "up")


def _tls_answers(host: LocalHost) -> bool:
    import socket

    try:
        with socket.create_connection((host.address, TLS_PORT), timeout=1):
            return True
    except OSError:
        return False


def netns_available() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


def describe(base: Path, name: str, index: int, netns: bool, tls: bool = False, ssh: bool = False) -> LocalHost:
    return LocalHost(
        name,
        base / name,
        f"vmp{_tag(base)}-{name}" if netns else None,
        f"{SUBNET}.{index + 1}" if netns else "127.0.0.1",
        tls,
        ssh,
    )


def start(
    base: Path,
    name: str,
    index: int = 0,
    netns: bool = False,
    timeout_s: float = 30.0,
    tls: bool = False,
    tls_ca: Path | None = None,
    ssh: bool = False,
) -> LocalHost:
    """Start (or adopt, if it already runs) the libvirtd host NAME under BASE. With `tls` (needs `netns`)
    it also listens with TLS on its address, its server certificate signed by `tls_ca` (a folder with
    cacert.pem and cakey.pem; default the hosts folder's own CA, BASE/tls/ca: another CA makes a host
    the control plane must refuse). With `ssh` (needs `netns`) an sshd runs on its address and its URI is
    qemu+ssh:// (see the module's docstring)."""
    reason = available()
    if reason:
        raise RuntimeError(f"cannot start local libvirt host {name}: {reason}")
    if tls:
        from vmplane import tlscerts

        if not netns:
            raise RuntimeError(
                f"cannot start local libvirt host {name} with TLS: it needs a network namespace "
                f"(its own address to listen on)"
            )
        if tlscerts.available():
            raise RuntimeError(f"cannot start local libvirt host {name} with TLS: {tlscerts.available()}")
    if tls or ssh:  # the URI's pkipath / keyfile are read by the daemons in their namespaces too
        resolved = str(Path(base).resolve())
        if any(resolved == d or resolved.startswith(d + "/") for d in _NS_COVERED):
            raise RuntimeError(
                f"cannot start local libvirt host {name} with TLS or ssh: its folder {resolved} is "
                f"hidden in the hosts' namespaces (under {', '.join(_NS_COVERED)})"
            )
    if ssh and (not netns or not os.access(SSHD, os.X_OK) or shutil.which("ssh") is None):
        raise RuntimeError(
            f"cannot start local libvirt host {name} with ssh: it needs a network namespace, "
            f"the ssh client and sshd ({SSHD}; set VMPLANE_SSHD)"
        )
    host = describe(base, name, index, netns, tls, ssh)
    if _stopped(host.pid()):
        return host  # partitioned by fail(host, "network"): it runs, unreachable, until recover()
    deadline = time.monotonic() + timeout_s
    while host.pid() is not None and not host.running():  # alive (just resumed, or busy): waited for
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"libvirtd host {name} runs (pid {host.pid()}) but does not answer within "
                f"{timeout_s:.0f} s; not started twice"
            )
        time.sleep(0.2)
    if host.running():
        _ensure_lockd(host)
        _ensure_heartbeat(host)
        if tls or ssh:
            _ensure_uplink(base)
        _ensure_sshd(host)
        return host
    if netns:
        _ensure_netns(base, host, index)
    if tls or ssh:
        _ensure_uplink(base)
        host.dir.mkdir(parents=True, exist_ok=True)
    if tls:
        _ensure_certs(host, base, tls_ca)
    if ssh:
        _ensure_ssh(host, base)
    _write_config(host, base)
    (host.dir / "host.json").write_text(json.dumps({"index": index, "netns": netns, "tls": tls, "ssh": ssh}))
    host.socket.unlink(missing_ok=True)
    cmd = ["unshare", "-m", "bash", str(host.dir / "start.sh")]
    if host.netns:
        # nsenter, not `ip netns exec`: the latter remounts /sys, which hides the cgroup mounts and
        # leaves libvirt unable to cap or account its domains
        cmd = ["nsenter", f"--net=/run/netns/{host.netns}"] + cmd
    with open(host.dir / "daemon.out", "ab") as out:
        subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if host.socket.exists() and host.pid() is not None and _answers(host) and (not tls or _tls_answers(host)):
            _ensure_heartbeat(host)
            _ensure_sshd(host)
            (host.dir / "failed").unlink(missing_ok=True)  # a new daemon: whatever failed is over
            return host
        time.sleep(0.05)
    log = (host.dir / "daemon.out").read_text(errors="replace")[-2000:]
    raise RuntimeError(f"libvirtd host {name} did not come up in {timeout_s:.0f} s: {log}")


def _answers(host: LocalHost, timeout_s: float = 5.0) -> bool:
    """Whether the daemon answers, asked by `virsh` in a process of its own, killed at `timeout_s`: never by
    libvirt's client in this process (the control plane's), where an open or a free racing the event
    loop on a daemon that is stopped or dies is what crashed libvirt 9.0's client (drivers/libvirt.py)."""
    try:
        return (
            subprocess.run(
                ["virsh", "-c", host.local_uri, "hostname"], capture_output=True, timeout=timeout_s
            ).returncode
            == 0
        )
    except (subprocess.TimeoutExpired, OSError):
        return False


def _destroy_domains(host: LocalHost) -> None:
    try:
        import libvirt

        from vmplane.hosts.drivers.libvirtdomains import discard_domain
    except ImportError:
        return
    try:
        conn = libvirt.open(host.local_uri)
    except libvirt.libvirtError:
        return
    try:
        for dom in conn.listAllDomains():
            discard_domain(dom)
    finally:
        conn.close()


def qemu_runs_domain(cmdline: bytes, domain: str) -> bool:
    """Whether a /proc/PID/cmdline (NUL-separated) is a QEMU started for exactly `domain`: libvirt names
    it with `-name guest=DOMAIN,...` (or the older `-name DOMAIN`). A pid from a stale pid file may have
    been reused by any process, another host's QEMU included: only this test says it is ours."""
    args = [a.decode(errors="replace") for a in cmdline.split(b"\0")]
    exe = Path(args[0]).name
    if not (exe.startswith("qemu-system") or exe == "qemu-kvm"):
        return False
    for flag, value in itertools.pairwise(args):
        if flag != "-name":
            continue
        # QEMU's option syntax: key=value pairs split by ",", a literal comma written ",,"
        parts = [p.replace("\0", ",") for p in value.replace(",,", "\0").split(",")]
        first = parts[0]
        name = first[len("guest=") :] if first.startswith("guest=") else None
        if name is None and "=" not in first:
            name = first  # `-name DOMAIN[,...]`
        if name is None:
            name = next((p[len("guest=") :] for p in parts[1:] if p.startswith("guest=")), None)
        return name == domain
    return False


def qemu_pids(host: LocalHost) -> list[int]:
    """The live QEMU processes this host started (by pid file, `run/qemu/DOMAIN.pid`): only pids that
    still are a QEMU of that very domain, zombies left out."""
    pids = []
    for pid_file in (host.dir / "run" / "qemu").glob("*.pid"):
        try:
            pid = int(pid_file.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if qemu_runs_domain(cmdline, pid_file.stem) and not _zombie(pid):
            pids.append(pid)
    return pids


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _kill_orphaned_qemu(host: LocalHost) -> None:
    """QEMU processes this host started whose daemon died before it could destroy them."""
    _kill(qemu_pids(host))


def processes(host: LocalHost) -> dict[str, list[int]]:
    """The host's live processes by role (libvirtd, qemu, virtlockd, heartbeat): what a power cut ends.
    A stopped (SIGSTOP) process is alive; a zombie is not."""
    found: dict[str, Sequence[int | None]] = {
        "libvirtd": [host.pid()],
        "qemu": qemu_pids(host),
        "virtlockd": [host.lockd_pid()],
        "heartbeat": [host.heartbeat_pid()],
    }
    if host.ssh:
        found["sshd"] = [host.sshd_pid()]
    return {role: [p for p in pids if p is not None and not _zombie(p)] for role, pids in found.items()}


def _ensure_heartbeat(host: LocalHost) -> None:
    """Start the host's heartbeat writer in its namespaces unless it runs: it writes through the host's
    own view of the shared folder, as a remote host writes to its NFS export."""
    import sys

    pid = host.pid()
    if pid is None or host.heartbeat_pid() is not None:
        return
    heartbeat_path(host.dir.parent, host.name).parent.mkdir(parents=True, exist_ok=True)
    cmd = (
        ["nsenter", f"--target={pid}", "--mount"]
        + (["--net"] if host.netns else [])
        + [
            sys.executable,
            "-m",
            "vmplane.heartbeat",
            "--file",
            f"{SHARED_PATH}/.heartbeat/{host.name}",
            "--interval",
            "1",
        ]
    )
    src = str(Path(__file__).resolve().parent.parent)  # vmplane importable wherever it was run from
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    with open(host.dir / "heartbeat.out", "ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env
        )
    (host.dir / "run" / "heartbeat.pid").write_text(str(proc.pid))  # nsenter execs: the same pid
    deadline = time.monotonic() + 5  # while a process execs, its cmdline reads empty: wait for python's
    while host.heartbeat_pid() is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)


FAIL_MODES = ("power", "daemon", "network")


def _wait_gone(pids: list[int], timeout_s: float = 5.0) -> None:
    """Wait (briefly) until SIGKILLed processes are dead: the kernel takes a moment to tear one down."""
    deadline = time.monotonic() + timeout_s
    while any(not _zombie(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)


def cut_power(host: LocalHost) -> None:
    """What a power cut does to the host: SIGKILL its libvirtd, every QEMU it ran, its virtlockd and its
    heartbeat writer, at once and without warning (a SIGSTOPped process dies of SIGKILL too)."""
    pids = [pid for pids in processes(host).values() for pid in pids]
    _kill(pids)
    _wait_gone(pids)


def fail(host: LocalHost, mode: str) -> None:
    """The nemesis: break the host as `mode` says, and record it in BASE/NAME/failed for recover().
    power    cut_power(): daemon, guests, virtlockd and heartbeat gone
    daemon   SIGKILL libvirtd only: the guests, virtlockd and the heartbeat run on
    network  SIGSTOP libvirtd: the control plane's calls get no answer, as if its packets were lost,
             while the guests and the heartbeat run on"""
    if mode not in FAIL_MODES:
        raise ValueError(f"mode must be one of {', '.join(FAIL_MODES)}, not {mode!r}")
    (host.dir / "failed").write_text(mode)
    pid = host.pid()
    if mode == "power":
        cut_power(host)
    elif pid is not None and mode == "daemon":
        os.kill(pid, signal.SIGKILL)
        _wait_gone([pid])
    elif pid is not None:
        os.kill(pid, signal.SIGSTOP)
        _wait_stopped(pid)  # SIGSTOP is delivered asynchronously: fail() returns once it took effect


def _wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _state(pid) not in ("T", "t", "", "Z") and time.monotonic() < deadline:
        time.sleep(0.01)


def _let_go(pid: int | None) -> None:
    """SIGCONT a daemon that is or may be about to be stopped (a SIGSTOP still on its way is not yet
    seen as stopped; a SIGCONT to a running process does nothing)."""
    if pid is not None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def failed(host: LocalHost) -> str | None:
    """The mode of the host's recorded failure, None when it is not failed."""
    try:
        return (host.dir / "failed").read_text().strip() or None
    except OSError:
        return None


def recover(host: LocalHost, timeout_s: float = 30.0) -> LocalHost:
    """Undo fail(): let a partitioned daemon run again (SIGCONT), start a dead one (start(), which adopts
    the guests, virtlockd and heartbeat still running; after a power cut the guests are gone)."""
    _let_go(host.pid())
    saved = json.loads((host.dir / "host.json").read_text())
    started = start(
        host.dir.parent,
        host.name,
        saved["index"],
        saved["netns"],
        timeout_s,
        saved.get("tls", False),
        ssh=saved.get("ssh", False),
    )
    (host.dir / "failed").unlink(missing_ok=True)
    return started


def _terminate(pid: int) -> None:
    """SIGTERM, then SIGKILL if the process still runs after 10 s."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(100):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return
        if stat[stat.rfind(")") + 2] == "Z":  # ended, not yet reaped by whoever started it
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def net_dir(host: LocalHost) -> Path:
    """Where the host's DHCP servers keep their files (hosts/hostnet.py)."""
    return host.dir / "net"


def _stop_dhcp(host: LocalHost) -> None:
    """The host's DHCP servers (a dnsmasq keeps a deleted namespace alive): by their pid files, each checked
    against its command line."""
    for pid_file in sorted(net_dir(host).glob("vmpn*.pid")):
        try:
            pid = int(pid_file.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if f"--interface={pid_file.stem}".encode() in cmdline and not _zombie(pid):
            _terminate(pid)


def stop(host: LocalHost, remove_files: bool = False) -> None:
    """Destroy the host's domains, stop its daemons (libvirtd, virtlockd: by pid), remove its network
    namespace."""
    pid = host.pid()
    _let_go(pid)  # a partitioned daemon (fail "network") answers again
    _keep_capabilities(host)
    if pid is not None:
        try:
            _destroy_domains(host)
        finally:  # a domain libvirt would not undefine never leaves the daemon running
            _terminate(pid)
    _kill_orphaned_qemu(host)
    heartbeat = host.heartbeat_pid()
    if heartbeat is not None:
        _terminate(heartbeat)
    sshd = host.sshd_pid()
    if sshd is not None:
        _terminate(sshd)
    lockd = host.lockd_pid()  # after QEMU: the leases go with the processes holding them
    if lockd is not None:
        _terminate(lockd)
    _stop_dhcp(host)
    if host.netns and _netns_exists(host.netns):
        _ip("netns", "del", host.netns, check=False)
    _remove_run_dir(host)  # its daemons are gone: nothing there is needed again
    if remove_files:
        shutil.rmtree(host.dir, ignore_errors=True)


def stop_switch(base: Path) -> None:
    """Remove the bridge namespace of a hosts folder (once its hosts are stopped) and its uplink."""
    uplink = f"v{_tag(base)}up"
    if os.path.exists(f"/sys/class/net/{uplink}"):
        _ip("link", "del", uplink, check=False)  # both ends, now: not when the namespace is freed
    if _netns_exists(switch_ns(base)):
        _ip("netns", "del", switch_ns(base), check=False)


def stop_all(base: Path) -> list[str]:
    """Stop every host started under BASE (by its pid file) and the bridge; returns their names."""
    stopped = []
    for name in sorted(p.name for p in base.iterdir() if (p / "host.json").exists()) if base.exists() else []:
        saved = json.loads((base / name / "host.json").read_text())
        host = describe(base, name, saved["index"], saved["netns"], saved.get("tls", False), saved.get("ssh", False))
        if (
            host.pid() is not None
            or host.lockd_pid() is not None
            or host.heartbeat_pid() is not None
            or host.sshd_pid() is not None
            or (host.netns and _netns_exists(host.netns))
        ):
            stop(host)
            stopped.append(name)
    stop_switch(base)
    return stopped
