//! `eyrie inspect`: what a checkpoint holds, from its config.json and its safetensors headers (no tensor data is
//! read): architecture, layers, shards, and tensor counts and bytes by dtype and by quantization.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::{Context, Result};
use eyrie_quant::config::{GroupSize, QuantPlan, QuantScheme, QuantizationConfig};
use eyrie_quant::linear::LinearKind;
use eyrie_quant::{Checkpoint, Dtype};
use serde::Serialize;
use serde_json::Value;

/// Count and bytes of a group of tensors.
#[derive(Debug, Default, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct Tally {
    /// Number of tensors (or modules).
    pub count: usize,
    /// Bytes on disk.
    pub bytes: u64,
}

impl Tally {
    fn add(&mut self, bytes: u64) {
        self.count += 1;
        self.bytes += bytes;
    }
}

/// Everything `inspect` reports.
#[derive(Debug, Serialize)]
pub struct Summary {
    /// The checkpoint path as given.
    pub path: String,
    /// Selected config.json fields (text model), when a config.json is present.
    pub architecture: BTreeMap<String, Value>,
    /// One line describing the quantization config, if any.
    pub quantization_config: Option<String>,
    /// Number of shard files.
    pub shards: usize,
    /// Number of tensors.
    pub tensors: usize,
    /// Bytes of tensor data.
    pub bytes: u64,
    /// Distinct `layers.N` indices found in tensor names.
    pub layers: usize,
    /// By dtype name.
    pub by_dtype: BTreeMap<String, Tally>,
    /// Linear modules by storage kind (bytes include scales and shapes), plus `other` for every remaining tensor.
    pub by_quantization: BTreeMap<String, Tally>,
}

const ARCH_KEYS: &[&str] = &[
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "first_k_dense_replace",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "torch_dtype",
    "dtype",
];

/// Builds the summary of the checkpoint at `path`.
pub fn summarize(path: &Path) -> Result<Summary> {
    let ckpt = Checkpoint::open(path)?;
    let (architecture, quantization_config) = read_config(path)?;

    let mut by_dtype: BTreeMap<String, Tally> = BTreeMap::new();
    let mut layers = BTreeSet::new();
    for name in ckpt.names() {
        let info = ckpt.info(name).context("index lists a tensor it cannot describe")?;
        by_dtype.entry(info.dtype.to_string()).or_default().add(info.nbytes());
        if let Some(n) = layer_index(name) {
            layers.insert(n);
        }
    }

    // Group tensors into Linear modules: `<p>.weight_packed` (INT4) or `<p>.weight` of rank 2.
    let mut claimed: BTreeSet<&str> = BTreeSet::new();
    let mut by_quantization: BTreeMap<String, Tally> = BTreeMap::new();
    for name in ckpt.names() {
        let prefix = match name.strip_suffix(".weight_packed").or_else(|| name.strip_suffix(".weight")) {
            Some(p) => p,
            None => continue,
        };
        let Some(kind) = LinearKind::detect(&ckpt, prefix) else { continue };
        if kind == LinearKind::Int4 && name.ends_with(".weight") {
            continue; // counted through weight_packed
        }
        let parts: &[&str] = match kind {
            LinearKind::Int4 => &["weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx"],
            LinearKind::Fp8Block => &["weight", "weight_scale_inv"],
            LinearKind::Dense => &["weight", "bias"],
        };
        let mut bytes = 0;
        for part in parts {
            let full = format!("{prefix}.{part}");
            if let Some((n, info)) = ckpt.names_with_prefix(&full).find(|n| *n == full).zip(ckpt.info(&full)) {
                bytes += info.nbytes();
                claimed.insert(n);
            }
        }
        let label = match kind {
            LinearKind::Dense => {
                let dtype = ckpt.info(&format!("{prefix}.weight")).map(|i| i.dtype).unwrap_or(Dtype::BF16);
                format!("dense {dtype} (2-D: linears, embeddings)")
            }
            LinearKind::Int4 => "int4 pack-quantized linears".to_string(),
            LinearKind::Fp8Block => "fp8 block-scaled linears".to_string(),
        };
        let t = by_quantization.entry(label).or_default();
        t.count += 1;
        t.bytes += bytes;
    }
    let other = by_quantization.entry("other tensors (norms, biases, router bias, ...)".into()).or_default();
    for name in ckpt.names() {
        if !claimed.contains(name) {
            other.add(ckpt.info(name).map(|i| i.nbytes()).unwrap_or(0));
        }
    }

    Ok(Summary {
        path: path.display().to_string(),
        architecture,
        quantization_config,
        shards: ckpt.shards().len(),
        tensors: ckpt.len(),
        bytes: ckpt.total_bytes(),
        layers: layers.len(),
        by_dtype,
        by_quantization,
    })
}

