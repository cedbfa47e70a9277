//! Writes the embedded default model of `eyrie serve` (`crates/server/assets/tiny-model/`): a tiny
//! DeepSeek-V3-architecture checkpoint laid out exactly like Kimi-K2-Thinking, with random weights.
//!
//! Run through `cargo xtask tiny-model [--check]`, or directly:
//! `cargo run -p eyrie-model --example tiny_model -- --out crates/server/assets/tiny-model`.
//!
//! What it writes, byte for byte the same on every run (no clock, no hash order, no transcendental functions):
//! - `tokenizer.json`: a byte-level BPE trained here with the `tokenizers` crate on the committed corpus
//!   `tiny_model_corpus.txt` ([`BPE_VOCAB`] entries: 256 bytes + merges), then Kimi's special tokens as added
//!   tokens after them ([`SPECIALS`]);
//! - `tokenizer_config.json` (bos/eos/pad/unk names, the added tokens) and `chat_template.jinja`, the real
//!   Kimi-K2-Thinking template committed at `fixtures/tokenizer/kimi/`;
//! - `config.json` / `generation_config.json`: Kimi-K2-Thinking's keys at tiny sizes, its compressed-tensors
//!   `quantization_config` verbatim (INT4 symmetric, group 32, only routed experts: the `ignore` list has the rest);
//! - `model.safetensors`: splitmix64 uniform weights (std `1/sqrt(fan_in)`, norms 1.0), dense tensors in BF16,
//!   routed experts as compressed-tensors pack-quantized INT4 made by [`PackedInt4::quantize_minmax`]
//!   (`weight_packed` I32, `weight_scale` BF16, `weight_shape` I32, as Kimi ships them);
//! - `README.md`.

use std::error::Error;
use std::path::{Path, PathBuf};

use eyrie_model::quant::{Dtype, PackedInt4, SafetensorsWriter};
use half::bf16;
use serde_json::{Value, json};
use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainer};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

type Result<T> = std::result::Result<T, Box<dyn Error + Send + Sync>>;

/// The tokenizer's training text (frozen; see its first lines).
const CORPUS: &str = include_str!("tiny_model_corpus.txt");
/// The real Kimi-K2-Thinking chat template (see fixtures/tokenizer/README.md).
const CHAT_TEMPLATE: &str = include_str!("../../../fixtures/tokenizer/kimi/chat_template.jinja");

/// Entries of the BPE model: 256 byte tokens plus merges.
const BPE_VOCAB: usize = 1008;
/// Kimi's special tokens, given ids `BPE_VOCAB..` in this order.
const SPECIALS: [&str; 16] = [
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<think>",
    "</think>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "[PAD]",
    "[UNK]",
];
/// Size of the whole vocabulary (`vocab_size` of config.json).
const VOCAB: usize = BPE_VOCAB + SPECIALS.len();

const HIDDEN: usize = 64;
const LAYERS: usize = 3;
const FIRST_K_DENSE: usize = 1;
const INTERMEDIATE: usize = 128;
const MOE_INTERMEDIATE: usize = 64;
const EXPERTS: usize = 8;
const SHARED_EXPERTS: usize = 1;
const HEADS: usize = 4;
const Q_LORA: usize = 32;
const KV_LORA: usize = 32;
const QK_NOPE: usize = 16;
const QK_ROPE: usize = 16;
const V_HEAD: usize = 16;
const GROUP_SIZE: usize = 32;
const MAX_POSITIONS: usize = 131_072;
const SEED: u64 = 0x0e1e_2026;

fn special_id(name: &str) -> u32 {
    let i = SPECIALS.iter().position(|s| *s == name).expect("a listed special token");
    (BPE_VOCAB + i) as u32
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let out = match args.as_slice() {
        [flag, dir] if flag == "--out" => PathBuf::from(dir),
        _ => return Err("usage: tiny_model --out DIR".into()),
    };
    std::fs::create_dir_all(&out)?;
    let tokenizer = train_tokenizer()?;
    let vocab = tokenizer.get_vocab_size(true);
    if vocab != VOCAB {
        return Err(format!("the trained vocabulary has {vocab} entries, expected {VOCAB}").into());
    }
    write(&out, "tokenizer.json", tokenizer.to_string(true)? + "\n")?;
    write(&out, "tokenizer_config.json", pretty(&tokenizer_config())?)?;
    write(&out, "chat_template.jinja", CHAT_TEMPLATE.to_owned())?;
    write(&out, "config.json", pretty(&config())?)?;
    write(&out, "generation_config.json", pretty(&generation_config())?)?;
    let weights = weights()?;
    std::fs::write(out.join("model.safetensors"), &weights)?;
    write(&out, "README.md", readme(&out)?)?;
    for entry in ["config.json", "model.safetensors", "tokenizer.json"] {
        eprintln!("{entry}: {} bytes", std::fs::metadata(out.join(entry))?.len());
    }
    eprintln!("wrote {}", out.display());
    Ok(())
}

