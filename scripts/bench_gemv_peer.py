#!/usr/bin/env python3
"""PyTorch peers of `gpu_gemv` (crates/quant/examples/gpu_gemv.rs) on the same GPU: for Kimi-K2's dense Linear
shapes and 1..16 tokens, the time of `F.linear` with BF16 activations and BF16 weights (cuBLAS; the same weight
bytes as eyrie's BF16-weight GEMV, but BF16 inputs) and with f32 activations and f32 weights (cuBLAS SGEMM, the
same math as eyrie's kernel at twice the weight bytes). Each call reads another copy of the weights (256 MB of
copies in all, so the L2 does not hold them); median of 9 runs of 20 calls, CUDA events. Writes JSON.

usage: python3 scripts/bench_gemv_peer.py --json OUT.json
"""
import argparse
import json

import torch
import torch.nn.functional as F

SHAPES = [
    ("q_a_proj", 1536, 7168), ("kv_a_proj_with_mqa", 576, 7168), ("q_b_proj", 12288, 1536),
    ("kv_b_proj", 16384, 512), ("o_proj", 7168, 8192), ("router", 384, 7168), ("shared gate/up", 2048, 7168),
    ("shared down", 7168, 2048), ("dense gate/up", 18432, 7168), ("dense down", 7168, 18432),
    ("lm_head", 163840, 7168),
]
TOKENS = [1, 2, 4, 8, 16]


def timed(fn, copies):
    times = []
    for _ in range(9):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for i in range(20):
            fn(i % copies)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 20 * 1e3)
    return sorted(times)[4]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda", 0)
    rows_out = []
    print("| matrix | rows x k | n | torch bf16 us | torch f32 us |\n|---|---|---|---|---|")
    for name, rows, k in SHAPES:
        copies = max(1, -(-(256 << 20) // (rows * k * 2)))
        wb = [torch.randn(rows, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        f32_copies = max(1, -(-(256 << 20) // (rows * k * 4)))
        wf = [wb[i % copies].float() for i in range(f32_copies)]
        for n in TOKENS:
            xb = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
            xf = xb.float()
            us_b = timed(lambda i: F.linear(xb, wb[i]), copies)
            us_f = timed(lambda i: F.linear(xf, wf[i % f32_copies]), f32_copies)
            print(f"| {name} | {rows} x {k} | {n} | {us_b:.1f} | {us_f:.1f} |")
            rows_out.append({"matrix": name, "rows": rows, "k": k, "n": n, "torch_bf16_us": us_b, "torch_f32_us": us_f})
        del wb, wf
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows_out}, f,
                      indent=1)


if __name__ == "__main__":
    main()
