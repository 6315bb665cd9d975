#!/usr/bin/env python3
"""Summarises `TESSERA_CUDA_TIMELINE` files (one per process): per step,
the span, each stream's busy time, their overlap, the device's idle time,
and what runs after the last op of the main stream (the exposed tail).

    python3 scripts/timeline_summary.py DIR STEPS
"""
import collections
import glob
import os
import sys


def union(intervals):
    """Total length of the union of (start, end) intervals."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def overlap(xs, ys):
    """Length of the intersection of two interval sets' unions."""
    return union(xs) + union(ys) - union(xs + ys)


def summarise(path, steps):
    rows = []
    with open(path) as f:
        next(f)
        for line in f:
            s, a, b, op = line.rstrip("\n").split("\t", 3)
            rows.append((float(a), float(b), int(s), op))
    rows.sort()
    per = len(rows) // steps
    print(f"{os.path.basename(path)}: {len(rows)} ops, {per} a step")
    by_op = collections.defaultdict(lambda: [0, 0.0])
    for k in range(steps):
        chunk = rows[k * per:(k + 1) * per]
        t0 = min(r[0] for r in chunk)
        t1 = max(r[1] for r in chunk)
        streams = sorted({r[2] for r in chunk})
        ivs = {s: [(r[0], r[1]) for r in chunk if r[2] == s] for s in streams}
        main = ivs.get(0, [])
        others = [iv for s in streams if s != 0 for iv in ivs[s]]
        last_main = max((b for a, b in main), default=t0)
        line = f"  step {k}: span {t1 - t0:7.3f} ms"
        for s in streams:
            line += f", stream {s} busy {union(ivs[s]):7.3f} ({len(ivs[s])} ops)"
        line += f", overlap {overlap(main, others):6.3f}, idle {t1 - t0 - union(main + others):6.3f}"
        line += f", after stream 0's last op {t1 - last_main:6.3f}"
        print(line)
        if k == steps - 1:
            for a, b, s, op in chunk:
                name = op.split(" ")[0] if not op.startswith("fused") else "fused"
                e = by_op[(s, name)]
                e[0] += 1
                e[1] += b - a
            tail = [r for r in chunk if r[1] > last_main - 1e-9 and r[2] != 0]
            for a, b, s, op in tail[-6:]:
                print(f"    tail: stream {s} {a - t0:8.3f}..{b - t0:8.3f} {op[:100]}")
    print("  last step, device time by stream and op:")
    for (s, name), (n, ms) in sorted(by_op.items(), key=lambda x: -x[1][1])[:14]:
        print(f"    stream {s} {name:<28} {n:5d}x {ms:8.3f} ms")


if __name__ == "__main__":
    d, steps = sys.argv[1], int(sys.argv[2])
    for path in sorted(glob.glob(os.path.join(d, "timeline-*.tsv"))):
        summarise(path, steps)
