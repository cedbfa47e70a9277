//! Project automation: `cargo xtask <command>`. Every CI step and benchmark starts here.
//!
//! xtask depends on none of the workspace's library crates at build time: it drives them through cargo, so a
//! broken library never breaks the tool that diagnoses it.

mod bench;
mod bench_serve;
mod gpu;
mod kernels;
mod tidy;
mod tiny_model;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  ci                      what CI runs: fmt check, tidy, clippy -D warnings, the whole test suite
  tidy                    check the crate graph (cargo metadata) and file hygiene
  test                    the whole test suite only (cargo test --workspace)
  fixtures [quant|model]  regenerate committed fixtures with the Python reference libraries
  gpu-bundle              release binary + GPU check inputs in .device/ for the device machine
                          (then there: python3 scripts/gpu_check.py)
  bench load              safetensors index/map and CPU dequantization throughput (bench/load.json)
  bench kernels           fused INT4 MoE and MLA attention kernels vs torch peers and copy bandwidth, on a GPU
                          (bench/kernels*.json, bench/attention*.json;
                          without a GPU here: builds .device-kern/ and prints the device command)
  bench decode [--tp N] [--ep N] [args]
                          full-width Kimi-K2 slice (synthetic weights) decode on 1 GPU and on tp x ep GPUs over
                          NCCL (bench/decode.json; without GPUs here: builds .device-par/ and prints the command)
  bench serve [--url URL] serving benchmark (scripts/bench_serve.py): starts eyrie serve on the embedded tiny
                          model unless --url is given (bench/serve.json)
  gpu-test                GPU kernels vs their CPU references (MoE, GEMV, RMSNorm/Linear, MLA attention, cache
                          write; on a GPU, else builds .device-kern/ and prints the device command)
  kernels [--arch sm_120] [--json FILE] [--nvrtc PATH] [--cuda-include DIR] [--install] [--only TEXT] [--dump DIR]
                          every kernel specialisation (fused MoE on CUDA and tensor cores, MLA attention, BF16
                          GEMV, ...) compiled by NVRTC for an architecture (no GPU):
                          registers, shared memory, spills; fails if one does not fit a block (default JSON:
                          target/kernels-<arch>.json; --install pip-installs CUDA 12.8's NVRTC and headers, with
                          nvcc's crt/mma.h and CCCL's cuda/barrier; --only keeps the specialisations whose label contains TEXT; --dump
                          writes each one's CUDA C++ into DIR)
  build --cuda X.Y [--check]
                          release eyrie (eyrie-server, cuda) with cudarc bindings for CUDA X.Y, in target/cuda-X.Y
  tiny-model [--check]    regenerate crates/server/assets/tiny-model (eyrie serve's default model), or check it
";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = workspace_root();
    std::env::set_current_dir(&root).with_context(|| format!("cd {}", root.display()))?;
    match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some("tidy") => tidy::run(&root),
        Some("test") => test(),
        Some("fixtures") => fixtures(&args[1..]),
        Some("bench") => bench::run(&root, &args[1..]),
        Some("gpu-bundle") => gpu_bundle(&root),
        Some("gpu-test") => gpu::gpu_test(&root),
        Some("kernels") => kernels::kernels(&root, &args[1..]),
        Some("build") => kernels::build(&root, &args[1..]),
        Some("tiny-model") => tiny_model::run(&root, &args[1..]),
        Some("help" | "-h" | "--help") | None => {
            print!("{USAGE}");
            Ok(())
        }
        Some(other) => bail!("unknown command {other:?}\n{USAGE}"),
    }
}

/// The workspace root: the parent of xtask's manifest directory.
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."))
}

/// Runs a command, echoing it, and fails with its exit status.
pub(crate) fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("$ {}", render(cmd));
    let status = cmd.status().with_context(|| format!("failed to start {}", render(cmd)))?;
    if !status.success() {
        bail!("{} failed with {status}", render(cmd));
    }
    Ok(())
}

fn render(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn ci() -> Result<()> {
    run(cargo().args(["fmt", "--all", "--", "--check"]))?;
    tidy::run(&workspace_root())?;
    run(cargo().args(["clippy", "--workspace", "--all-targets", "--locked", "--", "-D", "warnings"]))?;
    // eyrie-quant is reusable alone: it must build without the features the workspace turns on for it (a
    // `cuda`-only item outside `cfg(feature = "cuda")` broke that unnoticed from session 6 to 13).
    run(cargo().args(["check", "--package", "eyrie-quant", "--lib", "--locked"]))?;
    test()?;
    kernels::ci(&workspace_root())
}

fn test() -> Result<()> {
    run(cargo().args(["test", "--workspace", "--locked"]))
}

fn fixtures(args: &[String]) -> Result<()> {
    let which = args.first().map(String::as_str).unwrap_or("all");
    let scripts: &[&str] = match which {
        "quant" => &["scripts/fixtures_quant.py"],
        "model" => &["scripts/fixtures_model.py"],
        "all" => &["scripts/fixtures_quant.py", "scripts/fixtures_model.py"],
        other => bail!("unknown fixture set {other:?} (quant, model, all)"),
    };
    for s in scripts {
        run(Command::new("python3").arg(s))?;
    }
    Ok(())
}

/// Prepares `.device/` (git-ignored through .git/info/exclude) for a GPU run: the stripped release binary and a
/// Kimi-shaped INT4 expert checkpoint written by the real compressed-tensors library.
fn gpu_bundle(root: &Path) -> Result<()> {
    let dir = root.join(".device");
    std::fs::create_dir_all(&dir).with_context(|| dir.display().to_string())?;
    let exclude = root.join(".git/info/exclude");
    if let Ok(text) = std::fs::read_to_string(&exclude)
        && !text.lines().any(|l| l.trim() == "/.device/")
    {
        std::fs::write(&exclude, format!("{text}\n/.device/\n")).with_context(|| exclude.display().to_string())?;
    }
    run(cargo().args(["build", "--release", "--locked", "--package", "eyrie-server", "--bin", "eyrie"]))?;
    let bin = dir.join("eyrie");
    std::fs::copy(root.join("target/release/eyrie"), &bin).context("copying the release binary")?;
    run(Command::new("strip").arg(&bin))?;
    if !dir.join("kimi_expert/model.safetensors").exists()
        && let Err(e) =
            run(Command::new("python3").arg("scripts/kimi_expert_checkpoint.py").arg(dir.join("kimi_expert")))
    {
        // The checkpoint needs torch and compressed-tensors here; without it `gpu_check.py` skips only its
        // Kimi-shaped dequantization check.
        eprintln!(
            "note: no Kimi-shaped expert checkpoint ({e:#}); `pip install torch compressed-tensors` and rerun to \
             include it, or run `python3 scripts/kimi_expert_checkpoint.py .device/kimi_expert` on the device first"
        );
    }
    eprintln!("ready: carry .device and run `python3 scripts/gpu_check.py` on the device machine");
    Ok(())
}
