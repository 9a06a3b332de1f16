#!/usr/bin/env bash
# Runs the process-level integration tests and the GStreamer element (harness) and pipeline tests
# over real RDMA verbs:
# Soft-RoCE (rdma_rxe) inside a throwaway qemu VM (scripts/vm.sh), with host-built binaries and
# fewer, smaller frames than on the host (the VM runs under software CPU emulation). Installs what
# it needs on a fresh Debian 12 machine (through scripts/vm.sh prepare).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/vm.sh prepare
cargo build --release --quiet -p rdmastream-sender -p rdmastream-receiver
cargo build --release --quiet -p gst-plugin-rdma --lib
# Test executables are built on the host (cargo cannot run inside the VM).
test_exe() { # package test-name
  cargo test --release -p "$1" --test "$2" --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$2"
}
processes="$(test_exe rdmastream-integration processes)"
window="$(test_exe rdmastream-integration sliding_window)"
# The verbs crate's unit tests include the isolation test (protection domain per sender) and the
# verbs of the sliding-window baseline (WRITE WITH IMMEDIATE, receives, inline SEND, RNR).
core="$(cargo test --release -p rdmastream-verbs --lib --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["lib"]:
        print(m["executable"])')"
pipelines="$(test_exe gst-plugin-rdma pipelines)"
harness="$(test_exe gst-plugin-rdma harness)"
netfaults="$(test_exe rdmastream-integration netfaults)"
for exe in "$core" "$processes" "$window" "$pipelines" "$harness" "$netfaults"; do
  [ -x "$exe" ] || { echo "test-vm: could not build the test executables" >&2; exit 1; }
done
echo "== over verbs (Soft-RoCE rxe0 in a VM): $core (isolation, window verbs), $processes, $window, $pipelines, $harness"
echo "   (the V4L2 camera too: vivid, /dev/video0, capturing into rdmasink's and the sender binary's blocks)"
echo "== and $netfaults: over tcp with the VM's kernel netem (delay, reordering, loss) between two namespaces,"
echo "   over verbs the receiver killed 20 times and a full disk (Soft-RoCE cannot join two namespaces in this kernel)"
suite=0
scripts/vm.sh run --timeout "${RDMASTREAM_VM_TIMEOUT:-1500}" -- \
  env RDMASTREAM_PREBUILT=1 RDMASTREAM_IT_TRANSPORT=verbs RDMASTREAM_IT_HOST=192.0.2.1 \
  RDMASTREAM_TEST_TRANSPORT=verbs RDMASTREAM_TEST_HOST=192.0.2.1 RDMASTREAM_REQUIRE_CAMERA=1 \
  RUST_BACKTRACE=1 \
  bash -c 'run() { # seconds exe args...: one hung test binary must not eat the time of the others
      local t=$1; shift; timeout -k 10 "$t" "$@"; local r=$?
      [ $r -eq 124 ] && echo "test-vm: $1 did not finish within $t s" >&2; return $r; }
    run 120 "$1" --test-threads=1 isolation_tests window_verbs_tests; i=$?
    run 480 "$2" --test-threads=1; a=$?; run 420 "$3" --test-threads=1; b=$?
    run 360 "$4" --test-threads=1; c=$?
    RDMASTREAM_REQUIRE_NETNS=1 RDMASTREAM_REQUIRE_NETEM=1 RDMASTREAM_IT_TRANSPORT=tcp \
      run 420 "$5" --test-threads=1 delay_reordering_loss; d=$?
    run 300 "$5" --test-threads=1 twenty_receiver_kills full_disk; k=$?
    run 240 "$6" --test-threads=1; w=$?
    exit $((i | a | b | c | d | k | w))' _ "$core" "$processes" "$pipelines" "$harness" "$netfaults" "$window" ||
  suite=$?
# vm.sh's boot watchdog (a guest kernel that hangs before init is killed and booted once more):
# a first boot held with its CPUs stopped must be given up after the boot timeout and the second
# boot must run the command. Without the watchdog one such hang cost a CI run 25 minutes.
watchdog_log="$(mktemp)"
if RDMASTREAM_VM_HANG_FIRST_BOOT=1 RDMASTREAM_VM_BOOT_TIMEOUT=30 \
  scripts/vm.sh run --timeout 300 -- true 2>"$watchdog_log" &&
  grep -q "booting once more" "$watchdog_log"; then
  echo "test-vm: vm.sh's boot watchdog: a stopped first boot was killed after 30 s and the second ran"
else
  cat "$watchdog_log" >&2
  echo "test-vm: vm.sh's boot watchdog did not boot again after a stopped first boot" >&2
  suite=1
fi
rm -f "$watchdog_log"
exit "$suite"
