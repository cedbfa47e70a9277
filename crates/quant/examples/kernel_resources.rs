//! Registers, shared memory and spills of every kernel specialisation (fused MoE, MLA attention, BF16 GEMV) for a CUDA architecture, without a
//! GPU: each specialisation's CUDA C++ (`eyrie_quant::cuda::offline`, CubeCL's own code generator) is compiled by
//! NVRTC for the architecture with `--ptxas-options=-v`, and ptxas's report is checked against the architecture's
//! per-block limits. `cargo xtask kernels` finds NVRTC and the CUDA headers and runs this.
//!
//! ```text
//! kernel_resources --arch sm_120 --nvrtc /path/libnvrtc.so.12 --include /path/cuda_runtime/include \
//!     [--json FILE] [--dump DIR] [--only LABEL_PART] [--shape HIDDEN,INTER,EXPERTS,GROUP --topk 8]
//! ```
//!
//! `--dump DIR` writes each specialisation's CUDA C++ (`LABEL.cu`) and its CUBIN (`LABEL.cubin`) there (the label
//! with every character but letters, digits, `.`, `+` and `-` as `_`, e.g. `route_e384_groups1_1_top8_norm1`): the SASS
//! is then `nvdisasm -c LABEL.cubin` (pip `nvidia-cuda-nvdisasm`), and `scripts/sass_loop.py` counts the
//! instructions of its hottest loop.
//!
//! Exit status 1 when a specialisation does not compile or does not fit a block of the architecture (shared
//! memory, registers); the message names it.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use eyrie_quant::cuda::MoeShape;
use eyrie_quant::cuda::offline::{CudaKernelSource, cuda_source};
use eyrie_quant::cuda::resources::{Arch, BlockNeeds, PtxasUsage, check_limits, log_errors, parse_ptxas_log};
use eyrie_quant::cuda::specs::{
    KIMI_DENSE_K, KIMI_MLA, KIMI_NORM_WIDTHS, KernelSpec, ROUTERS, attention_and_dense_specs, mla_and_norm_specs,
    moe_kernel_specs, router_specs,
};
use serde_json::json;

const KIMI: MoeShape = MoeShape { hidden: 7168, inter: 2048, experts: 384, group: 32 };

type Program = *mut c_void;

/// The few NVRTC entry points used, from a library loaded by path.
struct Nvrtc {
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int,
    create: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> c_int,
    compile: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int,
    log_size: unsafe extern "C" fn(Program, *mut usize) -> c_int,
    log: unsafe extern "C" fn(Program, *mut c_char) -> c_int,
    destroy: unsafe extern "C" fn(*mut Program) -> c_int,
    cubin_size: unsafe extern "C" fn(Program, *mut usize) -> c_int,
    cubin: unsafe extern "C" fn(Program, *mut c_char) -> c_int,
    // Keeps the function pointers above valid.
    _lib: libloading::Library,
}

impl Nvrtc {
    fn load(path: &Path) -> Result<Self> {
        // SAFETY: loading libnvrtc runs its initialisers only; the symbols are looked up with NVRTC's documented
        // C signatures (nvrtc.h, stable since CUDA 11), and the library outlives them in `_lib`.
        unsafe {
            let lib =
                libloading::Library::new(path).with_context(|| format!("cannot load NVRTC from {}", path.display()))?;
            macro_rules! sym {
                ($name:literal) => {
                    *lib.get(concat!($name, "\0").as_bytes())
                        .with_context(|| format!("{} lacks {}", path.display(), $name))?
                };
            }
            Ok(Self {
                version: sym!("nvrtcVersion"),
                create: sym!("nvrtcCreateProgram"),
                compile: sym!("nvrtcCompileProgram"),
                log_size: sym!("nvrtcGetProgramLogSize"),
                log: sym!("nvrtcGetProgramLog"),
                destroy: sym!("nvrtcDestroyProgram"),
                cubin_size: sym!("nvrtcGetCUBINSize"),
                cubin: sym!("nvrtcGetCUBIN"),
                _lib: lib,
            })
        }
    }

