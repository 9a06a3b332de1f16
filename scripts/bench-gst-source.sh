#!/usr/bin/env bash
# The sender binary with a GStreamer source (videotestsrc, 640x480 RGB at 25 fps, 200 frames,
# through appsink as a camera would come in) over shm to the receiver binary, run in turn for
# each directory of `sender` and `receiver` binaries given (default: this tree's
# target/release), ROUNDS times. Prints per run the receiver's latency p50/p99 (capture ->
# delivered) and how the sender's frames went (written in place by the source thread, of them
# straight into the receiver's memory). A benchmark: it prints figures and asserts nothing.
#   scripts/bench-gst-source.sh [rounds] [bin-dir...]
#   e.g. scripts/bench-gst-source.sh 3 /tmp/rdmastream-before-target/release target/release
# Extra sender keys (e.g. in_place_blocks = 0) come from BENCH_SENDER_KEYS.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shift || true
dirs=("$@")
if ((${#dirs[@]} == 0)); then
  cargo build --release -q -p rdmastream-sender -p rdmastream-receiver
  dirs=(target/release)
fi
work=$(mktemp -d /tmp/bench-gst-source.XXXXXX)
trap 'rm -rf "$work"' EXIT
cat > "$work/rx.toml" <<EOF
listen = "unix:$work/rx.sock"
allow_anonymous = true
out = "$work/out"
format = "raw"
keep = 10
EOF
cat > "$work/tx.toml" <<EOF
name = "gst-source"
receiver = "unix:$work/rx.sock"
${BENCH_SENDER_KEYS:-}
[[device]]
id = 1
source = "gstreamer"
pipeline = "videotestsrc is-live=true pattern=black num-buffers=200 ! video/x-raw,format=RGB,width=640,height=480,framerate=25/1 ! appsink sync=false"
EOF
for ((r = 1; r <= rounds; r++)); do
  for d in "${dirs[@]}"; do
    rm -rf "$work/out" "$work/rx.sock"
    "$d/receiver" --config "$work/rx.toml" > "$work/rx.log" 2>&1 &
    rx=$!
    for _ in $(seq 50); do [[ -S $work/rx.sock ]] && break; sleep 0.1; done
    "$d/sender" --config "$work/tx.toml" > "$work/tx.log" 2>&1 || echo "sender failed: $(tail -3 "$work/tx.log")"
    sleep 0.5
    kill -INT "$rx"
    wait "$rx" || true
    latency=$(grep -o "latency p50 .*" "$work/rx.log" || echo "no summary")
    paths=$(grep -oE "\([0-9]+ (written|rendered) in place[^)]*\)" "$work/tx.log" || true)
    printf '%s round %d: %s %s\n' "$d" "$r" "$latency" "$paths"
  done
done
