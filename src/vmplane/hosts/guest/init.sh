#!/bin/sh
# /init of vmplane's test guest (busybox only). Answers commands on the serial console (ttyS0).
/bin/busybox mkdir -p /proc /sys /dev /tmp /run /bin /sbin /usr/bin /usr/sbin
/bin/busybox --install -s
export PATH=/sbin:/usr/sbin:/bin:/usr/bin   # the applets (ip, udhcpc, ping, nc...) for every child, scripts too
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/shm /dev/pts
mount -t tmpfs -o size=90% tmpfs /dev/shm
mount -t devpts devpts /dev/pts   # terminals of SSH sessions
dmesg -n 1                     # keep kernel messages off the console the control plane reads
for m in $(cat /lib/modules/load-order); do      # dependencies first (written by the build)
  insmod /lib/modules/$m.ko 2>/dev/null
done
# Networks: lo always; each NIC (virtio_net names them ethN) is brought up and asks for a lease with
# busybox's udhcpc in the background, so no boot waits for DHCP and a boot with no NIC starts nothing.
# udhcpc keeps running (renewals; discovers again every few seconds while no server answers) and runs
# /run/net/dhcp.sh, which never flushes the NIC: an address set by hand (ip addr add) stays. Each lease
# gets one console line, `vmplane-guest: eth0 10.0.2.15/24`. NICs hot-plugged later: see the watcher.
ip link set lo up
net_up() {        # $1: a NIC; starts its DHCP client unless one runs (/run/net/$1.up while it does)
  [ -e /run/net/$1.up ] && return
  [ -e /run/net/dhcp.sh ] || write_dhcp_script
  : > /run/net/$1.up
  ip link set "$1" up
  # when udhcpc ends (the NIC was unplugged), its lease's traces go, and a NIC of that name starts afresh
  ( udhcpc -f -i "$1" -s /run/net/dhcp.sh -p /run/net/$1.pid -O mtu -t 5 -T 2 -A 3 </dev/null >/dev/null 2>&1
    interface=$1 /run/net/dhcp.sh deconfig; rm -f /run/net/$1.up /run/net/$1.pid ) &
}
write_dhcp_script() {
  mkdir -p /run/net
  cat > /run/net/dhcp.sh.tmp <<'EOF'
#!/bin/sh
# udhcpc's script: $1 is the event; the lease is in $interface, $ip, $mask, $router, $dns, $domain, $mtu.
# Only the lease's own address and default route (metric 100+N for ethN: a route set by hand, metric 0,
# wins) come and go; /etc/resolv.conf is written only from leases that name servers: all NICs' together.
n=$interface; held=/run/net/$n.ip; metric=$((100 + ${n#eth}))
resolv() { cat /run/net/*.resolv > /etc/resolv.conf 2>/dev/null; }
forget() {
  old=$(cat $held 2>/dev/null)
  [ -n "$old" ] && ip addr del "$old" dev $n 2>/dev/null
  ip route del default dev $n metric $metric 2>/dev/null
  rm -f $held
  [ -e /run/net/$n.resolv ] && rm -f /run/net/$n.resolv && resolv
}
case "$1" in
  deconfig) forget ;;
  bound|renew)
    new=$ip/${mask:-32}; old=$(cat $held 2>/dev/null)
    [ "$old" != "$new" ] && forget
    [ -n "$mtu" ] && ip link set dev $n mtu $mtu
    ip addr replace $new dev $n ${broadcast:+broadcast $broadcast}
    for r in $router; do ip route replace default via $r dev $n metric $metric; break; done
    if [ -n "$dns" ]; then
      { [ -n "$domain" ] && echo "search $domain"; for d in $dns; do echo "nameserver $d"; done; } > /run/net/$n.resolv
      resolv
    fi
    echo $new > $held
    [ "$old" != "$new" ] && echo "vmplane-guest: $n $new" > /dev/console ;;
esac
exit 0
EOF
  chmod 755 /run/net/dhcp.sh.tmp && mv /run/net/dhcp.sh.tmp /run/net/dhcp.sh
}
for nic in /sys/class/net/eth*; do
  [ -e "$nic" ] && net_up "${nic##*/}"
done
# Write dirty data back within ~1 s (not 30): a guest that is destroyed keeps what it wrote a second ago.
echo 100 > /proc/sys/vm/dirty_expire_centisecs
echo 100 > /proc/sys/vm/dirty_writeback_centisecs
# The first virtio disk, when it holds a file system, is the guest's persistent disk. ext4 mounts ext2/3
# too; `mke2fs DEV` formats a hot-plugged disk (/dev/vdb, ...), which devtmpfs shows as it appears.
data=none
if [ -b /dev/vda ] && mount -t ext4 -o commit=1 /dev/vda /data 2>/dev/null; then
  data=/dev/vda
fi
# cloud-init's NoCloud seed: a file system labelled cidata (vmplane's: an ISO 9660 CD-ROM on virtio-scsi),
# read in the background once per boot (the guest's root is a fresh RAM disk at every boot), so no boot
# waits for it. Read: meta-data's instance-id, local-hostname, public-keys (a list); user-data either a
# `#!` script (run) or `#cloud-config` of which only the top-level ssh_authorized_keys, hostname and
# runcmd are read (everything else: users, write_files, packages..., network-config, MIME or gzip'd user
# data, is ignored). runcmd's entries (strings, or [argv] lists, shell-quoted) run in order as one sh
# script, as cloud-init's do: a failing entry does not stop the next. YAML only in the subset
# /run/seed/yaml.awk says. Keys go to root's authorized_keys, each once. One console line,
# `vmplane-guest: seed iid-1 keys=2`, once the hostname and keys are set, before the user data runs;
# its output is in /run/seed/user-data.log. No seed, no line.
write_seed_awk() {
  cat > /run/seed/yaml.awk <<'EOF'
# The YAML subset the seed is read in (PyYAML's block style, as vmplane writes its seed, and cloud-init's
# own examples): top-level `key: value`, and lists under a top-level key: `- item` lines at one
# indentation, `key: [a, b]`, and items that are lists themselves (a runcmd argv: `- [a, b]`, or
# `- - a` with `  - b` below it), which become one shell-quoted command. Values plain (a ` #` comment
# ends them), 'single' or "double" quoted, over several lines too (folded: a line break is a space, an
# empty line a newline). Not read: block scalars (| >), mappings under a key (skipped), anchors and
# aliases, several documents, escapes other than \n \t \" \\. Without -v only=KEY it prints `key<TAB>value`
# and `key[]<TAB>item` lines; with it, the items of the list KEY, as they are (newlines included).
function scalar(s,   c, i, out, q) {   # sets `closed`: 0 while a quoted scalar's end is not there yet
  sub(/^[ \t]+/, "", s)
  q = substr(s, 1, 1); closed = 1
  if (q != "'" && q != "\"") { sub(/([ \t]+#.*)?[ \t]*$/, "", s); return s }
  out = ""; closed = 0
  for (i = 2; i <= length(s); i++) {
    c = substr(s, i, 1)
    if (q == "'" && c == "'") { if (substr(s, i + 1, 1) != "'") { closed = 1; break }; i++ }
    else if (q == "\"" && c == "\\") {
      i++; c = substr(s, i, 1)
      if (c == "n") c = "\n"; else if (c == "t") c = "\t"
    }
    else if (q == "\"" && c == "\"") { closed = 1; break }
    out = out c
  }
  return out
}
function flow(s, items,   c, i, n, q, cur) {   # "[a, 'b c']" -> items[1..n]
  sub(/^[ \t]*\[/, "", s); sub(/\][ \t]*(#.*)?$/, "", s)
  n = 0; q = ""; cur = ""
  for (i = 1; i <= length(s); i++) {
    c = substr(s, i, 1)
    if (q != "" && c == q) q = ""
    else if (q == "" && (c == "'" || c == "\"")) q = c
    else if (q == "" && c == ",") { items[++n] = scalar(cur); cur = ""; continue }
    cur = cur c
  }
  if (cur ~ /[^ \t]/) items[++n] = scalar(cur)
  return n
}
function shquote(s) { gsub(/'/, "'\\''", s); return "'" s "'" }
function emit(k, value, islist) {
  if (only == "") print k (islist ? "[]" : "") "\t" value
  else if (islist && k == only && value != "") print value
}
function argv_end(   cmd, i) {   # an item that was a list: one shell-quoted command
  if (nargv < 0) return
  cmd = ""
  for (i = 1; i <= nargv; i++) cmd = cmd (i > 1 ? " " : "") shquote(argv[i])
  emit(list, cmd, 1); nargv = -1
}
function take(s, target,   v) {   # a value for `target` (value, item, argv), maybe the start of several lines
  v = scalar(s)
  if (!closed) { pend = target; pending = s; return }
  if (target == "value") emit(key, v, 0)
  else if (target == "item") emit(list, v, 1)
  else argv[++nargv] = v
}
BEGIN { nargv = -1; pend = "" }
{ sub(/\r$/, "") }
pend != "" {    # the next line of a quoted scalar: folded as YAML does
  line = $0; sub(/^[ \t]+/, "", line); sub(/[ \t]+$/, "", line)
  if (line == "") { pending = pending "\n"; blank = 1 }
  else { pending = pending (blank ? "" : " ") line; blank = 0 }
  t = pend; pend = ""
  take(pending, t)
  if (pend == "") blank = 0
  next
}
/^[ \t]*(#|$)/ || /^(---|\.\.\.)/ { next }
/^[A-Za-z0-9_-]+:([ \t]|$)/ {
  argv_end()
  key = $0; sub(/:.*/, "", key)
  val = substr($0, length(key) + 2); sub(/^[ \t]+/, "", val)
  list = ""; indent = -1
  if (val == "" || val ~ /^#/) list = key
  else if (val ~ /^\[/) { n = flow(val, items); for (i = 1; i <= n; i++) emit(key, items[i], 1) }
  else if (val !~ /^[|>&*!]/) take(val, "value")
  next
}
list != "" && /^[ \t]*-([ \t]|$)/ {
  match($0, /^[ \t]*/); at = RLENGTH
  val = substr($0, at + 2); sub(/^[ \t]+/, "", val)
  if (indent < 0) indent = at
  if (at == indent) {
    argv_end()
    if (val ~ /^\[/) {
      n = flow(val, items); nargv = 0
      for (i = 1; i <= n; i++) argv[++nargv] = items[i]
      argv_end()
    } else if (val ~ /^-([ \t]|$)/) { nargv = 0; take(substr(val, 2), "argv") }
    else if (val != "" && val !~ /^[|>&*!]/) take(val, "item")
  } else if (nargv >= 0 && at == indent + 2) take(val, "argv")
  next
}
/^[^ \t]/ { argv_end(); list = "" }
END { argv_end() }
EOF
}
# seed_value: $1 a file yaml.awk wrote, $2 a top-level key; its value. seed_items: $1 a YAML file, $2 a
# top-level key; its list's items, one after another (a runcmd entry can span lines)
seed_value() { awk -F'\t' -v k="$2" '$1 == k { print substr($0, length(k) + 2); exit }' "$1" 2>/dev/null; }
seed_items() { awk -v only="$2" -f /run/seed/yaml.awk "$1" 2>/dev/null; }
seed_find() {     # the seed's device: an ISO 9660 file system (CD001) whose volume label is cidata
  # read here with dd (busybox's findfs sees no label on a CD-ROM); either case, as cloud-init does
  for d in /dev/sr* /dev/vd* /dev/sd*; do
    [ -b "$d" ] && [ "$(dd if=$d bs=1 skip=32769 count=5 2>/dev/null)" = CD001 ] || continue
    case "$(dd if=$d bs=1 skip=32808 count=32 2>/dev/null)" in
      'cidata '*|'CIDATA '*) echo $d; return 0 ;;
    esac
  done
  return 1
}
seed_apply() {    # $1: the seed's device
  s=/run/seed
  mkdir -p $s/mnt
  if ! mount -t iso9660 -o ro "$1" $s/mnt 2>/dev/null; then
    echo "vmplane-guest: seed on $1 not readable (only ISO 9660 is)" > /dev/console
    return
  fi
  for f in meta-data user-data network-config; do
    [ -f $s/mnt/$f ] && cp $s/mnt/$f $s/$f
  done
  umount $s/mnt
  write_seed_awk
  : > $s/keys
  [ -f $s/meta-data ] && awk -f $s/yaml.awk $s/meta-data > $s/meta-data.kv
  iid=$(seed_value $s/meta-data.kv instance-id)
  host=$(seed_value $s/meta-data.kv local-hostname)
  seed_items $s/meta-data public-keys >> $s/keys
  kind=$(head -c 64 $s/user-data 2>/dev/null | head -n 1)
  case "$kind" in
    '#cloud-config'*)
      awk -f $s/yaml.awk $s/user-data > $s/user-data.kv
      h=$(seed_value $s/user-data.kv hostname)
      host=${h:-$host}                     # as cloud-init: user-data's hostname wins over meta-data's
      seed_items $s/user-data ssh_authorized_keys >> $s/keys
      { echo '#!/bin/sh'; seed_items $s/user-data runcmd; } > $s/runcmd
      chmod 755 $s/runcmd
      run=$s/runcmd ;;
    '#!'*) chmod 755 $s/user-data; run=$s/user-data ;;
    *) run= ;;
  esac
  [ -n "$host" ] && hostname "${host%%.*}"   # the short name, as cloud-init sets it
  mkdir -p /root/.ssh && chmod 700 /root/.ssh
  touch /root/.ssh/authorized_keys && chmod 600 /root/.ssh/authorized_keys
  sort -u $s/keys > $s/keys.u
  n=0
  while IFS= read -r key; do       # each key once, however many times the seed gives it
    n=$((n + 1))
    grep -qxF "$key" /root/.ssh/authorized_keys || echo "$key" >> /root/.ssh/authorized_keys
  done < $s/keys.u
  echo "vmplane-guest: seed ${iid:-none} keys=$n" > /dev/console
  [ -n "$run" ] && (cd / && HOME=/root $run </dev/null > $s/user-data.log 2>&1)
}
# A CD-ROM shows on a SCSI host after init got here (its bus is scanned asynchronously): with a SCSI
# host, the seed is looked for up to ~60 s; with none, once.
( tries=0
  until dev=$(seed_find); do
    [ -n "$(ls /sys/class/scsi_host 2>/dev/null)" ] && [ $tries -lt 120 ] || exit 0
    tries=$((tries + 1))
    sleep 0.5
  done
  seed_apply "$dev" ) </dev/null >/dev/null 2>&1 &
# The QEMU guest agent (qemu-ga and its libraries, from Debian's packages: build.py) on the virtio-serial port
# org.qemu.guest_agent.0, when the domain has a virtio-serial device (vmplane's domains do) and the port shows
# (ports come from the host after the driver is up: looked for up to ~30 s). No udev here: the
# /dev/virtio-ports/NAME link udev makes is made from sysfs. The agent is started again if it ends. Its
# guest-shutdown runs `/sbin/shutdown -P|-H|-r +0 MESSAGE`, which busybox lacks: the script below syncs the
# disks and powers off (halts, reboots) at once.
rm -f /sbin/shutdown      # (were it ever a busybox applet's link, writing through it would overwrite busybox)
cat > /sbin/shutdown <<'EOF'
#!/bin/sh
sync
case "$1" in -r) reboot -f ;; -H) halt -f ;; *) poweroff -f ;; esac
EOF
chmod 755 /sbin/shutdown
agent_port() {   # the /dev node of the agent's port, once it exists
  for p in /sys/class/virtio-ports/vport*; do
    [ "$(cat $p/name 2>/dev/null)" = org.qemu.guest_agent.0 ] && [ -c /dev/${p##*/} ] && echo /dev/${p##*/} && return 0
  done
  return 1
}
if [ -x /usr/sbin/qemu-ga ] && ls /sys/bus/virtio/drivers/virtio_console/virtio* >/dev/null 2>&1; then
  ( tries=0
    until port=$(agent_port); do
      [ $tries -lt 150 ] || exit 0
      tries=$((tries + 1))
      sleep 0.2
    done
    mkdir -p /dev/virtio-ports /run/qga /var
    ln -sf $port /dev/virtio-ports/org.qemu.guest_agent.0
    [ -e /var/run ] || ln -s /run /var/run
    while :; do
      qemu-ga -m virtio-serial -p /dev/virtio-ports/org.qemu.guest_agent.0 -t /run/qga </dev/null >/dev/null 2>>/run/qga/log
      sleep 1
    done ) </dev/null >/dev/null 2>&1 &
fi
# SSH: dropbear (Debian's dropbear-bin: build.py) on port 22. Only root is in /etc/passwd; it logs in with
# the keys of /root/.ssh/authorized_keys (the seed's: none before the seed is read, none without a seed),
# never with a password (-s). Host keys are made at the first connection that needs one (-R), in
# /etc/dropbear: new ones at every boot (the root is a RAM disk). Under TCG that first connection takes ~1 s
# more, where making an ed25519 key at boot (dropbearkey) took ~1.3 s of every boot. Started again if it
# ends; its log (-E: to stderr, there is no syslog) is /run/dropbear.log.
if [ -x /usr/sbin/dropbear ]; then
  mkdir -p /etc/dropbear
  ( while :; do
      dropbear -F -E -R -s -p 22 </dev/null >/dev/null 2>>/run/dropbear.log
      sleep 1
    done ) </dev/null >/dev/null 2>&1 &
fi
# Online hot-added vCPUs (what udev does on a distribution), unless the control plane asked to keep a
# vCPU offline (soft scale-down): it lists such vCPUs in /run/vmplane-offline. Bring up hot-plugged NICs.
( while :; do
    for f in /sys/devices/system/cpu/cpu[0-9]*/online; do
      cpu=${f%/online}; cpu=${cpu##*/}
      grep -qx "$cpu" /run/vmplane-offline 2>/dev/null && continue
      [ "$(cat $f 2>/dev/null)" = 0 ] && echo 1 > $f 2>/dev/null
    done
    for nic in /sys/class/net/eth*; do
      [ -e "$nic" ] && net_up "${nic##*/}"
    done
    sleep 0.2
  done ) &
echo "VMPLANE-BOOT-OK data=$data uptime=$(cut -d' ' -f1 /proc/uptime)"
export PS1=''
# PID 1 must never end (the kernel would panic): the console shell is started again if it exits
while :; do
  stty -echo 2>/dev/null
  setsid cttyhack sh
done