/// `N` of the first `layers.N.` in a tensor name.
fn layer_index(name: &str) -> Option<usize> {
    let rest = &name[name.find("layers.")? + "layers.".len()..];
    rest.split('.').next()?.parse().ok()
}

type ConfigParts = (BTreeMap<String, Value>, Option<String>);

/// Reads config.json beside the checkpoint (if any): selected text-model fields and the quantization config.
fn read_config(path: &Path) -> Result<ConfigParts> {
    let cfg_path = if path.is_dir() { path.join("config.json") } else { path.with_file_name("config.json") };
    let Ok(text) = std::fs::read_to_string(&cfg_path) else { return Ok((BTreeMap::new(), None)) };
    let json: Value = serde_json::from_str(&text).with_context(|| format!("{}: malformed JSON", cfg_path.display()))?;
    let mut arch = BTreeMap::new();
    for key in ["architectures", "model_type"] {
        if let Some(v) = json.get(key) {
            arch.insert(key.to_string(), v.clone());
        }
    }
    let text_cfg = json.get("text_config").unwrap_or(&json);
    if json.get("text_config").is_some()
        && let Some(v) = text_cfg.get("model_type")
    {
        arch.insert("text_config.model_type".into(), v.clone());
    }
    for key in ARCH_KEYS {
        if let Some(v) = text_cfg.get(*key) {
            arch.insert((*key).to_string(), v.clone());
        }
    }
    let quant = match QuantizationConfig::from_model_config(&json).with_context(|| cfg_path.display().to_string())? {
        None => None,
        Some(q) => Some(describe(&q.plan().with_context(|| cfg_path.display().to_string())?)),
    };
    Ok((arch, quant))
}

/// One line naming each distinct scheme of a validated quantization config.
fn describe(plan: &QuantPlan) -> String {
    let schemes: Vec<String> = plan
        .schemes()
        .iter()
        .map(|s| match s {
            QuantScheme::Int4Group { group_size: GroupSize::Columns(n), symmetric } => {
                format!("int4 pack-quantized, group {n}, {}", if *symmetric { "symmetric" } else { "asymmetric" })
            }
            QuantScheme::Int4Group { group_size: GroupSize::WholeRow, symmetric } => {
                format!("int4 pack-quantized, per channel, {}", if *symmetric { "symmetric" } else { "asymmetric" })
            }
            QuantScheme::Fp8Block { block } => format!("fp8 e4m3, {}x{} block scales", block.0, block.1),
        })
        .collect();
    if schemes.is_empty() { "none".to_string() } else { schemes.join("; ") }
}

fn human(bytes: u64) -> String {
    const UNITS: &[&str] = &["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{bytes} B") } else { format!("{v:.2} {}", UNITS[u]) }
}

/// Renders the summary as the table `inspect` prints.
pub fn render(s: &Summary) -> String {
    let mut out = format!("checkpoint  {}\n", s.path);
    if s.architecture.is_empty() {
        out.push_str("config      (no config.json)\n");
    }
    for (k, v) in &s.architecture {
        out.push_str(&format!("  {k:<26} {v}\n"));
    }
    if let Some(q) = &s.quantization_config {
        out.push_str(&format!("quantization {q}\n"));
    }
    out.push_str(&format!(
        "shards      {}\ntensors     {}\nbytes       {} ({})\nlayers      {}\n",
        s.shards,
        s.tensors,
        s.bytes,
        human(s.bytes),
        s.layers
    ));
    out.push_str("\nby dtype\n");
    for (d, t) in &s.by_dtype {
        out.push_str(&format!("  {d:<10} {:>9} tensors {:>14}\n", t.count, human(t.bytes)));
    }
    out.push_str("\nby quantization\n");
    for (k, t) in &s.by_quantization {
        out.push_str(&format!("  {k:<46} {:>9} {:>14}\n", t.count, human(t.bytes)));
    }
    out
}

pub fn run(path: &Path, json: bool) -> Result<()> {
    let s = summarize(path)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        print!("{}", render(&s));
    }
    Ok(())
}
