"""Instruction counts of a kernel's hottest loop, from its CUBIN, without a GPU.

Usage:
    cargo xtask kernels --arch sm_90 --only "mma down k2048 tb1 t1 x1 ks2" --dump DIR   # writes DIR/LABEL.cubin
    pip download --no-deps -d WHEELS nvidia-cuda-nvdisasm && unzip -o WHEELS/*.whl -d TOOLS
    python3 scripts/sass_loop.py DIR/LABEL.cubin --nvdisasm TOOLS/nvidia/cu13/bin/nvdisasm [--print]

Disassembles the CUBIN (`nvdisasm -c`), finds every backward branch (a loop) and reports the loop body with the
most matrix instructions (HMMA; in a kernel without any, FFMA; without those, global loads); of loops with as many
(an outer loop holds its inner one), the shortest. Then its instruction count and a histogram by opcode; `--print`
also prints that body. Static counts: what one iteration issues, not how often each path runs; compare two builds
of one kernel. (Until session 18 HMMA and FFMA were one count, so a gate/up launch whose epilogue has FFMAs outside
its loop could be reported as its outer loop; for kernels without HMMA, such as `Stages::GateUpLoads`' launches,
check the body with `--print`.)
"""

import argparse
import collections
import re
import subprocess
import sys

INSTR = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;")
LABEL = re.compile(r"^(\.L_x_\d+):")
BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")
# What marks the hot loop: matrix instructions; in a kernel without any, FMAs; without those, global loads.
KINDS = (("HMMA",), ("FFMA",), ("LDG", "LDGSTS"))


def opcode(text):
    parts = text.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0].split(".")[0] if parts else ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cubin")
    ap.add_argument("--nvdisasm", default="nvdisasm")
    ap.add_argument("--print", action="store_true", help="print the loop body")
    args = ap.parse_args()
    sass = subprocess.run([args.nvdisasm, "-c", args.cubin], capture_output=True, text=True, check=True).stdout
    lines = sass.split("\n")
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := LABEL.match(l))}
    loops = []
    for i, line in enumerate(lines):
        m = BRANCH.search(line)
        if m and labels.get(m.group(1), i) < i:
            loops.append([INSTR.match(l).group(1) for l in lines[labels[m.group(1)] : i + 1] if INSTR.match(l)])
    if not loops:
        sys.exit("no loop (backward branch) in the SASS")
    # The kind of work that marks the hot loop: the first of KINDS the kernel's loops have at all.
    kind = next((k for k in KINDS if any(opcode(t) in k for b in loops for t in b)), KINDS[0])
    # The most of that work; of loops with as much (an outer loop holds its inner one), the shortest.
    weight, body = max(((sum(opcode(t) in kind for t in b), b) for b in loops), key=lambda wb: (wb[0], -len(wb[1])))
    hist = collections.Counter(opcode(t) for t in body)
    print(f"hottest loop: {len(body)} instructions, {weight} {'/'.join(kind)}")
    for op, n in hist.most_common():
        print(f"  {op:10s} {n}")
    if args.print:
        print("\n".join(body))


if __name__ == "__main__":
    main()
