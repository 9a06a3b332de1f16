#!/usr/bin/env bash
# scripts/vm.sh - run a command inside a throwaway qemu VM that has real RDMA
# verbs (Soft-RoCE, rdma_rxe), although the host kernel has none.
#
# Usage:
#   scripts/vm.sh prepare [--refresh-kernel]
#   scripts/vm.sh run [--timeout SECS] [--mem MB] [--cpus N] [--out DIR]
#                     [--rw DIR]... [--env NAME[=VALUE]]... [--mtu BYTES]
#                     [--no-target-rw] [--verbose] -- CMD [ARGS...]
#
# `run` boots Debian's own kernel (linux-image-6.1.*-amd64, extracted, never
# installed) under qemu TCG with a busybox initramfs, loads the RDMA modules
# (and vivid, a V4L2 test camera at /dev/video0: one webcam input),
# creates dummy0 = 192.0.2.1/24 and `rdma link add rxe0 type rxe netdev dummy0`,
# then runs CMD in a chroot of the host's root filesystem (shared read-only
# over 9p) in the same working directory, so host-built binaries and the
# host's rdma-core/perftest run unchanged.  Inside: proc, sys, devtmpfs, a
# tmpfs on /tmp, /run and /dev/shm, `ulimit -l unlimited`, stdin /dev/null.
# CMD's stdout/stderr are streamed live to the host's stdout/stderr and
# vm.sh exits with CMD's exit status; 124 if --timeout (default 900 s) hit
# (the VM is killed), 125 if the VM could not boot or Soft-RoCE could not be
# set up (with a message and the tail of the guest console on stderr), 2 on
# a usage error.  The command starts ~4-6 s after launch (TCG, 2 vCPUs);
# `run -- true` takes ~5-7 s in all.  A guest still booting after
# $RDMASTREAM_VM_BOOT_TIMEOUT seconds (default 120: now and then the guest
# kernel hangs before init) is killed and booted once more, within --timeout.
# --mtu sets dummy0's MTU (default 1500, so rxe0's active_mtu is 1024; 9000
# gives 4096).
#
# Writable from the guest, at the same path as on the host:
#   --out DIR   (default: a fresh temp dir, removed afterwards if left empty,
#               else its path is printed); CMD sees it as $RDMASTREAM_VM_OUT.
#   the cargo target dir ($CARGO_TARGET_DIR or <repo>/target) if it exists
#   (unless --no-target-rw), and every --rw DIR.
# Everything else of the host is read-only inside; /tmp inside is the guest's
# own (but the repo and the working directory stay visible if under /tmp).
#
# CMD's stdout/stderr inside are not terminals (virtio-serial ports), as in
# CI.  Environment passed to CMD: PATH HOME USER LOGNAME LANG LANGUAGE LC_*
# TZ CI RUST_LOG RUST_BACKTRACE RUST_LIB_BACKTRACE RUST_TEST_THREADS
# RUST_MIN_STACK CARGO_TERM_COLOR NO_COLOR, every RDMASTREAM_*, TERM=dumb,
# RDMASTREAM_VM_OUT, RDMASTREAM_VM_GID_INDEX, plus each --env NAME[=VALUE].
#
# GID index: rxe0's GID table is 0 = fe80:: link-local, 1 = ::ffff:192.0.2.1,
# both RoCE v2 (rxe has no RoCE v1).  perftest picks index 1 by itself (its
# header says "GID index : 1"); `-x 1` makes that explicit.  (-x 0 also
# connects within the one VM, but 1 is the GID of 192.0.2.1.)  The index is
# exported to CMD as RDMASTREAM_VM_GID_INDEX.  Both peers run in the one VM,
# the client connects to 192.0.2.1, e.g.:
#   scripts/vm.sh run -- bash -c 'ib_write_bw -d rxe0 -F & sleep 1;
#                                  ib_write_bw -d rxe0 -F 192.0.2.1; wait'
#
# Cache (kernel, modules, initramfs): $RDMASTREAM_VM_CACHE, default
# /var/cache/rdmastream-vm.  `prepare` fills it (and installs the needed
# Debian packages with apt-get if missing); `run` does so when needed.
# Other env: RDMASTREAM_VM_KERNEL_PKG (kernel package to use instead of the
# one linux-image-amd64 depends on), RDMASTREAM_VM_VERBOSE=1 (= --verbose:
# guest console on stderr, boot time); for debugging: RDMASTREAM_VM_APPEND
# (extra kernel command line), RDMASTREAM_VM_QEMU_ARGS (extra qemu arguments),
# RDMASTREAM_VM_HANG_FIRST_BOOT=1 (the first boot starts with its CPUs stopped,
# to see the boot watchdog retry),
# RDMASTREAM_VM_CPU (qemu's -cpu model, default qemu64: under TCG it moved 1.3-1.75x the
# bytes of `-cpu max` through rxe, 30-40 against 23 MB/s for ib_write_bw at 1 MiB in
# alternating boots, as max has the guest kernel use instructions TCG emulates slowly).
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
REPO_DIR="$(cd "$SCRIPT_DIR/.." && pwd -P)"
readonly SCRIPT_DIR REPO_DIR
readonly INIT_SCRIPT="$SCRIPT_DIR/vm/init.sh"
CACHE_DIR="${RDMASTREAM_VM_CACHE:-/var/cache/rdmastream-vm}"
readonly CACHE_DIR
readonly PACKAGES=(qemu-system-x86 busybox-static kmod cpio rdma-core ibverbs-utils
    ibverbs-providers libibverbs1 perftest iproute2 xz-utils)
