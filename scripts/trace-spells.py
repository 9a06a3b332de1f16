#!/usr/bin/env python3
"""Reads traces written by `GST_BENCH_TRACE=PREFIX gst-bench ...` (one file per measured
pipeline, `PREFIX.<pid>`, each line "arrival_ns latency_ns" after a "#" line) and prints, per file, the p99
latency, the milliseconds in which the median frame took over 120 µs ("slow"), and the spells:
runs of slow milliseconds (gaps of up to 2 ms joined), as (start ms, length ms), longest first.
Only unthrottled pipelines (10000 frames or more) are looked at. A spell of 8 ms or more is the
sender off the receiver's blocks after a stall (docs/benchmarks.md, "Back to the receiver's
blocks after a stall"); the machine's own stalls show as spells of 1-6 ms.

For rdmasink, gst-bench's sending process writes `PREFIX.<pid>.paths` beside the trace
(rdmasink's `stats` each millisecond): then it also says how many frames upstream wrote into
rdmasink's own send blocks ("own", each copied again by the sending thread) and how many into
the receiver's memory ("lent", over shm), in the slow milliseconds and outside them, and in each
spell of 3 ms or more (from 2 ms before it to 2 ms after).
    scripts/trace-spells.py /tmp/t.*
"""
import os
import sys
from collections import defaultdict

SLOW_NS = 120_000


def paths_per_ms(path):
    """ms into the window -> (own, lent) frames placed in it, from the cumulative samples."""
    per_ms = {}
    prev = None
    for line in open(path):
        t, own, lent, _copied = map(int, line.split())
        if prev is not None:
            ms = t // 1_000_000
            o, l = per_ms.get(ms, (0, 0))
            per_ms[ms] = (o + own - prev[0], l + lent - prev[1])
        prev = (own, lent)
    return per_ms


def count(paths, mss):
    own = sum(paths.get(ms, (0, 0))[0] for ms in mss)
    return own, own + sum(paths.get(ms, (0, 0))[1] for ms in mss)


for path in sys.argv[1:]:
    if path.endswith(".paths"):
        continue
    rows = [tuple(map(int, line.split())) for line in open(path)
            if line.strip() and not line.startswith("#")]
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
    if not os.path.exists(path + ".paths"):
        continue
    paths = paths_per_ms(path + ".paths")
    slow_set = set(slow)
    own_in, all_in = count(paths, slow_set)
    own_out, all_out = count(paths, [ms for ms in paths if ms not in slow_set])
    print(f"  rdmasink: own send blocks {own_in} of {all_in} frames in the slow ms, "
          f"{own_out} of {all_out} outside them")
    for start, length in spells:
        if length < 3:
            break
        own, n = count(paths, range(start - 2, start + length + 2))
        print(f"  spell at {start} ms ({length} ms): own send blocks {own} of {n} frames")
