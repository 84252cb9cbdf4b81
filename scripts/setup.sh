#!/usr/bin/env bash
# Set up vmplane on a fresh machine: a virtual environment at .venv (repo root) with pinned packages,
# and, as root on Debian, QEMU + libvirt (no systemd) for real hosts and the PostgreSQL server the
# tests race on.
#   scripts/setup.sh          what `vmplane up` needs
#   scripts/setup.sh --test   plus what the tests need
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1
say() { echo "vmplane setup: $*"; }

py=""
for candidate in python3.11 python3; do
  if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    py=$candidate; break
  fi
done
if [ -z "$py" ]; then
  echo "vmplane needs Python 3.11 (python3.11 or python3)" >&2
  exit 1
fi

# -- Debian packages (root only; without them vmplane runs on simulated hosts) -------------------
packages=()
command -v qemu-system-x86_64 >/dev/null || packages+=(qemu-system-x86)
[ -x /usr/sbin/libvirtd ] || packages+=(libvirt-daemon libvirt-daemon-driver-qemu)
command -v virsh >/dev/null || packages+=(libvirt-clients)
# qemu-img: qcow2 disks and libvirt's storage pools; mkfs.ext4: the test template's disk image
command -v qemu-img >/dev/null || packages+=(qemu-utils)
command -v mkfs.ext4 >/dev/null || [ -x /usr/sbin/mkfs.ext4 ] || packages+=(e2fsprogs)
dpkg -s libvirt-dev >/dev/null 2>&1 || packages+=(libvirt-dev)
command -v pkg-config >/dev/null || packages+=(pkg-config)
command -v ip >/dev/null || packages+=(iproute2)
command -v nsenter >/dev/null || packages+=(util-linux)
[ -x /usr/sbin/nft ] || packages+=(nftables)          # the guests' filters on a host (core/netfilter.py)
[ -x /usr/sbin/dnsmasq ] || packages+=(dnsmasq-base)  # DHCP for guest networks, one per host per network (hosts/hostnet.py)
if [ "$want_test" = 1 ] && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  packages+=(postgresql)
fi
# the ipmi fence agent drives ipmitool; the tests fence against OpenIPMI's BMC simulator
command -v ipmitool >/dev/null || packages+=(ipmitool)
if [ "$want_test" = 1 ]; then
  command -v ipmi_sim >/dev/null || packages+=(openipmi)
  command -v promtool >/dev/null || packages+=(prometheus)       # checks /metrics and the sample alert rules
  command -v certtool >/dev/null || packages+=(gnutls-bin)       # certificates of the TLS host tests
  command -v ping >/dev/null || packages+=(iputils-ping)       # guests on a provider network pinged from here (and bench/network.py)
  command -v ssh-keygen >/dev/null || packages+=(openssh-client)  # ssh into test guests (tests/test_guest_ssh_real.py)
  # the console's browser tests drive Debian's Chromium through Playwright (never a browser download)
  command -v chromium >/dev/null || packages+=(chromium)
  # several control planes through PgBouncer (transaction pooling); a host reached by qemu+ssh:// runs an sshd
  [ -x /usr/sbin/pgbouncer ] || packages+=(pgbouncer)
  [ -x /usr/sbin/sshd ] || packages+=(openssh-server)
fi
if [ "${#packages[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing ${packages[*]} (apt-get, no recommends: libvirt without systemd)"
    apt-get update -q >/dev/null
    # no service of these packages may start by itself (sshd on port 22, a system PostgreSQL or PgBouncer):
    # the tests start their own, on private sockets and namespaces
    policy_added=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && policy_added=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null
    if [ "$policy_added" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
  else
    say "not root or no apt-get: missing ${packages[*]}; vmplane will use simulated hosts" >&2
  fi
fi
if [ "$(id -u)" = 0 ] && [ -x /usr/sbin/libvirtd ]; then
  # libvirt's QEMU driver refuses to start unless its compiled-in user exists (libvirt-daemon-system
  # would create it, but pulls in systemd)
  getent group libvirt-qemu >/dev/null || groupadd -r libvirt-qemu
  id libvirt-qemu >/dev/null 2>&1 || useradd -r -g libvirt-qemu -d /var/lib/libvirt -s /usr/sbin/nologin libvirt-qemu
fi
# the guest image is built from Debian packages with `apt-get download`, which needs package lists
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! apt-cache show linux-image-cloud-amd64 >/dev/null 2>&1; then
  apt-get update -q >/dev/null
fi
# the Debian test image (tests/test_debian_real.py): built once from Debian's packages with mmdebstrap (~2 min),
# then cached until scripts/build-debian-image.sh changes
if [ "$want_test" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  debian_image=$(bash scripts/build-debian-image.sh)  # (an assignment: a failed build stops setup)
  say "Debian test image at $debian_image"
fi

# -- Python ------------------------------------------------------------------------------------
[ -x .venv/bin/python ] || "$py" -m venv .venv
extras=()
[ "$want_test" = 1 ] && extras+=(test)
dpkg -s libvirt-dev >/dev/null 2>&1 && extras+=(libvirt)
spec="."
[ "${#extras[@]}" -gt 0 ] && spec=".[$(IFS=,; echo "${extras[*]}")]"
stamp=".venv/.installed-$(echo "$spec" | tr -c 'a-z' '_')"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade "pip==25.3" 2>&1 | grep -v -i "warning" || true
  .venv/bin/python -m pip install -q -e "$spec" 2>&1 | grep -v -i "warning" || true
  .venv/bin/python -c "import vmplane, fastapi, sqlalchemy, typer"   # fail loudly if the install did not work
  touch "$stamp"
fi
say ".venv ready ($(.venv/bin/python --version); extras: ${extras[*]:-none})"
