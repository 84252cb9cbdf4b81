#!/usr/bin/env bash
# Builds the Debian test image (issue 30): a bootable qcow2 made on this machine from Debian's package
# registry only (mmdebstrap from deb.debian.org; no cloud image is downloaded), with cloud-init (NoCloud),
# openssh-server and qemu-guest-agent, for the real-guest tests (tests/test_debian_real.py).
#
#   scripts/build-debian-image.sh          build it unless cached; prints its path
#   scripts/build-debian-image.sh --path   print the path it has (or would have); exit 1 when it is not built
#
# Cached in ${VMPLANE_DEBIAN_CACHE:-${XDG_CACHE_HOME:-~/.cache}/vmplane/debian} as
# debian-SUITE-HASH.qcow2, HASH being that of this script: rebuilt only when the script changes.
#
# The disk: an MBR partition table with one ext4 partition (label vmroot) from 1 MiB, made without a
# mount (mkfs.ext4 -d), and GRUB for BIOS written by hand (boot.img in the MBR, core.img in the gap
# after it: GRUB's own blocklist already points there). vmplane boots a template from its first disk
# (q35, SeaBIOS, virtio disk). The kernel logs to the serial console (ttyS0). Networking: cloud-init
# renders the seed's network-config (v2, NICs by MAC, static addresses) with netplan for
# systemd-networkd. Needs root (mmdebstrap's root mode, for device nodes and ownership).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
say() { echo "build-debian-image: $*" >&2; }

