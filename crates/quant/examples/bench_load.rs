//! Load benchmark (`cargo xtask bench load`): how fast a Kimi-K2.5-sized checkpoint is indexed and mapped, and how
//! fast INT4 experts dequantize on the CPU, each beside its peer or ceiling measured in the same run.
//!
//! 1. Index: a synthetic checkpoint with Kimi-K2.5's exact tensor layout (61 layers, 384 experts, INT4 routed
//!    experts, ~200k tensors, 64 shards, ~550 GB logical) is written as sparse files (headers real, data holes),
//!    then opened with [`Checkpoint::open`] (every header parsed and validated, every shard memory-mapped, the name
//!    index built). Peer: the `safetensors` Python package opening the same shards and listing their keys.
//! 2. Dequantize: the 24 INT4 Linears one token routes to (8 experts x gate/up/down at Kimi shapes, group 32) on
//!    the CPU, one thread and all threads. Ceiling: memcpy bandwidth of this machine measured in the same run.
//!    Peer: compressed-tensors' own `PackedQuantizationCompressor.decompress` (PyTorch, CPU) on the same shapes.
//!
//! Prints a table and writes JSON (`--json PATH`).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use eyrie_quant::{Checkpoint, Dtype, PackedInt4};
use rayon::prelude::*;
use serde_json::{Value, json};

const HIDDEN: usize = 7168;
const MOE_INTER: usize = 2048;
const GROUP: usize = 32;

