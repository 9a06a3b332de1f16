#!/usr/bin/env python3
"""Reads traces written by `GST_BENCH_TRACE=PREFIX gst-bench ...` (one file per measured
pipeline, `PREFIX.<pid>`, each line "arrival_ns latency_ns") and prints, per file, the p99
latency, the milliseconds in which the median frame took over 120 µs ("slow"), and the spells:
runs of slow milliseconds (gaps of up to 2 ms joined), as (start ms, length ms), longest first.
Only unthrottled pipelines (10000 frames or more) are looked at. A spell of 8 ms or more is the sender off the receiver's blocks after a stall (docs/benchmarks.md, "Back to
the receiver's blocks after a stall"); the machine's own stalls show as spells of 1-6 ms.
    scripts/trace-spells.py /tmp/t.*
"""
import sys
from collections import defaultdict

SLOW_NS = 120_000
for path in sys.argv[1:]:
    rows = [tuple(map(int, line.split())) for line in open(path) if line.strip()]
    if len(rows) < 10_000:
        print(f"{path}: {len(rows)} frames, too few to speak of spells (a 25 fps run)")
        continue
    lat = sorted(l for _, l in rows)
    p99 = lat[min(len(lat) - 1, round((len(lat) - 1) * 0.99))]
    per_ms = defaultdict(list)
    for arrival, latency in rows:
        per_ms[arrival // 1_000_000].append(latency)
    slow = sorted(ms for ms, v in per_ms.items() if sorted(v)[len(v) // 2] > SLOW_NS)
    spells = []
    for ms in slow:
        if spells and ms - spells[-1][1] <= 2:
            spells[-1][1] = ms
        else:
            spells.append([ms, ms])
    spells = sorted(((a, b - a + 1) for a, b in spells), key=lambda s: -s[1])
    print(f"{path}: {len(rows)} frames, p99 {p99 / 1000:.0f} µs, {len(slow)} slow ms, "
          f"longest spells {spells[:4]}")
