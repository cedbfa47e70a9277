//! `cargo xtask kernels` (every fused-MoE kernel specialisation compiled for an architecture through NVRTC, no GPU
//! needed: registers, shared memory, spills, checked against the architecture's per-block limits) and `cargo xtask
//! build --cuda X.Y` (the release `eyrie` with cudarc bindings for one CUDA version).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{cargo, run};

/// The NVRTC and headers `--install` puts under the target dir (pip wheels; CUDA 12.8, the RTX PRO 6000 target).
const PIP_CUDA: &str = "12.8";

fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from)
}

/// Where `--install` puts the pip packages (`nvidia/cuda_nvrtc/lib`, `nvidia/cuda_runtime/include`).
fn pip_dir(root: &Path) -> PathBuf {
    target_dir(root).join(format!("nvidia-cu{PIP_CUDA}"))
}

/// The pip command that installs NVRTC and the CUDA runtime headers into `dir` (and nvcc's, for `crt/mma.h`, which
/// the tensor-core kernels' source includes through `mma.h`, and CCCL's, for `cuda/barrier`, which the attention
/// kernel's `cp.async` copies include).
fn pip_command(dir: &Path) -> Command {
    let mut cmd = Command::new("python3");
    cmd.args(["-m", "pip", "install", "--no-deps", "--target"]).arg(dir).args([
        format!("nvidia-cuda-nvrtc-cu12=={PIP_CUDA}.*"),
        format!("nvidia-cuda-runtime-cu12=={PIP_CUDA}.*"),
        format!("nvidia-cuda-nvcc-cu12=={PIP_CUDA}.*"),
        format!("nvidia-cuda-cccl-cu12=={PIP_CUDA}.*"),
    ]);
    cmd
}

/// A folder holding `crt/mma.h` beside `include` (a toolkit's own include folder, or pip's `cuda_nvcc/include`
/// next to `cuda_runtime/include`), if any.
fn crt_include(include: &Path) -> Option<PathBuf> {
    let nvcc = include.parent()?.parent()?.join("cuda_nvcc/include");
    [include.to_path_buf(), nvcc].into_iter().find(|d| d.join("crt/mma.h").is_file())
}

/// A folder holding libcu++'s `cuda/barrier` (the attention kernel's `cp.async` copies include it) for the
/// toolkit include folder `include`: itself, its `cccl` (CUDA 13), or pip's `cuda_cccl/include` beside it.
fn cccl_include(include: &Path) -> Option<PathBuf> {
    let pip = include.parent()?.parent()?.join("cuda_cccl/include");
    [include.to_path_buf(), include.join("cccl"), pip].into_iter().find(|d| d.join("cuda/barrier").is_file())
}

/// `libnvrtc.so*` in `dir` (not the builtins or `.alt` variants), newest name first.
fn nvrtc_in(dir: &Path) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            name.starts_with("libnvrtc.so") && !name.contains("builtins") && !name.contains(".alt.")
        })
        .collect();
    found.sort();
    found.pop()
}

/// The `nvidia` package folder of python3's site-packages, if the pip wheels are installed there.
fn python_nvidia_dir() -> Option<PathBuf> {
    let out = Command::new("python3")
        .args(["-c", "import nvidia.cuda_nvrtc as m, os; print(os.path.dirname(list(m.__path__)[0]))"])
        .output()
        .ok()?;
    let s = String::from_utf8(out.stdout).ok()?;
    out.status.success().then(|| PathBuf::from(s.trim()))
}

