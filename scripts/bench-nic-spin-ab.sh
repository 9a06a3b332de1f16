#!/usr/bin/env bash
# The tcp NIC's spin off and on, side by side with one binary (docs/benchmarks.md, "The NIC
# thread looks before it sleeps"): each round plain TCP, then the engine with
# BENCH_NIC_SPIN_US=0 and with SPIN µs in alternating order, then plain TCP again, 2 s each;
# prints each engine run ÷ the mean of its round's two plain TCP runs.
#   scripts/bench-nic-spin-ab.sh BLOCK ROUNDS [SPIN_US (300)] [MODE (engine-tcp-place)]
# e.g. scripts/bench-nic-spin-ab.sh 1048576 8; BENCH_BLOCKS=64 scripts/bench-nic-spin-ab.sh 65536 6
set -euo pipefail
cd "$(dirname "$0")/.."
block=${1:?usage: $0 BLOCK ROUNDS [SPIN_US] [MODE]}
rounds=${2:?usage: $0 BLOCK ROUNDS [SPIN_US] [MODE]}
spin=${3:-300}
mode=${4:-engine-tcp-place}
bench=target/release/bench
[ -x "$bench" ] || cargo build --release --quiet -p rdmastream-bench
rate() { "$@" 2>&1 | tail -1 | grep -o '[0-9.]* MB/s' | cut -d' ' -f1; }
off() { BENCH_NIC_SPIN_US=0 rate "$bench" "$mode" --block "$block" --seconds 2; }
on() { BENCH_NIC_SPIN_US=$spin rate "$bench" "$mode" --block "$block" --seconds 2; }
echo "== $mode, $block-byte blocks: MB/s (÷ plain TCP of the round), spin 0 and $spin µs =="
for i in $(seq "$rounds"); do
  p1=$(rate "$bench" plain-tcp --block "$block" --seconds 2)
  if (( i % 2 )); then a=$(off); b=$(on); else b=$(on); a=$(off); fi
  p2=$(rate "$bench" plain-tcp --block "$block" --seconds 2)
  awk -v p="$p1" -v q="$p2" -v a="$a" -v b="$b" 'BEGIN { m = (p + q) / 2;
    printf "plain %6.0f | spin 0 %6.0f (%3.0f %%) | spin on %6.0f (%3.0f %%) %s\n",
      m, a, 100 * a / m, b, 100 * b / m, (b > a ? "on more" : "off more") }'
done
