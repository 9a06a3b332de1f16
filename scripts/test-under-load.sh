#!/usr/bin/env bash
# Runs the host test suite beside busy loops, to find tests that fail when the machine is slow
# (they must not: a test asserts behaviour, never speed). CI runs on a shared 2-core machine;
# this reproduces that and worse on purpose.
#   scripts/test-under-load.sh [RUNS] [BUSY-LOOPS]      default: 2 runs beside 2 busy loops
# Prints each run's failing tests, and a line per run; exit status 1 if any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-2}
busy=${2:-2}
if [ "$(id -u)" = 0 ]; then export RDMASTREAM_REQUIRE_NETNS=1 RDMASTREAM_REQUIRE_BROWSER=1; fi
cargo build --release --workspace --all-targets --quiet || exit 1
failed=0
for run in $(seq 1 "$runs"); do
  pids=()
  for _ in $(seq 1 "$busy"); do
    sh -c 'while :; do :; done' &
    pids+=($!)
  done
  log=$(mktemp /tmp/test-under-load.XXXXXX)
  cargo test --workspace --release --no-fail-fast >"$log" 2>&1
  rc=$?
  kill "${pids[@]}" 2>/dev/null
  wait "${pids[@]}" 2>/dev/null
  grep -E '^test .* FAILED$' "$log" | sed "s/^/run $run: /"
  echo "run $run of $runs beside $busy busy loops: exit $rc (log: $log)"
  [ "$rc" = 0 ] || failed=1
done
exit $failed