struct Args {
    json: Option<PathBuf>,
    shards: usize,
    layers: usize,
    experts: usize,
    reps: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args { json: None, shards: 64, layers: 61, experts: 384, reps: 3 };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{k} needs a value"));
        match k.as_str() {
            "--json" => a.json = Some(PathBuf::from(val()?)),
            "--shards" => a.shards = val()?.parse().map_err(|e| format!("--shards: {e}"))?,
            "--layers" => a.layers = val()?.parse().map_err(|e| format!("--layers: {e}"))?,
            "--experts" => a.experts = val()?.parse().map_err(|e| format!("--experts: {e}"))?,
            "--reps" => a.reps = val()?.parse().map_err(|e| format!("--reps: {e}"))?,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if a.shards == 0 || a.layers < 2 || a.reps == 0 {
        return Err("--shards and --reps must be positive, --layers at least 2".into());
    }
    Ok(a)
}

/// `(name, dtype, shape)` of every tensor of the Kimi-K2.5 text model, with the layer it belongs to (None for
/// embeddings and head).
fn kimi_tensors(layers: usize, experts: usize) -> Vec<(Option<usize>, String, Dtype, Vec<usize>)> {
    let mut t = Vec::new();
    let p = "language_model.model";
    t.push((None, format!("{p}.embed_tokens.weight"), Dtype::BF16, vec![163840, HIDDEN]));
    t.push((None, format!("{p}.norm.weight"), Dtype::BF16, vec![HIDDEN]));
    t.push((None, "language_model.lm_head.weight".into(), Dtype::BF16, vec![163840, HIDDEN]));
    for l in 0..layers {
        let lp = format!("{p}.layers.{l}");
        let mut add = |n: String, d: Dtype, s: Vec<usize>| t.push((Some(l), n, d, s));
        add(format!("{lp}.input_layernorm.weight"), Dtype::BF16, vec![HIDDEN]);
        add(format!("{lp}.post_attention_layernorm.weight"), Dtype::BF16, vec![HIDDEN]);
        for (n, s) in [
            ("q_a_proj", vec![1536, HIDDEN]),
            ("q_a_layernorm", vec![1536]),
            ("q_b_proj", vec![64 * 192, 1536]),
            ("kv_a_proj_with_mqa", vec![576, HIDDEN]),
            ("kv_a_layernorm", vec![512]),
            ("kv_b_proj", vec![64 * 256, 512]),
            ("o_proj", vec![HIDDEN, 64 * 128]),
        ] {
            add(format!("{lp}.self_attn.{n}.weight"), Dtype::BF16, s);
        }
        if l == 0 {
            add(format!("{lp}.mlp.gate_proj.weight"), Dtype::BF16, vec![18432, HIDDEN]);
            add(format!("{lp}.mlp.up_proj.weight"), Dtype::BF16, vec![18432, HIDDEN]);
            add(format!("{lp}.mlp.down_proj.weight"), Dtype::BF16, vec![HIDDEN, 18432]);
            continue;
        }
        add(format!("{lp}.mlp.gate.weight"), Dtype::BF16, vec![experts, HIDDEN]);
        add(format!("{lp}.mlp.gate.e_score_correction_bias"), Dtype::F32, vec![experts]);
        for n in ["gate_proj", "up_proj"] {
            add(format!("{lp}.mlp.shared_experts.{n}.weight"), Dtype::BF16, vec![MOE_INTER, HIDDEN]);
        }
        add(format!("{lp}.mlp.shared_experts.down_proj.weight"), Dtype::BF16, vec![HIDDEN, MOE_INTER]);
        for e in 0..experts {
            for (n, out, inp) in
                [("gate_proj", MOE_INTER, HIDDEN), ("up_proj", MOE_INTER, HIDDEN), ("down_proj", HIDDEN, MOE_INTER)]
            {
                let ep = format!("{lp}.mlp.experts.{e}.{n}");
                add(format!("{ep}.weight_packed"), Dtype::I32, vec![out, inp / 8]);
                add(format!("{ep}.weight_scale"), Dtype::BF16, vec![out, inp / GROUP]);
                add(format!("{ep}.weight_shape"), Dtype::I32, vec![2]);
            }
        }
    }
    t
}

/// Writes one sparse shard: a real header, then a hole as long as the data.
fn write_sparse_shard(path: &Path, tensors: &[(String, Dtype, Vec<usize>)]) -> std::io::Result<u64> {
    let mut header = serde_json::Map::new();
    let mut offset = 0u64;
    for (name, dtype, shape) in tensors {
        let n = (shape.iter().product::<usize>() * dtype.size()) as u64;
        header.insert(
            name.clone(),
            json!({"dtype": dtype.as_str(), "shape": shape, "data_offsets": [offset, offset + n]}),
        );
        offset += n;
    }
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut bytes = serde_json::to_vec(&Value::Object(header))?;
    while bytes.len() % 8 != 0 {
        bytes.push(b' ');
    }
    let mut f = File::create(path)?;
    f.write_all(&(bytes.len() as u64).to_le_bytes())?;
    f.write_all(&bytes)?;
    f.set_len(8 + bytes.len() as u64 + offset)?;
    Ok(offset)
}

struct Synthetic {
    dir: tempfile::TempDir,
    tensors: usize,
    logical_bytes: u64,
    header_bytes: u64,
}

fn build_synthetic(a: &Args) -> std::io::Result<Synthetic> {
    let dir = tempfile::tempdir()?;
    let all = kimi_tensors(a.layers, a.experts);
    let mut shards: Vec<Vec<(String, Dtype, Vec<usize>)>> = vec![Vec::new(); a.shards];
    let mut weight_map = BTreeMap::new();
    for (layer, name, d, s) in &all {
        let shard = match layer {
            None => 0,
            Some(l) => (l * a.shards / a.layers).min(a.shards - 1),
        };
        shards[shard].push((name.clone(), *d, s.clone()));
    }
    let mut logical = 0;
    let mut header_bytes = 0;
    for (i, tensors) in shards.iter().enumerate() {
        // Not zero-padded consistently, as in the real K2.5 release.
        let file = format!("model-{:05}-of-{:06}.safetensors", i + 1, a.shards);
        for (n, _, _) in tensors {
            weight_map.insert(n.clone(), file.clone());
        }
        let path = dir.path().join(&file);
        logical += write_sparse_shard(&path, tensors)?;
        header_bytes += std::fs::metadata(&path)?.len();
    }
    header_bytes -= logical;
    let index = json!({"metadata": {"total_size": logical}, "weight_map": weight_map});
    std::fs::write(dir.path().join("model.safetensors.index.json"), serde_json::to_vec(&index)?)?;
    Ok(Synthetic { dir, tensors: all.len(), logical_bytes: logical, header_bytes })
}

fn best_of<T>(reps: usize, mut f: impl FnMut() -> T) -> (f64, T) {
    let mut best = f64::INFINITY;
    let mut last = None;
    for _ in 0..reps {
        let t = Instant::now();
        let v = f();
        best = best.min(t.elapsed().as_secs_f64());
        last = Some(v);
    }
    (best, last.expect("reps > 0"))
}

/// Deterministic pseudo-random words (xorshift), never all zero.
fn words(n: usize, seed: u64) -> Vec<u32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u32
        })
        .collect()
}

fn routed_experts() -> Vec<PackedInt4> {
    let mut v = Vec::new();
    for e in 0..8u64 {
        for (k, (out, inp)) in [(MOE_INTER, HIDDEN), (MOE_INTER, HIDDEN), (HIDDEN, MOE_INTER)].into_iter().enumerate() {
            let seed = e * 3 + k as u64 + 1;
            let scales: Vec<f32> = words(out * inp / GROUP, seed + 100)
                .into_iter()
                .map(|w| half::bf16::from_f32(1e-3 + (w % 1000) as f32 * 1e-5).to_f32())
                .collect();
            v.push(
                PackedInt4::new(out, inp, GROUP, words(out * inp / 8, seed), scales, Dtype::BF16, None)
                    .expect("valid Kimi expert shapes"),
            );
        }
    }
    v
}