fn write(dir: &Path, name: &str, text: String) -> Result<()> {
    std::fs::write(dir.join(name), text).map_err(|e| format!("{}: {e}", dir.join(name).display()).into())
}

fn pretty(value: &Value) -> Result<String> {
    Ok(serde_json::to_string_pretty(value)? + "\n")
}

/// Byte-level BPE (GPT-2 pre-tokenizer regex, no prefix space) trained on [`CORPUS`], plus [`SPECIALS`].
fn train_tokenizer() -> Result<Tokenizer> {
    // Training is deterministic either way (the merge queue breaks count ties by pair ids); single-threaded
    // settles it regardless of the machine.
    tokenizers::utils::parallelism::set_parallelism(false);
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_post_processor(Some(ByteLevel::new(false, false, false)));
    tokenizer.with_decoder(Some(ByteLevel::new(false, false, false)));
    let mut trainer: TrainerWrapper = BpeTrainer::builder()
        .show_progress(false)
        .vocab_size(BPE_VOCAB)
        .min_frequency(2)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    tokenizer.train(&mut trainer, CORPUS.split_inclusive('\n'))?;
    let added = tokenizer.add_special_tokens(SPECIALS.iter().map(|s| AddedToken::from(*s, true)))?;
    if added != SPECIALS.len() {
        return Err(format!("{added} special tokens added, expected {}", SPECIALS.len()).into());
    }
    for s in SPECIALS {
        if tokenizer.token_to_id(s) != Some(special_id(s)) {
            return Err(format!("special token {s} did not get id {}", special_id(s)).into());
        }
    }
    Ok(tokenizer)
}

fn tokenizer_config() -> Value {
    let added: serde_json::Map<String, Value> = SPECIALS
        .iter()
        .map(|s| {
            let spec = json!({
                "content": s, "lstrip": false, "normalized": false, "rstrip": false, "single_word": false,
                "special": true
            });
            (special_id(s).to_string(), spec)
        })
        .collect();
    json!({
        "added_tokens_decoder": added,
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": false,
        "eos_token": "[EOS]",
        "model_max_length": MAX_POSITIONS,
        "pad_token": "[PAD]",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "[UNK]"
    })
}

/// Kimi-K2-Thinking's config.json keys and values, at tiny sizes.
fn config() -> Value {
    json!({
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "bos_token_id": special_id("[BOS]"),
        // As Kimi-K2-Thinking (163586): the end-of-turn token is what ends a chat completion.
        "eos_token_id": special_id("<|im_end|>"),
        "first_k_dense_replace": FIRST_K_DENSE,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "kv_lora_rank": KV_LORA,
        "max_position_embeddings": MAX_POSITIONS,
        "model_type": "kimi_k2",
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "moe_layer_freq": 1,
        "n_group": 2,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": SHARED_EXPERTS,
        "norm_topk_prob": true,
        "num_attention_heads": HEADS,
        "num_experts_per_tok": 2,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": HEADS,
        "num_nextn_predict_layers": 0,
        "pad_token_id": special_id("[PAD]"),
        "q_lora_rank": Q_LORA,
        "qk_nope_head_dim": QK_NOPE,
        "qk_rope_head_dim": QK_ROPE,
        "quantization_config": quantization_config(),
        "rms_norm_eps": 1e-5,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn"
        },
        "rope_theta": 50000.0,
        "routed_scaling_factor": 2.827,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": false,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": true,
        "v_head_dim": V_HEAD,
        "vocab_size": VOCAB
    })
}

/// Kimi-K2-Thinking's `quantization_config`, verbatim: compressed-tensors INT4 on every Linear except those its
/// `ignore` list names (lm_head, attention, shared experts, dense MLPs; the router `mlp.gate` is no `nn.Linear`
/// in transformers, and it is stored dense).
fn quantization_config() -> Value {
    json!({
        "config_groups": {
            "group_0": {
                "input_activations": null,
                "output_activations": null,
                "targets": ["Linear"],
                "weights": {
                    "actorder": null,
                    "block_structure": null,
                    "dynamic": false,
                    "group_size": GROUP_SIZE,
                    "num_bits": 4,
                    "observer": "minmax",
                    "observer_kwargs": {},
                    "strategy": "group",
                    "symmetric": true,
                    "type": "int"
                }
            }
        },
        "format": "pack-quantized",
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
        "kv_cache_scheme": null,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed"
    })
}

