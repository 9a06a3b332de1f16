#!/usr/bin/env bash
# One synthetic 640x480 camera at 25 fps from the sender binary to the receiver binary, two
# builds in turn: the receiver's p50/p99 for the device, the sender's CPU ticks and how many
# chains the thread handing the block over posted itself (docs/benchmarks.md, "A lone lossless
# device's frames posted by the filling thread" and the section after it).
#   scripts/bench-lone-camera-ab.sh BEFORE_DIR AFTER_DIR [block|drop-oldest] [tcp|shm]
#   (directories holding `sender` and `receiver`; N pairs of SECS seconds, default 5 and 12)
set -euo pipefail
before=$(realpath "${1:?usage: $0 BEFORE_DIR AFTER_DIR [policy] [transport]}")
after=$(realpath "${2:?usage: $0 BEFORE_DIR AFTER_DIR [policy] [transport]}")
policy=${3:-block} transport=${4:-tcp} n=${N:-5} secs=${SECS:-12}
((secs >= 3)) || { echo "$0: SECS must be at least 3" >&2; exit 2; }
dir=$(mktemp -d /tmp/lone-camera.XXXXXX)
trap 'rm -rf "$dir"' EXIT
cd "$dir"
case $transport in
  shm) addr="unix:$dir/rx.sock" ;;
  tcp) addr="127.0.0.1:$((20000 + RANDOM % 20000))" ;;
  *) echo "$0: transport tcp or shm, not $transport" >&2; exit 2 ;;
esac
cat > tx.toml <<TOML
name = "edge-1"
receiver = "$addr"
transport = "$transport"
[[device]]
id = 0
source = "camera-synthetic"
width = 640
height = 480
fps = 25
policy = "$policy"
TOML
printf 'listen = "%s"\ntransport = "%s"\nkeep = 2\n' "$addr" "$transport" > rx.toml
run() {
  local b=$1 r s u st
  rm -rf out
  "$b/receiver" --config rx.toml --out out --verify --exit-after-eos > rx.log 2>&1 & r=$!
  sleep 0.5
  "$b/sender" --config tx.toml --duration "$secs" > tx.log 2>&1 & s=$!
  sleep $((secs - 1))
  read -r u st < <(awk '{print $14, $15}' "/proc/$s/stat")
  wait "$s"
  wait "$r" || { echo "$b: receiver failed (see its log):" >&2; tail -5 rx.log >&2; exit 1; }
  printf '%-8s %s cpu_ticks=%s posted_here=%s\n' "$2" \
    "$(grep -E '^edge-1/d000' rx.log | tail -1 | awk '{print "frames=" $2, "p50=" $8, "p99=" $9}')" \
    $((u + st)) "$(grep -oE '[0-9]+ posted by the thread' tx.log | cut -d' ' -f1)"
}
echo "one camera, policy $policy, over $transport: $n pairs of $secs s"
for _ in $(seq "$n"); do run "$before" before; run "$after" after; done
