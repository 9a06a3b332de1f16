#!/usr/bin/env bash
# Cameras falling due together through rdmasink elements that share one connection: CAMERAS
# (default 12) live `videotestsrc` 640x480 RGB streams at 25 fps in one `gst-launch-1.0`
# pipeline (one clock, so their frames fall due at the same instants), each ending in its own
# `rdmasink` (device 1..CAMERAS, one sender name: one connection, one queue pair), to the
# receiver binary, which hands every device's frames to a `fakesink`. By default each buffer
# comes from upstream's own pool (`identity drop-allocation=true`), as a V4L2 camera's mmap
# buffers do, so `render` copies it; BENCH_POOL=1 lets upstream draw into rdmasink's pool.
# FRAMES frames per camera, over TRANSPORT (shm or tcp), the sinks' POLICY (drop-oldest or
# block), ROUNDS rounds. BENCH_PLUGIN_DIRS: directories each holding a libgstrdma.so (e.g. an
# older build's), run in turn per round (default: this tree's, target/release); the receiver is
# BENCH_RECEIVER (default target/release/receiver, the same for every build). Prints per run
# the sender's CPU seconds (GNU time, user + sys), the frames the receiver took and its latency
# capture -> delivered over all devices, and how many of the frames `render` copied waited for a
# block to copy into (the sinks' last `stats`, every 500 ms: the final half second may be
# missing). A benchmark: it prints figures and asserts nothing.
#   scripts/bench-gst-cameras.sh [rounds] [frames] [transport] [policy]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
frames=${2:-250}
transport=${3:-shm}
policy=${4:-drop-oldest}
cameras=${CAMERAS:-12}
case $transport in shm | tcp) ;; *) echo "transport must be shm or tcp, not $transport" >&2; exit 2 ;; esac
case $policy in drop-oldest | block) ;; *) echo "policy must be drop-oldest or block, not $policy" >&2; exit 2 ;; esac
command -v gst-launch-1.0 > /dev/null || { echo "gst-launch-1.0 is missing (apt-get install gstreamer1.0-tools)" >&2; exit 2; }
work=$(mktemp -d /tmp/bench-gst-cameras.XXXXXX)
trap '[[ -n ${BENCH_KEEP:-} ]] || rm -rf "$work"' EXIT
if [[ -z ${BENCH_PLUGIN_DIRS:-} ]]; then
  cargo build --release -q -p gst-plugin-rdma -p rdmastream-receiver
  # Only the plugin: GStreamer scans a plugin directory's other libraries too.
  mkdir -p "$work/plugin"
  cp target/release/libgstrdma.so "$work/plugin/"
  BENCH_PLUGIN_DIRS="$work/plugin"
fi
read -r -a dirs <<< "$BENCH_PLUGIN_DIRS"
for d in "${dirs[@]}"; do
  [[ -f $d/libgstrdma.so ]] || { echo "$d holds no libgstrdma.so" >&2; exit 2; }
done
receiver=${BENCH_RECEIVER:-target/release/receiver}
[[ -x $receiver ]] || cargo build --release -q -p rdmastream-receiver
tail="! "
[[ -n ${BENCH_POOL:-} ]] || tail="! identity drop-allocation=true ! "
run() {
  local dir=$1 round=$2 w
  w=$(mktemp -d "$work/run.XXXXXX")
  local port=$((20000 + RANDOM % 20000)) listen dest
  if [[ $transport == tcp ]]; then
    listen="127.0.0.1:$port" dest="host=127.0.0.1 port=$port transport=tcp"
  else
    listen="unix:$w/rx.sock" dest="host=unix:$w/rx.sock"
  fi
  {
    echo "listen = \"$listen\""
    echo "transport = \"$transport\""
    echo 'allow_anonymous = true'
    echo "out = \"$w/out\""
    for d in $(seq 1 "$cameras"); do
      printf '[[device]]\nid = %d\npipeline = "fakesink sync=false"\n' "$d"
    done
  } > "$w/rx.toml"
  "$receiver" --config "$w/rx.toml" > "$w/rx.log" 2>&1 &
  local rx=$!
  for _ in $(seq 200); do
    grep -q "listening" "$w/rx.log" 2> /dev/null && break
    sleep 0.05
  done
  local p=()
  for d in $(seq 1 "$cameras"); do
    # shellcheck disable=SC2206 # the pipeline's words
    p+=(videotestsrc is-live=true pattern=ball num-buffers="$frames"
      ! video/x-raw,format=RGB,width=640,height=480,framerate=25/1 $tail
      rdmasink $dest device-id="$d" drop-policy="$policy" sender-name=cameras sync=false
      stats-interval=500)
  done
  GST_PLUGIN_PATH=$dir /usr/bin/time -f "%U %S" -o "$w/time" gst-launch-1.0 -m "${p[@]}" \
    > "$w/tx.log" 2>&1 || { echo "gst-launch-1.0 failed:" >&2; tail -5 "$w/tx.log" >&2; }
  sleep 1
  kill -INT "$rx" 2> /dev/null || true
  wait "$rx" || true
  local cpu got lat
  cpu=$(awk '{printf "%.2f", $1 + $2}' "$w/time")
  got=$(grep -oE "[0-9]+ frames received" "$w/rx.log" | awk '{s += $1} END {print s + 0}')
  lat=$(grep -E "summary: .*latency p50" "$w/rx.log" | tail -1 | grep -oE "latency p50 [0-9.]+ ms p99 [0-9.]+ ms" || echo "no latency")
  # The sinks' last stats: copies `render` made and those that waited for a block (builds
  # before `copies-waited` have none: n/a).
  local waits
  waits=$( { grep -E 'application/x-rdmasink-stats' "$w/tx.log" || true; } | awk '
    # The value of stats field `name` on this line, or -1 without it.
    function field(name,   v) {
      if (!match($0, name "=\\(guint64\\)[0-9]+")) return -1
      v = substr($0, RSTART, RLENGTH); sub(/.*\)/, "", v); return v + 0
    }
    match($0, /element "rdmasink[0-9]+"/) {
      e = substr($0, RSTART, RLENGTH)
      c[e] = field("frames-copied")
      if ((v = field("copies-waited")) >= 0) { w[e] = v; has = 1 }
    }
    END {
      for (e in c) { tc += c[e]; tw += w[e] }
      if (has) printf "%d of %d copies waited for a block", tw, tc; else printf "copies waited n/a"
    }')
  echo "$dir round $round: sender CPU $cpu s; $got of $((cameras * frames)) frames received; $lat; $waits"
}
echo "$cameras cameras x $frames frames, $transport, $policy, $([[ -n ${BENCH_POOL:-} ]] && echo "upstream drawing into rdmasink's pool" || echo "buffers copied by render")"
for round in $(seq 1 "$rounds"); do
  for d in "${dirs[@]}"; do
    run "$d" "$round"
  done
done