    /// (major, minor).
    fn version(&self) -> (i32, i32) {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two valid out-pointers.
        unsafe { (self.version)(&mut major, &mut minor) };
        (major, minor)
    }

    /// Compiles `source`; returns whether NVRTC succeeded, its log (ptxas's report included) and the CUBIN (empty
    /// when the compile failed).
    fn compile(&self, source: &str, name: &str, options: &[String]) -> Result<(bool, String, Vec<u8>)> {
        let src = CString::new(source).context("source has a NUL byte")?;
        let name = CString::new(name).context("name has a NUL byte")?;
        let opts: Vec<CString> = options.iter().map(|o| CString::new(o.as_str())).collect::<Result<_, _>>()?;
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: NUL-terminated strings that outlive the calls, no headers passed (count 0, null arrays), and the
        // program is destroyed once, after its log is copied out.
        unsafe {
            let rc = (self.create)(&mut prog, src.as_ptr(), name.as_ptr(), 0, std::ptr::null(), std::ptr::null());
            if rc != 0 {
                bail!("nvrtcCreateProgram failed ({rc})");
            }
            let ok = (self.compile)(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) == 0;
            let mut size = 0usize;
            (self.log_size)(prog, &mut size);
            let mut buf = vec![0 as c_char; size.max(1)];
            (self.log)(prog, buf.as_mut_ptr());
            let log = CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned();
            let mut cubin = Vec::new();
            let mut size = 0usize;
            if ok && (self.cubin_size)(prog, &mut size) == 0 && size > 0 {
                cubin = vec![0u8; size];
                if (self.cubin)(prog, cubin.as_mut_ptr().cast()) != 0 {
                    cubin.clear();
                }
            }
            (self.destroy)(&mut prog);
            Ok((ok, log, cubin))
        }
    }
}

struct Args {
    arch: Arch,
    nvrtc: PathBuf,
    includes: Vec<PathBuf>,
    json: Option<PathBuf>,
    dump: Option<PathBuf>,
    only: Option<String>,
    shape: MoeShape,
    topk: usize,
}

fn parse_args() -> Result<Args> {
    let mut it = std::env::args().skip(1);
    let (mut arch, mut nvrtc, mut includes, mut json, mut dump, mut only) = (None, None, Vec::new(), None, None, None);
    let (mut shape, mut topk) = (KIMI, 8);
    while let Some(a) = it.next() {
        let mut val = || it.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--arch" => {
                let v = val()?;
                arch = Some(Arch::parse(&v).with_context(|| format!("unknown architecture {v:?} (sm_120, sm_90)"))?)
            }
            "--nvrtc" => nvrtc = Some(PathBuf::from(val()?)),
            "--include" => includes.push(PathBuf::from(val()?)),
            "--json" => json = Some(PathBuf::from(val()?)),
            "--dump" => dump = Some(PathBuf::from(val()?)),
            "--only" => only = Some(val()?),
            "--topk" => topk = val()?.parse().context("--topk")?,
            "--shape" => {
                let v: Vec<usize> =
                    val()?.split(',').map(str::parse).collect::<Result<_, _>>().context("--shape H,I,E,G")?;
                let [hidden, inter, experts, group] = v[..] else { bail!("--shape takes HIDDEN,INTER,EXPERTS,GROUP") };
                shape = MoeShape { hidden, inter, experts, group };
                shape.validate()?;
            }
            other => bail!("unknown argument {other:?}"),
        }
    }
    Ok(Args {
        arch: arch.context("--arch is required")?,
        nvrtc: nvrtc.context("--nvrtc PATH (libnvrtc.so) is required")?,
        includes,
        json,
        dump,
        only,
        shape,
        topk,
    })
}

/// One specialisation's row of the report.
struct Row {
    spec: KernelSpec,
    src: CudaKernelSource,
    usage: Option<PtxasUsage>,
    errors: Vec<String>,
}

