//! GPU check of eyrie-model's own CUDA paths (issue 4) against the generic burn ops and an f64 CPU reference,
//! with timings: the one-launch RMSNorm (`cuda_ops::rms_norm`) at Kimi-K2's norm widths and a Linear with BF16
//! weights (the GEMV path, `cuda_ops::gemv`, up to `GEMV_MAX_TOKENS` rows; the f32-exact cuBLAS GEMM, `cuda_ops::gemm`, above)
//! against the same Linear's generic f32 matmul, and RoPE on row groups in
//! one launch (`RotaryEmbedding::apply_rows`, `cuda_ops::rope_rows`) against its generic ops, and the absorbed MLA
//! (`cuda_ops::mla_absorbed`: query absorption + RoPE, attention over the paged cache, value absorption) against an
//! f64 host reference (1e-5), the MHA form of prefill chunks (`cuda_ops::mla_mha_prefill`) against the absorbed form
//! (1e-5), greedy picks on the device (`sampling::device_argmax`) against the host's argmax (equal ids), and the MoE
//! router on the device (`eyrie_quant::cuda::router`) against the host
//! routing (ids and grouping exact, weights 1e-6) and a whole MoE block routed on the device vs on the host (1e-6).
//!
//! Tolerance, norm-wise `max|gpu - ref| / max|ref|`: 1e-6 for RMSNorm (f32, sums in another order) and RoPE against the
//! f64 reference; 1e-5 for the GEMV and GEMM against the f64 reference (the generic path's TF32 matmul is printed beside
//! it, ~1e-3). Exit status 1 on a mismatch. usage: gpu_ops [--json PATH]

use std::time::Instant;

use burn::backend::Cuda;
use burn::backend::cuda::CudaDevice;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use eyrie_model::linear::Linear;
use eyrie_model::rms_norm::RmsNorm;
use eyrie_model::rope::RotaryEmbedding;
use eyrie_quant::cuda::SplitMix64;

type B = Cuda;
type Error = Box<dyn std::error::Error + Send + Sync>;

fn host<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().expect("f32 data")
}

fn err(got: &[f32], want: &[f64]) -> f64 {
    let diff = got.iter().zip(want).map(|(g, w)| (f64::from(*g) - w).abs()).fold(0.0, f64::max);
    diff / want.iter().map(|w| w.abs()).fold(0.0, f64::max).max(f64::MIN_POSITIVE)
}

/// Median microseconds of `f` over 9 runs of 20 calls between syncs.
fn time(device: &CudaDevice, mut f: impl FnMut()) -> f64 {
    let mut t = Vec::new();
    for _ in 0..9 {
        <B as Backend>::sync(device).expect("sync");
        let s = Instant::now();
        for _ in 0..20 {
            f();
        }
        <B as Backend>::sync(device).expect("sync");
        t.push(s.elapsed().as_secs_f64() * 1e6 / 20.0);
    }
    t.sort_by(f64::total_cmp);
    t[4]
}