const PY_INDEX_PEER: &str = r#"
import sys, time, json, glob
from safetensors import safe_open
d = sys.argv[1]; reps = int(sys.argv[2])
best = 1e9; n = 0
for _ in range(reps):
    t = time.perf_counter(); n = 0
    for f in sorted(glob.glob(d + "/*.safetensors")):
        with safe_open(f, framework="np") as h:
            n += len(list(h.keys()))
    best = min(best, time.perf_counter() - t)
print(json.dumps({"seconds": best, "tensors": n}))
"#;

const PY_DEQUANT_PEER: &str = r#"
import sys, time, json, torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationScheme, QuantizationArgs
reps = int(sys.argv[1]); threads = int(sys.argv[2]); torch.set_num_threads(threads)
scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))
g = torch.Generator().manual_seed(0)
mods = []
for e in range(8):
    for (o, i) in [(2048, 7168), (2048, 7168), (7168, 2048)]:
        mods.append({"weight_packed": torch.randint(-2**31, 2**31 - 1, (o, i // 8), dtype=torch.int32, generator=g),
                     "weight_scale": (torch.rand(o, i // 32, generator=g) * 1e-2 + 1e-3).to(torch.bfloat16),
                     "weight_shape": torch.tensor([o, i], dtype=torch.int64)})
best = 1e9
for _ in range(reps):
    t = time.perf_counter()
    for m in mods:
        w = PackedQuantizationCompressor.decompress(m, scheme)["weight"]
    best = min(best, time.perf_counter() - t)
print(json.dumps({"seconds": best, "dtype": str(w.dtype), "torch": torch.__version__}))
"#;

fn python_peer(script: &str, args: &[String]) -> Result<Value, String> {
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .map_err(|e| format!("python3 not runnable: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(err.lines().last().unwrap_or("failed").to_string());
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("bad peer output: {e}"))
}

fn memcpy_gbps(bytes: usize, threads: usize, reps: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let chunk = bytes.div_ceil(threads);
    let (secs, ()) = best_of(reps, || {
        dst.par_chunks_mut(chunk).zip(src.par_chunks(chunk)).for_each(|(d, s)| d.copy_from_slice(s));
    });
    std::hint::black_box(&dst);
    // read + write bytes, as the device copy-bandwidth figures count them
    2.0 * bytes as f64 / secs / 1e9
}

fn main() {
    let a = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!(
                "bench_load: {e}\nusage: bench_load [--json PATH] [--shards 64] [--layers 61] [--experts 384] [--reps 3]"
            );
            std::process::exit(2);
        }
    };
    let threads = rayon::current_num_threads();
    let mut rows: Vec<(String, String, String)> = Vec::new();
    let mut report = serde_json::Map::new();

    // 1. Index and map.
    let t = Instant::now();
    let syn = match build_synthetic(&a) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("bench_load: writing the synthetic checkpoint failed: {e}");
            std::process::exit(1);
        }
    };
    eprintln!(
        "synthetic checkpoint: {} tensors, {:.1} GB logical, written in {:.1} s",
        syn.tensors,
        syn.logical_bytes as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );
    let (open_s, ckpt) = best_of(a.reps, || Checkpoint::open(syn.dir.path()));
    let ckpt = match ckpt {
        Ok(c) => c,
        Err(e) => {
            eprintln!("bench_load: opening the synthetic checkpoint failed: {e}");
            std::process::exit(1);
        }
    };
    assert_eq!(ckpt.len(), syn.tensors, "every tensor indexed exactly once");
    let (lookup_s, found) = best_of(a.reps, || ckpt.names().filter(|n| ckpt.info(n).is_some()).count());
    assert_eq!(found, syn.tensors);
    let peer = python_peer(PY_INDEX_PEER, &[syn.dir.path().display().to_string(), a.reps.to_string()]);
    rows.push((
        format!("open {} shards, {} tensors", a.shards, syn.tensors),
        format!(
            "{:.1} ms ({:.0} GB/s logical, {:.2}M tensors/s)",
            open_s * 1e3,
            syn.logical_bytes as f64 / open_s / 1e9,
            syn.tensors as f64 / open_s / 1e6
        ),
        match &peer {
            Ok(p) => {
                format!("python safetensors safe_open+keys: {:.1} ms", p["seconds"].as_f64().unwrap_or(f64::NAN) * 1e3)
            }
            Err(e) => format!("peer unavailable: {e}"),
        },
    ));
    rows.push((
        "look up every tensor by name".into(),
        format!("{:.1} ms ({:.0} ns/tensor)", lookup_s * 1e3, lookup_s / syn.tensors as f64 * 1e9),
        String::new(),
    ));
    report.insert(
        "index".into(),
        json!({
            "shards": a.shards, "tensors": syn.tensors, "logical_bytes": syn.logical_bytes,
            "header_bytes": syn.header_bytes, "open_seconds": open_s, "lookup_all_seconds": lookup_s,
            "logical_gb_per_s": syn.logical_bytes as f64 / open_s / 1e9,
            "header_mb_per_s": syn.header_bytes as f64 / open_s / 1e6,
            "peer_python_safetensors": peer.clone().unwrap_or_else(|e| json!({"error": e})),
        }),
    );
    drop(ckpt);
    drop(syn);

    // 2. Dequantize the routed experts of one token.
    let experts = routed_experts();
    let in_bytes: usize = experts.iter().map(|w| w.checkpoint_bytes()).sum();
    let out_bytes: usize = experts.iter().map(|w| w.out_features() * w.in_features() * 2).sum();
    let (one_s, _) =
        best_of(a.reps, || experts.iter().map(|w| std::hint::black_box(w.dequantize_bf16()).len()).sum::<usize>());
    let (all_s, _) = best_of(a.reps, || {
        experts
            .par_iter()
            .map(|w| {
                let (o, i) = (w.out_features(), w.in_features());
                let rows_per = 64;
                let mut out = vec![half::bf16::ZERO; o * i];
                out.par_chunks_mut(rows_per * i).enumerate().for_each(|(k, chunk)| {
                    let r0 = k * rows_per;
                    w.dequantize_rows_bf16_into(r0..r0 + chunk.len() / i, chunk).expect("row range in bounds");
                });
                std::hint::black_box(out).len()
            })
            .sum::<usize>()
    });
    let copy1 = memcpy_gbps(out_bytes, 1, a.reps);
    let copyn = memcpy_gbps(out_bytes, threads, a.reps);
    let peer1 = python_peer(PY_DEQUANT_PEER, &[a.reps.to_string(), "1".into()]);
    let peern = python_peer(PY_DEQUANT_PEER, &[a.reps.to_string(), threads.to_string()]);
    let fmt_peer = |p: &Result<Value, String>| match p {
        Ok(v) => {
            let s = v["seconds"].as_f64().unwrap_or(f64::NAN);
            format!("compressed-tensors decompress: {:.1} ms ({:.2} GB/s out)", s * 1e3, out_bytes as f64 / s / 1e9)
        }
        Err(e) => format!("peer unavailable: {e}"),
    };
    rows.push((
        "dequant 24 routed INT4 linears, 1 thread, bf16".into(),
        format!(
            "{:.1} ms ({:.2} GB/s out, {:.2} GB/s in)",
            one_s * 1e3,
            out_bytes as f64 / one_s / 1e9,
            in_bytes as f64 / one_s / 1e9
        ),
        format!("{}; memcpy ceiling {copy1:.1} GB/s", fmt_peer(&peer1)),
    ));
    rows.push((
        format!("dequant 24 routed INT4 linears, {threads} threads, bf16"),
        format!(
            "{:.1} ms ({:.2} GB/s out, {:.2} GB/s in)",
            all_s * 1e3,
            out_bytes as f64 / all_s / 1e9,
            in_bytes as f64 / all_s / 1e9
        ),
        format!("{}; memcpy ceiling {copyn:.1} GB/s", fmt_peer(&peern)),
    ));
    report.insert(
        "dequant".into(),
        json!({
            "linears": experts.len(), "in_bytes": in_bytes, "out_bytes_bf16": out_bytes,
            "one_thread_seconds": one_s, "all_threads_seconds": all_s, "threads": threads,
            "memcpy_gb_per_s_1_thread": copy1, "memcpy_gb_per_s_all_threads": copyn,
            "peer_compressed_tensors_1_thread": peer1.unwrap_or_else(|e| json!({"error": e})),
            "peer_compressed_tensors_all_threads": peern.unwrap_or_else(|e| json!({"error": e})),
        }),
    );

    let w0 = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    let w1 = rows.iter().map(|r| r.1.len()).max().unwrap_or(0);
    println!("{:<w0$}  {:<w1$}  peer / ceiling (same run)", "what", "eyrie");
    for (a, b, c) in &rows {
        println!("{a:<w0$}  {b:<w1$}  {c}");
    }
    if let Some(path) = &a.json {
        report.insert("machine".into(), json!({"threads": threads}));
        let text = serde_json::to_string_pretty(&Value::Object(report)).expect("JSON of plain values");
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("bench_load: cannot write {}: {e}", path.display());
            std::process::exit(1);
        }
        eprintln!("wrote {}", path.display());
    }
}
