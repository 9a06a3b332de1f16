# Sourced by the A/B scripts (bench-cpu-ab.sh, bench-tcp-ab.sh, bench-tcp-modes.sh).
# busy_ms: the whole machine's busy CPU time so far in ms (/proc/stat: user, nice, system, irq,
# softirq; 100 ticks a second). Softirq work the kernel defers to ksoftirqd is not in a
# process's own task-clock, and moving work there can look like a saving (docs/benchmarks.md,
# "Tried and not kept: the kernel reading send blocks"). It also counts whatever else runs: a quiet machine, please.
busy_ms() { awk 'NR == 1 { print ($2 + $3 + $4 + $7 + $8) * 10 }' /proc/stat; }

# record_run FILE LABEL CMD...: runs CMD and appends "LABEL MB/s busy-ms" to FILE: the first
# "N MB/s" the command prints, and the machine's busy time while it ran.
record_run() {
  local file=$1 label=$2
  shift 2
  local b0 out mbs
  b0=$(busy_ms)
  out=$("$@" 2>&1)
  mbs=$(grep -o '[0-9.]* MB/s' <<<"$out" | head -1 | cut -d' ' -f1)
  echo "$label $mbs $(($(busy_ms) - b0))" >>"$file"
}
