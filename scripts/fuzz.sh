#!/usr/bin/env bash
# Runs every cargo-fuzz target under fuzz/ for SECONDS each (default 60) and prints, per target,
# the executions and whether it crashed. Needs the nightly toolchain (installed on these
# machines; the workspace itself stays on 1.95) and installs cargo-fuzz when it is missing.
#   scripts/fuzz.sh [SECONDS] [TARGET...]
# A crash leaves its input under fuzz/artifacts/TARGET/; replay it with
#   cargo +nightly fuzz run TARGET fuzz/artifacts/TARGET/crash-...
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"
shift || true
scripts/setup.sh >/dev/null
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  echo "fuzz: installing cargo-fuzz (once)" >&2
  cargo +nightly install --locked --quiet cargo-fuzz
fi
targets=("$@")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(cargo +nightly fuzz list --fuzz-dir fuzz)
cargo +nightly fuzz build --fuzz-dir fuzz -O >&2
failed=0
printf '%-24s %14s %8s %s\n' target executions seconds result
for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t"
  log="$(mktemp)"
  # The tcp request decoder needs inputs past 16 KiB to reach the NIC's direct reads.
  max_len=()
  [ "$t" = tcp_requests ] && max_len=(-max_len=131072)
  started=$SECONDS
  if cargo +nightly fuzz run --fuzz-dir fuzz -O "$t" "fuzz/corpus/$t" -- \
    -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 "${max_len[@]}" >"$log" 2>&1; then
    result=ok
  elif grep -q 'libFuzzer: run interrupted' "$log"; then
    # Ctrl-C or a signal: no input crashed it (libFuzzer exits 72), so no artifact to look for.
    result="interrupted after $((SECONDS - started)) s, no crash (log $log)"
    failed=1
  else
    result="CRASH (see fuzz/artifacts/$t/, log $log)"
    failed=1
  fi
  runs="$(grep -oE 'Done [0-9]+ runs' "$log" | grep -oE '[0-9]+' | tail -1 || true)"
  [ -n "$runs" ] || runs="$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#' || true)"
  printf '%-24s %14s %8s %s\n' "$t" "${runs:-?}" "$secs" "$result"
  [ "$result" = ok ] && rm -f "$log"
done
exit $failed