# the machine's own suite and mirror (its apt sources), so the image matches what apt here resolves
suite=${DEBIAN_SUITE:-$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
cache=${VMPLANE_DEBIAN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vmplane/debian}
hash=$(sha256sum "$here/build-debian-image.sh" | cut -c1-16)
image="$cache/debian-$suite-$hash.qcow2"
DISK_MIB=2048    # the virtual size; cloud-init grows the partition and file system into a larger disk
PART_START=2048  # sectors: the partition starts at 1 MiB, GRUB's core.img lives in the gap before it
CMDLINE="root=LABEL=vmroot ro console=tty0 console=ttyS0,115200n8 net.ifnames=0"
PACKAGES=(
  linux-image-cloud-amd64 systemd-sysv udev dbus cloud-init cloud-guest-utils openssh-server
  qemu-guest-agent netplan.io iproute2 e2fsprogs sudo
  grub-pc-bin  # its modules and boot.img; grub-pc itself is left out (its postinst wants a disk to install on)
)

if [ "${1:-}" = "--path" ]; then
  echo "$image"
  [ -f "$image" ]
  exit
fi
if [ -f "$image" ]; then
  echo "$image"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  say "needs root (mmdebstrap's root mode); run it as root" && exit 1
fi
need=()
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v sfdisk >/dev/null || [ -x /usr/sbin/sfdisk ] || [ -x /sbin/sfdisk ] || need+=(fdisk)
command -v qemu-img >/dev/null || need+=(qemu-utils)
[ -x /usr/sbin/mkfs.ext4 ] || [ -x /sbin/mkfs.ext4 ] || need+=(e2fsprogs)
if [ "${#need[@]}" -gt 0 ]; then
  say "installing ${need[*]}"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
fi
export PATH="$PATH:/usr/sbin:/sbin"

mkdir -p "$cache"
work=$(mktemp -d "$cache/build.XXXXXX")
trap 'rm -rf "$work"' EXIT
started=$SECONDS
say "building $image ($suite from $mirror)"

# What the customize hook does inside the new system ($1 = its root): the boot loader's files, the kernel
# command line, fstab, and cloud-init's data source.
cat > "$work/customize.sh" <<EOF
#!/bin/sh
set -eu
root=\$1
kernel=\$(cd "\$root/boot" && ls vmlinuz-* | sort -V | tail -n1)
version=\${kernel#vmlinuz-}
mkdir -p "\$root/boot/grub"
cp -r "\$root/usr/lib/grub/i386-pc" "\$root/boot/grub/"
cat > "\$root/boot/grub/grub.cfg" <<CFG
serial --unit=0 --speed=115200
terminal_input serial console
terminal_output serial console
set default=0
set timeout=0
menuentry debian {
  search --no-floppy --label --set=root vmroot
  linux /boot/vmlinuz-\$version $CMDLINE
  initrd /boot/initrd.img-\$version
}
CFG
# core.img: finds its prefix on the first disk's first partition; modules for that and for grub.cfg
chroot "\$root" grub-mkimage -O i386-pc -o /boot/grub/core.img -p '(hd0,msdos1)/boot/grub' \\
  biosdisk part_msdos ext2 normal configfile linux search search_label serial terminal echo test
echo 'LABEL=vmroot / ext4 errors=remount-ro 0 1' > "\$root/etc/fstab"
echo debian > "\$root/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 debian\n::1 localhost ip6-localhost ip6-loopback\n' > "\$root/etc/hosts"
# only the NoCloud seed (a CD-ROM labelled cidata): no probing of cloud metadata servers at boot; none of
# what a test guest does not use and a TCG vCPU pays seconds for (measured with systemd-analyze blame and
# cloud-init analyze: GRUB's debconf 3.5 s, the keys printed to the console 1.3 s, RSA host keys)
printf 'datasource_list: [NoCloud, None]\nlocale: false\ngrub_dpkg: {enabled: false}\nno_ssh_fingerprints: true\nssh_genkeytypes: [ed25519, ecdsa]\n' \
  > "\$root/etc/cloud/cloud.cfg.d/90-vmplane.cfg"
# units that compete with cloud-init for the guest's one vCPU at boot (e2scrub_reap took 15 s) and timers
# no test guest needs; the network is online once one link is (the guest has one NIC, or none)
for unit in e2scrub_reap.service e2scrub_all.timer apt-daily.timer apt-daily-upgrade.timer man-db.timer fstrim.timer; do
  ln -sf /dev/null "\$root/etc/systemd/system/\$unit"
done
mkdir -p "\$root/etc/systemd/system/systemd-networkd-wait-online.service.d"
printf '[Service]\nExecStart=\nExecStart=/lib/systemd/systemd-networkd-wait-online --any --timeout=60\n' \
  > "\$root/etc/systemd/system/systemd-networkd-wait-online.service.d/any.conf"
# each VM makes its own identity: machine-id at first boot, SSH host keys by cloud-init
: > "\$root/etc/machine-id"
rm -f "\$root"/etc/ssh/ssh_host_*
rm -rf "\$root"/var/lib/apt/lists/* "\$root"/var/cache/apt/*.bin "\$root"/var/cache/apt/archives/*.deb
EOF
chmod +x "$work/customize.sh"

mmdebstrap --mode=root --variant=minbase --format=directory --components=main \
  --include="$(IFS=,; echo "${PACKAGES[*]}")" \
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias' \
  --customize-hook="$work/customize.sh \"\$1\"" \
  "$suite" "$work/root" \
  "deb $mirror $suite main" "deb $mirror $suite-updates main" "deb $security $suite-security main" >&2

# the file system (no mount: mkfs.ext4 copies the tree), then the disk around it
part_mib=$((DISK_MIB - 1))
mkfs.ext4 -q -L vmroot -d "$work/root" "$work/part.raw" "${part_mib}M" >&2
cp "$work/root/usr/lib/grub/i386-pc/boot.img" "$work/root/boot/grub/core.img" "$work/"
rm -rf "$work/root"
truncate -s "${DISK_MIB}M" "$work/disk.raw"
echo "start=$PART_START, type=83, bootable" | sfdisk -q "$work/disk.raw"
dd if="$work/part.raw" of="$work/disk.raw" bs=1M seek=1 conv=notrunc,sparse status=none
# boot.img's code only (440 bytes: the partition table after it stays); it loads sector 1, core.img's
# first sector, whose blocklist (written by grub-mkimage) reads the rest from sector 2 on
core_sectors=$(( ($(stat -c %s "$work/core.img") + 511) / 512 ))
if [ "$core_sectors" -ge "$PART_START" ]; then
  say "GRUB's core.img ($core_sectors sectors) does not fit before the partition" && exit 1
fi
dd if="$work/boot.img" of="$work/disk.raw" bs=440 count=1 conv=notrunc status=none
dd if="$work/core.img" of="$work/disk.raw" bs=512 seek=1 conv=notrunc status=none
qemu-img convert -c -O qcow2 "$work/disk.raw" "$work/disk.qcow2"
mv "$work/disk.qcow2" "$image"
# older builds of this script are of no use any more
find "$cache" -maxdepth 1 -name 'debian-*.qcow2' ! -path "$image" -delete
say "built in $((SECONDS - started)) s: $(du -h "$image" | cut -f1) on disk, ${DISK_MIB} MiB virtual"
echo "$image"
