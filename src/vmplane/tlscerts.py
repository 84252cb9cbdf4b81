"""Certificates for libvirt over TLS, made with GnuTLS's `certtool` as libvirt documents them
(https://libvirt.org/kbase/tlscerts.html): one certificate authority, a server certificate per host
(its address in the subject alternative names: libvirt's client checks the name or IP address of the
URI against them) and client certificates (the control plane's, and every host's for peer-to-peer
migration, where the source daemon is the client of the target daemon).

The files are named as libvirt looks for them:
  CA folder       cacert.pem, cakey.pem (the key stays with whoever signs)
  server folder   cacert.pem, servercert.pem, serverkey.pem
                  -> /etc/pki/CA/cacert.pem, /etc/pki/libvirt/servercert.pem,
                     /etc/pki/libvirt/private/serverkey.pem on a host (or libvirtd.conf ca_file,
                     cert_file, key_file)
  client folder   cacert.pem, clientcert.pem, clientkey.pem
                  -> the folder a URI's `?pkipath=` names, or /etc/pki/CA/cacert.pem,
                     /etc/pki/libvirt/clientcert.pem, /etc/pki/libvirt/private/clientkey.pem (root)

From a shell:
  python -m vmplane.tlscerts ca DIR [--name NAME]
  python -m vmplane.tlscerts server DIR --ca CADIR --host NAME_OR_IP [--host ...]
  python -m vmplane.tlscerts client DIR --ca CADIR [--name CN]
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CERTTOOL = "certtool"


def available() -> str | None:
    """None when certificates can be made here, else why not."""
    if shutil.which(CERTTOOL) is None:
        return "GnuTLS's certtool is not installed (Debian: apt-get install gnutls-bin)"
    return None


def _certtool(*args: str, template: str | None = None) -> None:
    if available():
        raise RuntimeError(available())
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [CERTTOOL, *args]
        if template is not None:
            info = Path(tmp) / "template.info"
            info.write_text(template)
            cmd += ["--template", str(info)]
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"certtool {' '.join(args[:1])} failed: {done.stderr.strip()[-500:]}")


def _private_key(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _certtool("--generate-privkey", "--outfile", str(path))
    os.chmod(path, 0o600)


def make_ca(folder: Path, name: str = "vmplane CA", days: int = 3650) -> Path:
    """A self-signed certificate authority in FOLDER (cacert.pem, cakey.pem); kept if already there."""
    folder = Path(folder)
    if (folder / "cacert.pem").exists() and (folder / "cakey.pem").exists():
        return folder
    _private_key(folder / "cakey.pem")
    _certtool(
        "--generate-self-signed",
        "--load-privkey",
        str(folder / "cakey.pem"),
        "--outfile",
        str(folder / "cacert.pem"),
        template=f'cn = "{name}"\nca\ncert_signing_key\nexpiration_days = {days}\n',
    )
    return folder


def _names(hosts: list[str]) -> str:
    lines = []
    for host in hosts:
        try:
            ipaddress.ip_address(host)
            lines.append(f"ip_address = {host}")
        except ValueError:
            lines.append(f'dns_name = "{host}"')
    return "\n".join(lines) + "\n"


def _sign(ca: Path, out: Path, cert: str, key: str, template: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    _private_key(out / key)
    _certtool(
        "--generate-certificate",
        "--load-privkey",
        str(out / key),
        "--load-ca-certificate",
        str(ca / "cacert.pem"),
        "--load-ca-privkey",
        str(ca / "cakey.pem"),
        "--outfile",
        str(out / cert),
        template=template,
    )
    shutil.copyfile(ca / "cacert.pem", out / "cacert.pem")


def make_server_cert(ca: Path, folder: Path, hosts: list[str], organization: str = "vmplane", days: int = 3650) -> Path:
    """servercert.pem + serverkey.pem (and the CA's cacert.pem) in FOLDER for a libvirtd reached as any
    of HOSTS (names or IP addresses; the first is the common name). It may also act as a client (a
    daemon that migrates peer to peer connects to the other daemon)."""
    if not hosts:
        raise ValueError("a server certificate needs at least one host name or address")
    _sign(
        Path(ca),
        Path(folder),
        "servercert.pem",
        "serverkey.pem",
        f'organization = "{organization}"\ncn = "{hosts[0]}"\n'
        + _names(hosts)
        + f"tls_www_server\ntls_www_client\nencryption_key\nsigning_key\nexpiration_days = {days}\n",
    )
    return Path(folder)


def make_client_cert(
    ca: Path, folder: Path, name: str = "vmplane", organization: str = "vmplane", days: int = 3650
) -> Path:
    """clientcert.pem + clientkey.pem (and cacert.pem) in FOLDER: what a URI's `?pkipath=FOLDER` uses."""
    _sign(
        Path(ca),
        Path(folder),
        "clientcert.pem",
        "clientkey.pem",
        f'organization = "{organization}"\ncn = "{name}"\n'
        f"tls_www_client\nencryption_key\nsigning_key\nexpiration_days = {days}\n",
    )
    return Path(folder)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m vmplane.tlscerts", description="Certificates for libvirt over TLS (GnuTLS certtool)."
    )
    sub = parser.add_subparsers(dest="what", required=True)
    ca = sub.add_parser("ca", help="a certificate authority: DIR/cacert.pem, DIR/cakey.pem")
    ca.add_argument("dir")
    ca.add_argument("--name", default="vmplane CA")
    server = sub.add_parser("server", help="a host's server certificate: DIR/servercert.pem, serverkey.pem")
    server.add_argument("dir")
    server.add_argument("--ca", required=True, help="the CA's folder")
    server.add_argument("--host", action="append", required=True, help="a name or address (repeatable)")
    client = sub.add_parser("client", help="a client certificate: DIR/clientcert.pem, clientkey.pem")
    client.add_argument("dir")
    client.add_argument("--ca", required=True, help="the CA's folder")
    client.add_argument("--name", default="vmplane")
    args = parser.parse_args(argv)
    try:
        if args.what == "ca":
            make_ca(Path(args.dir), args.name)
        elif args.what == "server":
            make_server_cert(Path(args.ca), Path(args.dir), args.host)
        else:
            make_client_cert(Path(args.ca), Path(args.dir), args.name)
    except (RuntimeError, ValueError) as exc:
        print(f"error: {exc}")
        return 1
    print(f"wrote {args.dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
