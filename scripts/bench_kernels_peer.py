"""Peers of `cargo xtask bench kernels` (the fused INT4 MoE layer at Kimi-K2 shapes), run on the device machine in the
same command as the Rust benchmark, and the merge of both into one table.

Usage (device machine, repository root):
    python3 scripts/bench_kernels_peer.py --out PEER.json [--batches 1,8]
    python3 scripts/bench_kernels_peer.py --merge OURS.json PEER.json     # prints the side-by-side table

Peers, all on the same MoE layer (hidden 7168, moe_intermediate 2048, 384 experts, top-8, group 32) and the same
kind of routing (8 distinct random experts per token, 16 routings cycled so the 60 MB L2 cannot hold the weights):
- tinygemm INT4: per routed expert, `torch.ops.aten._weight_int4pack_mm` for gate+up (one [4096, 7168] weight),
  SiLU*up, `_weight_int4pack_mm` for down, weighted `index_add_`; eager, and replayed from a CUDA graph (the
  peer at its best: no Python or launch overhead between the per-expert calls);
- torch bf16: the same loop with bf16 weights (`F.linear`, cuBLAS), replayed from a CUDA graph; and
  `torch._grouped_mm` (one grouped GEMM for gate+up, one for down) where this torch has it;
- device-to-device copy bandwidth (`Tensor.copy_`, 1 GiB, read + write bytes).
Times are CUDA-event medians of 9 batches of 20 calls after warm-up, in microseconds per layer.
"""

import argparse
import json
import statistics
import sys

H, I, E, G, TOPK = 7168, 2048, 384, 32, 8
BATCHES = [1, 8, 32, 128]
N_ROUTINGS = 16


def time_us(fn, warm=5, reps=9, iters=20):
    import torch

    for i in range(warm):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for r in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            fn(r * iters + i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / iters)
    return statistics.median(times)


def routing(gen, m, device):
    """`TOPK` distinct experts per token and normalised positive weights, grouped by expert."""
    import torch

    ids = torch.rand(m, E, generator=gen).argsort(dim=1)[:, :TOPK]
    w = torch.rand(m, TOPK, generator=gen) + 0.1
    w = w / w.sum(dim=1, keepdim=True)
    groups = []
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        groups.append((e, tok.to(device), w[tok, slot].to(device=device, dtype=torch.bfloat16)))
    return groups


def moe_layer(x, groups, gate_up, down):
    """The MoE layer as a loop over routed experts; `gate_up(e, xe)` -> [n, 2I], `down(e, h)` -> [n, H]."""
    import torch
    import torch.nn.functional as F

    out = torch.zeros(x.shape[0], H, dtype=torch.float32, device=x.device)
    for e, tok, w in groups:
        gu = gate_up(e, x.index_select(0, tok))
        h = F.silu(gu[:, :I]) * gu[:, I:]
        out.index_add_(0, tok, (down(e, h) * w[:, None]).float())
    return out