fn main() -> Result<(), Error> {
    let json = std::env::args().skip_while(|a| a != "--json").nth(1);
    let device = CudaDevice::new(0);
    let mut rng = SplitMix64::new(11);
    let mut failed = false;
    let mut rows = Vec::new();
    println!(
        "| op | shape | error vs f64 | generic burn path error | kernel us | generic us | ok |\n|---|---|---|---|---|---|---|"
    );
    for (n, width, eps) in [(1usize, 7168usize, 1e-6f64), (8, 7168, 1e-6), (33, 1536, 1e-6), (5, 512, 1e-6)] {
        let x: Vec<f32> = rng.activations(n * width).iter().map(|v| v.to_f32() * 3.0).collect();
        let w: Vec<f32> = (0..width).map(|_| 0.5 + rng.next_f32()).collect();
        let xt = Tensor::<B, 2>::from_data(TensorData::new(x.clone(), [n, width]), &device);
        let norm = RmsNorm::new(Tensor::<B, 1>::from_data(TensorData::new(w.clone(), [width]), &device), eps);
        let got = host(norm.forward(xt.clone()));
        let mut want = vec![0.0f64; n * width];
        for r in 0..n {
            let row = &x[r * width..(r + 1) * width];
            let ms = row.iter().map(|v| f64::from(*v) * f64::from(*v)).sum::<f64>() / width as f64;
            let inv = 1.0 / (ms + eps).sqrt();
            for c in 0..width {
                want[r * width + c] = f64::from(row[c]) * inv * f64::from(w[c]);
            }
        }
        // The generic ops (what the CPU runs), on the GPU.
        let generic = |x: Tensor<B, 2>| {
            let variance = x.clone().powi_scalar(2).mean_dim(1);
            x * variance.add_scalar(eps).sqrt().recip() * norm.weight.clone().unsqueeze::<2>()
        };
        let e = err(&got, &want);
        let e_generic = err(&host(generic(xt.clone())), &want);
        let ok = e <= 1e-6;
        failed |= !ok;
        let us = time(&device, || drop(norm.forward(xt.clone())));
        let us_generic = time(&device, || drop(generic(xt.clone())));
        println!("| rms_norm | {n} x {width} | {e:.1e} | {e_generic:.1e} | {us:.1} | {us_generic:.1} | {ok} |");
        rows.push(serde_json::json!({"op": "rms_norm", "n": n, "width": width, "error": e, "generic_error": e_generic,
            "kernel_us": us, "generic_us": us_generic, "ok": ok}));
    }
    // The residual add fused into the norm (`RmsNorm::forward_add`, `cuda_ops::add_rms_norm`): h = x + res and its norm.
    for (n, width, eps) in [(1usize, 7168usize, 1e-6f64), (40, 7168, 1e-6)] {
        let x: Vec<f32> = (0..n * width).map(|_| (rng.next_f32() - 0.5) * 6.0).collect();
        let res: Vec<f32> = (0..n * width).map(|_| (rng.next_f32() - 0.5) * 2.0).collect();
        let w: Vec<f32> = (0..width).map(|_| 0.5 + rng.next_f32()).collect();
        let t2 = |v: &Vec<f32>| Tensor::<B, 2>::from_data(TensorData::new(v.clone(), [n, width]), &device);
        let norm = RmsNorm::new(Tensor::<B, 1>::from_data(TensorData::new(w.clone(), [width]), &device), eps);
        let (xt, rt) = (t2(&x), t2(&res));
        let (h, y) = norm.forward_add(xt.clone(), rt.clone());
        let h_want: Vec<f32> = x.iter().zip(&res).map(|(a, b)| a + b).collect();
        let h_exact = host(h) == h_want;
        let mut want = vec![0.0f64; n * width];
        for r in 0..n {
            let row = &h_want[r * width..(r + 1) * width];
            let ms = row.iter().map(|v| f64::from(*v) * f64::from(*v)).sum::<f64>() / width as f64;
            let inv = 1.0 / (ms + eps).sqrt();
            for c in 0..width {
                want[r * width + c] = f64::from(row[c]) * inv * f64::from(w[c]);
            }
        }
        let e = err(&host(y), &want);
        let ok = h_exact && e <= 1e-6;
        failed |= !ok;
        let us = time(&device, || drop(norm.forward_add(xt.clone(), rt.clone())));
        println!("| add + rms_norm (sum exact: {h_exact}) | {n} x {width} | {e:.1e} | - | {us:.1} | - | {ok} |");
        rows.push(serde_json::json!({"op": "add_rms_norm", "n": n, "width": width, "error": e, "sum_exact": h_exact,
            "kernel_us": us, "ok": ok}));
    }
    // Up to `gemv_max_tokens()` rows: the GEMV kernel; up to `mma_gemv_max_tokens()` the tensor-core GEMV; more:
    // the f32-exact cuBLAS GEMM (`cuda_ops::gemm`). Activations with all 24 mantissa bits in use (BF16-valued
    // ones would hide a lost split part).
    for (n, out, inp) in [
        (1usize, 1536usize, 7168usize),
        (4, 7168, 2048),
        (6, 576, 7168),
        (12, 12288, 1536),
        (16, 2048, 7168),
        (17, 1536, 7168),
        (300, 576, 1024),
    ] {
        let x: Vec<f32> = (0..n * inp).map(|_| (rng.next_f32() - 0.5) * 4.0).collect();
        let wv: Vec<f32> =
            (0..out * inp).map(|_| half::bf16::from_f32((rng.next_f32() - 0.5) / 16.0).to_f32()).collect();
        let w = Tensor::<B, 2>::from_data(TensorData::new(wv.clone(), [out, inp]), &device).cast(FloatDType::BF16);
        let linear = Linear::from_weight(w);
        let xt = Tensor::<B, 2>::from_data(TensorData::new(x.clone(), [n, inp]), &device);
        let got = host(linear.forward(xt.clone()));
        let want: Vec<f64> = (0..n * out)
            .map(|i| {
                let (t, o) = (i / out, i % out);
                (0..inp).map(|c| f64::from(x[t * inp + c]) * f64::from(wv[o * inp + c])).sum()
            })
            .collect();
        let generic = |x: Tensor<B, 2>| x.matmul(linear.weight_t());
        let e = err(&got, &want);
        let e_generic = err(&host(generic(xt.clone())), &want);
        let ok = e <= 1e-5;
        failed |= !ok;
        let us = time(&device, || drop(linear.forward(xt.clone())));
        let us_generic = time(&device, || drop(generic(xt.clone())));
        println!(
            "| linear (BF16 weights, {}) | {n} x {inp} -> {out} | {e:.1e} | {e_generic:.1e} | {us:.1} | {us_generic:.1} | {ok} |",
            if n <= eyrie_model::cuda_ops::gemv_max_tokens() {
                "GEMV"
            } else if n <= eyrie_model::cuda_ops::mma_gemv_max_tokens() {
                "tensor-core GEMV"
            } else {
                "cuBLAS GEMM"
            }
        );
        rows.push(serde_json::json!({"op": "linear_bf16", "n": n, "in": inp, "out": out, "error": e,
            "generic_error": e_generic, "kernel_us": us, "generic_us": us_generic, "ok": ok}));
    }
    // An MLP at decode widths (`Mlp::forward`: gate, up and SiLU * up in one launch, `cuda_ops::gemv_swiglu_pair`,
    // then the down GEMV), Kimi-K2's shared-expert shape, against f64 (the activation rounded to f32 as the GPU
    // stores it).
    for n in [1usize, 8, 16] {
        let (d, inter) = (7168usize, 2048usize);
        let x: Vec<f32> = (0..n * d).map(|_| (rng.next_f32() - 0.5) * 4.0).collect();
        let mut mats = Vec::new();
        for (o, i) in [(inter, d), (inter, d), (d, inter)] {
            let v: Vec<f32> =
                (0..o * i).map(|_| half::bf16::from_f32((rng.next_f32() - 0.5) / 16.0).to_f32()).collect();
            mats.push(v);
        }
        let lin = |v: &Vec<f32>, o: usize, i: usize| {
            Linear::from_weight(
                Tensor::<B, 2>::from_data(TensorData::new(v.clone(), [o, i]), &device).cast(FloatDType::BF16),
            )
        };
        let mlp = eyrie_model::mlp::Mlp {
            gate_proj: lin(&mats[0], inter, d),
            up_proj: lin(&mats[1], inter, d),
            down_proj: lin(&mats[2], d, inter),
        };
        let xt = Tensor::<B, 2>::from_data(TensorData::new(x.clone(), [n, d]), &device);
        let got = host(mlp.forward(xt.clone()));
        let mut want = vec![0.0f64; n * d];
        for t in 0..n {
            let h: Vec<f32> = (0..inter)
                .map(|r| {
                    let dot = |w: &Vec<f32>| -> f64 {
                        (0..d).map(|c| f64::from(x[t * d + c]) * f64::from(w[r * d + c])).sum()
                    };
                    let g = dot(&mats[0]);
                    (g / (1.0 + (-g).exp()) * dot(&mats[1])) as f32
                })
                .collect();
            for o in 0..d {
                want[t * d + o] = (0..inter).map(|c| f64::from(h[c]) * f64::from(mats[2][o * inter + c])).sum();
            }
        }
        let generic = |x: Tensor<B, 2>| {
            let h = burn::tensor::activation::silu(mlp.gate_proj.forward(x.clone())) * mlp.up_proj.forward(x);
            mlp.down_proj.forward(h)
        };
        let e = err(&got, &want);
        let e_generic = err(&host(generic(xt.clone())), &want);
        let ok = e <= 1e-5;
        failed |= !ok;
        let us = time(&device, || drop(mlp.forward(xt.clone())));
        let us_generic = time(&device, || drop(generic(xt.clone())));
        println!(
            "| mlp (SwiGLU GEMV + down) | {n} x {d} -> {inter} -> {d} | {e:.1e} | {e_generic:.1e} | {us:.1} | {us_generic:.1} | {ok} |"
        );
        rows.push(serde_json::json!({"op": "mlp_swiglu", "n": n, "error": e, "generic_error": e_generic,
            "kernel_us": us, "generic_us": us_generic, "ok": ok}));
    }
    // RoPE on row groups (`RotaryEmbedding::apply_rows`): the queries' rotary parts (64 heads a token, columns
    // 128..192 of each head's row) and the keys' (columns 512..576 of kv_a), both pair layouts.
    let inv_freq: Vec<f32> = (0..32).map(|i| 1.0 / 50_000f32.powf(2.0 * i as f32 / 64.0)).collect();
    for (n, group, cols, off, interleave) in
        [(1usize, 64usize, 192usize, 128usize, true), (8, 1, 576, 512, true), (33, 64, 192, 128, false)]
    {
        let d = 64;
        let rope = RotaryEmbedding { inv_freq: inv_freq.clone(), attention_factor: 1.2, interleave };
        let x: Vec<f32> = rng.activations(n * group * cols).iter().map(|v| v.to_f32()).collect();
        let xt = Tensor::<B, 2>::from_data(TensorData::new(x.clone(), [n * group, cols]), &device);
        let start = 4000;
        let tables = rope.tables::<B>(start, n, &device);
        let (cos, sin) = rope.host_tables(start, n);
        let got = host(rope.apply_rows(xt.clone(), off, d, group, &tables));
        let mut want = vec![0.0f64; n * group * d];
        for row in 0..n * group {
            let tok = row / group;
            for i in 0..d / 2 {
                let (a, b) = if interleave { (2 * i, 2 * i + 1) } else { (i, i + d / 2) };
                let (a, b) = (f64::from(x[row * cols + off + a]), f64::from(x[row * cols + off + b]));
                let (c, sn) = (f64::from(cos[tok * d / 2 + i]), f64::from(sin[tok * d / 2 + i]));
                want[row * d + i] = a * c - b * sn;
                want[row * d + d / 2 + i] = b * c + a * sn;
            }
        }
        // The generic ops (what the CPU runs), on the GPU.
        let generic = |x: Tensor<B, 2>| {
            let part = x.narrow(1, off, d).reshape([1, n, group, d]).swap_dims(1, 2);
            rope.apply(part, &tables).swap_dims(1, 2).reshape([n * group, d])
        };
        let e = err(&got, &want);
        let e_generic = err(&host(generic(xt.clone())), &want);
        let ok = e <= 1e-6;
        failed |= !ok;
        let us = time(&device, || drop(rope.apply_rows(xt.clone(), off, d, group, &tables)));
        let us_generic = time(&device, || drop(generic(xt.clone())));
        let layout = if interleave { "interleaved" } else { "rotate-half" };
        println!(
            "| rope ({layout}) | {n} x {group} rows of {cols}, cols {off}.. | {e:.1e} | {e_generic:.1e} | {us:.1} | {us_generic:.1} | {ok} |"
        );
        rows.push(
            serde_json::json!({"op": "rope_rows", "n": n, "group": group, "cols": cols, "interleave": interleave,
            "error": e, "generic_error": e_generic, "kernel_us": us, "generic_us": us_generic, "ok": ok}),
        );
    }
    // The new latents straight into the cache (`cuda_ops::mla_latent_write`: kv_a norm + RoPE + scatter in one
    // launch), Kimi-K2's 512 + 64, against f64; the pool's other rows must stay as they were.
    for (n, interleave) in [(1usize, true), (37, false)] {
        let (r, rot, pool_rows) = (512usize, 64usize, 1000usize);
        let (width, half) = (r + rot, rot / 2);
        let pool0: Vec<f32> = (0..pool_rows * width).map(|_| rng.next_f32() - 0.5).collect();
        let kv: Vec<f32> = (0..n * width).map(|_| (rng.next_f32() - 0.5) * 4.0).collect();
        let w: Vec<f32> = (0..r).map(|_| 0.5 + rng.next_f32()).collect();
        let cos: Vec<f32> = (0..n * half).map(|_| rng.next_f32() * 2.0 - 1.0).collect();
        let sin: Vec<f32> = (0..n * half).map(|_| rng.next_f32() * 2.0 - 1.0).collect();
        let slots: Vec<u32> = (0..n).map(|i| ((i * 409 + 17) % pool_rows) as u32).collect();
        let t2 =
            |v: &Vec<f32>, shape: [usize; 2]| Tensor::<B, 2>::from_data(TensorData::new(v.clone(), shape), &device);
        let pool = t2(&pool0, [pool_rows, width]);
        let (kv_t, cos_t, sin_t) = (t2(&kv, [n, width]), t2(&cos, [n, half]), t2(&sin, [n, half]));
        let w_t = Tensor::<B, 1>::from_data(TensorData::new(w.clone(), [r]), &device);
        let eps = 1e-6;
        // The slots already on the device, as a decode step's layers pass them (the timing below uploads them).
        let slots_t = Tensor::<B, 1, Int>::from_data(
            TensorData::new(slots.iter().map(|&s| s as i32).collect::<Vec<_>>(), [slots.len()]),
            &device,
        );
        let wrote = match eyrie_model::cuda_ops::mla_latent_write(
            &pool,
            &kv_t,
            &w_t,
            eps,
            &cos_t,
            &sin_t,
            interleave,
            &slots,
            Some(&slots_t),
        ) {
            Ok(()) => true,
            Err(e) => {
                println!("mla_latent_write refused: {e}");
                false
            }
        };
        let got = host(pool.clone());
        let mut want: Vec<f64> = pool0.iter().map(|&v| f64::from(v)).collect();
        for t in 0..n {
            let row = &kv[t * width..(t + 1) * width];
            let ms = row[..r].iter().map(|v| f64::from(*v) * f64::from(*v)).sum::<f64>() / r as f64;
            let inv = 1.0 / (ms + eps).sqrt();
            let dst = slots[t] as usize * width;
            for c in 0..r {
                want[dst + c] = f64::from(row[c]) * inv * f64::from(w[c]);
            }
            for i in 0..half {
                let (a, b) = if interleave { (2 * i, 2 * i + 1) } else { (i, half + i) };
                let (a, b) = (f64::from(row[r + a]), f64::from(row[r + b]));
                let (c, sn) = (f64::from(cos[t * half + i]), f64::from(sin[t * half + i]));
                want[dst + r + i] = a * c - b * sn;
                want[dst + r + half + i] = b * c + a * sn;
            }
        }
        let e = err(&got, &want);
        let untouched = (0..pool_rows)
            .filter(|p| !slots.contains(&(*p as u32)))
            .all(|p| got[p * width..(p + 1) * width] == pool0[p * width..(p + 1) * width]);
        let ok = wrote && untouched && e <= 1e-6;
        failed |= !ok;
        let us = time(&device, || {
            let _ = eyrie_model::cuda_ops::mla_latent_write(
                &pool, &kv_t, &w_t, eps, &cos_t, &sin_t, interleave, &slots, None,
            );
        });
        println!(
            "| mla_latent_write (other rows untouched: {untouched}) | {n} rows of 512 + 64 into {pool_rows} | {e:.1e} | - | {us:.1} | - | {ok} |"
        );
        rows.push(serde_json::json!({"op": "mla_latent_write", "n": n, "error": e, "untouched": untouched,
            "kernel_us": us, "ok": ok}));
    }
    // The absorbed MLA on CUDA (`cuda_ops::mla_absorbed`: query absorption + RoPE, attention over the paged
    // cache, value absorption) at Kimi-K2's shapes, against an f64 host reference of the same math.
    {
        use eyrie_model::cuda_ops::{MlaDims, mla_absorbed};
        use eyrie_quant::cuda::attention::{PagedRows, mla_attention_reference};
        let dims = MlaDims { heads: 64, nope: 128, rot: 64, vd: 128, r: 512 };
        let MlaDims { heads, nope, rot, vd, r } = dims;
        let (half, width, block) = (rot / 2, r + rot, 16);
        for (n, interleave) in [(1usize, true), (5, false), (40, true)] {
            // n rows of 3 sequences (lengths 257..), each row seeing its sequence's positions up to its own.
            let lens: Vec<usize> = (0..3).map(|s| 257 + 61 * s).collect();
            let max_blocks = lens.iter().max().unwrap().div_ceil(block);
            let tables: Vec<u32> = (0..3 * max_blocks).map(|i| ((i * 7) % (3 * max_blocks)) as u32).collect();
            let row_seq: Vec<u32> = (0..n).map(|i| (i % 3) as u32).collect();
            let row_len: Vec<u32> = (0..n).map(|i| (lens[i % 3] - i / 3) as u32).collect();
            let paged = PagedRows { row_seq, row_len, tables, max_blocks, block_size: block };
            let packed: Vec<i32> = paged.packed().iter().map(|&v| v as i32).collect();
            let paged_t = Tensor::<B, 1, Int>::from_data(TensorData::new(packed, [paged.packed_len()]), &device);
            let slots = 3 * max_blocks * block;
            let rand = |rng: &mut SplitMix64, len: usize, s: f32| -> Vec<f32> {
                (0..len).map(|_| (rng.next_f32() - 0.5) * s).collect()
            };
            let q = rand(&mut rng, n * heads * (nope + rot), 2.0);
            let pool = rand(&mut rng, slots * width, 2.0);
            let cos = rand(&mut rng, n * half, 2.0);
            let sin = rand(&mut rng, n * half, 2.0);
            let w: Vec<f32> = (0..heads * (nope + vd) * r)
                .map(|_| half::bf16::from_f32((rng.next_f32() - 0.5) / 8.0).to_f32())
                .collect();
            let t2 =
                |v: &Vec<f32>, shape: [usize; 2]| Tensor::<B, 2>::from_data(TensorData::new(v.clone(), shape), &device);
            let w_t = t2(&w, [heads * (nope + vd), r]).cast(FloatDType::BF16);
            let scale = 1.0 / ((nope + rot) as f64).sqrt();
            let run = || {
                mla_absorbed(
                    &t2(&q, [n, heads * (nope + rot)]),
                    &w_t,
                    &t2(&cos, [n, half]),
                    &t2(&sin, [n, half]),
                    interleave,
                    &t2(&pool, [slots, width]),
                    &paged,
                    Some(&paged_t),
                    scale,
                    dims,
                )
            };
            let got = host(run().ok_or("mla_absorbed refused Kimi-K2's shapes")?);
            // f64 reference: queries (rounded to f32, as the kernel stores them), attention, value absorption.
            let mut qf = vec![0.0f32; n * heads * width];
            for t in 0..n {
                for h in 0..heads {
                    let qb = t * heads * (nope + rot) + h * (nope + rot);
                    for c in 0..r {
                        let acc: f64 =
                            (0..nope).map(|j| f64::from(q[qb + j]) * f64::from(w[(h * (nope + vd) + j) * r + c])).sum();
                        qf[(t * heads + h) * width + c] = acc as f32;
                    }
                    for i in 0..half {
                        let (a, b) = if interleave { (2 * i, 2 * i + 1) } else { (i, half + i) };
                        let (a, b) = (f64::from(q[qb + nope + a]), f64::from(q[qb + nope + b]));
                        let (c, sn) = (f64::from(cos[t * half + i]), f64::from(sin[t * half + i]));
                        qf[(t * heads + h) * width + r + i] = (a * c - b * sn) as f32;
                        qf[(t * heads + h) * width + r + half + i] = (b * c + a * sn) as f32;
                    }
                }
            }
            let o_lat = mla_attention_reference(&qf, &pool, &paged, heads, r, rot, scale);
            let mut want = vec![0.0f64; n * heads * vd];
            for t in 0..n {
                for h in 0..heads {
                    for v in 0..vd {
                        want[t * heads * vd + h * vd + v] = (0..r)
                            .map(|c| {
                                f64::from(o_lat[(t * heads + h) * r + c])
                                    * f64::from(w[(h * (nope + vd) + nope + v) * r + c])
                            })
                            .sum();
                    }
                }
            }
            let e = err(&got, &want);
            let ok = e <= 1e-5;
            failed |= !ok;
            let us = time(&device, || drop(run()));
            println!(
                "| mla_absorbed ({}) | {n} rows, 64 heads, ctx <= 379 | {e:.1e} | - | {us:.1} | - | {ok} |",
                if interleave { "interleaved" } else { "rotate-half" }
            );
            rows.push(serde_json::json!({"op": "mla_absorbed", "n": n, "error": e, "kernel_us": us, "ok": ok}));
        }
    }
    // The MHA form of a prefill chunk (`cuda_ops::mla_mha_prefill`: keys and values expanded through kv_b_proj by
    // the Linear, RoPE, the MHA kernel, segments merged) against the absorbed form (`cuda_ops::mla_absorbed`, checked
    // against the f64 reference above) on the same queries and latents: the two forms are the same sums in another
    // order, so they agree to f32 rounding (1e-5 norm-wise). With and without a cached prefix, in one segment and in
    // segments of 128 keys.
    {
        use eyrie_model::cuda_ops::{MlaDims, mla_absorbed, mla_mha_prefill};
        use eyrie_quant::cuda::attention::PagedRows;
        let dims = MlaDims { heads: 64, nope: 128, rot: 64, vd: 128, r: 512 };
        let MlaDims { heads, nope, rot, vd, r } = dims;
        let (half, width) = (rot / 2, r + rot);
        for (n, start, segment, interleave) in
            [(150usize, 250usize, 0usize, true), (150, 250, 128, false), (300, 0, 0, false), (129, 1000, 256, true)]
        {
            let keys = start + n;
            let rand = |rng: &mut SplitMix64, len: usize, s: f32| -> Vec<f32> {
                (0..len).map(|_| (rng.next_f32() - 0.5) * s).collect()
            };
            let q = rand(&mut rng, n * heads * (nope + rot), 2.0);
            let lat = rand(&mut rng, keys * width, 2.0);
            let cos = rand(&mut rng, n * half, 2.0);
            let sin = rand(&mut rng, n * half, 2.0);
            let w: Vec<f32> = (0..heads * (nope + vd) * r)
                .map(|_| half::bf16::from_f32((rng.next_f32() - 0.5) / 8.0).to_f32())
                .collect();
            let t2 =
                |v: &Vec<f32>, shape: [usize; 2]| Tensor::<B, 2>::from_data(TensorData::new(v.clone(), shape), &device);
            let kv_b = Linear::from_weight(t2(&w, [heads * (nope + vd), r]).cast(FloatDType::BF16));
            let scale = 1.0 / ((nope + rot) as f64).sqrt();
            let paged = PagedRows::contiguous_chunk(n, start);
            let (q_t, cos_t, sin_t, lat_t) =
                (t2(&q, [n, heads * (nope + rot)]), t2(&cos, [n, half]), t2(&sin, [n, half]), t2(&lat, [keys, width]));
            let want = host(
                mla_absorbed(&q_t, &kv_b.weight, &cos_t, &sin_t, interleave, &lat_t, &paged, None, scale, dims)
                    .ok_or("mla_absorbed refused Kimi-K2's shapes")?,
            );
            let run = || {
                mla_mha_prefill(
                    &q_t,
                    &cos_t,
                    &sin_t,
                    interleave,
                    &lat_t,
                    |c| kv_b.forward(c),
                    start,
                    scale,
                    dims,
                    segment,
                )
            };
            let got = host(run().ok_or("mla_mha_prefill refused Kimi-K2's shapes")?);
            let want64: Vec<f64> = want.iter().map(|&x| f64::from(x)).collect();
            let e = err(&got, &want64);
            let ok = e <= 1e-5;
            failed |= !ok;
            let us = time(&device, || drop(run()));
            let segs = if segment == 0 { 1 } else { keys.div_ceil(segment) };
            println!(
                "| mla_mha_prefill vs mla_absorbed ({segs} segments) | {n} rows after {start}, 64 heads | {e:.1e} | - | {us:.1} | - | {ok} |"
            );
            rows.push(serde_json::json!({"op": "mla_mha_prefill", "n": n, "start": start, "segments": segs,
                "error": e, "kernel_us": us, "ok": ok}));
        }
    }
    // Greedy picks on the device (`sampling::device_argmax`: eyrie-quant's `cuda::sampling::argmax_rows`) against
    // the host's `sampling::argmax` on the same rows: random rows of Kimi's and the tiny model's vocabulary, ties of
    // the maximum far apart, NaN, infinities, all -inf. Ids must be equal; the time against copying the rows to the
    // host and picking there.
    {
        use eyrie_model::sampling::{argmax, device_argmax};
        for (rows_n, vocab) in [(1usize, 163_840usize), (64, 163_840), (7, 1024)] {
            let mut v: Vec<f32> = (0..rows_n * vocab).map(|_| rng.next_f32() * 20.0 - 10.0).collect();
            for r in 0..rows_n {
                let row = &mut v[r * vocab..(r + 1) * vocab];
                match r % 4 {
                    1 => {
                        for i in [vocab - 1, vocab / 3, 5 + r] {
                            row[i] = 11.0;
                        }
                    }
                    2 => {
                        for (i, x) in row.iter_mut().enumerate() {
                            if i % 3 == 0 {
                                *x = f32::NAN;
                            }
                        }
                        row[vocab / 2] = f32::INFINITY;
                    }
                    3 if r == 3 => row.iter_mut().for_each(|x| *x = f32::NEG_INFINITY),
                    _ => {}
                }
            }
            let want: Vec<u32> = v.chunks(vocab).map(argmax).collect();
            let t = Tensor::<B, 2>::from_data(TensorData::new(v.clone(), [rows_n, vocab]), &device);
            let got = device_argmax(&t).ok_or("device_argmax: no device path on CUDA")??;
            let ok = got == want;
            failed |= !ok;
            let us = time(&device, || drop(device_argmax(&t)));
            let host_us = time(&device, || {
                let h = host(t.clone());
                drop(h.chunks(vocab).map(argmax).collect::<Vec<_>>());
            });
            println!(
                "| device_argmax ({} of {rows_n} ids equal) | {rows_n} x {vocab} | - | - | {us:.1} | {host_us:.1} (copy + host argmax) | {ok} |",
                got.iter().zip(&want).filter(|(a, b)| a == b).count()
            );
            rows.push(serde_json::json!({"op": "device_argmax", "rows": rows_n, "vocab": vocab, "equal": ok,
                "kernel_us": us, "host_us": host_us, "ok": ok}));
        }
    }
    // The MoE router on the device (`eyrie_quant::cuda::router`: top-k and grouping kernels) against the host
    // reference (`moe::route` on the sigmoid of the same logits, `Routing::new` of the device's choices), at
    // Kimi-K2's router (384 experts, one group) and DeepSeek-V3's (256 experts, 8 groups, 4 kept): ids and the
    // grouping exact, weights within 1e-6 (the sigmoid's exp differs by an ulp between host and device).
    {
        use eyrie_model::moe::{RouterParams, route};
        use eyrie_quant::cuda::Routing;
        use eyrie_quant::cuda::router::{RouterSpec, route_on_device};
        for (experts, n_group, topk_group) in [(384usize, 1usize, 1usize), (256, 8, 4)] {
            let spec = RouterSpec {
                experts,
                n_group,
                topk_group,
                top_k: 8,
                norm_topk_prob: true,
                routed_scaling_factor: 2.827,
            };
            let params =
                RouterParams { top_k: 8, n_group, topk_group, norm_topk_prob: true, routed_scaling_factor: 2.827 };
            for m in [1usize, 8, 64, 777, 8192] {
                let logits: Vec<f32> = (0..m * experts).map(|_| (rng.next_f32() - 0.5) * 8.0).collect();
                let bias: Vec<f32> = (0..experts).map(|_| (rng.next_f32() - 0.5) * 0.1).collect();
                let lt = Tensor::<B, 2>::from_data(TensorData::new(logits.clone(), [m, experts]), &device);
                let bt = Tensor::<B, 1>::from_data(TensorData::new(bias.clone(), [experts]), &device);
                let lc = burn_cubecl::kernel::into_contiguous(lt.into_primitive().tensor());
                let bc = burn_cubecl::kernel::into_contiguous(bt.into_primitive().tensor());
                let client = lc.client.clone();
                let run = || route_on_device(&client, &spec, &lc.handle, &bc.handle, m, None);
                let got = run()?.read_back(&client)?;
                let scores: Vec<f32> = logits.iter().map(|&x| (1.0 / (1.0 + (-f64::from(x)).exp())) as f32).collect();
                let want = route(&scores, &bias, &params);
                let ids = got.ids.clone().ok_or("the device router returned no ids")?;
                let want_ids: Vec<u32> = want.experts.iter().map(|&e| e as u32).collect();
                // A choice that differs from the host's counts unless the two experts' selection keys (score +
                // bias) are within 1e-6 of each other: an ulp of the sigmoid between host and device may order a
                // near-tie either way (seen once in 8192 x 8 choices); such a token's weights are not compared
                // (a different eighth expert changes every weight's normalization).
                let key = |t: usize, e: u32| f64::from(scores[t * experts + e as usize]) + f64::from(bias[e as usize]);
                let (mut id_mismatch, mut ties, mut w_err) = (0usize, 0usize, 0.0f64);
                for t in 0..m {
                    let mut tie = false;
                    for j in t * 8..t * 8 + 8 {
                        let (a, b) = (ids[j], want_ids[j]);
                        if a != b {
                            if (key(t, a) - key(t, b)).abs() <= 1e-6 {
                                tie = true;
                            } else {
                                id_mismatch += 1;
                            }
                        }
                    }
                    if tie {
                        ties += 1;
                        continue;
                    }
                    for j in t * 8..t * 8 + 8 {
                        let (a, b) = (got.weights[j], want.weights[j]);
                        w_err = w_err.max(f64::from((a - b).abs()) / f64::from(b.abs()));
                    }
                }
                let grouping = Routing::new(&ids, m, 8, experts)?;
                let b = grouping.class_bounds.map(|v| v as u32);
                let grouped = got.experts == grouping.experts
                    && got.offsets == grouping.offsets
                    && got.pairs == grouping.pairs
                    && got.bounds == b;
                let ok = id_mismatch == 0 && w_err <= 1e-6 && grouped;
                failed |= !ok;
                let us = time(&device, || drop(run()));
                println!(
                    "| moe router e{experts} groups {n_group}/{topk_group} (ids differing: {id_mismatch}, tokens with a near-tie: {ties}, grouping exact: {grouped}, bounds {b:?}) | {m} tokens | {w_err:.1e} | - | {us:.1} | - | {ok} |"
                );
                rows.push(serde_json::json!({"op": "moe_router", "experts": experts, "n_group": n_group,
                    "m": m, "ids_differing": id_mismatch, "near_tie_tokens": ties, "weight_error": w_err, "grouping_exact": grouped,
                    "kernel_us": us, "ok": ok}));
            }
        }
    }
    // A whole MoE block (router, fused INT4 experts, shared expert) with the routing chosen on the device vs on
    // the host: the same experts and weights up to the sigmoid's last bit, so outputs within 1e-6.
    {
        use eyrie_model::fused_moe::{set_host_router, set_route_split};
        use eyrie_model::linear::StoredLinear;
        use eyrie_model::mlp::{Expert, Mlp};
        use eyrie_model::moe::{Moe, RouterParams};
        use eyrie_quant::burn::Int4Tensors;
        use eyrie_quant::cuda::{MoeExperts, MoeShape};
        let (d, inter, experts) = (1024usize, 256usize, 384usize);
        let shape = MoeShape { hidden: d, inter, experts, group: 32 };
        let ex = MoeExperts::random(shape, 5)?;
        let int4 = |w: &eyrie_quant::PackedInt4| StoredLinear::Int4(Box::new(Int4Tensors::<B>::upload(w, &device)));
        let list: Vec<Expert<B>> = (0..experts)
            .map(|e| Expert { gate_proj: int4(ex.gate(e)), up_proj: int4(ex.up(e)), down_proj: int4(ex.down(e)) })
            .collect();
        let dense = |rng: &mut SplitMix64, out: usize, inp: usize, s: f32| {
            let w: Vec<f32> = (0..out * inp).map(|_| (rng.next_f32() - 0.5) * s).collect();
            Linear::from_weight(
                Tensor::<B, 2>::from_data(TensorData::new(w, [out, inp]), &device).cast(FloatDType::BF16),
            )
        };
        let mut moe = Moe {
            gate: dense(&mut rng, experts, d, 0.2),
            e_score_correction_bias: (0..experts).map(|_| (rng.next_f32() - 0.5) * 0.1).collect(),
            experts: list,
            fused: None,
            shared_experts: Mlp {
                gate_proj: dense(&mut rng, inter, d, 0.1),
                up_proj: dense(&mut rng, inter, d, 0.1),
                down_proj: dense(&mut rng, d, inter, 0.1),
            },
            params: RouterParams {
                top_k: 8,
                n_group: 1,
                topk_group: 1,
                norm_topk_prob: true,
                routed_scaling_factor: 2.827,
            },
            device_router: None,
        };
        if !moe.fuse(false) || moe.device_router.is_none() {
            return Err("the test block was not fused with a device router".into());
        }
        // The fused buffers as the kernels read them: made on the device by burn's reshape/permute (tiled, since
        // 1024 and 256 are multiples of 128), bit for bit eyrie-quant's host layout of the same experts.
        {
            let (f, want) = (moe.fused.as_ref().ok_or("fused")?, ex.kernel_layout());
            let words =
                |t: &Tensor<B, 2, Int>| -> Vec<u32> { t.clone().into_data().iter::<i64>().map(|v| v as u32).collect() };
            let bits = |t: &Tensor<B, 2>| -> Vec<u16> {
                t.clone().into_data().iter::<f32>().map(|v| half::bf16::from_f32(v).to_bits()).collect()
            };
            let want_bits = |v: &[half::bf16]| -> Vec<u16> { v.iter().map(|b| b.to_bits()).collect() };
            let ok = shape.tiled()
                && words(&f.w13) == want.w13
                && words(&f.w2) == want.w2
                && bits(&f.s13) == want_bits(&want.s13)
                && bits(&f.s2) == want_bits(&want.s2);
            failed |= !ok;
            println!(
                "| fused experts' tiled layout made on the device == host layout | {d} x {inter}, {experts} experts | - | - | - | - | {ok} |"
            );
            rows.push(serde_json::json!({"op": "fused_experts_tiled_layout", "hidden": d, "inter": inter, "ok": ok}));
        }
        for m in [1usize, 8, 100, 3000] {
            let x: Vec<f32> = (0..m * d).map(|_| (rng.next_f32() - 0.5) * 2.0).collect();
            let xt = Tensor::<B, 2>::from_data(TensorData::new(x, [m, d]), &device);
            set_host_router(true);
            let host_out = host(moe.forward(xt.clone()));
            let us_host = time(&device, || drop(moe.forward(xt.clone())));
            set_host_router(false);
            let dev_out = host(moe.forward(xt.clone()));
            let us_dev = time(&device, || drop(moe.forward(xt.clone())));
            // The input's split written by the route launch (the default) against the layer's own split launch.
            set_route_split(false);
            let own_split = host(moe.forward(xt.clone()));
            let us_own = time(&device, || drop(moe.forward(xt.clone())));
            set_route_split(true);
            let same_split = own_split == dev_out;
            println!(
                "| moe block, input split in the route launch == its own launch (bit-identical: {same_split}) | {m} x {d}, 384 experts top-8 | - | - | {us_dev:.1} | {us_own:.1} | {same_split} |"
            );
            failed |= !same_split;
            rows.push(serde_json::json!({"op": "moe_block_route_split", "m": m, "bit_identical": same_split,
                "route_split_us": us_dev, "own_split_us": us_own, "ok": same_split}));
            let want: Vec<f64> = host_out.iter().map(|&v| f64::from(v)).collect();
            let e = err(&dev_out, &want);
            let same = dev_out == host_out;
            let ok = e <= 1e-6;
            failed |= !ok;
            println!(
                "| moe block, device vs host router (bit-identical: {same}) | {m} x {d}, 384 experts top-8 | {e:.1e} | - | {us_dev:.1} | {us_host:.1} | {ok} |"
            );
            rows.push(serde_json::json!({"op": "moe_block_device_router", "m": m, "error_vs_host_router": e,
                "bit_identical": same, "kernel_us": us_dev, "host_router_us": us_host, "ok": ok}));
            // From `TILED_GEMM_MIN_TOKENS` the experts run as the tiled grouped GEMM (`moe_tiled`): the same block
            // on the 16-tokens-a-pass kernels (another kernel, the same math) must agree within 1e-6.
            if m >= eyrie_quant::cuda::gpu::TILED_GEMM_MIN_TOKENS {
                eyrie_quant::cuda::set_tiled_gemm(false);
                let passes = host(moe.forward(xt.clone()));
                let us_passes = time(&device, || drop(moe.forward(xt.clone())));
                eyrie_quant::cuda::set_tiled_gemm(true);
                let want: Vec<f64> = passes.iter().map(|&v| f64::from(v)).collect();
                let e = err(&dev_out, &want);
                let ok = e <= 1e-6;
                failed |= !ok;
                println!(
                    "| moe block, tiled grouped GEMM vs 16 tokens a pass | {m} x {d}, 384 experts top-8 | {e:.1e} | - | {us_dev:.1} | {us_passes:.1} | {ok} |"
                );
                rows.push(serde_json::json!({"op": "moe_block_tiled_gemm", "m": m, "error_vs_passes": e,
                    "tiled_us": us_dev, "passes_us": us_passes, "ok": ok}));
            }
        }
    }
    // Out of device memory (last: it fills the device): buffers of 30 GiB until the device has no room for one
    // more (each takes a page of its own), with a small tensor read after each. The failed allocation must come
    // back as an error of that read, naming the allocation (CubeCL's device thread panicked instead, and later
    // reads returned whatever the kernels made of the unbound buffer: vendor/cubecl-cuda, "Eyrie patch"); after
    // the buffers are dropped the device must work again (what the engine relies on to fail one step and go on).
    {
        let small = || Tensor::<B, 1>::from_floats([1.0, 2.0, 3.0, 4.0], &device);
        let probe = burn_cubecl::kernel::into_contiguous(small().into_primitive().tensor());
        let client = probe.client.clone();
        let mut held = Vec::new();
        let mut error = None;
        for _ in 0..8 {
            held.push(client.empty(30 << 30));
            if let Err(e) = (small() * 2.0).try_into_data() {
                error = Some(format!("{e:?}"));
                break;
            }
        }
        let buffers = held.len();
        drop(held);
        B::memory_cleanup(&device);
        let after = (small() * 2.0).try_into_data().map(|d| d.to_vec::<f32>());
        let recovered = matches!(&after, Ok(Ok(v)) if v == &[2.0, 4.0, 6.0, 8.0]);
        let named = error.as_deref().is_some_and(|e| e.contains("allocate"));
        let ok = named && recovered;
        failed |= !ok;
        let first_line = error.as_deref().map_or("none", |e| e.lines().next().unwrap_or(""));
        println!(
            "| out of device memory (error at buffer {buffers} of 30 GiB: {}, device works after: {recovered}) | - | - | - | - | - | {ok} |",
            first_line.chars().take(160).collect::<String>().replace('|', "/")
        );
        rows.push(serde_json::json!({"op": "out_of_memory", "buffers": buffers, "error": error,
            "recovered": recovered, "ok": ok}));
    }
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(&serde_json::json!({"rows": rows}))? + "\n")?;
    }
    if failed {
        eprintln!("FAILED: a GPU path differs from the reference beyond tolerance");
        std::process::exit(1);
    }
    Ok(())
}
