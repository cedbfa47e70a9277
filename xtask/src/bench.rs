//! `cargo xtask bench <name>`: runs a benchmark program in release mode; each prints a table and writes JSON
//! under `bench/`, which `bench/REPORT.md` summarises.

use std::path::Path;

use anyhow::{Result, bail};

use crate::cargo;

const BENCHES: &[(&str, &str, &str)] = &[
    // (name, package, example)
    ("load", "eyrie-quant", "bench_load"),
    ("spec", "eyrie-spec-decode", "bench_spec"),
    ("sampling", "eyrie-model", "bench_sampling"),
];

pub fn run_bench(root: &Path, args: &[String]) -> Result<()> {
    if args.first().map(String::as_str) == Some("kernels") {
        // GPU benchmark: built here, run where the GPU is (see gpu.rs).
        return crate::gpu::bench_kernels(root);
    }
    if args.first().map(String::as_str) == Some("decode") {
        // Multi-GPU decode benchmark: built here, run where the GPUs are (see gpu.rs).
        return crate::gpu::bench_decode(root, &args[1..]);
    }
    if args.first().map(String::as_str) == Some("serve") {
        // Serving benchmark: starts `eyrie serve` (or uses --url) and runs scripts/bench_serve.py.
        return crate::bench_serve::run_serve(root, &args[1..]);
    }
    let Some(name) = args.first() else {
        bail!("usage: cargo xtask bench <{}> [args...]", names());
    };
    let Some((_, package, example)) = BENCHES.iter().find(|(n, _, _)| n == name) else {
        bail!("unknown benchmark {name:?} (known: {})", names());
    };
    let json = root.join("bench").join(format!("{name}.json"));
    let mut cmd = cargo();
    cmd.args(["run", "--release", "--package", package, "--example", example, "--"]);
    cmd.arg("--json").arg(&json);
    cmd.args(&args[1..]);
    crate::run(&mut cmd)
}

fn names() -> String {
    BENCHES.iter().map(|(n, _, _)| *n).chain(["kernels", "decode", "serve"]).collect::<Vec<_>>().join("|")
}

pub fn run(root: &Path, args: &[String]) -> Result<()> {
    run_bench(root, args)
}
