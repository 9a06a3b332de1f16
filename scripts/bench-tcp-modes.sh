#!/usr/bin/env bash
# How a device's frames get into its send blocks, over tcp, each against plain TCP of the same
# round: per round `bench plain-tcp`, then the engine with a lossless device whose frames are
# copied in by the filling thread (`engine-tcp`), a lossless device whose source writes them in
# place (`engine-tcp-lossless-place`) and a live one writing in place (`engine-tcp-place`), the
# engines' order rotating from round to round, 3 s each. Prints per kind MB/s, the machine's
# busy ms per MB and the ratio to the round's plain TCP.
#   scripts/bench-tcp-modes.sh [rounds] [block bytes]
#   e.g. scripts/bench-tcp-modes.sh 4 4194304
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-4}
block=${2:-4194304}
seconds=3
cargo build --release -q -p rdmastream-bench
bench=target/release/bench
# shellcheck source=scripts/machine-busy.sh
source scripts/machine-busy.sh
results=$(mktemp)
trap 'rm -f "$results"' EXIT
run() { record_run "$results" "$@"; } # label, then the command
modes=(engine-tcp engine-tcp-lossless-place engine-tcp-place)
for i in $(seq "$rounds"); do
  run plain-tcp $bench plain-tcp --block "$block" --seconds $seconds
  for j in 0 1 2; do
    m=${modes[$(((i + j) % 3))]}
    run "$m" $bench "$m" --block "$block" --seconds $seconds
  done
done
python3 - "$results" "$block" "$seconds" <<'PY'
import sys
rows = [l.split() for l in open(sys.argv[1])]
block, secs = int(sys.argv[2]), float(sys.argv[3])
print(f"{block // 1024} KiB blocks over tcp, {secs:.0f} s per run, plain TCP first in each round")
per = {}
for i in range(0, len(rows), 4):
    plain = float(rows[i][1])
    for label, mbs, busy in rows[i:i + 4]:
        mbs, busy = float(mbs), float(busy)
        per.setdefault(label, []).append((mbs, busy / (mbs * secs), mbs / plain))
for label, v in per.items():
    lo = lambda k: min(x[k] for x in v)
    hi = lambda k: max(x[k] for x in v)
    print(f"{label:26} {lo(0):6.0f}–{hi(0):<6.0f} MB/s  machine {lo(1):.3f}–{hi(1):.3f} ms/MB  "
          f"{100 * lo(2):.0f}–{100 * hi(2):.0f} % of plain TCP (≥ 80 % in {sum(x[2] >= 0.8 for x in v)} of {len(v)})")
PY