fn generation_config() -> Value {
    json!({
        "bos_token_id": special_id("[BOS]"),
        "eos_token_id": [special_id("<|im_end|>"), special_id("[EOS]")],
        "max_length": MAX_POSITIONS,
        "pad_token_id": special_id("[PAD]")
    })
}

/// splitmix64 (Steele, Lea, Flood 2014): a tiny, exactly reproducible generator.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)` from the top 24 bits (exact in f32).
    fn symmetric(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32) / (1u32 << 23) as f32 - 1.0
    }

    /// `n` values uniform with mean 0 and standard deviation `std` (`U(-a, a)` has std `a / sqrt(3)`).
    fn uniform(&mut self, n: usize, std: f32) -> Vec<f32> {
        let a = std * 3f32.sqrt();
        (0..n).map(|_| a * self.symmetric()).collect()
    }
}

/// Every tensor the model loads, in checkpoint names; returns the safetensors file's bytes.
fn weights() -> Result<Vec<u8>> {
    let mut rng = SplitMix64(SEED);
    let mut w = SafetensorsWriter::new();
    w.metadata("format", "pt");
    let bf = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
    // A Linear `[out, in]` in BF16 with std 1/sqrt(in), so activations stay O(1) through every layer.
    let dense = |w: &mut SafetensorsWriter, rng: &mut SplitMix64, name: &str, out: usize, inp: usize| {
        let v = rng.uniform(out * inp, 1.0 / (inp as f32).sqrt());
        w.add_bf16(format!("{name}.weight"), &[out, inp], &bf(&v))
    };
    let ones = |w: &mut SafetensorsWriter, name: &str, n: usize| w.add_bf16(name, &[n], &bf(&vec![1.0; n]));

    w.add_bf16("model.embed_tokens.weight", &[VOCAB, HIDDEN], &bf(&rng.uniform(VOCAB * HIDDEN, 1.0)))?;
    for i in 0..LAYERS {
        let p = format!("model.layers.{i}");
        ones(&mut w, &format!("{p}.input_layernorm.weight"), HIDDEN)?;
        ones(&mut w, &format!("{p}.post_attention_layernorm.weight"), HIDDEN)?;
        let a = format!("{p}.self_attn");
        dense(&mut w, &mut rng, &format!("{a}.q_a_proj"), Q_LORA, HIDDEN)?;
        ones(&mut w, &format!("{a}.q_a_layernorm.weight"), Q_LORA)?;
        dense(&mut w, &mut rng, &format!("{a}.q_b_proj"), HEADS * (QK_NOPE + QK_ROPE), Q_LORA)?;
        dense(&mut w, &mut rng, &format!("{a}.kv_a_proj_with_mqa"), KV_LORA + QK_ROPE, HIDDEN)?;
        ones(&mut w, &format!("{a}.kv_a_layernorm.weight"), KV_LORA)?;
        dense(&mut w, &mut rng, &format!("{a}.kv_b_proj"), HEADS * (QK_NOPE + V_HEAD), KV_LORA)?;
        dense(&mut w, &mut rng, &format!("{a}.o_proj"), HIDDEN, HEADS * V_HEAD)?;
        if i < FIRST_K_DENSE {
            dense(&mut w, &mut rng, &format!("{p}.mlp.gate_proj"), INTERMEDIATE, HIDDEN)?;
            dense(&mut w, &mut rng, &format!("{p}.mlp.up_proj"), INTERMEDIATE, HIDDEN)?;
            dense(&mut w, &mut rng, &format!("{p}.mlp.down_proj"), HIDDEN, INTERMEDIATE)?;
            continue;
        }
        // The router as Kimi stores it: a BF16 weight and an F32 `e_score_correction_bias` (small: it only selects).
        dense(&mut w, &mut rng, &format!("{p}.mlp.gate"), EXPERTS, HIDDEN)?;
        w.add_f32(format!("{p}.mlp.gate.e_score_correction_bias"), &[EXPERTS], &rng.uniform(EXPERTS, 0.05))?;
        let shared = MOE_INTERMEDIATE * SHARED_EXPERTS;
        dense(&mut w, &mut rng, &format!("{p}.mlp.shared_experts.gate_proj"), shared, HIDDEN)?;
        dense(&mut w, &mut rng, &format!("{p}.mlp.shared_experts.up_proj"), shared, HIDDEN)?;
        dense(&mut w, &mut rng, &format!("{p}.mlp.shared_experts.down_proj"), HIDDEN, shared)?;
        for e in 0..EXPERTS {
            let x = format!("{p}.mlp.experts.{e}");
            for (proj, out, inp) in [
                ("gate_proj", MOE_INTERMEDIATE, HIDDEN),
                ("up_proj", MOE_INTERMEDIATE, HIDDEN),
                ("down_proj", HIDDEN, MOE_INTERMEDIATE),
            ] {
                let v = rng.uniform(out * inp, 1.0 / (inp as f32).sqrt());
                int4(&mut w, &format!("{x}.{proj}"), &v, out, inp)?;
            }
        }
    }
    ones(&mut w, "model.norm.weight", HIDDEN)?;
    dense(&mut w, &mut rng, "lm_head", VOCAB, HIDDEN)?;
    Ok(w.to_bytes())
}

