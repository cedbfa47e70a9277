//! GPU kernel checks and benchmarks (issue 4): the `gpu_kernels` program of eyrie-quant, built here in release
//! with the `cuda` feature (CubeCL loads the CUDA driver and NVRTC at run time, so no CUDA is needed to build) and
//! run on a machine with an NVIDIA GPU.
//!
//! - `cargo xtask gpu-test`: builds `.device-kern/{gpu_kernels, gpu_gemv, gpu_ops, gpu_attention, gpu_gemm,
//!   gpu_prefill_attention}` (stripped) and runs the six GPU checks when this machine has a GPU; otherwise compresses them and prints the command to run on the device
//!   machine (carrying `.device-kern`).
//! - `cargo xtask bench kernels`: same build, then the MoE (decode and prefill widths) and MLA-attention benchmarks
//!   and their torch peers, the prefill GEMM against cuBLAS and burn, and the prefill chunks' MHA-form attention
//!   against the absorbed kernel and its torch peer in one run, writing `bench/kernels.json`,
//!   `bench/kernels_prefill.json`, `bench/kernels_peer.json`, `bench/attention.json`, `bench/attention_peer.json`,
//!   `bench/gemm.json`, `bench/prefill_attention.json` and `bench/prefill_attention_peer.json` and printing the
//!   tables.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};

use crate::{cargo, run};

/// Folder (ignored through .git/info/exclude) that carries the binary to the device machine.
const DIR: &str = ".device-kern";

/// Makes `root/name` and lists it in .git/info/exclude (a carried folder must be ignored by git).
fn carry_dir(root: &Path, name: &str) -> Result<std::path::PathBuf> {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).with_context(|| dir.display().to_string())?;
    let exclude = root.join(".git/info/exclude");
    let line = format!("/{name}/");
    if let Ok(text) = std::fs::read_to_string(&exclude)
        && !text.lines().any(|l| l.trim() == line)
    {
        std::fs::write(&exclude, format!("{text}\n{line}\n")).with_context(|| exclude.display().to_string())?;
    }
    Ok(dir)
}

/// Builds the stripped release `gpu_kernels`, `gpu_attention`, `gpu_gemm` and `gpu_prefill_attention`
/// (eyrie-quant's kernel programs) into `.device-kern/`.
pub fn bundle(root: &Path) -> Result<()> {
    let dir = carry_dir(root, DIR)?;
    let target = std::env::var("CARGO_TARGET_DIR").map_or_else(|_| root.join("target"), Into::into);
    for example in ["gpu_kernels", "gpu_attention", "gpu_gemm", "gpu_prefill_attention"] {
        run(cargo()
            .args(["build", "--release", "--locked", "--package", "eyrie-quant", "--features", "cuda", "--example"])
            .arg(example))?;
        let bin = dir.join(example);
        std::fs::copy(target.join("release/examples").join(example), &bin)
            .with_context(|| format!("copying {example}"))?;
        run(Command::new("strip").arg(&bin))?;
    }
    Ok(())
}

/// True when an NVIDIA GPU answers here.
fn has_gpu() -> bool {
    Command::new("nvidia-smi").arg("-L").output().is_ok_and(|o| o.status.success())
}

/// The GPU checks of `cargo xtask gpu-test`: program and arguments, each exiting 1 on a mismatch.
const CHECKS: [(&str, &str); 6] = [
    ("gpu_kernels", "check"),
    ("gpu_gemv", ""),
    ("gpu_ops", ""),
    ("gpu_attention", "--quick"),
    ("gpu_gemm", "--quick"),
    ("gpu_prefill_attention", "--quick"),
];

/// `cargo xtask gpu-test`: the fused INT4 MoE (`gpu_kernels check`), the BF16-weight GEMV (`gpu_gemv`), the
/// model's CUDA paths (`gpu_ops`: RMSNorm, BF16 Linear) and MLA attention over the paged cache with the cache write
/// (`gpu_attention --quick`: every check, a short benchmark), the f32-exact cuBLAS GEMM (`gpu_gemm --quick`) and
/// the prefill chunks' MHA-form attention (`gpu_prefill_attention --quick`), each against its CPU reference. cuBLAS must be on the library path (e.g. `LD_LIBRARY_PATH=/usr/local/cuda/lib64`).
pub fn gpu_test(root: &Path) -> Result<()> {
    bundle(root)?;
    let dir = root.join(DIR);
    for (package, features, example) in [("eyrie-quant", "cuda", "gpu_gemv"), ("eyrie-model", "cuda", "gpu_ops")] {
        run(cargo()
            .args(["build", "--release", "--locked", "--package", package, "--features", features, "--example"])
            .arg(example))?;
        let target = std::env::var("CARGO_TARGET_DIR").map_or_else(|_| root.join("target"), Into::into);
        let bin = dir.join(example);
        std::fs::copy(target.join("release/examples").join(example), &bin)
            .with_context(|| format!("copying {example}"))?;
        run(Command::new("strip").arg(&bin))?;
    }
    if has_gpu() {
        for (program, arg) in CHECKS {
            let mut cmd = Command::new(dir.join(program));
            if !arg.is_empty() {
                cmd.arg(arg);
            }
            run(&mut cmd)?;
        }
        return Ok(());
    }
    // Six stripped CUDA binaries exceed the 64 MiB a device call carries: compress them.
    for (program, _) in CHECKS {
        run(Command::new("gzip").args(["-1", "-f"]).arg(dir.join(program)))?;
    }
    let runs: Vec<String> = CHECKS.iter().map(|(p, a)| format!("./{DIR}/{p} {a}").trim_end().to_string()).collect();
    eprintln!(
        "no GPU here: carry {DIR} to the GPU machine and run, from the repository root:\n  (cd {DIR} && gunzip -f *.gz) && {}",
        runs.join(" && ")
    );
    Ok(())
}

