//! GPU check of eyrie-model's own CUDA paths (issue 4) against the generic burn ops and an f64 CPU reference,
//! with timings: the one-launch RMSNorm (`cuda_ops::rms_norm`) at Kimi-K2's norm widths and a Linear with BF16
//! weights (the GEMV path, `cuda_ops::gemv`) against the same Linear's generic f32 matmul.
//!
//! Tolerance, norm-wise `max|gpu - ref| / max|ref|`: 1e-6 for RMSNorm (f32, sums in another order) against the
//! f64 reference; 1e-5 for the GEMV against the f64 reference (the generic path's TF32 matmul is printed beside
//! it, ~1e-3). Exit status 1 on a mismatch. usage: gpu_ops [--json PATH]

use std::time::Instant;

use burn::backend::Cuda;
use burn::backend::cuda::CudaDevice;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor, TensorData};
use eyrie_model::linear::Linear;
use eyrie_model::rms_norm::RmsNorm;
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
    for (n, out, inp) in [(1usize, 1536usize, 7168usize), (4, 7168, 2048), (16, 2048, 7168)] {
        let x: Vec<f32> = rng.activations(n * inp).iter().map(|v| v.to_f32()).collect();
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
            "| linear (BF16 weights) | {n} x {inp} -> {out} | {e:.1e} | {e_generic:.1e} | {us:.1} | {us_generic:.1} | {ok} |"
        );
        rows.push(serde_json::json!({"op": "linear_bf16", "n": n, "in": inp, "out": out, "error": e,
            "generic_error": e_generic, "kernel_us": us, "generic_us": us_generic, "ok": ok}));
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
