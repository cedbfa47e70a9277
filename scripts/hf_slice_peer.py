"""The PyTorch / HF transformers peer of `cargo xtask bench decode` (issue 4 item 5): decode steps of the same
full-width Kimi-K2 slice in `transformers`' own `DeepseekV3ForCausalLM`, bf16, on one CUDA GPU.

Usage (device machine, repository root; no network needed, the config is built here):
    python3 scripts/hf_slice_peer.py --json $OUT/hf_peer.json 2>&1 | tee $OUT/hf_peer.log
    python3 scripts/hf_slice_peer.py --tiny --device cpu          # smoke test on a CPU, a tiny config
Options: --layers 4 (layer 0 dense, the rest MoE) --batch 1,8,32 --context 1024,8192 --warmup 3 --steps 10
         --experts grouped_mm,batched_mm,eager --attn sdpa --prefill-chunk 1024 --prefill-tokens 16384
         --budget-s 480 --json PATH

What is measured, per (context, batch): every sequence is prefilled with `context` tokens (a `DynamicCache`,
chunks of at most `--prefill-chunk` tokens a sequence and `--prefill-tokens` a forward, routed experts through
`grouped_mm`), then, for each experts implementation transformers offers (`model.set_experts_implementation`:
`grouped_mm`, one `torch.nn.functional.grouped_mm` per projection over all experts with token offsets, the
default; `batched_mm`, a `bmm` over the gathered weights of each (token, expert) pair; `eager`, the Python loop
over the hit experts), `--warmup` untimed and `--steps` timed decode steps (one token per sequence), each timed
alone by the wall clock between device syncs; the median step is reported, with the mean and the slowest. After
each implementation the cache is cropped back to `context` tokens, so all of them decode from the same state. All
under `torch.inference_mode()`. The JSON is rewritten after every row, so a run cut off by a time limit keeps
what finished; rows that do not fit in `--budget-s` (counted from the start, model building included) are listed as
skipped, out-of-memory rows as failures. Progress lines on stderr carry the seconds since start.

Same workload as `crates/model/examples/bench_decode.rs`: prompt token `t` of sequence `s` is
`(s * 7919 + t * 104729) % vocab`, decode step `i` feeds `(s * 31 + i * 17) % vocab`, and each step's last logits
(`[batch, vocab]`) are copied to the host (bench_decode's `into_data`). Config: `kimi_k2_config` of
`crates/model/src/synthetic.rs` (hidden 7168, 64 MLA heads, q_lora 1536, kv_lora 512, qk_nope 128, qk_rope 64,
v_head 128, intermediate 18432, 384 routed experts of width 2048, top-8, 1 shared expert, noaux_tc sigmoid
routing with n_group 1, vocabulary 163840, YaRN factor 64 over 4096 positions, rope_theta 50000).

Weights: the definition of `SyntheticWeights` (crates/model/src/synthetic.rs), applied to the names and shapes
`DeepseekV3::build` / `load_layer` (crates/model/src/deepseek_v3.rs) ask for, read from the code:
- `pattern(name, rows, cols)[r, c] = sin(r * 0.7548777 + c * 0.5698403 + s) * sin((r + 1) * (c + 1) * 0.1234567 + s)`
  with `s = (fnv1a64(name) % 1000003) / 1000003 * 2 pi` (in f32), the same f32 operations in the same order;
- `*norm.weight` (input/post-attention, q_a/kv_a latent norms, final norm): 1; `e_score_correction_bias`: 0;
- `model.embed_tokens.weight` (`tensor()`, shape `[vocab, hidden]`): `pattern(name, vocab, hidden)`, scale 1.0;
- every other Linear (`linear()`, canonical name without `.weight`, e.g. `model.layers.0.self_attn.q_a_proj`,
  `model.layers.1.mlp.gate`, `model.layers.1.mlp.shared_experts.down_proj`, `lm_head`), weight `[out, in]`:
  Eyrie makes W^T directly as `pattern(name, in, out) / sqrt(in)`, so `W[o, i] = pattern(name, in, out)[i, o] /
  sqrt(in)`; here the same matrix transposed into transformers' `[out, in]` `nn.Linear` weight;
- routed experts (`stored_linear()`, names `model.layers.L.mlp.experts.J.{gate,up,down}_proj`, `[out, in]`):
  packed words `trunc(pattern(name, out, in / 8) * 2147483520.0)` as i32 bit patterns, nibble `j` of word `w`
  (LSB first) is input `8 w + j` with `q = nibble - 8`, one BF16 scale `bf16(1 / (4 sqrt(in)))` for every group of
  32. transformers holds experts fused and unquantized: `gate_up_proj[J] = [gate; up]` (`[E, 2 * 2048, 7168]`) and
  `down_proj[J]` (`[E, 7168, 2048]`); here each is `q * scale` computed in f32 and rounded once to bf16
  (the dequantized INT4 values, which bf16 holds exactly unless `q * scale` needs more than 8 mantissa bits).
So the values follow the same definition, not necessarily the same bits: the `(r + 1)(c + 1)` term reaches ~1e9
for the embedding and `lm_head`, where one f32 ulp of the sine's argument is tens of radians, so any difference in
the f32 rounding (CubeCL may contract `a * b + c` into an FMA) or in the sine implementation changes individual
entries completely (Eyrie itself only promises the same values "on every run of the same backend"); the
distribution is the same. (Measured: numpy's and torch's CPU sines, which differ in the last bit here and there,
give different packed words for 25% of the words of one Kimi-shaped expert, mostly in nibbles 0-2; the dense
weights agree within 1.5e-8.) Another consequence of the definition, reproduced as is: packed words of magnitude
>= 2^27 are multiples of 16 in f32, so their first nibble is 0 (q = -8) in ~90% of the words, the second is
skewed too; `--tiny` prints the per-position nibble histogram.

Differences from Eyrie's run that matter for the comparison (by design, this is what transformers does):
- dtypes: Eyrie keeps non-expert weights in f32 and routed experts INT4 (0.5625 bytes a parameter with the BF16
  scales); here everything is bf16 (2 bytes a parameter: 3.6x the expert bytes, half the dense bytes);
- KV cache: transformers caches the compressed latent (kv_lora + rope = 576 values a token and layer, bf16, in a
  `DynamicCache` grown by `torch.cat`) and re-expands every cached token through `kv_b_proj` at every step (no
  weight absorption), then runs `scaled_dot_product_attention` (`--attn sdpa`) over the expanded heads;
- no CUDA graphs or `torch.compile` (a static cache + compile is transformers' fast decode path; its compile time
  would not fit the budget).

Memory: the weights of `--layers L` are ~2 x 2.35 GB (embedding, lm_head) + 0.2 GB attention a layer + 0.79 GB
(dense MLP) + 33.9 GB a MoE layer; the default 4 layers (~108 GB) leave ~40 GB of an H200 for the cache and the
transients (the latent re-expansion at batch 32 x 8192 tokens is ~15 GB a layer, `batched_mm` at batch 32 gathers
~22 GB of expert weights). The script refuses to build a model whose weights do not fit with a margin.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np

T0 = time.perf_counter()

# The constants of `matrix()` in crates/model/src/synthetic.rs (Rust f32 literals).
A, B, K = 0.754_877_7, 0.569_840_3, 0.123_456_7
# Largest f32 below 2^31, the scale of packed words.
WORD_SCALE = 2_147_483_520.0
GROUP = 32


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def salt(name):
    """`salt()` of synthetic.rs: FNV-1a 64 of the name, mod 1000003, scaled to [0, 2 pi) in f32."""
    h = 0xCBF29CE484222325
    for byte in name.encode():
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return float(np.float32(h % 1_000_003) / np.float32(1_000_003.0) * np.float32(2 * math.pi))


def pattern(torch, salts, rows, cols, device):
    """`matrix()` of synthetic.rs without its scale, f32: rows `rows` (a range), columns `cols` (a range), one
    `[rows, cols]` matrix per salt (`[len(salts), rows, cols]`), or `[rows, cols]` for one float salt."""
    r = torch.arange(rows.start, rows.stop, dtype=torch.float32, device=device).reshape(-1, 1)
    c = torch.arange(cols.start, cols.stop, dtype=torch.float32, device=device).reshape(1, -1)
    if isinstance(salts, float):
        s = salts
    else:
        s = torch.tensor(salts, dtype=torch.float32, device=device).reshape(-1, 1, 1)
    smooth = torch.sin(r * A + c * B + s)
    mixed = torch.sin((r + 1.0) * (c + 1.0) * K + s)
    return smooth * mixed


def linear_scale(inp):
    """`1.0 / (inp as f32).sqrt()` in f32."""
    return float(np.float32(1.0) / np.sqrt(np.float32(inp)))


def expert_scale(torch, inp):
    """`bf16::from_f32(1.0 / (4.0 * (inp as f32).sqrt())).to_f32()`."""
    x = np.float32(1.0) / (np.float32(4.0) * np.sqrt(np.float32(inp)))
    return float(torch.tensor(float(x), dtype=torch.float32).to(torch.bfloat16).float())


CHUNK_ELEMS = 1 << 25  # f32 elements of one pattern block (128 MiB), to bound the temporaries


def fill_embedding(torch, param, name):
    """`tensor()`: `[rows, cols]` = pattern, scale 1.0, made by blocks of rows."""
    rows, cols = param.shape
    step = max(1, CHUNK_ELEMS // cols)
    s = salt(name)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        param[r0:r1].copy_(pattern(torch, s, range(r0, r1), range(cols), param.device))


def fill_linear(torch, param, canonical):
    """`linear()`: W^T = pattern(name, in, out) / sqrt(in), made by blocks of output features."""
    out, inp = param.shape
    scale = linear_scale(inp)
    step = max(1, CHUNK_ELEMS // inp)
    s = salt(canonical)
    for o0 in range(0, out, step):
        o1 = min(out, o0 + step)
        block = pattern(torch, s, range(inp), range(o0, o1), param.device) * scale  # [in, o1 - o0]
        param[o0:o1].copy_(block.t())


def packed_words(torch, names, out, inp, device):
    """`stored_linear()`'s packed words `[len(names), out, inp / 8]`, i32 (truncation toward zero, as `.int()`)."""
    salts = [salt(n) for n in names]
    return (pattern(torch, salts, range(out), range(inp // 8), device) * WORD_SCALE).to(torch.int32)


def fill_experts(torch, dest, names, inp):
    """Dequantized INT4 experts into `dest` (`[len(names), out, inp]`, bf16): `q * bf16 scale`, rounded once."""
    n, out, _ = dest.shape
    scale = expert_scale(torch, inp)
    words = packed_words(torch, names, out, inp, dest.device)  # [n, out, inp / 8]
    view = dest.view(n, out, inp // 8, 8)
    for j in range(8):
        q = ((words >> (4 * j)) & 0xF).to(torch.float32) - 8.0
        view[..., j].copy_(q * scale)
    return words


def fill_model(torch, model, config, nibble_stats=False):
    """Every parameter and buffer of `model` from the synthetic definition; fails on one it does not know."""
    hist = np.zeros((8, 16), dtype=np.int64) if nibble_stats else None
    params = dict(model.named_parameters())
    for name, p in params.items():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name == "model.embed_tokens.weight":
                fill_embedding(torch, p, name)
            elif name.endswith(".mlp.experts.gate_up_proj") or name.endswith(".mlp.experts.down_proj"):
                prefix = name.rsplit(".", 1)[0]  # model.layers.L.mlp.experts
                e_count, out2, inp = p.shape
                inter = config.moe_intermediate_size
                parts = [("gate_proj", 0, inter), ("up_proj", inter, 2 * inter)] if name.endswith("gate_up_proj") \
                    else [("down_proj", 0, out2)]
                per = max(1, CHUNK_ELEMS // ((parts[0][2] - parts[0][1]) * inp // 8))
                for part, lo, hi in parts:
                    for e0 in range(0, e_count, per):
                        e1 = min(e_count, e0 + per)
                        names = [f"{prefix}.{j}.{part}" for j in range(e0, e1)]
                        words = fill_experts(torch, p[e0:e1, lo:hi], names, inp)
                        if hist is not None:
                            for j in range(8):
                                nib = ((words >> (4 * j)) & 0xF).flatten().cpu()
                                hist[j] += np.bincount(nib.numpy(), minlength=16)
                log(f"filled {name} {tuple(p.shape)}")
            elif name.endswith(".weight"):
                fill_linear(torch, p, name[: -len(".weight")])
            else:
                raise SystemExit(f"hf_slice_peer: no synthetic rule for parameter {name} {tuple(p.shape)}")
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.zero_()
    return hist


def kimi_k2_config(transformers, layers, tiny):
    """`kimi_k2_config(layers)` of synthetic.rs as a transformers `DeepseekV3Config` (or the tiny smoke config)."""
    kw = dict(
        hidden_size=7168, num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=64,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=384, num_experts_per_tok=8,
        n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.827, norm_topk_prob=True,
        first_k_dense_replace=1, vocab_size=163840, max_position_embeddings=262144, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=163584, eos_token_id=163585, hidden_act="silu",
    )
    rope = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0, "original_max_position_embeddings": 4096,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 1.0, "beta_slow": 1.0}
    if tiny:
        kw.update(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=64,
                  qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, intermediate_size=512,
                  moe_intermediate_size=128, n_routed_experts=16, vocab_size=1024, bos_token_id=0, eos_token_id=1,
                  max_position_embeddings=1024)
        rope.update(factor=4.0, original_max_position_embeddings=256)
    return transformers.DeepseekV3Config(**kw, rope_parameters=rope)


def weight_bytes(c):
    """bf16 bytes of the model's weights."""
    d, h = c.hidden_size, c.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    attn = (d * c.q_lora_rank + c.q_lora_rank * h * qk + d * (c.kv_lora_rank + c.qk_rope_head_dim)
            + c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim) + h * c.v_head_dim * d)
    total = 2 * c.vocab_size * d
    for layer in range(c.num_hidden_layers):
        total += attn
        if layer < c.first_k_dense_replace:
            total += 3 * d * c.intermediate_size
        else:
            e = c.n_routed_experts
            total += e * 3 * d * c.moe_intermediate_size + 3 * d * c.moe_intermediate_size * c.n_shared_experts + e * d
    return 2 * total


def free_bytes(torch, device):
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def sdpa_probe(torch, c, device):
    """Whether SDPA runs this model's prefill shape (q/k head dim 192, v 128, a boolean mask) without the math
    backend, which would materialize the whole score matrix."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    h, qk = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    q = torch.randn(2, h, 128, qk, device=device, dtype=torch.bfloat16)
    k = torch.randn(2, h, 1024, qk, device=device, dtype=torch.bfloat16)
    v = torch.randn(2, h, 1024, c.v_head_dim, device=device, dtype=torch.bfloat16)
    mask = torch.ones(128, 1024, dtype=torch.bool, device=device).tril(1024 - 128)[None, None]
    fused = []
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            torch.cuda.synchronize()
            fused.append(backend.name)
        except RuntimeError:
            pass
    return fused


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=None, help="layers (layer 0 dense, the rest MoE); default 4, --tiny 2")
    ap.add_argument("--batch", default=None, help="default 1,8,32 (--tiny: 1,4)")
    ap.add_argument("--context", default=None, help="default 1024,8192 (--tiny: 64)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--experts", default="grouped_mm,batched_mm,eager", help="experts implementations to time")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager, ...)")
    ap.add_argument("--prefill-chunk", type=int, default=1024, help="prefill tokens a sequence per forward (at most)")
    ap.add_argument("--prefill-tokens", type=int, default=16384, help="prefill tokens a forward (at most)")
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny config (hidden 256, 4 heads, 16 experts, vocab 1024)")
    args = ap.parse_args()
    layers = args.layers or (2 if args.tiny else 4)
    batches = [int(x) for x in (args.batch or ("1,4" if args.tiny else "1,8,32")).split(",")]
    contexts = [int(x) for x in (args.context or ("64" if args.tiny else "1024,8192")).split(",")]
    impls = [x for x in args.experts.split(",") if x]
    if layers < 2 or args.steps < 1 or min(contexts) < 1 or min(batches) < 1:
        raise SystemExit("hf_slice_peer: --layers >= 2 (one dense, then MoE), --steps, --context, --batch >= 1")
    deadline = T0 + args.budget_s

    import torch
    import transformers

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("hf_slice_peer: no CUDA device (use --device cpu --tiny for a smoke test)")
        torch.cuda.set_device(device)
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"cpu ({os.cpu_count()} cores)"
    config = kimi_k2_config(transformers, layers, args.tiny)
    config._attn_implementation = args.attn
    need = weight_bytes(config)
    free = free_bytes(torch, device)
    margin = 8e9 if not args.tiny else 0.2e9
    if need + margin > free:
        fits = [n for n in range(2, layers) if weight_bytes(kimi_k2_config(transformers, n, args.tiny)) + margin <= free]
        hint = f"try --layers {fits[-1]}" if fits else "even --layers 2 does not fit"
        raise SystemExit(f"hf_slice_peer: {layers} layers need {need / 1e9:.1f} GB of bf16 weights (+{margin / 1e9:.0f} GB"
                         f" margin for the cache and transients), {free / 1e9:.1f} GB free on {device}: {hint}")
    log(f"{device_name}; torch {torch.__version__}, transformers {transformers.__version__}; "
        f"{layers} layers, {need / 1e9:.1f} GB of bf16 weights, {free / 1e9:.1f} GB free")

    t_build = time.perf_counter()
    with torch.device(device):
        model = transformers.DeepseekV3ForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.eval()
    if any(p.device.type != device.type for p in model.parameters()):
        raise SystemExit(f"hf_slice_peer: transformers did not build the model on {device}")
    log(f"model built in {time.perf_counter() - t_build:.1f} s; filling synthetic weights")
    t_fill = time.perf_counter()
    hist = fill_model(torch, model, config, nibble_stats=args.tiny)
    if device.type == "cuda":
        torch.cuda.synchronize()
    fill_s = time.perf_counter() - t_fill
    log(f"weights filled in {fill_s:.1f} s")
    if hist is not None:
        print("routed-expert nibble histogram (rows: position j in the word, LSB first; columns: q = -8..7):",
              file=sys.stderr)
        for j in range(8):
            print(f"  j={j}: " + " ".join(f"{x / hist[j].sum():.3f}" for x in hist[j]), file=sys.stderr)

    weights_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    fused_sdpa = sdpa_probe(torch, config, device) if device.type == "cuda" else []
    if device.type == "cuda":
        log(f"SDPA without the math backend for the prefill shape: {', '.join(fused_sdpa) or 'none'}")
    try:
        model.set_experts_implementation("grouped_mm")
        prefill_impl = "grouped_mm"
    except Exception as e:  # noqa: BLE001 (transformers raises ValueError/ImportError/KeyError)
        log(f"grouped_mm unavailable ({e}); prefill with eager experts")
        prefill_impl = "eager"

    vocab = config.vocab_size
    rows, skipped, failures = [], [], []

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def write_json():
        if not args.json:
            return
        doc = {
            "model": "Kimi-K2 slice, synthetic weights (eyrie synthetic.rs definition), transformers "
                     "DeepseekV3ForCausalLM, bf16 everywhere (routed experts dequantized from the INT4 pattern)",
            "weights_note": "same definition and f32 operation order as crates/model/src/synthetic.rs; bit equality "
                            "not verified (sine / FMA rounding of large f32 arguments may differ across backends)",
            "device": device_name, "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "layers": layers, "tiny": args.tiny, "attn_implementation": args.attn,
            "sdpa_fused_backends": fused_sdpa, "prefill_experts": prefill_impl, "warmup": args.warmup,
            "steps": args.steps, "weights_gb": weights_gb, "fill_s": fill_s,
            "rows": rows, "skipped": skipped, "failures": failures,
            "elapsed_s": time.perf_counter() - T0,
        }
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        os.replace(tmp, args.json)

    write_json()
    with torch.inference_mode():
        for context in contexts:
            for batch in batches:
                label = f"batch {batch} context {context}"
                if time.perf_counter() >= deadline:
                    skipped.append(f"{label}: out of time (--budget-s {args.budget_s:g})")
                    log(f"{label}: skipped, out of time")
                    continue
                cache = None
                try:
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats(device)
                    model.set_experts_implementation(prefill_impl)
                    cache = transformers.DynamicCache(config=model.config)
                    chunk = max(1, min(args.prefill_chunk, args.prefill_tokens // batch))
                    if device.type == "cuda" and not fused_sdpa:
                        # Math SDPA: keep the f32 scores under ~4 GB.
                        per_q = batch * config.num_attention_heads * context * 4
                        chunk = max(1, min(chunk, int(4e9 // per_q)))
                    prompts = torch.tensor(
                        [[(s * 7919 + t * 104_729) % vocab for t in range(context)] for s in range(batch)],
                        dtype=torch.long, device=device)
                    sync()
                    started = time.perf_counter()
                    for start in range(0, context, chunk):
                        end = min(context, start + chunk)
                        out = model(input_ids=prompts[:, start:end], past_key_values=cache, use_cache=True,
                                    logits_to_keep=1)
                        out.logits.float().cpu()
                        if end == context or (start // chunk) % 8 == 7:
                            log(f"{label}: prefilled {end} of {context}")
                    prefill_s = time.perf_counter() - started
                    after_prefill_gb = torch.cuda.memory_allocated(device) / 1e9 if device.type == "cuda" else None
                    prefill_peak_gb = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
                except torch.OutOfMemoryError as e:
                    failures.append(f"{label}: prefill out of memory ({str(e).splitlines()[0]})")
                    log(failures[-1])
                    del cache
                    write_json()
                    continue

                step_no = 0
                for impl in impls:
                    if time.perf_counter() >= deadline:
                        skipped.append(f"{label} experts {impl}: out of time (--budget-s {args.budget_s:g})")
                        log(f"{label} experts {impl}: skipped, out of time")
                        continue
                    try:
                        model.set_experts_implementation(impl)
                    except Exception as e:  # noqa: BLE001
                        failures.append(f"{label} experts {impl}: not available ({e})")
                        log(failures[-1])
                        continue
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)

                    def step(i):
                        ids = torch.tensor([[(s * 31 + i * 17) % vocab] for s in range(batch)], dtype=torch.long,
                                           device=device)
                        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                        out.logits[:, -1].float().cpu()

                    try:
                        for i in range(args.warmup):
                            step(step_no)
                            step_no += 1
                        each = []
                        sync()
                        timed = time.perf_counter()
                        for i in range(args.steps):
                            one = time.perf_counter()
                            step(step_no)
                            step_no += 1
                            sync()
                            each.append((time.perf_counter() - one) * 1e3)
                        mean_ms = (time.perf_counter() - timed) * 1e3 / args.steps
                    except torch.OutOfMemoryError as e:
                        failures.append(f"{label} experts {impl}: out of memory ({str(e).splitlines()[0]})")
                        log(failures[-1])
                    else:
                        row = {
                            "batch": batch, "context": context, "experts": impl,
                            "ms_per_step": statistics.median(each), "mean_ms": mean_ms, "max_ms": max(each),
                            "tokens_per_s": batch * 1e3 / statistics.median(each), "prefill_s": prefill_s,
                            "prefill_chunk": chunk,
                            "gpu_gb_after_prefill": after_prefill_gb, "gpu_peak_gb_prefill": prefill_peak_gb,
                            "gpu_peak_gb": torch.cuda.max_memory_allocated(device) / 1e9
                            if device.type == "cuda" else None,
                        }
                        rows.append(row)
                        log(f"{label} experts {impl}: {row['ms_per_step']:.2f} ms/step median, {mean_ms:.2f} mean, "
                            f"{row['max_ms']:.2f} max; prefill {prefill_s:.1f} s")
                    # Back to `context` tokens: every implementation decodes from the same state.
                    # (Layer by layer: a step cut short by an error may have grown only some of them.)
                    for layer in cache.layers:
                        grown = layer.get_seq_length() - context
                        if grown > 0:
                            layer.crop(-grown)
                    write_json()
                del cache
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                write_json()

    print(f"\nHF transformers {transformers.__version__} DeepseekV3ForCausalLM, {device_name}: {layers} layers "
          f"(hidden {config.hidden_size}, {config.n_routed_experts} routed experts, bf16, experts dequantized), "
          f"attn {args.attn}, {args.warmup} warm-up and {args.steps} timed steps (median shown); weights "
          f"{weights_gb:.1f} GB")
    print("| batch | context | experts | ms/step | mean ms | max ms | tokens/s | prefill s | peak GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        peak = f"{r['gpu_peak_gb']:.1f}" if r["gpu_peak_gb"] is not None else "-"
        print(f"| {r['batch']} | {r['context']} | {r['experts']} | {r['ms_per_step']:.2f} | {r['mean_ms']:.2f} | "
              f"{r['max_ms']:.2f} | {r['tokens_per_s']:.1f} | {r['prefill_s']:.1f} | {peak} |")
    for s in skipped:
        print(f"SKIPPED: {s}")
    for f in failures:
        print(f"FAILED: {f}")
    write_json()
    log("done")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