# Loaded in this order, each after its dependencies.
# veth and sch_netem: the network-fault test (delay, reordering) between two namespaces.
# vivid: a V4L2 test camera (/dev/video0, one webcam input), so that v4l2src runs against a real
# kernel driver (the camera pipeline tests).
readonly MODULES=(crc32_generic virtio_pci virtio_console 9pnet_virtio 9p dummy rdma_rxe ib_uverbs rdma_ucm
    veth sch_netem vivid)
# Bump when the layout of the cached initramfs changes.
readonly INITRD_FORMAT=1
readonly ENV_PASS=(PATH HOME USER LOGNAME LANG LANGUAGE TZ CI RUST_LOG RUST_BACKTRACE
    RUST_LIB_BACKTRACE RUST_TEST_THREADS RUST_MIN_STACK CARGO_TERM_COLOR NO_COLOR)

VERBOSE="${RDMASTREAM_VM_VERBOSE:-0}"
[[ "$VERBOSE" == 1 ]] || VERBOSE=0

log() { printf 'vm.sh: %s\n' "$*" >&2; }
vlog() { if [[ "$VERBOSE" == 1 ]]; then log "$@"; fi; }
die() {
    log "error: $*"
    exit 125
}
usage_error() {
    log "error: $*"
    exit 2
}

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
}

as_root() {
    if [[ $EUID -eq 0 ]]; then
        "$@"
    elif command -v sudo >/dev/null; then
        sudo "$@"
    else
        die "need root for: $*"
    fi
}

# --- host packages ---------------------------------------------------------

APT_UPDATED=0
apt_update() {
    [[ $APT_UPDATED == 1 ]] && return 0
    local i
    for i in 1 2 3 4 5 6; do
        if as_root apt-get -qq -o DPkg::Lock::Timeout=300 update >/dev/null; then
            APT_UPDATED=1
            return 0
        fi
        log "apt-get update failed (try $i), retrying"
        sleep 10
    done
    die "apt-get update failed"
}

