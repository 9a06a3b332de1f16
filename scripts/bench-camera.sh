#!/usr/bin/env bash
# scripts/bench-camera.sh [PAIRS] [FRAMES] [shm|verbs] - what a V4L2 camera costs the sending
# process with its frames written in place (v4l2src io-mode=userptr, into rdmasink's pool) and
# with the driver's own buffers copied once by rdmasink (io-mode=mmap), in turn, PAIRS times
# (default 3) of FRAMES frames (default 600, 640x480 RGB at the camera's own rate) over shm
# (default) or verbs. Runs in the Soft-RoCE VM (scripts/vm.sh), whose kernel has the vivid test
# camera; prints the sending gst-launch-1.0's user + system CPU (GNU time) per run.
set -euo pipefail
cd "$(dirname "$0")/.."
pairs="${1:-3}" frames="${2:-600}" transport="${3:-shm}"
cargo build --release --quiet -p gst-plugin-rdma --lib
scripts/vm.sh prepare
scripts/vm.sh run --timeout 3600 -- env PAIRS="$pairs" FRAMES="$frames" TRANSPORT="$transport" bash -c '
export GST_PLUGIN_PATH=$PWD/target/release
still="extra-controls=c,horizontal_movement=3,vertical_movement=3,osd_text_mode=2"
key=key=bench-camera-key-0123456789
one() { # io-mode
  local d; d=$(mktemp -d)
  if [ "$TRANSPORT" = shm ]; then
    rx="transport=shm address=unix:$d/rx.sock"; tx="transport=shm host=unix:$d/rx.sock"
  else
    rx="transport=verbs address=192.0.2.1 port=7700 $key"; tx="transport=verbs host=192.0.2.1 port=7700 $key"
  fi
  gst-launch-1.0 -q rdmasrc $rx device-id=1 drop-policy=block ! fakesink &
  sleep 1
  t=$( { /usr/bin/time -f "%U %S %e" gst-launch-1.0 -q v4l2src device=/dev/video0 io-mode=$1 \
        num-buffers=$FRAMES "$still" ! video/x-raw,format=RGB,width=640,height=480 ! \
        rdmasink $tx device-id=1 drop-policy=block sync=false >/dev/null; } 2>&1 | tail -1)
  wait
  rm -rf "$d"
  echo "$TRANSPORT $1 $t" | awk -v n=$FRAMES "{printf \"%s %-7s %d frames: CPU %.2f s (user %.2f, system %.2f), %.1f s\n\", \$1, \$2, n, \$3 + \$4, \$3, \$4, \$5}"
}
for p in $(seq "$PAIRS"); do one userptr; one mmap; done'