/// One compressed-tensors pack-quantized INT4 Linear (group [`GROUP_SIZE`], symmetric, BF16 scales), quantized
/// from its BF16 weight as compressed-tensors' min-max observer does.
fn int4(w: &mut SafetensorsWriter, name: &str, weight: &[f32], out: usize, inp: usize) -> Result<()> {
    let q = PackedInt4::quantize_minmax(weight, out, inp, GROUP_SIZE, true, Dtype::BF16)?;
    w.add_u32_as_i32(format!("{name}.weight_packed"), &[out, inp / 8], q.packed())?;
    let scales: Vec<bf16> = q.scales().iter().map(|&s| bf16::from_f32(s)).collect();
    w.add_bf16(format!("{name}.weight_scale"), &[out, inp / GROUP_SIZE], &scales)?;
    w.add_i32(format!("{name}.weight_shape"), &[2], &[out as i32, inp as i32])?;
    Ok(())
}

fn readme(out: &Path) -> Result<String> {
    let mut files = String::new();
    let mut total = 0;
    for name in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        let bytes = std::fs::metadata(out.join(name))?.len();
        total += bytes;
        files.push_str(&format!("| `{name}` | {bytes} |\n"));
    }
    let specials: String = SPECIALS.iter().map(|s| format!("| `{s}` | {} |\n", special_id(s))).collect();
    Ok(format!(
        "# tiny-model: the embedded default model of `eyrie serve`

A tiny DeepSeek-V3-architecture checkpoint in the layout of Kimi-K2-Thinking, which `eyrie serve` serves when no
`--model-path` is given: the server, the OpenAI API, streaming, and the reasoning and tool-call parsers all run with
nothing to download.

**The weights are random** (a fixed seed, not trained), so the output is gibberish. The model exists to exercise
every code path until a trained tiny model replaces it.

- config.json: `DeepseekV3ForCausalLM`, model_type `kimi_k2`; hidden size {HIDDEN}, {LAYERS} layers ({FIRST_K_DENSE} dense,
  then MoE), {EXPERTS} routed experts in 2 groups (topk_group 1, top-2, noaux_tc sigmoid router), {SHARED_EXPERTS} shared
  expert, intermediate sizes {INTERMEDIATE} (dense) and {MOE_INTERMEDIATE} (experts); MLA with {HEADS} heads,
  q_lora_rank {Q_LORA}, kv_lora_rank {KV_LORA}, qk {QK_NOPE}+{QK_ROPE}, v {V_HEAD}; YaRN RoPE (factor 32 over 4096 positions,
  theta 50000) up to {MAX_POSITIONS} positions; vocabulary {VOCAB}; `eos_token_id` is `<|im_end|>`, as in
  Kimi-K2-Thinking.
- model.safetensors: dense tensors in BF16 (uniform, std 1/sqrt(fan_in); embeddings std 1; norms 1.0; router
  `e_score_correction_bias` F32); routed experts as compressed-tensors pack-quantized INT4 (`weight_packed` I32,
  `weight_scale` BF16, `weight_shape` I32; symmetric, group {GROUP_SIZE}), with Kimi-K2-Thinking's
  `quantization_config` (only the routed experts are quantized).
- tokenizer.json: a byte-level BPE trained with the `tokenizers` crate on
  `crates/model/examples/tiny_model_corpus.txt` ({BPE_VOCAB} entries: 256 bytes + merges), then Kimi's special
  tokens as single added tokens; tokenizer_config.json names `[BOS]`, `[EOS]`, `[PAD]`, `[UNK]`.
- chat_template.jinja: the real Kimi-K2-Thinking template (tools, `<think>` reasoning), copied from
  `fixtures/tokenizer/kimi/`.

| special token | id |
|---|---|
{specials}
| file | bytes |
|---|---|
{files}
{total} bytes in all, plus this README.

Regenerate with `cargo xtask tiny-model` (deterministic: the same bytes on every run); `cargo xtask tiny-model
--check` fails if the committed files differ from a fresh run. The generator is
`crates/model/examples/tiny_model.rs`; `crates/model/tests/tiny_model.rs` loads and runs the model, and
`scripts/check_tiny_model.py` compares it with Hugging Face transformers, compressed-tensors and tokenizers.
"
    ))
}
