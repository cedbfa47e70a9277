#!/usr/bin/env python3
"""Sums Nsight Compute's per-kernel GPU times of profiled decode steps by kernel: what a step spends where.

Input: the CSV of `ncu --profile-from-start off --metrics gpu__time_duration.sum --csv --print-units base
bench_decode ... --profile-steps N` (one row a launch; only the launches between cuProfilerStart/Stop, i.e. the N
profiled steps; profile ONE batch a process: steps of different batches launch different kernels, so their rows
cannot be told apart in the CSV). Each kernel is replayed alone under ncu, so a row is that kernel's
own GPU time with no launch gap; the sum over a step is the GPU's busy time, and the step's wall time minus it is
what launches, gaps and host waits cost.

usage: python3 scripts/ncu_step_summary.py CSV --steps N [--batch B] [--top K] [--json OUT] [--order]
(--batch: the batch the run profiled, a label for the table and the JSON key; --order: also every launch of the
first profiled step in the order it ran, with its grid and GPU time, e.g. to read one layer's launches)
"""
import argparse
import collections
import csv
import json
import re


def kernel_name(raw):
    """CubeCL names carry their generics and a hash: keep the function's name."""
    name = raw.split("<")[0].split("(")[0].strip()
    return re.sub(r"_[0-9a-f]{8,}$", "", name) or raw[:60]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json")
    ap.add_argument("--order", action="store_true")
    a = ap.parse_args()
    batches = [a.batch]
    launches = []
    with open(a.csv, newline="", errors="replace") as f:
        lines = [l for l in f if l.startswith('"')]
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        unit = row.get("Metric Unit", "ns")
        us = value / 1e3 if unit in ("ns", "nsecond") else value * 1e3 if unit in ("ms", "msecond") else value
        launches.append((kernel_name(row["Kernel Name"]), row.get("Grid Size", ""), row.get("Block Size", ""), us))
    if not launches:
        raise SystemExit(f"{a.csv}: no gpu__time_duration.sum rows (was ncu run with --metrics gpu__time_duration.sum?)")
    if len(launches) % a.steps:
        raise SystemExit(f"{a.csv}: {len(launches)} launches do not split evenly over {a.steps} steps")
    per = len(launches) // len(batches)
    out = {}
    for i, batch in enumerate(batches):
        rows = launches[i * per:(i + 1) * per]
        by = collections.defaultdict(lambda: [0, 0.0])
        for name, _grid, _block, us in rows:
            by[name][0] += 1
            by[name][1] += us
        total = sum(us for *_, us in rows) / a.steps
        print(f"\nbatch {batch}: {len(rows) / a.steps:.0f} launches a step, GPU busy {total / 1e3:.3f} ms a step")
        print("| kernel | launches/step | us/step | share | mean us |")
        print("|---|---|---|---|---|")
        table = sorted(by.items(), key=lambda kv: -kv[1][1])
        for name, (n, us) in table[: a.top]:
            print(f"| {name} | {n / a.steps:.0f} | {us / a.steps:.1f} | {100 * us / a.steps / total:.1f}% | {us / n:.1f} |")
        if a.order:
            print(f"\nthe first profiled step's launches in order (batch {batch})")
            print("| # | kernel | grid | block | us |")
            print("|---|---|---|---|---|")
            for j, (name, grid, block, us) in enumerate(rows[: len(rows) // a.steps]):
                print(f"| {j} | {name} | {grid} | {block} | {us:.1f} |")
        out[str(batch)] = {"launches_per_step": len(rows) / a.steps, "gpu_busy_ms_per_step": total / 1e3,
                           "kernels": {k: {"launches_per_step": n / a.steps, "us_per_step": us / a.steps}
                                       for k, (n, us) in table}}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
