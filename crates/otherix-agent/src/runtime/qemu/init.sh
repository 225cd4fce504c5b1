#!/bin/busybox sh
# Init of the Otherix guest image (PID 1 of a QEMU guest). The runtime gives
# the guest its identity on the kernel command line (otherix.name=,
# otherix.ip=ADDR/PREFIX, otherix.gw=) and the authorized SSH keys over
# fw_cfg (opt/otherix/authorized_keys), the way a cloud's metadata does.
# Serves HTTP on 80 (/ and /cgi-bin/uptime), echo on 7, SSH on 22, and a
# root shell on the serial console (ttyS0).
/bin/busybox --install -s /bin
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts && mount -t devpts devpts /dev/pts
for m in $(cat /etc/modules); do
  insmod "/lib/modules/$m.ko" || echo "otherix: module $m did not load"
done
arg() { for w in $(cat /proc/cmdline); do case "$w" in "$1"=*) echo "${w#*=}";; esac; done; }
NAME=$(arg otherix.name)
IP=$(arg otherix.ip)
GW=$(arg otherix.gw)
hostname "${NAME:-guest}"
ip link set lo up
i=0
while [ ! -e /sys/class/net/eth0 ] && [ $i -lt 200 ]; do usleep 50000; i=$((i+1)); done
ip link set eth0 up
[ -n "$IP" ] && ip addr add "$IP" dev eth0
[ -n "$GW" ] && ip route add default via "$GW"
mkdir -p /root/.ssh && chmod 700 /root/.ssh
KEYS=/sys/firmware/qemu_fw_cfg/by_name/opt/otherix/authorized_keys/raw
if [ -r "$KEYS" ]; then cat "$KEYS" > /root/.ssh/authorized_keys; chmod 600 /root/.ssh/authorized_keys; fi
echo "hello from ${NAME:-guest}" > /www/index.html
httpd -p 80 -h /www
nc -ll -p 7 -e cat &
mkdir -p /etc/dropbear
dropbear -R -p 22
echo "otherix guest ${NAME:-guest} ready: ${IP:-no address}"
while :; do setsid -c sh -l </dev/ttyS0 >/dev/ttyS0 2>&1; done