ensure_packages() {
    local -a missing=()
    local p status
    # One dpkg-query for all: "name status" for the installed ones.
    declare -A ok=()
    while read -r p status; do
        [[ "$status" == ii ]] && ok[$p]=1
    done < <(dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' "${PACKAGES[@]}" 2>/dev/null || true)
    for p in "${PACKAGES[@]}"; do
        [[ -n "${ok[$p]:-}" ]] || missing+=("$p")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    log "installing ${missing[*]}"
    apt_update
    if ! as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends -o DPkg::Lock::Timeout=300 "${missing[@]}" \
        >"$CACHE_DIR/apt-install.log" 2>&1; then
        tail -n 20 "$CACHE_DIR/apt-install.log" >&2
        die "apt-get install ${missing[*]} failed"
    fi
}

# --- kernel and initramfs ----------------------------------------------------

# The kernel package linux-image-amd64 currently depends on (or the override).
kernel_package() {
    if [[ -n "${RDMASTREAM_VM_KERNEL_PKG:-}" ]]; then
        echo "$RDMASTREAM_VM_KERNEL_PKG"
        return 0
    fi
    apt-cache depends linux-image-amd64 2>/dev/null |
        awk '!found && $1 == "Depends:" && $2 ~ /^linux-image-[0-9].*-amd64$/ { print $2; found = 1 }'
}

# download_kernel DIR: prints the package name; the .deb lands in DIR.
download_kernel() {
    local dir="$1" pkg
    pkg="$(kernel_package)"
    if [[ -n "$pkg" ]] && (cd "$dir" &&
        apt-get download -qq -o APT::Sandbox::User=root "$pkg" >/dev/null 2>&1); then
        echo "$pkg"
        return 0
    fi
    # Package lists missing or stale (an old kernel is gone from the archive).
    apt_update
    pkg="$(kernel_package)"
    [[ -n "$pkg" ]] || die "cannot tell which kernel package linux-image-amd64 depends on"
    (cd "$dir" && apt-get download -qq -o APT::Sandbox::User=root "$pkg" >/dev/null) ||
        die "apt-get download $pkg failed"
    echo "$pkg"
}

# bzImage -> uncompressed ELF vmlinux.  qemu boots that directly through its
# PVH entry point, which under TCG saves the ~4 s the kernel would spend
# decompressing itself (Debian's kernel is xz-compressed).
extract_vmlinux() {
    local img="$1" out="$2" off
    while read -r off; do
        # (xz stops reading after the stream: no pipe, or pipefail trips on tail's SIGPIPE)
        if xz -dc --single-stream < <(tail -c +"$((off + 1))" "$img") >"$out" 2>/dev/null &&
            [[ "$(head -c 4 "$out" | od -An -c | tr -d ' ')" == 177ELF ]]; then
            return 0
        fi
    done < <(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$img" | cut -d: -f1)
    rm -f "$out"
    return 1
}

# Prints the modules to load, dependencies first: "name path-in-tree".
module_closure() {
    local root="$1" kver="$2"
    declare -A seen=()
    local -a order=()
    visit() {
        local m="${1//-/_}" file deps d
        [[ -n "${seen[$m]:-}" ]] && return 0
        seen[$m]=1
        file="$(modinfo -b "$root" -k "$kver" -F filename "$m" 2>/dev/null | head -n1)" ||
            true
        [[ -n "$file" ]] || die "module $m not found in kernel $kver"
        if [[ "$file" == "(builtin)" ]]; then
            return 0
        fi
        deps="$(modinfo -b "$root" -k "$kver" -F depends "$m")"
        for d in ${deps//,/ }; do
            visit "$d"
        done
        order+=("$m ${file#"$root"/lib/modules/"$kver"/}")
    }
    local m
    for m in "${MODULES[@]}"; do
        visit "$m"
    done
    printf '%s\n' "${order[@]}"
}

# Downloads and unpacks the kernel package into $CACHE_DIR/kernel.
fetch_kernel() {
    local pkg work kver name rel
    work="$(mktemp -d "$CACHE_DIR/work.XXXXXX")"
    pkg="$(download_kernel "$work")"
    log "unpacking kernel package $pkg (not installing it)"
    dpkg-deb -x "$work"/*.deb "$work/root"
    kver="$(ls "$work/root/lib/modules")"
    [[ -n "$kver" && -f "$work/root/boot/vmlinuz-$kver" ]] || die "no kernel found in $pkg"
    depmod -b "$work/root" "$kver"

    rm -rf "$work/kernel"
    mkdir -p "$work/kernel/modules"
    cp "$work/root/boot/vmlinuz-$kver" "$work/kernel/vmlinuz"
    extract_vmlinux "$work/kernel/vmlinuz" "$work/kernel/vmlinux" ||
        log "note: could not unpack an ELF vmlinux, booting the bzImage (slower under TCG)"
    : >"$work/kernel/load.list"
    module_closure "$work/root" "$kver" >"$work/closure"
    while read -r name rel; do
        local flat="${name}.ko" src="$work/root/lib/modules/$kver/$rel"
        case "$rel" in
        *.ko) cp "$src" "$work/kernel/modules/$flat" ;;
        *.ko.xz) xz -dc "$src" >"$work/kernel/modules/$flat" ;;
        *.ko.zst) zstd -qdc "$src" >"$work/kernel/modules/$flat" ;;
        *.ko.gz) gzip -dc "$src" >"$work/kernel/modules/$flat" ;;
        *) die "unexpected module file $rel" ;;
        esac
        local params=""
        [[ "$name" == dummy ]] && params="numdummies=0"
        [[ "$name" == vivid ]] && params="n_devs=1 node_types=0x1 num_inputs=1 input_types=0x0"
        echo "$flat $params" >>"$work/kernel/load.list"
    done <"$work/closure"
    echo "$kver" >"$work/kernel/kver"
    echo "${MODULES[*]}" >"$work/kernel/modules.wanted"
    echo "$pkg $(dpkg-deb -f "$work"/*.deb Version)" >"$work/kernel/package"
    rm -rf "$CACHE_DIR/kernel"
    mv "$work/kernel" "$CACHE_DIR/kernel"
    rm -rf "$work"
}

initrd_stamp() {
    {
        echo "format $INITRD_FORMAT"
        cat "$CACHE_DIR/kernel/package" "$CACHE_DIR/kernel/load.list"
        sha256sum "$INIT_SCRIPT" /bin/busybox | cut -d' ' -f1
    } | sha256sum | cut -d' ' -f1
}

build_initrd() {
    local stage
    stage="$(mktemp -d "$CACHE_DIR/work.XXXXXX")"
    mkdir -p "$stage"/{bin,sbin,usr/bin,usr/sbin,proc,sys,dev,host,ctl,run,lib/modules}
    cp /bin/busybox "$stage/bin/busybox"
    cp "$INIT_SCRIPT" "$stage/init"
    chmod 755 "$stage/init" "$stage/bin/busybox"
    cp "$CACHE_DIR/kernel/modules/"*.ko "$CACHE_DIR/kernel/load.list" "$stage/lib/modules/"
    (cd "$stage" && find . -print0 | LC_ALL=C sort -z |
        cpio --null -o -H newc --quiet -R 0:0) >"$CACHE_DIR/initrd.cpio.tmp"
    mv "$CACHE_DIR/initrd.cpio.tmp" "$CACHE_DIR/initrd.cpio"
    initrd_stamp >"$CACHE_DIR/initrd.stamp"
    rm -rf "$stage"
}

cache_ready() {
    [[ -f "$CACHE_DIR/kernel/vmlinuz" && -f "$CACHE_DIR/initrd.cpio" &&
        -f "$CACHE_DIR/initrd.stamp" ]] || return 1
    [[ "$(cat "$CACHE_DIR/initrd.stamp")" == "$(initrd_stamp)" ]]
}

prepare() {
    local refresh_kernel=0
    while [[ $# -gt 0 ]]; do
        case "$1" in
        --refresh-kernel) refresh_kernel=1 ;;
        -h | --help) usage; exit 0 ;;
        *) usage_error "prepare: unknown argument $1" ;;
        esac
        shift
    done
    if [[ ! -d "$CACHE_DIR" ]]; then
        as_root mkdir -p "$CACHE_DIR"
        [[ $EUID -eq 0 ]] || as_root chown "$(id -u):$(id -g)" "$CACHE_DIR"
    fi
    [[ -w "$CACHE_DIR" ]] || die "cache dir $CACHE_DIR is not writable (set RDMASTREAM_VM_CACHE)"
    local lock_fd
    exec {lock_fd}>"$CACHE_DIR/lock"
    flock "$lock_fd"
    rm -rf "$CACHE_DIR"/work.*
    ensure_packages
    if [[ $refresh_kernel == 1 || ! -f "$CACHE_DIR/kernel/vmlinuz" ||
        "$(cat "$CACHE_DIR/kernel/modules.wanted" 2>/dev/null)" != "${MODULES[*]}" ]] ||
        [[ -n "${RDMASTREAM_VM_KERNEL_PKG:-}" &&
            "$(cut -d' ' -f1 "$CACHE_DIR/kernel/package")" != "$RDMASTREAM_VM_KERNEL_PKG" ]]; then
        fetch_kernel
    fi
    if ! cache_ready; then
        build_initrd
        vlog "initramfs built for kernel $(cat "$CACHE_DIR/kernel/package")"
    fi
    exec {lock_fd}>&-
}

# --- run ---------------------------------------------------------------------

RUN_TMP=""
OUT_TEMP=""
QEMU_PID=""
RELAY_PIDS=()
# stop_qemu: ends the VM of QEMU_PID (timeout(1)'s pid; qemu's own is in its -pidfile).
stop_qemu() {
    local -a pids=()
    local p
    [[ -n "$QEMU_PID" ]] || return 0
    pids+=("$QEMU_PID")
    if [[ -s "$RUN_TMP/qemu.pid" ]]; then
        pids+=("$(cat "$RUN_TMP/qemu.pid")")
    fi
    kill -TERM "${pids[@]}" 2>/dev/null || true
    local i alive
    for ((i = 0; i < 50; i++)); do
        alive=0
        for p in "${pids[@]}"; do
            if kill -0 "$p" 2>/dev/null; then alive=1; fi
        done
        [[ $alive == 1 ]] || break
        sleep 0.1
    done
    kill -KILL "${pids[@]}" 2>/dev/null || true
}

# stop_relays: the relays see EOF once qemu is gone; if qemu never opened the
# fifos they are still blocked in open(): give them a moment, then stop them.
stop_relays() {
    local p t
    for p in "${RELAY_PIDS[@]}"; do
        for ((t = 0; t < 10; t++)); do
            kill -0 "$p" 2>/dev/null || break
            sleep 0.2
        done
        kill "$p" 2>/dev/null || true
        wait "$p" 2>/dev/null || true
    done
    RELAY_PIDS=()
}

cleanup() {
    stop_qemu
    local p
    for p in "${RELAY_PIDS[@]}"; do
        kill "$p" 2>/dev/null || true
    done
    if [[ -n "$RUN_TMP" ]]; then
        rm -rf "$RUN_TMP"
    fi
    if [[ -n "$OUT_TEMP" ]] && ! rmdir "$OUT_TEMP" 2>/dev/null; then
        log "guest output kept in $OUT_TEMP"
    fi
}

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

# check_range OPTION VALUE MIN MAX
check_range() {
    if ! is_uint "$2" || ((10#$2 < $3 || 10#$2 > $4)); then
        usage_error "$1 must be a number from $3 to $4"
    fi
}

run() {
    local timeout=900 mem=2048 cpus=2 mtu=1500 out="" target_rw=1
    local -a rw=() envs=()
    while [[ $# -gt 0 ]]; do
        case "$1" in
        --timeout) timeout="${2:?--timeout needs a value}"; shift ;;
        --mem) mem="${2:?--mem needs a value}"; shift ;;
        --cpus) cpus="${2:?--cpus needs a value}"; shift ;;
        --mtu) mtu="${2:?--mtu needs a value}"; shift ;;
        --out) out="${2:?--out needs a value}"; shift ;;
        --rw) rw+=("${2:?--rw needs a value}"); shift ;;
        --env) envs+=("${2:?--env needs a value}"); shift ;;
        --no-target-rw) target_rw=0 ;;
        -v | --verbose) VERBOSE=1 ;;
        -h | --help) usage; exit 0 ;;
        --) shift; break ;;
        *) usage_error "run: unknown option $1 (the command goes after --)" ;;
        esac
        shift
    done
    [[ $# -gt 0 ]] || usage_error "run: no command given (scripts/vm.sh run [options] -- CMD ARGS...)"
    [[ "$timeout" =~ ^[1-9][0-9]*$ ]] || usage_error "--timeout must be a positive number of seconds"
    check_range --mem "$mem" 256 1048576
    check_range --cpus "$cpus" 1 64
    check_range --mtu "$mtu" 1280 9000

    local cwd
    cwd="$(pwd -P)"
    prepare

    trap cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    RUN_TMP="$(mktemp -d "${TMPDIR:-/tmp}/rdmastream-vm.XXXXXX")"
    local ctl="$RUN_TMP/ctl"
    mkdir -p "$ctl"

    if [[ -z "$out" ]]; then
        out="$(mktemp -d "${TMPDIR:-/tmp}/rdmastream-vm-out.XXXXXX")"
        OUT_TEMP="$out"
    else
        mkdir -p "$out"
        out="$(cd "$out" && pwd -P)"
    fi

    # Writable shares: tag<space>path, one a line.
    local -a shares=("$out") share_args=()
    local target="${CARGO_TARGET_DIR:-$REPO_DIR/target}"
    if [[ $target_rw == 1 && -d "$target" ]]; then
        shares+=("$(cd "$target" && pwd -P)")
    fi
    local d
    for d in "${rw[@]}"; do
        [[ -d "$d" ]] || die "--rw $d: not a directory"
        shares+=("$(cd "$d" && pwd -P)")
    done
    # Sorted and unique, so that a share inside another is mounted after it.
    mapfile -t shares < <(printf '%s\n' "${shares[@]}" | LC_ALL=C sort -u)
    : >"$ctl/shares"
    local i=0
    for d in "${shares[@]}"; do
        [[ "$d" != *[[:space:]]* ]] || die "writable share path with whitespace is not supported: $d"
        [[ "$d" != / ]] || die "cannot share / writable"
        echo "rw$i $d" >>"$ctl/shares"
        share_args+=(-virtfs "local,path=$d,mount_tag=rw$i,security_model=none,multidevs=remap")
        i=$((i + 1))
    done

    printf 'MTU %s\n' "$mtu" >"$ctl/config"

    # The guest sees the host's HOME read-only, so GStreamer cannot write its plugin registry
    # there: on a machine where no GStreamer program has run yet, every process in the guest
    # rescans all plugins (6-9 s each under TCG, measured 2026-12-03), pipelines start after
    # gst-bench's warm-up and a tcpclientsrc finds no server yet. Writing the registry on the
    # host first (well under a second) gives the guest a valid one to read.
    if command -v gst-inspect-1.0 >/dev/null 2>&1; then
        gst-inspect-1.0 >/dev/null 2>&1 || vlog "gst-inspect-1.0 on the host failed; the guest will scan plugins itself"
    fi

    # /tmp inside is the guest's tmpfs; a working directory or a repo (a CI
    # clone, say) under the host's /tmp stays visible there (read-only).
    : >"$ctl/binds"
    local bound=""
    for d in "$REPO_DIR" "$cwd"; do
        if [[ "$d" == /tmp/* ]] && [[ -z "$bound" || ( "$d" != "$bound" && "$d" != "$bound"/* ) ]]; then
            [[ "$d" != *[[:space:]]* ]] || die "a path under /tmp with whitespace is not supported: $d"
            echo "$d" >>"$ctl/binds"
            bound="$d"
        fi
    done

    # The command script, run by the host's bash in the chroot.
    {
        echo '# generated by scripts/vm.sh'
        local name
        for name in "${ENV_PASS[@]}"; do
            if [[ -n "${!name+x}" ]]; then
                printf 'export %s=%q\n' "$name" "${!name}"
            fi
        done
        while IFS= read -r name; do
            printf 'export %s=%q\n' "$name" "${!name}"
        done < <(compgen -e | grep -E '^(RDMASTREAM_|LC_)' || true)
        echo 'export TERM=dumb'
        printf 'export RDMASTREAM_VM_OUT=%q\n' "$out"
        local e
        for e in "${envs[@]}"; do
            if [[ "$e" == *=* ]]; then
                [[ "${e%%=*}" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || usage_error "--env $e: bad name"
                printf 'export %s=%q\n' "${e%%=*}" "${e#*=}"
            else
                [[ "$e" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || usage_error "--env $e: bad name"
                [[ -n "${!e+x}" ]] && printf 'export %s=%q\n' "$e" "${!e}"
            fi
        done
        printf 'umask %s\n' "$(umask)"
        printf 'cd -- %q || { echo "vm.sh: cannot enter the working directory inside the VM" >&2; exit 125; }\n' "$cwd"
        printf 'exec'
        printf ' %q' "$@"
        printf '\n'
    } >"$ctl/cmd.sh"

    # Live output: guest virtio-serial ports -> fifos -> host stdout/stderr.
    local fifo
    for fifo in stdout stderr; do
        mkfifo "$RUN_TMP/$fifo.in" "$RUN_TMP/$fifo.out"
    done
    local console="$RUN_TMP/console.log"

    local append="console=ttyS0 quiet loglevel=4 panic=-1 rdinit=/init"
    append+="${RDMASTREAM_VM_APPEND:+ $RDMASTREAM_VM_APPEND}"
    local -a extra=()
    read -r -a extra <<<"${RDMASTREAM_VM_QEMU_ARGS:-}"
    local kernel="$CACHE_DIR/kernel/vmlinuz"
    [[ -f "$CACHE_DIR/kernel/vmlinux" ]] && kernel="$CACHE_DIR/kernel/vmlinux"
    # shellcheck disable=SC2054 # commas are qemu's
    local -a qemu=(qemu-system-x86_64
        -accel tcg,thread=multi -cpu "${RDMASTREAM_VM_CPU:-qemu64}" -smp "$cpus" -m "$mem"
        -nographic -nodefaults -no-user-config -monitor none -no-reboot -nic none
        -pidfile "$RUN_TMP/qemu.pid"
        -kernel "$kernel" -initrd "$CACHE_DIR/initrd.cpio" -append "$append"
        -serial "file:$console" -fw_cfg name=etc/sercon-port,string=0
        -device virtio-serial-pci,id=vser0
        -chardev "pipe,id=out,path=$RUN_TMP/stdout"
        -device virtserialport,bus=vser0.0,chardev=out,name=rdmastream.stdout
        -chardev "pipe,id=err,path=$RUN_TMP/stderr"
        -device virtserialport,bus=vser0.0,chardev=err,name=rdmastream.stderr
        -virtfs "local,path=$ctl,mount_tag=ctl,security_model=none"
        -virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"
        "${share_args[@]}" "${extra[@]}")

    # The boot watchdog: now and then (once in some forty CI runs under TCG; KVM always here)
    # the guest kernel hangs before init runs, and the VM would sit until --timeout (25 min in
    # CI).  A guest that has not mounted the control share after boot_timeout seconds (it
    # normally does so within 4-6 s) is killed and booted once more, within what is left of
    # --timeout.  RDMASTREAM_VM_HANG_FIRST_BOOT=1 starts the first attempt with its CPUs
    # stopped (qemu -S), to try the watchdog.
    local boot_timeout="${RDMASTREAM_VM_BOOT_TIMEOUT:-120}"
    [[ "$boot_timeout" =~ ^[1-9][0-9]*$ ]] || usage_error "RDMASTREAM_VM_BOOT_TIMEOUT must be a positive number of seconds"
    local start=$SECONDS attempt=1 attempt_start left qemu_rc hung
    local -a hang=()
    while :; do
        rm -f "$ctl/stage" "$ctl/rc" "$ctl/error" "$ctl/boot_seconds" "$RUN_TMP/qemu.pid"
        : >"$console"
        # If the reader goes away (`vm.sh run ... | head`), the rest is drained
        # so that the guest does not block on a full port until the timeout.
        RELAY_PIDS=()
        { cat || cat >/dev/null; } <"$RUN_TMP/stdout.out" &
        RELAY_PIDS+=("$!")
        { cat >&2 || cat >/dev/null; } <"$RUN_TMP/stderr.out" &
        RELAY_PIDS+=("$!")
        hang=()
        if [[ $attempt == 1 && "${RDMASTREAM_VM_HANG_FIRST_BOOT:-0}" == 1 ]]; then hang=(-S); fi

        attempt_start=$SECONDS
        left=$((timeout - (attempt_start - start)))
        ((left > 0)) || left=1
        vlog "booting $(cat "$CACHE_DIR/kernel/package") (timeout ${left}s, attempt $attempt)"
        # timeout(1) kills a VM still running at the deadline (TERM, then KILL).
        timeout --kill-after=5 "$left" "${qemu[@]}" "${hang[@]}" </dev/null >"$RUN_TMP/qemu.log" 2>&1 &
        QEMU_PID=$!
        if [[ "$VERBOSE" == 1 ]]; then
            tail -n +1 -s 0.2 --pid="$QEMU_PID" -f "$console" >&2 &
            RELAY_PIDS+=("$!")
        fi
        # Watched only until the guest has mounted its control share; then waited for.
        hung=0
        while [[ ! -f "$ctl/stage" ]] && kill -0 "$QEMU_PID" 2>/dev/null; do
            if ((SECONDS - attempt_start >= boot_timeout)); then
                hung=1
                stop_qemu
                break
            fi
            sleep 0.5
        done
        qemu_rc=0
        wait "$QEMU_PID" || qemu_rc=$?
        QEMU_PID=""
        stop_relays
        if [[ $hung == 1 ]]; then
            log "warning: the guest had not booted after ${boot_timeout}s (attempt $attempt); VM killed"
            show_console "$console"
            if [[ $attempt == 1 ]] && ((SECONDS - start + boot_timeout < timeout)); then
                attempt=2
                log "booting once more"
                continue
            fi
            if [[ $attempt == 1 ]]; then
                log "error: the VM did not boot, and --timeout ${timeout}s leaves no time for a second boot"
            else
                log "error: the VM did not boot twice in a row"
            fi
            exit 125
        fi
        break
    done

    local elapsed=$((SECONDS - start))
    if [[ -f "$ctl/boot_seconds" ]]; then
        vlog "guest ready after $(cat "$ctl/boot_seconds") s of guest uptime; VM ran ${elapsed} s in all"
    fi

    if [[ -f "$ctl/rc" ]]; then
        local rc
        rc="$(cat "$ctl/rc")"
        is_uint "$rc" || rc=125
        exit "$rc"
    fi

    local stage="booting"
    [[ -f "$ctl/stage" ]] && stage="$(cat "$ctl/stage")"
    if [[ $qemu_rc == 124 || $qemu_rc == 137 ]]; then
        if [[ "$stage" == running ]]; then
            log "error: timed out after ${timeout}s: the command did not finish; VM killed"
        else
            log "error: timed out after ${timeout}s before the command started (guest stage: $stage); VM killed"
            show_console "$console"
        fi
        exit 124
    fi
    if [[ -f "$ctl/error" ]]; then
        log "error: VM setup failed: $(cat "$ctl/error")"
    elif [[ "$stage" == booting ]]; then
        log "error: the VM failed to boot (qemu exit status $qemu_rc)"
    else
        log "error: the VM stopped unexpectedly (stage: $stage, qemu exit status $qemu_rc)"
    fi
    # (less the warning that -fw_cfg etc/sercon-port always gives)
    if grep -qv 'sercon-port' "$RUN_TMP/qemu.log"; then
        log "qemu said:"
        grep -v 'sercon-port' "$RUN_TMP/qemu.log" | sed 's/^/  /' >&2
    fi
    show_console "$console"
    exit 125
}

show_console() {
    [[ "$VERBOSE" == 1 ]] && return 0
    if [[ ! -s "$1" ]]; then
        log "the guest console stayed empty (the kernel printed nothing)"
        return 0
    fi
    log "last lines of the guest console:"
    tail -n 40 "$1" | sed -e $'s/\x1b\\[[0-9;?]*[A-Za-z]//g' -e $'s/\x1bc//g' -e 's/^/  | /' >&2
}

main() {
    local cmd="${1:-}"
    [[ $# -gt 0 ]] && shift
    case "$cmd" in
    prepare) prepare "$@" ;;
    run) run "$@" ;;
    -h | --help | help) usage ;;
    "") usage >&2; exit 2 ;;
    *) log "unknown command $cmd"; usage >&2; exit 2 ;;
    esac
}

main "$@"