/// A specialisation's label as a file name: spaces, `/` and every other character but letters, digits, `.`, `+`
/// and `-` as `_` (the router's labels name "groups 1/1").
fn file_stem(label: &str) -> String {
    label.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '+' | '-') { c } else { '_' }).collect()
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let nvrtc = Nvrtc::load(&args.nvrtc)?;
    let (major, minor) = nvrtc.version();
    let cuda_version = (major * 1000 + minor * 10) as u32;
    let target = args.arch.nvrtc_target();
    let mut options = vec![format!("--gpu-architecture={target}"), "-lineinfo".into(), "--ptxas-options=-v".into()];
    options.extend(args.includes.iter().map(|i| format!("--include-path={}", i.display())));
    eprintln!(
        "NVRTC {major}.{minor} ({}), target {target}, shape {:?}, top-k {}",
        args.nvrtc.display(),
        args.shape,
        args.topk
    );

    let mut rows = Vec::new();
    // The launches the launchers make on this architecture: the MoE's (4-token passes capped where they do not
    // fit), the MLA attention's (warps that fit) and the dense GEMV's at Kimi-K2's widths.
    let limit = args.arch.max_shared_per_block();
    let (r, rot) = KIMI_MLA;
    let mut specs = moe_kernel_specs(&args.shape, args.topk, limit);
    specs.extend(attention_and_dense_specs(r, rot, &KIMI_DENSE_K, limit));
    for router in &ROUTERS {
        specs.extend(router_specs(router, args.shape.hidden));
    }
    specs.extend(mla_and_norm_specs(&KIMI_NORM_WIDTHS));
    if let Some(only) = &args.only {
        specs.retain(|s| s.label().contains(only.as_str()));
        if specs.is_empty() {
            bail!("--only {only:?} matches no kernel specialisation");
        }
    }
    for spec in specs {
        let src = cuda_source(&spec, args.arch, cuda_version).map_err(anyhow::Error::msg)?;
        if let Some(dir) = &args.dump {
            std::fs::create_dir_all(dir)?;
            let file = dir.join(format!("{}.cu", file_stem(&spec.label())));
            std::fs::write(&file, &src.source).with_context(|| file.display().to_string())?;
        }
        let (ok, log, cubin) = nvrtc.compile(&src.source, &format!("{}.cu", src.entry), &options)?;
        if let Some(dir) = &args.dump
            && !cubin.is_empty()
        {
            let file = dir.join(format!("{}.cubin", file_stem(&spec.label())));
            std::fs::write(&file, &cubin).with_context(|| file.display().to_string())?;
        }
        let mut errors: Vec<String> = log_errors(&log).iter().map(|l| l.trim().to_string()).collect();
        if !ok && errors.is_empty() {
            errors.push(format!("NVRTC failed:\n{log}"));
        }
        let entries = parse_ptxas_log(&log);
        let usage = entries.iter().find(|u| u.function.contains(&src.entry)).or(entries.first()).cloned();
        match &usage {
            Some(u) => {
                let needs = BlockNeeds { threads: src.threads, dynamic_smem: src.dynamic_smem };
                errors.extend(check_limits(args.arch, u, &needs).iter().map(ToString::to_string));
            }
            None if ok => errors.push("no ptxas report in the NVRTC log".into()),
            None => {}
        }
        rows.push(Row { spec, src, usage, errors });
    }

    print_table(&args, &rows, (major, minor));
    if let Some(path) = &args.json {
        write_json(path, &args, &rows, (major, minor))?;
        eprintln!("wrote {}", path.display());
    }
    let failed: Vec<String> = rows
        .iter()
        .filter(|r| !r.errors.is_empty())
        .map(|r| format!("{} [{}]: {}", r.src.entry, r.spec.label(), r.errors.join("; ")))
        .collect();
    if !failed.is_empty() {
        bail!(
            "{} of {} kernel specialisations fail on {}:\n  {}",
            failed.len(),
            rows.len(),
            args.arch,
            failed.join("\n  ")
        );
    }
    eprintln!("all {} kernel specialisations fit {}", rows.len(), args.arch);
    Ok(())
}

