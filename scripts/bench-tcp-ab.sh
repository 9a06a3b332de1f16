#!/usr/bin/env bash
# The engine over tcp, before and after, each against plain TCP of the same round: builds the
# bench of an older commit beside this tree's (scripts/build-before.sh), then per round runs
# `bench plain-tcp`, and the two engines in turn (the order alternating), 3 s each. Prints, per
# kind, MB/s, the machine's busy ms per MB (/proc/stat: softirq work outside the process
# counts too), the ratio to the round's plain TCP, and how many rounds "after" did better.
#   scripts/bench-tcp-ab.sh <commit> [rounds] [block bytes] [engine-tcp-place|engine-tcp]
#   e.g. scripts/bench-tcp-ab.sh 3c1184e 4 4194304 engine-tcp
set -euo pipefail
cd "$(dirname "$0")/.."
before=${1:?usage: scripts/bench-tcp-ab.sh <commit> [rounds] [block bytes] [engine-tcp-place|engine-tcp]}
rounds=${2:-4}
block=${3:-1048576}
mode=${4:-engine-tcp-place}
scripts/build-before.sh "$before" bench
seconds=3
# shellcheck source=scripts/machine-busy.sh
source scripts/machine-busy.sh
results=$(mktemp)
trap 'rm -f "$results"' EXIT
run() { record_run "$results" "$@"; } # label, then the command
for i in $(seq "$rounds"); do
  run plain target/ab/after/bench plain-tcp --block "$block" --seconds $seconds
  order=(before after)
  ((i % 2)) || order=(after before)
  for v in "${order[@]}"; do
    run "$v" target/ab/$v/bench "$mode" --block "$block" --seconds $seconds
  done
done
python3 - "$results" "$block" "$mode" "$seconds" <<'PY'
import sys
rows = [l.split() for l in open(sys.argv[1])]
block, mode, secs = int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
print(f"{mode}, {block // 1024} KiB blocks, {secs:.0f} s per run, plain TCP first in each round")
per = {"plain": [], "before": [], "after": []}
for i in range(0, len(rows), 3):
    plain = float(rows[i][1])
    for label, mbs, busy in rows[i:i + 3]:
        mbs, busy = float(mbs), float(busy)
        per[label].append((mbs, busy / (mbs * secs), mbs / plain))
for label, v in per.items():
    lo = lambda k: min(x[k] for x in v)
    hi = lambda k: max(x[k] for x in v)
    print(f"{label:7} {lo(0):6.0f}–{hi(0):<6.0f} MB/s  machine {lo(1):.3f}–{hi(1):.3f} ms/MB  "
          f"{100 * lo(2):.0f}–{100 * hi(2):.0f} % of plain TCP (≥ 80 % in {sum(x[2] >= 0.8 for x in v)} of {len(v)})")
b, a = per["before"], per["after"]
print(f"after better in {sum(a[i][0] > b[i][0] for i in range(len(a)))} of {len(a)} rounds by MB/s, "
      f"{sum(a[i][1] < b[i][1] for i in range(len(a)))} by the machine's busy time per MB")
PY
