#!/bin/sh
# /init of vmplane's test guest (busybox only). Answers commands on the serial console (ttyS0).
/bin/busybox mkdir -p /proc /sys /dev /tmp /run /bin /sbin /usr/bin /usr/sbin
/bin/busybox --install -s
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/shm /dev/pts
mount -t tmpfs -o size=90% tmpfs /dev/shm
dmesg -n 1                     # keep kernel messages off the console the control plane reads
for m in $(cat /lib/modules/load-order); do      # dependencies first (written by the build)
  insmod /lib/modules/$m.ko 2>/dev/null
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
# vCPU offline (soft scale-down): it lists such vCPUs in /run/vmplane-offline.
( while :; do
    for f in /sys/devices/system/cpu/cpu[0-9]*/online; do
      cpu=${f%/online}; cpu=${cpu##*/}
      grep -qx "$cpu" /run/vmplane-offline 2>/dev/null && continue
      [ "$(cat $f 2>/dev/null)" = 0 ] && echo 1 > $f 2>/dev/null
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
