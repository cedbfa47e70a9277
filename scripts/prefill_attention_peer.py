#!/usr/bin/env python3
"""PyTorch peer of `gpu_prefill_attention` (crates/quant/examples/gpu_prefill_attention.rs) on the same GPU:
Kimi-K2's MLA attention of a prefill chunk in its MHA form (64 heads, q/k 128 + 64 = 192, v 128) for the same
(rows, prefix) shapes, through `F.scaled_dot_product_attention`:

- f32 (TF32 off): the precision eyrie's kernel keeps;
- bf16: what vLLM/SGLang prefill with (FlashAttention-class kernels where PyTorch has them).

Without a prefix the mask is `is_causal`; with one it is an explicit boolean mask (row i sees keys <= prefix + i),
which some backends do not take (SDPA then picks another). The `k_pe` head is already broadcast (the peer gets
dense per-head keys). Also reports which SDPA backend ran (the first that accepts the inputs, tried in PyTorch's
order), and the error of each dtype against an f64 computation of one shape. Median of 5 calls, CUDA events.

usage: python3 scripts/prefill_attention_peer.py --json OUT.json [--quick]
"""
import argparse
import json
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, NOPE, ROT, VD = 64, 128, 64, 128


def timed(fn, reps=5):
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def inputs(n, start, dtype, gen):
    keys = start + n
    q = torch.randn(1, HEADS, n, NOPE + ROT, device="cuda", generator=gen).to(dtype)
    k = torch.randn(1, HEADS, keys, NOPE + ROT, device="cuda", generator=gen).to(dtype)
    v = torch.randn(1, HEADS, keys, VD, device="cuda", generator=gen).to(dtype)
    mask = None
    if start > 0:
        rows = torch.arange(n, device="cuda").unsqueeze(1) + start
        mask = torch.arange(keys, device="cuda").unsqueeze(0) <= rows
    return q, k, v, mask


def run(q, k, v, mask, backend):
    scale = 1.0 / (NOPE + ROT) ** 0.5
    with sdpa_kernel([backend]):
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def best(q, k, v, mask):
    """The first backend (PyTorch's order) that takes the inputs, and its time."""
    for b in BACKENDS:
        try:
            run(q, k, v, mask, b)
        except RuntimeError:
            continue
        return b.name, timed(lambda: run(q, k, v, mask, b))
    raise RuntimeError("no SDPA backend took the inputs")


def main():
    # SDPA warns each time a backend declines the inputs; `best` tries them in order on purpose.
    warnings.filterwarnings("ignore", category=UserWarning)
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1024, 0), (64, 960)] if args.quick else [
        (64, 960), (256, 768), (1024, 0), (2048, 0), (2048, 6144), (64, 8128), (256, 7936), (8192, 0)]
    rows = []
    print("| rows | prefix | f32 backend | f32 us | f32 TFLOP/s | bf16 backend | bf16 us | bf16 TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    for n, start in shapes:
        pairs = sum(start + i + 1 for i in range(n))
        flops = 2 * HEADS * pairs * (NOPE + ROT + VD)
        row = {"rows": n, "prefix": start}
        for dtype, name in [(torch.float32, "f32"), (torch.bfloat16, "bf16")]:
            q, k, v, mask = inputs(n, start, dtype, gen)
            backend, us = best(q, k, v, mask)
            row[name] = {"backend": backend, "us": us, "tflops": flops / us / 1e6}
            del q, k, v, mask
            torch.cuda.empty_cache()
        print(f"| {n} | {start} | {row['f32']['backend']} | {row['f32']['us']:.0f} | {row['f32']['tflops']:.1f} | "
              f"{row['bf16']['backend']} | {row['bf16']['us']:.0f} | {row['bf16']['tflops']:.1f} |")
        rows.append(row)
    # Error against f64 on one shape (what each dtype's backend gives up).
    q, k, v, mask = inputs(256, 768, torch.float64, gen)
    ref = run(q, k, v, mask, SDPBackend.MATH)
    errors = {}
    for dtype, name in [(torch.float32, "f32"), (torch.bfloat16, "bf16")]:
        b, _ = best(q.to(dtype), k.to(dtype), v.to(dtype), mask)
        out = run(q.to(dtype), k.to(dtype), v.to(dtype), mask, getattr(SDPBackend, b))
        errors[name] = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    print(f"error vs f64 (256 rows after 768): f32 {errors['f32']:.1e}, bf16 {errors['bf16']:.1e}")
    with open(args.json, "w") as f:
        json.dump({"peer": "torch.nn.functional.scaled_dot_product_attention", "torch": torch.__version__,
                   "gpu": torch.cuda.get_device_name(), "bench": rows, "error_vs_f64": errors}, f, indent=2)


if __name__ == "__main__":
    main()
