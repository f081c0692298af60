#!/bin/busybox sh
# PID 1 of a kspeedfs test guest (tests/vm/qemu.py builds it into the initramfs).
#
# Kernel command line knobs (all ks.*):
#   ks.name=a                   this guest's name (its files in the run share are <name>.*)
#   ks.ip=198.18.1.1/24,...     one address per NIC, in NIC order (eth0, eth1, ...)
#   ks.rxe=1                    create one rxe device per NIC (rxe0 on eth0, ...)
#   ks.loopwire=1               eth0 and eth1 are the two ends of one wire: policy-route
#                               traffic between their addresses over the wire (see below)
#   ks.keep=/tmp/x,/tmp/venv    host paths under /tmp, /run or /var/tmp (the checkout, the
#                               venv) kept visible through the tmpfs mounted over those
# The payload is /run/ks/<name>.sh on the run share; its exit status goes to
# /run/ks/<name>.rc and to the console as "KS_EXIT=<rc>".  The host's / is the guest's
# root, read-only (9p), with tmpfs on /tmp, /run and /var/tmp.
/bin/busybox mkdir -p /sbin /usr/bin /usr/sbin
/bin/busybox --install -s
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
say() { echo "[ks-init $(cut -d' ' -f1 /proc/uptime)] $*" > /dev/console; }
say "kernel up"

name=guest ip= rxe=1 loopwire=0 keep=
for kv in $(cat /proc/cmdline); do
  case "$kv" in
    ks.name=*) name=${kv#ks.name=} ;;
    ks.ip=*) ip=${kv#ks.ip=} ;;
    ks.rxe=*) rxe=${kv#ks.rxe=} ;;
    ks.loopwire=*) loopwire=${kv#ks.loopwire=} ;;
    ks.keep=*) keep=${kv#ks.keep=} ;;
  esac
done

for m in $(cat /modules.order); do
  insmod "/lib/modules/$m" 2>/dev/console || say "insmod $m failed"
done
say "modules loaded"

R=/host
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot $R || say "9p hostroot failed"
# host paths that live under the directories about to be covered by tmpfs: park a bind
# mount of each first, then put it back at the same path on top of the tmpfs
i=0
for p in $(echo "$keep" | tr ',' ' '); do
  mkdir -p /keep/$i && mount -o bind "$R$p" /keep/$i || say "keep $p failed"
  i=$((i + 1))
done
for d in tmp run var/tmp; do mount -t tmpfs tmpfs $R/$d; done
i=0
for p in $(echo "$keep" | tr ',' ' '); do
  mkdir -p "$R$p" && mount -o bind /keep/$i "$R$p" || say "keep $p failed"
  i=$((i + 1))
done
mount -t proc proc $R/proc
mount -t sysfs sysfs $R/sys
mount -t devtmpfs devtmpfs $R/dev
mkdir -p $R/dev/pts $R/dev/shm $R/run/ks
mount -t devpts devpts $R/dev/pts
mount -t tmpfs tmpfs $R/dev/shm
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 run $R/run/ks || say "9p run share failed"
in_root() { chroot $R /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin "$@"; }

ip link set lo up
n=0
for a in $(echo "$ip" | tr ',' ' '); do
  ip addr add "$a" dev eth$n && ip link set eth$n up
  n=$((n + 1))
done

if [ "$loopwire" = 1 ]; then
  # Two local addresses talk through lo, where rxe never sees the packets: send them
  # out of the NIC of the source address instead, accept them as "local" on arrival,
  # and pin the neighbours (ARP between two local addresses gets no reply).
  a0=$(echo "$ip" | cut -d, -f1 | cut -d/ -f1); a1=$(echo "$ip" | cut -d, -f2 | cut -d/ -f1)
  for c in all default eth0 eth1; do
    in_root sysctl -qw net.ipv4.conf.$c.accept_local=1 net.ipv4.conf.$c.rp_filter=0
  done
  in_root ip route replace "$a1/32" dev eth0 src "$a0" table 100
  in_root ip route replace "$a0/32" dev eth1 src "$a1" table 101
  in_root ip rule add pref 10 iif lo to "$a1" lookup 100
  in_root ip rule add pref 11 iif lo to "$a0" lookup 101
  in_root ip rule add pref 100 lookup local
  in_root ip rule del pref 0 lookup local
  in_root ip neigh replace "$a1" lladdr "$(cat /sys/class/net/eth1/address)" dev eth0 nud permanent
  in_root ip neigh replace "$a0" lladdr "$(cat /sys/class/net/eth0/address)" dev eth1 nud permanent
fi

if [ "$rxe" = 1 ]; then
  i=0
  while [ $i -lt $n ]; do
    in_root rdma link add rxe$i type rxe netdev eth$i || say "rdma link add rxe$i failed"
    i=$((i + 1))
  done
  for t in $(seq 100); do
    ok=1
    for p in /sys/class/infiniband/*/ports/1/state; do grep -q ACTIVE "$p" 2>/dev/null || ok=0; done
    [ $ok = 1 ] && break
    sleep 0.05
  done
fi
say "ready: $(ls /sys/class/infiniband 2>/dev/null | tr '\n' ' ')"

rc=125
if [ -f "$R/run/ks/$name.sh" ]; then
  chroot $R /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin HOME=/tmp \
      TERM=dumb LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 KS_GUEST=$name \
      /bin/sh -c "cd /tmp && exec /bin/sh /run/ks/$name.sh" </dev/console >/dev/console 2>&1
  rc=$?
else
  say "no payload /run/ks/$name.sh"
fi
echo "$rc" > $R/run/ks/$name.rc
say "KS_EXIT=$rc"
sync
umount $R/run/ks
poweroff -f