fn print_table(args: &Args, rows: &[Row], (major, minor): (i32, i32)) {
    let limit = args.arch.max_shared_per_block();
    println!(
        "{} ({}), NVRTC {major}.{minor}: shared memory limit {} B ({} KiB) per block",
        args.arch,
        args.arch.nvrtc_target(),
        limit,
        limit / 1024
    );
    println!(
        "{:<42} {:>7} {:>5} {:>12} {:>12} {:>10} {:>7}  status",
        "kernel", "threads", "regs", "static smem", "dynamic smem", "spill st/ld", "stack"
    );
    for r in rows {
        let u = r.usage.clone().unwrap_or_default();
        let status = if r.errors.is_empty() { "ok".to_string() } else { format!("FAIL: {}", r.errors.join("; ")) };
        println!(
            "{:<42} {:>7} {:>5} {:>12} {:>12} {:>10} {:>7}  {status}",
            r.spec.label(),
            r.src.threads,
            u.registers,
            u.static_smem,
            r.src.dynamic_smem,
            format!("{}/{}", u.spill_stores, u.spill_loads),
            u.stack_frame
        );
    }
}

fn write_json(path: &Path, args: &Args, rows: &[Row], (major, minor): (i32, i32)) -> Result<()> {
    let kernels: Vec<_> = rows
        .iter()
        .map(|r| {
            let u = r.usage.clone().unwrap_or_default();
            let spec = match &r.spec {
                KernelSpec::ExpertRows { act, spec: s } => json!({
                    "act": act.name(), "k": s.k, "rows": s.rows, "rows_at_once": s.rows_at_once, "group": s.group,
                    "topk": s.topk, "tb": s.tb, "rows_per_warp": s.rows_per_warp, "warps": s.warps,
                    "gated": s.gated, "by_token": s.by_token, "prefetch": s.prefetch, "tiled": s.tiled,
                    "address": format!("{:?}", s.address),
                }),
                KernelSpec::ExpertMma { spec: s } => json!({
                    "k": s.k, "rows": s.rows, "group": s.group, "topk": s.topk, "tb": s.tb, "tiles": s.tiles,
                    "tasks": s.tasks, "ksplit": s.ksplit, "gated": s.gated, "by_token": s.by_token, "tiled": s.tiled,
                    "address": format!("{:?}", s.address),
                }),
                KernelSpec::SplitX3 { act, k } | KernelSpec::SplitRows { act, k } => json!({"act": act.name(), "k": k}),
                KernelSpec::TiledExpert { k, rows, group, topk, gated, tiled, address } => json!({
                    "k": k, "rows": rows, "group": group, "topk": topk, "gated": gated, "tiled": tiled,
                    "address": format!("{address:?}"),
                }),
                KernelSpec::TileList => json!({}),
                KernelSpec::Combine { hidden, topk, add, address } => {
                    json!({"hidden": hidden, "topk": topk, "add": add, "address": format!("{address:?}")})
                }
                KernelSpec::Copy => json!({}),
                KernelSpec::MlaAttention { r, rot, warps, hpw } => {
                    json!({"r": r, "rot": rot, "warps": warps, "heads_per_warp": hpw})
                }
                KernelSpec::MlaAttentionDims { r, rot, shape: s } => {
                    json!({"r": r, "rot": rot, "head_warps": s.wh, "key_warps": s.wk, "heads_per_warp": s.hpw, "groups": s.sg})
                }
                KernelSpec::MlaAttentionMma { r, rot, shape: s } => {
                    json!({"r": r, "rot": rot, "tiles": s.tiles, "warps_a_tile": s.wk, "positions": s.pt})
                }
                KernelSpec::MlaAttentionTf32 { r, rot, shape: s } => {
                    json!({"r": r, "rot": rot, "warps": s.warps, "positions": s.pt, "stages": s.stages})
                }
                KernelSpec::MlaCombine { r, halves, one_pass } => json!({"r": r, "halves": halves, "one_pass": one_pass}),
                KernelSpec::MhaPrefill { dims } => json!({"nope": dims.nope, "rot": dims.rot, "vd": dims.vd}),
                KernelSpec::ArgmaxRows => json!({}),
                KernelSpec::Gemv { k, cfg } | KernelSpec::GemvSwiglu { k, cfg } | KernelSpec::GemvNorm { k, cfg } => {
                    json!({"k": k, "warps": cfg.warps, "rows_at_once": cfg.rows_at_once, "tb": cfg.tb})
                }
                KernelSpec::GemvPair { k, a, swiglu_a, b, swiglu_b } => json!({
                    "k": k, "warps": a.warps, "tb": a.tb, "a": {"rows_at_once": a.rows_at_once, "ksplit": a.ksplit,
                    "unroll": a.unroll, "swiglu": swiglu_a}, "b": {"rows_at_once": b.rows_at_once, "ksplit": b.ksplit,
                    "unroll": b.unroll, "swiglu": swiglu_b},
                }),
                KernelSpec::GemvMma { k, cfg } => json!({
                    "k": k, "tb": cfg.tb, "tiles": cfg.tiles, "tasks": cfg.tasks, "ksplit": cfg.ksplit, "bv": cfg.bv, "gated": cfg.gated,
                }),
                KernelSpec::SplitBf16x3 | KernelSpec::Sum3 => json!({}),
                KernelSpec::Route { experts, n_group, topk_group, top_k, norm, grouped, split_k } => json!({
                    "experts": experts, "n_group": n_group, "topk_group": topk_group, "top_k": top_k, "norm": norm,
                    "grouped": grouped, "split_k": split_k,
                }),
                KernelSpec::Group { experts } => json!({"experts": experts}),
                KernelSpec::RmsNorm { width, add } => json!({"width": width, "add": add}),
                KernelSpec::RopeRows { half, interleave } => json!({"half": half, "interleave": interleave}),
                KernelSpec::MlaQuery { heads, dims, tb, groups, interleave } => json!({
                    "heads": heads, "nope": dims.0, "rot": dims.1, "vd": dims.2, "r": dims.3, "tb": tb,
                    "groups": groups, "interleave": interleave,
                }),
                KernelSpec::MlaOutput { heads, dims, ra, tb, warps, merge } => json!({
                    "heads": heads, "nope": dims.0, "vd": dims.1, "r": dims.2, "ra": ra, "tb": tb, "warps": warps,
                    "merge": merge,
                }),
                KernelSpec::MlaLatent { r, rot, interleave } => json!({"r": r, "rot": rot, "interleave": interleave}),
            };
            json!({
                "entry": r.src.entry,
                "label": r.spec.label(),
                "spec": spec,
                "threads": r.src.threads,
                "registers": r.usage.as_ref().map(|_| u.registers),
                "static_smem": u.static_smem,
                "dynamic_smem": r.src.dynamic_smem,
                "spill_stores": u.spill_stores,
                "spill_loads": u.spill_loads,
                "stack_frame": u.stack_frame,
                "ok": r.errors.is_empty(),
                "errors": r.errors,
            })
        })
        .collect();
    let doc = json!({
        "arch": args.arch.to_string(),
        "nvrtc_target": args.arch.nvrtc_target(),
        "nvrtc_version": format!("{major}.{minor}"),
        "max_shared_per_block": args.arch.max_shared_per_block(),
        "shape": {"hidden": args.shape.hidden, "inter": args.shape.inter, "experts": args.shape.experts,
                  "group": args.shape.group, "topk": args.topk},
        "kernels": kernels,
    });
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n").with_context(|| path.display().to_string())
}
