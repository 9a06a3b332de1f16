#!/bin/busybox sh
# shellcheck shell=sh
#
# PID 1 of the throwaway Soft-RoCE VM started by scripts/vm.sh (copied into
# its busybox-static initramfs as /init; it is not meant to run on the host).
#
# 1. loads the kernel modules listed in /lib/modules/load.list (in order),
# 2. mounts the control share (tag "ctl": config, command, results),
# 3. mounts the host's root read-only at /host (tag "hostroot") plus the
#    writable shares listed in /ctl/shares, and proc/sys/dev/tmp/run inside,
# 4. sets up dummy0 (192.0.2.1/24) and the Soft-RoCE device rxe0 on it, with
#    the host's own `ip` and `rdma` tools (run in the chroot),
# 5. runs /ctl/cmd.sh with the host's bash in a chroot of /host, its
#    stdout/stderr on two virtio-serial ports (which the host streams live),
# 6. writes the exit status to /ctl/rc and powers off.
# Progress and errors go to the console (ttyS0); a setup failure is also
# written to /ctl/error so that the host can report it.

/bin/busybox mkdir -p /bin /sbin /usr/bin /usr/sbin /proc /sys /dev /host /ctl /run
/bin/busybox --install -s
export PATH=/sbin:/bin:/usr/sbin:/usr/bin

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
exec </dev/null >/dev/console 2>&1

STAGE=boot
CTL_OK=
P9='trans=virtio,version=9p2000.L,msize=262144'

say() { echo "vm-init: [$(cut -d' ' -f1 /proc/uptime)] $*"; }

halt_vm() {
    sync
    poweroff -f
    sleep 30
}

fail() {
    say "FAILED during $STAGE: $*"
    if [ -n "$CTL_OK" ]; then
        echo "$STAGE: $*" >/ctl/error
    fi
    dmesg | tail -n 30
    halt_vm
}

# mount_9p TAG DIR OPTIONS: retried briefly, the virtio device may still be probing.
mount_9p() {
    _i=0
    while ! mount -t 9p -o "$P9,$3" "$1" "$2" 2>/dev/null; do
        _i=$((_i + 1))
        [ "$_i" -ge 25 ] && return 1
        sleep 0.2
    done
}

# --- kernel modules -------------------------------------------------------
STAGE="loading kernel modules"
while read -r file params; do
    [ -n "$file" ] || continue
    # shellcheck disable=SC2086 # params is a word list on purpose
    insmod "/lib/modules/$file" $params || fail "insmod $file failed"
done </lib/modules/load.list

say "modules loaded"

# --- shares ----------------------------------------------------------------
STAGE="mounting the control share"
mount_9p ctl /ctl 'cache=none' || fail "cannot mount the 9p control share"
CTL_OK=1
echo booted >/ctl/stage

MTU=1500
while read -r key value; do
    case "$key" in
    MTU) MTU=$value ;;
    esac
done </ctl/config

STAGE="mounting the host root filesystem"
mount_9p hostroot /host 'ro,cache=loose' || fail "cannot mount the host root (9p, read-only)"
mount -t proc proc /host/proc || fail "mount proc"
mount -t sysfs sysfs /host/sys || fail "mount sysfs"
mount -t devtmpfs devtmpfs /host/dev || fail "mount devtmpfs"
mkdir -p /host/dev/pts /host/dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /host/dev/pts || fail "mount devpts"
mount -t tmpfs -o mode=1777 tmpfs /host/dev/shm || fail "mount /dev/shm"
mkdir -p /hosttmp
mount --bind /host/tmp /hosttmp || fail "bind the host's /tmp"
mount -t tmpfs -o mode=1777 tmpfs /host/tmp || fail "mount /tmp"
# Host directories under /tmp that must stay visible (read-only).
while read -r path; do
    [ -n "$path" ] || continue
    mkdir -p "/host$path"
    mount --bind "/hosttmp${path#/tmp}" "/host$path" || fail "bind $path"
done </ctl/binds
mount -t tmpfs -o mode=755 tmpfs /host/run || fail "mount /run"

