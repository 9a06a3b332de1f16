#!/usr/bin/env bash
# The demo: a receiver and a sender on this machine over the built-in software transport (tcp),
# streaming 12 synthetic 640x480 RGB cameras at 25 fps and 2 synthetic radars for DURATION
# seconds (default 20) with the shipped configs/sender.toml and configs/receiver.toml. Both print
# a status line each second; the receiver checks every frame against the reference pattern.
# Frames land in out/edge-1/device-<ddd>/ (the newest 50 per device are kept).
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION="${DURATION:-20}"
OUT="${OUT:-out}"

scripts/setup.sh
echo "== building the sender and the receiver (the first build takes a few minutes)"
cargo build --release -p rdmastream-sender -p rdmastream-receiver

rm -rf "$OUT"
listen="$(sed -n 's/^listen = "\(.*\)"/\1/p' configs/receiver.toml)"
echo "== receiver: listening on $listen (configs/receiver.toml), writing to $OUT/"
./target/release/receiver --out "$OUT" --verify --exit-after-eos &
receiver=$!
trap 'kill $receiver 2>/dev/null || true' EXIT
sleep 0.5
if ! kill -0 "$receiver" 2>/dev/null; then
  # It said why above (e.g. the address in use: another receiver, or the compose demo, running).
  wait "$receiver" || true
  echo "demo: the receiver did not start (its message is above); nothing was streamed" >&2
  exit 1
fi
echo "== sender: 12 cameras + 2 radars for ${DURATION}s"
./target/release/sender --duration "$DURATION"
wait $receiver
trap - EXIT
echo
echo "== frames written (newest kept per device):"
for d in "$OUT"/edge-1/device-*; do
  printf '  %s: %s files, newest %s\n' "$d" "$(ls "$d" | wc -l)" "$(ls "$d" | tail -1)"
done
echo "Look at one: $(ls "$OUT"/edge-1/device-000/*.ppm | tail -1) (a PPM image; radar frames are raw bytes)"
