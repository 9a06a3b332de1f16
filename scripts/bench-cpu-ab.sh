#!/usr/bin/env bash
# The engine over tcp, before and after, by the CPU and context switches it spends per MB:
# builds the bench of an older commit (in a throwaway worktree) beside this tree's and runs
# `bench engine-tcp-place` of each in turn under `perf stat`, so each pair is measured side by
# side on a noisy host. Prints, per run, MB/s, task-clock ms per MB and context switches per MB
# (the whole process: both ends of the loopback), the machine's busy ms per MB (/proc/stat: it
# counts softirq work done outside the process too), then how many pairs "after" did better.
#   scripts/bench-cpu-ab.sh <commit> [blocks] [pairs] [block bytes]
#   e.g. scripts/bench-cpu-ab.sh fd1eaf9 64 4
set -euo pipefail
cd "$(dirname "$0")/.."
before=${1:?usage: scripts/bench-cpu-ab.sh <commit> [blocks] [pairs] [block bytes]}
blocks=${2:-16}
pairs=${3:-4}
block=${4:-65536}
command -v perf >/dev/null || { echo "bench-cpu-ab: needs perf (apt-get install linux-perf)" >&2; exit 2; }
scripts/build-before.sh "$before" bench
seconds=3
# shellcheck source=scripts/machine-busy.sh
source scripts/machine-busy.sh
results=$(mktemp)
for _ in $(seq "$pairs"); do
  for v in before after; do
    busy0=$(busy_ms)
    out=$(BENCH_BLOCKS=$blocks perf stat -x, -e task-clock,context-switches \
      target/ab/$v/bench engine-tcp-place --block "$block" --seconds $seconds 2>&1)
    busy=$(($(busy_ms) - busy0))
    mbs=$(grep -o '[0-9.]* MB/s' <<<"$out" | cut -d' ' -f1)
    tc=$(grep task-clock <<<"$out" | cut -d, -f1)
    cs=$(grep context-switches <<<"$out" | cut -d, -f1)
    echo "$v $mbs $tc $cs $busy" >>"$results"
  done
done
python3 - "$results" "$blocks" "$block" "$seconds" <<'PY'
import sys
rows = [l.split() for l in open(sys.argv[1])]
blocks, block, secs = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
print(f"engine-tcp-place, {block // 1024} KiB blocks, {blocks} receiver blocks, {secs:.0f} s per run")
print(f"{'':7} {'MB/s':>8} {'cpu ms/MB':>10} {'cs/MB':>7} {'machine ms/MB':>14}")
per = {"before": [], "after": []}
for v, m, t, c, busy in rows:
    m, t, c, busy = float(m), float(t), float(c), float(busy)
    r = (m, t / (m * secs), c / (m * secs), busy / (m * secs))
    per[v].append(r)
    print(f"{v:7} {r[0]:8.1f} {r[1]:10.3f} {r[2]:7.1f} {r[3]:14.3f}")
b, a = per["before"], per["after"]
n = min(len(a), len(b))
print(f"after better in {sum(a[i][0] > b[i][0] for i in range(n))} of {n} pairs by MB/s, "
      f"{sum(a[i][1] < b[i][1] for i in range(n))} by CPU per MB, "
      f"{sum(a[i][2] < b[i][2] for i in range(n))} by context switches per MB, "
      f"{sum(a[i][3] < b[i][3] for i in range(n))} by the machine's busy time per MB")
PY
rm -f "$results"