say "host root mounted"
STAGE="mounting the writable shares"
while read -r tag path; do
    [ -n "$tag" ] || continue
    # Under /tmp (a guest tmpfs) the mount point has to be made; elsewhere it
    # exists already in the read-only view of the host.
    mkdir -p "/host$path" 2>/dev/null
    mount_9p "$tag" "/host$path" 'cache=mmap' || fail "cannot mount writable share $tag at $path"
done </ctl/shares

# --- Soft-RoCE -------------------------------------------------------------
STAGE="setting up Soft-RoCE"
# Host tools run through the host's env: busybox's chroot would run its own
# applet of the same name (ip, date, ...) instead of the host's program.
H() { chroot /host /usr/bin/env "$@" || fail "$* failed"; }
# (one `ip -batch` rather than one exec per step: exec is slow under TCG)
H ip -batch - <<EOF
link set lo up
link add dummy0 type dummy
link set dummy0 mtu $MTU
addr add 192.0.2.1/24 dev dummy0
link set dummy0 up
EOF
H rdma link add rxe0 type rxe netdev dummy0

# Wait until the port is ACTIVE and the RoCE v2 GID for 192.0.2.1 is in the
# GID table (filled in asynchronously by the kernel).
port=/sys/class/infiniband/rxe0/ports/1
want_gid=0000:0000:0000:0000:0000:ffff:c000:0201
_i=0
while :; do
    ready=
    if grep -q ACTIVE "$port/state" 2>/dev/null; then
        for g in "$port"/gids/*; do
            n=${g##*/}
            if [ "$(cat "$g" 2>/dev/null)" = "$want_gid" ] &&
                [ "$(cat "$port/gid_attrs/types/$n" 2>/dev/null)" = "RoCE v2" ]; then
                ready=1
                echo "$n" >/ctl/gid_index
                break
            fi
        done
    fi
    [ -n "$ready" ] && break
    _i=$((_i + 1))
    [ "$_i" -ge 100 ] && fail "rxe0 port not ACTIVE with an IPv4 RoCE v2 GID after 10 s (state: $(cat "$port/state" 2>/dev/null))"
    sleep 0.1
done
echo rxe-ready >/ctl/stage
say "rxe0 ready, RoCE v2 IPv4 GID index $(cat /ctl/gid_index)"

# --- the command -------------------------------------------------------------
STAGE="running the command"
# The clock came from the emulated RTC (whole seconds, up to ~1 s off): set
# it from the host's, read as the mtime the host gives a new file in /ctl,
# so that timestamps of files written on either side compare sanely.
if : >/ctl/clock; then
    t=$(stat -c '%Y %y' /ctl/clock)
    frac=${t#*.}
    chroot /host /usr/bin/env date -u -s "@${t%% *}.${frac%% *}" >/dev/null ||
        say "could not set the clock"
fi
# shellcheck disable=SC3045 # busybox ash has ulimit -l
ulimit -l unlimited || fail "ulimit -l unlimited"
cp /ctl/cmd.sh /host/run/rdmastream-vm-cmd.sh || fail "cannot copy the command script"
cut -d' ' -f1 /proc/uptime >/ctl/boot_seconds

# stdout/stderr go to two virtio-serial ports that the host streams live
# (about 40x faster than a 16550 UART under TCG).  Their names come from
# the host; the kernel may fill in the name files a moment after probing.
out=
err=
_i=0
while [ -z "$out" ] || [ -z "$err" ]; do
    for p in /sys/class/virtio-ports/*; do
        case "$(cat "$p/name" 2>/dev/null)" in
        rdmastream.stdout) out=/dev/${p##*/} ;;
        rdmastream.stderr) err=/dev/${p##*/} ;;
        esac
    done
    _i=$((_i + 1))
    [ "$_i" -ge 50 ] && fail "virtio-serial ports rdmastream.stdout/stderr not found"
    if [ -z "$out" ] || [ -z "$err" ]; then sleep 0.1; fi
done

echo running >/ctl/stage
chroot /host /usr/bin/env -i "RDMASTREAM_VM_GID_INDEX=$(cat /ctl/gid_index)" \
    /bin/bash /run/rdmastream-vm-cmd.sh <"/dev/null" >"$out" 2>"$err"
rc=$?
say "command exited with status $rc"
# Stop whatever the command left running in the background.
kill -KILL -1 2>/dev/null
sleep 0.2
echo "$rc" >/ctl/rc
echo finished >/ctl/stage
halt_vm
