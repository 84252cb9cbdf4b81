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
