#!/usr/bin/env python3
"""Sums a CubeCL profile log (`CUBECL_DEBUG_LOG=FILE CUBECL_DEBUG_OPTION=profile`: one `| <duration> | <kernel>`
line per launch, each timed alone with a sync) by kernel name over its last N launches, and prints the top kernels
by total time: a decode step's kernel mix. Durations are Rust `Duration` debug strings (`14.2µs`, `1.3ms`).

usage: python3 scripts/cubecl_profile_summary.py LOG [--last N] [--top K] [--count]
(--count: print only the number of launches in the log; two runs with different step counts give the launches a step)
"""
import argparse
import collections
import re

UNITS = {"ns": 1e-3, "µs": 1.0, "us": 1.0, "ms": 1e3, "s": 1e6}
LINE = re.compile(r"^\|\s*([\d.]+)(ns|µs|us|ms|s)\s*\|\s*(.*)$")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--last", type=int, default=1000)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--count", action="store_true")
    a = ap.parse_args()
    rows = []
    with open(a.log, errors="replace") as f:
        for line in f:
            m = LINE.match(line.strip())
            if m:
                rows.append((float(m.group(1)) * UNITS[m.group(2)], m.group(3)[:90]))
    if a.count:
        print(len(rows))
        return
    rows = rows[-a.last:]
    total = sum(t for t, _ in rows)
    by = collections.defaultdict(lambda: [0.0, 0])
    for t, name in rows:
        by[name][0] += t
        by[name][1] += 1
    print(f"{len(rows)} launches, {total / 1e3:.2f} ms in all (each timed alone)")
    print("| total us | launches | mean us | kernel |\n|---|---|---|---|")
    for name, (t, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[: a.top]:
        print(f"| {t:.0f} | {n} | {t / n:.1f} | {name} |")


if __name__ == "__main__":
    main()
