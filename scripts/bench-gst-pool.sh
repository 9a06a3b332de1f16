#!/usr/bin/env bash
# The sender binary's GStreamer source with and without the send-block pool its appsink
# proposes, side by side: the same `videotestsrc` 640x480 RGB pipeline ending in `appsink`
# ("pool": videotestsrc draws each frame into a send block, or over shm into the receiver's
# memory) and with `identity drop-allocation=true` before the appsink ("copied": videotestsrc
# draws into its own buffer, which the source copies). Over TRANSPORT (shm or tcp) to the
# receiver binary (which hands them to a `fakesink`: no disk in the way), FRAMES frames,
# unthrottled (`sync=false`; `paced` as the 5th argument: a live source at 25 fps, as a camera
# is), the device's POLICY (block: the pool waits for a free send block; drop-oldest: over shm
# the frames go straight into the receiver's memory), ROUNDS rounds of the two in turn; with
# BENCH_BIN_DIRS (directories of `sender` and `receiver` binaries, e.g. an older build's), the
# two with each in turn. Prints per run the sender process's CPU seconds (GNU time, user +
# sys), the pipeline's frames per second (from the sender's first log line to its last frame
# taken; "-" for builds before 4bdaac8, which do not log that), how its frames went, and the
# receiver's latency. BENCH_PATTERN: videotestsrc's pattern (default ball, about 700 frames/s
# drawn; smpte is drawn once and copied, ten times as fast, a source that outruns the link).
# BENCH_PIN=1: the sender on core 0 and the receiver on core 1 (taskset), as on two hosts.
# A benchmark: it prints figures and asserts nothing.
#   scripts/bench-gst-pool.sh [rounds] [frames] [transport] [policy] [unthrottled|paced]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
frames=${2:-1000}
transport=${3:-shm}
policy=${4:-block}
sync=false
live=false
case ${5:-unthrottled} in
  unthrottled) ;;
  paced) sync=true live=true ;;
  *) echo "the 5th argument is unthrottled or paced, not $5" >&2; exit 2 ;;
esac
read -r -a dirs <<< "${BENCH_BIN_DIRS:-target/release}"
[[ -n ${BENCH_BIN_DIRS:-} ]] || cargo build --release -q -p rdmastream-sender -p rdmastream-receiver
work=$(mktemp -d /tmp/bench-gst-pool.XXXXXX)
trap '[[ -n ${BENCH_KEEP:-} ]] || rm -rf "$work"' EXIT
case $transport in
  shm) address="unix:$work/rx.sock" ;;
  tcp) address="127.0.0.1:$((20000 + RANDOM % 20000))" ;;
  *) echo "transport must be shm or tcp, not $transport" >&2; exit 2 ;;
esac
cat > "$work/rx.toml" <<EOF
listen = "$address"
transport = "$transport"
allow_anonymous = true
out = "$work/out"
[[device]]
id = 1
pipeline = "fakesink sync=false"
EOF
raw="videotestsrc is-live=$live pattern=${BENCH_PATTERN:-ball} num-buffers=$frames ! video/x-raw,format=RGB,width=640,height=480,framerate=25/1"
for variant in pool copied; do
  tail=""
  [[ $variant == copied ]] && tail="identity drop-allocation=true ! "
  cat > "$work/tx-$variant.toml" <<EOF
name = "gst-pool"
receiver = "$address"
transport = "$transport"
[[device]]
id = 1
source = "gstreamer"
policy = "$policy"
pipeline = "$raw ! $tail appsink sync=$sync"
EOF
done
pin_tx=() pin_rx=()
if [[ ${BENCH_PIN:-} == 1 ]]; then
  pin_tx=(taskset -c 0) pin_rx=(taskset -c 1)
fi
for ((r = 1; r <= rounds; r++)); do
  for dir in "${dirs[@]}"; do
  for variant in pool copied; do
    rm -rf "$work/out" "$work/rx.sock"
    ${pin_rx[@]+"${pin_rx[@]}"} "$dir/receiver" --config "$work/rx.toml" > "$work/rx.log" 2>&1 &
    rx=$!
    for _ in $(seq 50); do
      grep -q "listening" "$work/rx.log" 2> /dev/null && break
      sleep 0.1
    done
    /usr/bin/time -o "$work/time" -f "%U %S %e" ${pin_tx[@]+"${pin_tx[@]}"} "$dir/sender" \
      --config "$work/tx-$variant.toml" > "$work/tx.log" 2>&1 \
      || echo "sender failed: $(tail -3 "$work/tx.log")"
    sleep 0.5
    kill -INT "$rx"
    wait "$rx" || true
    read -r user sys _ < "$work/time"
    stamp() { date -d "$(grep -m1 -oE '^[0-9T:.-]+Z' <<< "$1")" +%s.%N; }
    t0=$(stamp "$(head -1 "$work/tx.log")")
    rate="- frames/s"
    if last=$(grep "frames from the pipeline" "$work/tx.log"); then
      rate=$(printf '%.0f frames/s' "$(echo "$frames / ($(stamp "$last") - $t0)" | bc -l)")
    fi
    latency=$(grep -o "latency p50 .*" "$work/rx.log" || echo "no summary")
    paths=$(grep -oE "[0-9]+ frames from the pipeline: .*" "$work/tx.log" \
      || grep -oE "\([0-9]+ written in place[^)]*\)" "$work/tx.log" || echo "?")
    ((${#dirs[@]} == 1)) || printf '%s ' "$dir"
    printf '%-6s round %d: sender CPU %.2f s, %s; %s; %s\n' \
      "$variant" "$r" "$(echo "$user + $sys" | bc)" "$rate" \
      "$paths" "$latency"
  done
  done
done
