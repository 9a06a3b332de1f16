# Sourced by the A/B scripts (bench-cpu-ab.sh, bench-tcp-ab.sh).
# busy_ms: the whole machine's busy CPU time so far in ms (/proc/stat: user, nice, system, irq,
# softirq; 100 ticks a second). Softirq work the kernel defers to ksoftirqd is not in a
# process's own task-clock, and moving work there can look like a saving (README, "the kernel
# reading send blocks"). It also counts whatever else runs: a quiet machine, please.
busy_ms() { awk 'NR == 1 { print ($2 + $3 + $4 + $7 + $8) * 10 }' /proc/stat; }