/// The device command of `cargo xtask bench kernels`, writing into `$OUT` (or `bench/` when run here). The MoE
/// layer at the launch shapes the engine uses (`--no-sweep`: a sweep's fastest shape, picked by wall clock, is not
/// what serving runs), its GPU time at 16 and 32 calls behind the copy and their slope (session 30).
pub fn bench_command(out: &str) -> String {
    format!(
        "./{DIR}/gpu_kernels bench --no-sweep --calls 16,32 --json {out}/kernels.json && \
         ./{DIR}/gpu_kernels prefill --json {out}/kernels_prefill.json && \
         python3 scripts/bench_kernels_peer.py --out {out}/kernels_peer.json && \
         python3 scripts/bench_kernels_peer.py --merge {out}/kernels.json {out}/kernels_peer.json && \
         ./{DIR}/gpu_attention --json {out}/attention.json && \
         python3 scripts/bench_attention_peer.py --json {out}/attention_peer.json && \
         ./{DIR}/gpu_gemm --json {out}/gemm.json && \
         ./{DIR}/gpu_prefill_attention --json {out}/prefill_attention.json && \
         python3 scripts/prefill_attention_peer.py --json {out}/prefill_attention_peer.json"
    )
}

/// `cargo xtask bench kernels`.
pub fn bench_kernels(root: &Path) -> Result<()> {
    bundle(root)?;
    if has_gpu() {
        return run(Command::new("sh").arg("-c").arg(bench_command("bench")));
    }
    eprintln!(
        "no GPU here: carry {DIR} to the GPU machine and run there, from the repository root:\n  {}\n\
         then copy kernels.json, kernels_prefill.json, kernels_peer.json, attention.json, attention_peer.json, \
         gemm.json, prefill_attention.json and prefill_attention_peer.json into bench/",
        bench_command("$OUT")
    );
    Ok(())
}

/// Folder carrying the multi-GPU programs (eyrie-model examples with NCCL).
const PAR_DIR: &str = ".device-par";

/// Builds eyrie-model's `example` with NCCL into `.device-par/` (`strip -g`: function names stay for backtraces).
fn bundle_parallel(root: &Path, example: &str) -> Result<std::path::PathBuf> {
    let dir = carry_dir(root, PAR_DIR)?;
    run(cargo()
        .args(["build", "--release", "--locked", "--package", "eyrie-model", "--features", "nccl", "--example"])
        .arg(example))?;
    let target = std::env::var("CARGO_TARGET_DIR").map_or_else(|_| root.join("target"), Into::into);
    let bin = dir.join(example);
    std::fs::copy(target.join("release/examples").join(example), &bin).with_context(|| format!("copying {example}"))?;
    run(Command::new("strip").arg("-g").arg(&bin))?;
    Ok(bin)
}

/// `cargo xtask bench decode [--tp N] [--ep N] [bench_decode args]`: the full-width Kimi-K2 slice on 1 GPU and
/// on the tp x ep group (plus tp alone and ep alone), writing `bench/decode.json`; without GPUs here it builds
/// `.device-par/bench_decode` and prints the device command.
pub fn bench_decode(root: &Path, args: &[String]) -> Result<()> {
    let (mut tp, mut ep, mut rest) = (1usize, 1usize, Vec::new());
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--tp" => tp = it.next().context("--tp needs a value")?.parse().context("--tp")?,
            "--ep" => ep = it.next().context("--ep needs a value")?.parse().context("--ep")?,
            _ => rest.push(a.clone()),
        }
    }
    let mut splits = vec![(1, 1)];
    for s in [(tp, 1), (1, ep), (tp, ep)] {
        if s.0 >= 1 && s.1 >= 1 && !splits.contains(&s) {
            splits.push(s);
        }
    }
    let splits = splits.iter().map(|(t, e)| format!("{t}x{e}")).collect::<Vec<_>>().join(",");
    let bin = bundle_parallel(root, "bench_decode")?;
    // The same program on the CPU with a small config first: a bug found here costs no GPU time.
    run(Command::new(&bin).args([
        "--device",
        "cpu",
        "--config",
        "fixtures/model/yarn_qlora",
        "--splits",
        &splits,
        "--batch",
        "1,4",
        "--context",
        "40",
        "--steps",
        "4",
    ]))
    .context("the CPU smoke run of bench_decode failed")?;
    let command =
        |out: &str| format!("./{PAR_DIR}/bench_decode --splits {splits} --json {out}/decode.json {}", rest.join(" "));
    if has_gpu() {
        return run(Command::new("bash").arg("-c").arg(command("bench")));
    }
    eprintln!(
        "no GPU here: carry {PAR_DIR} to a machine with {} GPUs and run there, from the repository root:\n  {}\n\
         then copy decode.json into bench/",
        tp.max(ep),
        command("$OUT")
    );
    Ok(())
}