/// Finds libnvrtc and the folder holding `cuda_runtime.h`: `--nvrtc` / `EYRIE_NVRTC` and `--cuda-include` /
/// `EYRIE_CUDA_INCLUDE` first, then the pip install under the target dir, python3's site-packages, `CUDA_PATH`,
/// `/usr/local/cuda`.
fn find_cuda(root: &Path, nvrtc: Option<PathBuf>, include: Option<PathBuf>) -> Result<(PathBuf, PathBuf)> {
    let nvrtc = nvrtc.or_else(|| std::env::var_os("EYRIE_NVRTC").map(PathBuf::from));
    let include = include.or_else(|| std::env::var_os("EYRIE_CUDA_INCLUDE").map(PathBuf::from));
    // (lib dir, include dir) pairs, in order of preference.
    let mut places: Vec<(PathBuf, PathBuf)> = Vec::new();
    for nv in [Some(pip_dir(root).join("nvidia")), python_nvidia_dir()].into_iter().flatten() {
        places.push((nv.join("cuda_nvrtc/lib"), nv.join("cuda_runtime/include")));
    }
    for cuda in
        [std::env::var_os("CUDA_PATH").map(PathBuf::from), Some(PathBuf::from("/usr/local/cuda"))].into_iter().flatten()
    {
        places.push((cuda.join("lib64"), cuda.join("include")));
    }
    let lib = match nvrtc {
        Some(p) if p.is_file() => p,
        Some(p) => bail!("NVRTC not found at {} (--nvrtc / EYRIE_NVRTC)", p.display()),
        None => places.iter().find_map(|(lib, _)| nvrtc_in(lib)).with_context(|| {
            format!(
                "libnvrtc.so not found (looked in {}); install CUDA {PIP_CUDA}'s NVRTC and headers with \
                 `cargo xtask kernels --install` (runs `{}`), or pass --nvrtc PATH/libnvrtc.so.12 \
                 (or set EYRIE_NVRTC)",
                places.iter().map(|(l, _)| l.display().to_string()).collect::<Vec<_>>().join(", "),
                crate::render(&pip_command(&pip_dir(root)))
            )
        })?,
    };
    let include = match include {
        Some(p) => p,
        None => {
            // Prefer the headers next to the NVRTC found (same pip tree or toolkit), then any other place.
            let lib_dir = lib.parent().map(Path::to_path_buf).unwrap_or_default();
            let mut order: Vec<&PathBuf> = places.iter().filter(|(l, _)| *l == lib_dir).map(|(_, i)| i).collect();
            order.extend(places.iter().map(|(_, i)| i));
            order.into_iter().find(|i| i.join("cuda_runtime.h").is_file()).cloned().with_context(|| {
                format!(
                    "cuda_runtime.h not found (the kernels' source includes it and cuda_bf16.h): pip install \
                     nvidia-cuda-runtime-cu12=={PIP_CUDA}.* (`cargo xtask kernels --install`), or pass \
                     --cuda-include DIR (or set EYRIE_CUDA_INCLUDE)"
                )
            })?
        }
    };
    if !include.join("cuda_runtime.h").is_file() {
        bail!("{} has no cuda_runtime.h (--cuda-include / EYRIE_CUDA_INCLUDE)", include.display());
    }
    Ok((lib, include))
}

/// `cargo xtask kernels [--arch sm_120] [--json FILE] [--nvrtc PATH] [--cuda-include DIR] [--install]
/// [--dump DIR] [--only LABEL_PART] [--shape H,I,E,G] [--topk K]`.
pub fn kernels(root: &Path, args: &[String]) -> Result<()> {
    let (mut arch, mut json, mut nvrtc, mut include, mut install) = ("sm_120".to_string(), None, None, None, false);
    let mut pass = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().cloned().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--arch" => arch = val()?,
            "--json" => json = Some(PathBuf::from(val()?)),
            "--nvrtc" => nvrtc = Some(PathBuf::from(val()?)),
            "--cuda-include" => include = Some(PathBuf::from(val()?)),
            "--install" => install = true,
            "--dump" | "--only" | "--shape" | "--topk" => pass.extend([a.clone(), val()?]),
            other => bail!("unknown argument {other:?} for `cargo xtask kernels`"),
        }
    }
    if install {
        run(&mut pip_command(&pip_dir(root)))?;
    }
    let cuda = find_cuda(root, nvrtc, include)?;
    let json = json.unwrap_or_else(|| target_dir(root).join(format!("kernels-{arch}.json")));
    run(cargo().args([
        "build",
        "--release",
        "--locked",
        "--package",
        "eyrie-quant",
        "--features",
        "cuda",
        "--example",
        "kernel_resources",
    ]))?;
    let bin = target_dir(root).join("release/examples/kernel_resources");
    run_resources(&bin, &arch, &cuda, &json, &pass)
}

