#!/usr/bin/env bash
# What an idle receiver costs: each receiver binary given (default target/release/receiver)
# listens over tcp and over shm with no sender for SECONDS (default 10), and this prints the
# CPU time it used meanwhile and how often each of its threads woke (voluntary context
# switches). Run several binaries in one call to compare them side by side.
#   scripts/idle-receiver.sh [--seconds N] [receiver-binary...]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=10
if [ "${1:-}" = --seconds ]; then seconds=${2:?--seconds needs a number}; shift 2; fi
(($#)) || set -- target/release/receiver
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
hz=$(getconf CLK_TCK)
wakes() { # pid -> "thread:wake-ups ..." sorted by thread name
  for t in /proc/"$1"/task/*; do
    printf '%s:%s\n' "$(cat "$t/comm")" "$(awk '/^voluntary_ctxt_switches/ {print $2}' "$t/status")"
  done | sort | tr '\n' ' '
}
for bin; do
  for transport in tcp shm; do
    addr=127.0.0.1:$((20000 + RANDOM % 20000))
    [ "$transport" = shm ] && addr=unix:$tmp/idle.sock
    "$bin" --listen "$addr" --transport "$transport" --out "$tmp/out" >"$tmp/log" 2>&1 &
    pid=$!
    sleep 2 # started and settled
    before=$(awk '{print $14 + $15}' /proc/$pid/stat)
    w0=$(wakes $pid)
    sleep "$seconds"
    after=$(awk '{print $14 + $15}' /proc/$pid/stat)
    w1=$(wakes $pid)
    kill -INT $pid
    wait $pid || { echo "idle-receiver: $bin exited badly:" >&2; cat "$tmp/log" >&2; exit 1; }
    # Wake-ups per thread during the window: the second count minus the first.
    per=$(join <(tr ' ' '\n' <<<"$w0" | grep . | sed 's/:/ /' | sort) <(tr ' ' '\n' <<<"$w1" | grep . | sed 's/:/ /' | sort) |
      awk '{printf "%s %d/s  ", $1, ($3 - $2) / '"$seconds"'}')
    awk -v b="$bin" -v t="$transport" -v d=$((after - before)) -v hz="$hz" -v s="$seconds" -v per="$per" \
      'BEGIN { printf "%-45s %-4s CPU %.2f %% of a core; wake-ups: %s\n", b, t, 100 * d / hz / s, per }'
  done
done