def graphed(fn):
    """Captures `fn()` in a CUDA graph; returns the replay."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def measure(out_path, batches):
    import torch

    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(7)
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": []}

    a = torch.empty(1 << 28, dtype=torch.float32, device=dev)
    b = torch.empty_like(a)
    copy_us = time_us(lambda _: b.copy_(a), warm=3, reps=7, iters=10)
    result["copy_gb_per_s"] = 2 * a.numel() * 4 / copy_us / 1e3
    del a, b
    print(f"torch copy bandwidth: {result['copy_gb_per_s']:.0f} GB/s", flush=True)

    # tinygemm INT4 weights: q in [0, 15] (w = (q - 8) * scale + zero, zero = 0), packed two per byte, high nibble
    # first, then converted to the tinygemm tile layout (innerKTiles = 8).
    def pack(n, k):
        q = torch.randint(0, 16, (n, k), dtype=torch.int32, device=dev)
        u8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
        sz = torch.zeros(k // G, n, 2, dtype=torch.bfloat16, device=dev)
        sz[..., 0] = (torch.rand(k // G, n, device=dev) + 0.5) / 128
        return q, torch.ops.aten._convert_weight_to_int4pack(u8, 8), sz

    w13, sz13, w2, sz2 = [], [], [], []
    for e in range(E):
        q, p, sz = pack(2 * I, H)
        if e == 0:
            # Sanity: tinygemm equals x @ ((q - 8) * scale).T within bf16 rounding.
            x = torch.randn(8, H, dtype=torch.bfloat16, device=dev)
            deq = ((q.float() - 8) * sz[..., 0].float().t().repeat_interleave(G, dim=1)).to(torch.bfloat16)
            want = (x.float() @ deq.float().t())
            got = torch.ops.aten._weight_int4pack_mm(x, p, G, sz).float()
            result["tinygemm_sanity_rel_err"] = ((got - want).abs().max() / want.abs().max()).item()
            print(f"tinygemm sanity: max|got-want|/max|want| = {result['tinygemm_sanity_rel_err']:.2e}", flush=True)
        w13.append(p)
        sz13.append(sz)
        _, p, sz = pack(H, I)
        w2.append(p)
        sz2.append(sz)
    del q
    int4_gate_up = lambda e, xe: torch.ops.aten._weight_int4pack_mm(xe, w13[e], G, sz13[e])  # noqa: E731
    int4_down = lambda e, h: torch.ops.aten._weight_int4pack_mm(h, w2[e], G, sz2[e])  # noqa: E731

    # bf16 weights of all experts (34 GB), random.
    b13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=dev).normal_(0, 0.02)
    b2 = torch.empty(E, H, I, dtype=torch.bfloat16, device=dev).normal_(0, 0.02)
    bf16_gate_up = lambda e, xe: torch.nn.functional.linear(xe, b13[e])  # noqa: E731
    bf16_down = lambda e, h: torch.nn.functional.linear(h, b2[e])  # noqa: E731
    has_grouped = hasattr(torch, "_grouped_mm")

    for m in batches:
        x = torch.randn(m, H, dtype=torch.bfloat16, device=dev)
        routings = [routing(gen, m, dev) for _ in range(N_ROUTINGS)]
        row = {"m": m, "active_experts_mean": sum(len(r) for r in routings) / N_ROUTINGS}
        row["tinygemm_eager_us"] = time_us(lambda i: moe_layer(x, routings[i % N_ROUTINGS], int4_gate_up, int4_down))
        replays = [graphed(lambda r=r: moe_layer(x, r, int4_gate_up, int4_down)) for r in routings]
        row["tinygemm_graph_us"] = time_us(lambda i: replays[i % N_ROUTINGS]())
        del replays
        replays = [graphed(lambda r=r: moe_layer(x, r, bf16_gate_up, bf16_down)) for r in routings]
        row["bf16_graph_us"] = time_us(lambda i: replays[i % N_ROUTINGS]())
        del replays
        if has_grouped:
            try:
                row["bf16_grouped_mm_us"] = time_us(lambda i: grouped(x, routings[i % N_ROUTINGS], b13, b2))
            except Exception as err:  # noqa: BLE001 - reported, not fatal
                row["bf16_grouped_mm_error"] = str(err)[:200]
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)


def grouped(x, groups, b13, b2):
    """bf16 MoE with two `torch._grouped_mm` calls over the routed experts (tokens sorted by expert)."""
    import torch
    import torch.nn.functional as F

    experts = torch.tensor([g[0] for g in groups], device=x.device)
    tok = torch.cat([g[1] for g in groups])
    w = torch.cat([g[2] for g in groups])
    offs = torch.tensor([len(g[1]) for g in groups], device=x.device).cumsum(0).to(torch.int32)
    xs = x.index_select(0, tok)
    gu = torch._grouped_mm(xs, b13[experts].transpose(-2, -1), offs=offs)
    h = F.silu(gu[:, :I]) * gu[:, I:]
    y = torch._grouped_mm(h, b2[experts].transpose(-2, -1), offs=offs)
    out = torch.zeros(x.shape[0], H, dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, (y * w[:, None]).float())
    return out


def merge(ours_path, peer_path):
    ours = json.load(open(ours_path))
    peer = json.load(open(peer_path))
    print(f"GPU: {peer.get('gpu', '?')}, torch {peer.get('torch', '?')}")
    print(f"copy bandwidth: ours (CubeCL kernel) {ours['copy_gb_per_s']:.0f} GB/s, torch {peer['copy_gb_per_s']:.0f} GB/s")
    print(
        "| m | active experts | ours us | ours GB/s | % copy BW | roofline us | tinygemm graph us | tinygemm eager us "
        "| bf16 graph us | bf16 grouped_mm us | ours vs tinygemm | ours GPU us (behind a copy) | GPU % copy BW "
        "| ours GPU vs tinygemm |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    by_m = {r["m"]: r for r in peer["rows"]}
    for r in ours["rows"]:
        p = by_m.get(r["m"], {})
        tg = p.get("tinygemm_graph_us")
        gm = p.get("bf16_grouped_mm_us")
        print(
            f"| {r['m']} | {r['active_experts_mean']:.1f} | {r['us']:.1f} | {r['gb_per_s']:.0f} | {r['pct_copy_bw']:.1f} "
            f"| {r['roofline_us']:.1f} | {tg:.1f} | {p.get('tinygemm_eager_us', float('nan')):.1f} "
            f"| {p.get('bf16_graph_us', float('nan')):.1f} | {gm if gm is None else round(gm, 1)} "
            f"| {tg / r['us']:.2f}x | {r.get('gpu_us', float('nan')):.1f} | {r.get('gpu_pct_copy_bw', float('nan')):.1f} "
            f"| {tg / r.get('gpu_us', float('nan')):.2f}x |"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--merge", nargs=2, metavar=("OURS", "PEER"))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="token counts, e.g. 1,8")
    args = ap.parse_args()
    if args.merge:
        merge(*args.merge)
    elif args.out:
        measure(args.out, [int(b) for b in args.batches.split(",")])
    else:
        ap.print_help()
        sys.exit(2)