/// Runs `kernel_resources` for `arch` with NVRTC and headers `(lib, include)`, the extra arguments `pass`.
fn run_resources(
    bin: &Path,
    arch: &str,
    (lib, include): &(PathBuf, PathBuf),
    json: &Path,
    pass: &[String],
) -> Result<()> {
    let crt = crt_include(include).with_context(|| {
        format!(
            "crt/mma.h not found beside {} (the tensor-core kernels include mma.h): `cargo xtask kernels --install` \
             (pip's nvidia-cuda-nvcc-cu12=={PIP_CUDA}.*)",
            include.display()
        )
    })?;
    let cccl = cccl_include(include).with_context(|| {
        format!(
            "cuda/barrier not found beside {} (the attention kernel's cp.async copies include it): `cargo xtask \
             kernels --install` (pip's nvidia-cuda-cccl-cu12=={PIP_CUDA}.*)",
            include.display()
        )
    })?;
    let mut cmd = Command::new(bin);
    cmd.args(["--arch", arch, "--nvrtc"]).arg(lib).arg("--include").arg(include);
    for extra in [crt, cccl] {
        if extra != *include {
            cmd.arg("--include").arg(&extra);
        }
    }
    run(cmd.arg("--json").arg(json).args(pass))
        .with_context(|| format!("kernel check for {arch} failed (see the table above)"))
}

/// CI's kernel check (`cargo xtask ci`, after the tests): every kernel specialisation compiled by NVRTC for sm_120,
/// each within SM120's per-block limits (issue 4's check, so that a kernel NVRTC refuses or one that outgrows the
/// user's GPU fails CI, not a GPU run), and CubeCL's code reproducible: the MoE down kernels dumped twice give
/// byte-identical CUBINs (bench/REPORT.md, session 24: what makes a dump an exact check of a refactor). Uses the
/// `kernel_resources` example that `cargo test --workspace` built (no release build); installs CUDA 12.8's NVRTC
/// and headers from pip under the target dir when they are not found.
pub fn ci(root: &Path) -> Result<()> {
    let bin = test_built_example(root, "kernel_resources")?;
    let cuda = match find_cuda(root, None, None) {
        Ok(found) => found,
        Err(_) => {
            run(&mut pip_command(&pip_dir(root)))?;
            find_cuda(root, None, None)?
        }
    };
    let out = target_dir(root);
    run_resources(&bin, "sm_120", &cuda, &out.join("kernels-sm_120.json"), &[])?;
    let dumps = [out.join("kernel-dump-a"), out.join("kernel-dump-b")];
    for d in &dumps {
        if d.exists() {
            std::fs::remove_dir_all(d).with_context(|| format!("removing {}", d.display()))?;
        }
        let pass = ["--only".to_string(), "mma down".to_string(), "--dump".to_string(), d.display().to_string()];
        run_resources(&bin, "sm_90", &cuda, &out.join("kernels-sm_90-dump.json"), &pass)?;
    }
    let mut compared = 0;
    for entry in std::fs::read_dir(&dumps[0]).with_context(|| format!("reading {}", dumps[0].display()))? {
        let a = entry?.path();
        if a.extension().is_some_and(|e| e == "cubin") {
            let b = dumps[1].join(a.file_name().unwrap_or_default());
            let (x, y) = (std::fs::read(&a)?, std::fs::read(&b).with_context(|| format!("reading {}", b.display()))?);
            if x != y {
                bail!(
                    "{} and {} differ: CubeCL's code for a kernel changed between two processes",
                    a.display(),
                    b.display()
                );
            }
            compared += 1;
        }
    }
    if compared == 0 {
        bail!("no CUBIN in {}: the determinism check compared nothing", dumps[0].display());
    }
    println!("kernel dumps: {compared} CUBINs byte-identical across two processes");
    Ok(())
}

