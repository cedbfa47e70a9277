#!/usr/bin/env python3
"""PyTorch peers of `gpu_attention` (crates/quant/examples/gpu_attention.rs) on the same GPU: Kimi-K2's absorbed
MLA decode (64 heads, one query per sequence, key = the 576-wide latent [c_kv | k_pe] shared by all heads, value =
its first 512 entries) for batches 1..128 at context 1k and 8k, through `F.scaled_dot_product_attention` on a
contiguous cache (no page table: the peer gets the easier layout):

- f32: the same math and bytes as eyrie's kernel (f32 cache, f32 accumulation; TF32 off);
- bf16: half the bytes, BF16 inputs (what vLLM/SGLang serve with; FlashMLA-class kernels are not installed here).

SDPA picks its backend (with head dim 576 that is the math path: the flash and memory-efficient kernels stop at
256); the key/value head is broadcast to 64 heads with `enable_gqa`. Each call reads another copy of the cache
when one copy is under 512 MB (so the L2 does not hold it); median of 9 runs of 10 calls, CUDA events. Also times
the explicit two-matmul form (`softmax(q K^T) V` with bmm) and reports the faster of the two per dtype. The
inputs are random (timings do not depend on the values). Writes JSON.

usage: python3 scripts/bench_attention_peer.py --json OUT.json [--quick] [--heads H]

`--heads 8` is a tensor-parallel rank's share of Kimi-K2's 64 (the user's `--tp-size 8`; `gpu_attention --heads 8`).
"""
import argparse
import json

import torch
import torch.nn.functional as F

HEADS, R, ROT = 64, 512, 64
D = R + ROT


def timed(fn, copies):
    times = []
    for rep in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for i in range(10):
            fn(i % copies)
        end.record()
        torch.cuda.synchronize()
        if rep > 0:
            times.append(start.elapsed_time(end) / 10 * 1e3)
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--heads", type=int, default=HEADS)
    args = ap.parse_args()
    heads = args.heads
    if heads < 1:
        ap.error(f"--heads {heads}: at least 1")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda", 0)
    scale = 192 ** -0.5
    out = []
    print("| batch | context | dtype | SDPA us | bmm form us | best GB/s |\n|---|---|---|---|---|---|")
    batches = [1, 8] if args.quick else [1, 8, 32, 128]
    for ctx in (1024, 8192):
        for batch in batches:
            for dtype in (torch.float32, torch.bfloat16):
                size = torch.tensor([], dtype=dtype).element_size()
                per = batch * ctx * D * size
                copies = max(1, min(16, -(-(512 << 20) // per)))
                q = torch.randn(batch, heads, 1, D, device=dev, dtype=dtype)
                caches = [torch.randn(batch, 1, ctx, D, device=dev, dtype=dtype) for _ in range(copies)]

                def sdpa(i):
                    kv = caches[i]
                    return F.scaled_dot_product_attention(q, kv, kv[..., :R], scale=scale, enable_gqa=True)

                def bmm(i):
                    kv = caches[i][:, 0]  # [b, T, D]
                    s = torch.bmm(q[:, :, 0], kv.transpose(1, 2)) * scale  # [b, H, T]
                    p = torch.softmax(s.float(), dim=-1).to(dtype)
                    return torch.bmm(p, kv[..., :R])  # [b, H, R]

                try:
                    us_sdpa = timed(sdpa, copies)
                except RuntimeError as e:  # out of memory or no backend
                    us_sdpa = float("nan")
                    print(f"  SDPA {dtype} b{batch} ctx{ctx}: {e}")
                us_bmm = timed(bmm, copies)
                best = min(x for x in (us_sdpa, us_bmm) if x == x)
                moved = per + batch * heads * (D + R) * size
                gbs = moved / best / 1e3
                name = "f32" if dtype == torch.float32 else "bf16"
                print(f"| {batch} | {ctx} | {name} | {us_sdpa:.1f} | {us_bmm:.1f} | {gbs:.0f} |")
                out.append({"batch": batch, "context": ctx, "dtype": name, "sdpa_us": us_sdpa, "bmm_us": us_bmm,
                            "best_us": best, "bytes_moved": moved, "gb_s": gbs})
                del caches
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "heads": heads, "gpu": torch.cuda.get_device_name(0), "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