/// The path of example `name` as `cargo test --workspace` built it (with the workspace's features), from cargo's
/// JSON messages (a no-op build right after the tests).
fn test_built_example(root: &Path, name: &str) -> Result<PathBuf> {
    let out = cargo()
        .current_dir(root)
        .args(["test", "--workspace", "--no-run", "--locked", "--message-format=json"])
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("running cargo test --no-run")?;
    if !out.status.success() {
        bail!("cargo test --workspace --no-run failed");
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|m| {
            m["reason"] == "compiler-artifact"
                && m["target"]["name"] == name
                && m["target"]["kind"].as_array().is_some_and(|k| k.iter().any(|k| k == "example"))
        })
        .and_then(|m| m["executable"].as_str().map(PathBuf::from))
        .with_context(|| format!("cargo test --workspace did not build the example {name}"))
}

/// cudarc's `CUDARC_CUDA_VERSION` for a CUDA version `X.Y` (`12.8` -> `12080`), if cudarc 0.19 supports it.
pub(crate) fn cudarc_version(cuda: &str) -> Option<String> {
    const SUPPORTED: &[&str] = &[
        "11.4", "11.5", "11.6", "11.7", "11.8", "12.0", "12.1", "12.2", "12.3", "12.4", "12.5", "12.6", "12.8", "12.9",
        "13.0", "13.1", "13.2", "13.3", "13.4",
    ];
    let (major, minor) = cuda.split_once('.')?;
    SUPPORTED.contains(&cuda).then(|| format!("{major}0{minor}0"))
}

/// `cargo xtask build --cuda X.Y [--check]`: the release `eyrie` (eyrie-server, feature `cuda`) whose cudarc
/// bindings target CUDA X.Y. cudarc's build script reads `CUDARC_CUDA_VERSION` before its features, so no manifest
/// changes; the build goes to its own target dir (`target/cuda-X.Y`), so the default build (which finds no nvcc
/// here and falls back to cudarc's newest bindings) is not rebuilt each time one switches.
pub fn build(root: &Path, args: &[String]) -> Result<()> {
    let (mut cuda, mut check) = (None, false);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--cuda" => cuda = Some(it.next().context("--cuda needs a version such as 12.8")?.clone()),
            "--check" => check = true,
            other => bail!("unknown argument {other:?} for `cargo xtask build`"),
        }
    }
    let cuda = cuda.context("usage: cargo xtask build --cuda 12.8 [--check]")?;
    let version =
        cudarc_version(&cuda).with_context(|| format!("CUDA {cuda} is not one cudarc 0.19 has bindings for"))?;
    let dir = target_dir(root).join(format!("cuda-{cuda}"));
    let mut cmd = cargo();
    cmd.env("CUDARC_CUDA_VERSION", &version).arg(if check { "check" } else { "build" });
    if !check {
        cmd.arg("--release");
    }
    cmd.args(["--locked", "--package", "eyrie-server", "--features", "cuda", "--bin", "eyrie", "--target-dir"])
        .arg(&dir);
    eprintln!("CUDARC_CUDA_VERSION={version}");
    run(&mut cmd)?;
    if !check {
        eprintln!("built {} (cudarc bindings: CUDA {cuda})", dir.join("release/eyrie").display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_versions_map_to_cudarc_features() {
        assert_eq!(cudarc_version("12.8").as_deref(), Some("12080"));
        assert_eq!(cudarc_version("13.0").as_deref(), Some("13000"));
        assert_eq!(cudarc_version("12.7"), None, "cudarc has no 12.7 bindings");
        assert_eq!(cudarc_version("12"), None);
    }

    #[test]
    fn nvrtc_lookup_skips_builtins_and_alt_libraries() {
        let dir = std::env::temp_dir().join(format!("xtask-nvrtc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["libnvrtc-builtins.so.12.8", "libnvrtc.alt.so.12", "__init__.py"] {
            std::fs::write(dir.join(f), "").unwrap();
        }
        assert_eq!(nvrtc_in(&dir), None);
        std::fs::write(dir.join("libnvrtc.so.12"), "").unwrap();
        assert_eq!(nvrtc_in(&dir), Some(dir.join("libnvrtc.so.12")));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
