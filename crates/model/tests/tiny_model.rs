//! The embedded default model of `eyrie serve` (`crates/server/assets/tiny-model`, written by
//! `cargo xtask tiny-model`) loads and runs through everything the server uses: config, INT4 experts, tokenizer,
//! the Kimi-K2-Thinking chat template, a prefill and greedy decode steps over the paged KV cache on burn's `Flex`
//! CPU backend in f32.
//!
//! With `EYRIE_TINY_MODEL_DUMP=path.safetensors` the test also writes the rendered prompt (metadata), its tokens and
//! the full-form logits of prompt + greedy tokens, which `scripts/check_tiny_model.py` compares with transformers.

mod common;

use std::path::PathBuf;

use common::{argmax, host, scaled_error};

use burn::backend::Flex;
use eyrie_model::chat::{ChatMessage, ChatTemplate, FunctionCall, RenderOptions, ToolCall};
use eyrie_model::deepseek_v3::{BatchEntry, LogitRows};
use eyrie_model::kv_cache::{PagedMlaCache, SequenceCache};
use eyrie_model::quant::SafetensorsWriter;
use eyrie_model::tokenizer::Tokenizer;
use eyrie_model::{DeepseekV3, ModelConfig};

/// Absorbed (cached) vs full form, as the golden tests.
const FULL_FORM_TOLERANCE: f32 = 1e-4;
const DECODE_STEPS: usize = 6;

/// Kimi's special tokens, each of which must be one added token.
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

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../server/assets/tiny-model")
}

#[test]
fn config_is_kimi_k2_shaped() {
    let c = ModelConfig::from_dir(dir()).unwrap();
    assert_eq!(c.raw.model_type.as_deref(), Some("kimi_k2"));
    assert_eq!((c.vocab_size, c.hidden_size, c.num_hidden_layers), (1024, 64, 3));
    assert_eq!((c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group), (8, 2, 2, 1));
    assert_eq!((c.moe_intermediate_size, c.intermediate_size, c.num_heads), (64, 128, 4));
    assert_eq!(c.q_lora_rank, Some(32));
    assert_eq!((c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim), (32, 16, 16, 16));
    let q = c.quantization().unwrap().expect("a quantization_config");
    let plan = q.plan().unwrap();
    let quantized = |name: &str| plan.scheme_for(name, "Linear").is_some();
    assert!(quantized("model.layers.1.mlp.experts.0.gate_proj"));
    assert!(quantized("model.layers.2.mlp.experts.7.down_proj"));
    for dense in [
        "lm_head",
        "model.layers.0.mlp.gate_proj",
        "model.layers.1.mlp.shared_experts.up_proj",
        "model.layers.1.self_attn.kv_b_proj",
    ] {
        assert!(!quantized(dense), "{dense} must stay dense");
    }
}

#[test]
fn tokenizer_has_single_special_tokens_and_round_trips() {
    let tok = Tokenizer::from_dir(dir()).unwrap();
    let config = ModelConfig::from_dir(dir()).unwrap();
    assert_eq!(tok.vocab_size(), config.vocab_size);
    for s in SPECIALS {
        let id = tok.special_token_id(s).unwrap_or_else(|| panic!("{s} is not a special token"));
        assert_eq!(tok.encode(s, true).unwrap(), vec![id], "{s}");
        assert!(tok.encode(s, false).unwrap().len() > 1, "{s} as plain text");
        assert!(tok.is_special(id));
    }
    let eos = tok.eos_token_ids();
    assert!(eos.contains(&tok.special_token_id("<|im_end|>").unwrap()));
    assert!(eos.contains(&tok.special_token_id("[EOS]").unwrap()));
    assert_eq!(tok.bos_token_id(), tok.special_token_id("[BOS]"));
    for s in [
        "Hello, world! The model picks two experts per token.",
        "  leading spaces, tabs\tand\nnewlines\r\n",
        "Unicode: café, naïve, Straße, 你好世界, こんにちは, Привет, مرحبا",
        "Emoji: 🙂🚀🦀 👩‍💻 🇫🇷 ❤️",
        r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#,
        "fn main() { println!(\"{}\", 1 + 2); }",
        "<think>reasoning</think>answer<|im_end|>",
        "",
    ] {
        for allow_special in [true, false] {
            let ids = tok.encode(s, allow_special).unwrap();
            assert!(ids.iter().all(|&t| (t as usize) < config.vocab_size));
            assert_eq!(tok.decode(&ids, false).unwrap(), s, "allow_special {allow_special}");
        }
    }
    // Merges were learned: common English takes well under one token per two bytes.
    let text = "The model reads the tokens of the conversation and streams its answer.";
    assert!(tok.encode(text, false).unwrap().len() * 2 < text.len());
}

#[test]
fn chat_template_renders_thinking_and_tool_calls_as_special_tokens() {
    let tok = Tokenizer::from_dir(dir()).unwrap();
    let template = ChatTemplate::from_dir(dir()).unwrap();
    let call = ToolCall {
        id: Some("functions.get_weather:0".into()),
        kind: "function".into(),
        function: FunctionCall { name: "get_weather".into(), arguments: r#"{"city": "Paris"}"#.into() },
    };
    let messages = vec![
        ChatMessage::new("user", "Weather in Paris?"),
        ChatMessage {
            role: "assistant".into(),
            content: Some("".into()),
            tool_calls: Some(vec![call]),
            reasoning_content: Some("I should call the tool.".into()),
            ..ChatMessage::default()
        },
        ChatMessage { tool_call_id: Some("functions.get_weather:0".into()), ..ChatMessage::new("tool", "18 C") },
    ];
    let text = template.render(&messages, None, true, &RenderOptions::default()).unwrap();
    assert!(text.contains("<think>I should call the tool.</think>"), "{text}");
    let ids = tok.encode(&text, true).unwrap();
    for s in [
        "<|im_system|>",
        "<|im_user|>",
        "<|im_assistant|>",
        "<|im_middle|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
    ] {
        let id = tok.special_token_id(s).unwrap();
        assert!(ids.contains(&id), "{s} is not a single token of the rendered chat");
    }
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
}

#[test]
fn chat_prefill_and_greedy_decode_over_the_kv_cache() {
    let device = Default::default();
    let model = DeepseekV3::<Flex>::load(dir(), &device).unwrap();
    let vocab = model.config.vocab_size;
    let tok = Tokenizer::from_dir(dir()).unwrap();
    let template = ChatTemplate::from_dir(dir()).unwrap();
    let messages = [
        ChatMessage::new("system", "You are a helpful assistant."),
        ChatMessage::new("user", "Hello! What is 2 + 2? Answer briefly 🙂"),
    ];
    let options = RenderOptions { thinking: Some(true), ..RenderOptions::default() };
    let prompt_text = template.render(&messages, None, true, &options).unwrap();
    assert!(prompt_text.starts_with("<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>"));
    assert!(prompt_text.ends_with("<|im_assistant|>assistant<|im_middle|>"), "{prompt_text}");
    let prompt = tok.encode(&prompt_text, true).unwrap();
    assert_eq!(prompt[0], tok.special_token_id("<|im_system|>").unwrap());
    assert!(prompt.iter().all(|&t| (t as usize) < vocab));

    // Prefill, then greedy decode steps, over a paged cache of 8-token blocks.
    let mut cache = PagedMlaCache::<Flex>::new(&model.config, 32, 8, &device).unwrap();
    let mut seq = SequenceCache::default();
    let mut rows: Vec<Vec<f32>> = Vec::new();
    let mut step: Vec<u32> = prompt.clone();
    let mut generated = Vec::new();
    for i in 0..=DECODE_STEPS {
        let which = if i == 0 { LogitRows::All } else { LogitRows::Last };
        let logits = host(
            model
                .forward_batch(&mut [BatchEntry { seq: &mut seq, tokens: &step }], &mut cache, which, &device)
                .unwrap(),
        );
        assert!(logits.iter().all(|v| v.is_finite()), "non-finite logits at step {i}");
        rows.extend(logits.chunks_exact(vocab).map(<[f32]>::to_vec));
        let next = argmax(rows.last().unwrap());
        assert!((next as usize) < vocab);
        if i < DECODE_STEPS {
            generated.push(next);
            step = vec![next];
        }
    }
    assert_eq!(seq.len, prompt.len() + DECODE_STEPS);
    let spread =
        rows[0].iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) - rows[0].iter().fold(f32::INFINITY, |m, &v| m.min(v));
    assert!(spread > 1.0 && spread < 100.0, "logit spread {spread}: activations out of scale");

    // The same positions through the full-form forward.
    let all: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
    let full = host(model.forward(model.token_tensor(&[&all], &device).unwrap()));
    for (pos, row) in rows.iter().enumerate() {
        let want = &full[pos * vocab..(pos + 1) * vocab];
        let err = scaled_error(row, want);
        assert!(err <= FULL_FORM_TOLERANCE, "position {pos}: cached vs full form {err:e}");
    }
    eprintln!("prompt {} tokens, greedy {generated:?} = {:?}", prompt.len(), tok.decode(&generated, false).unwrap());

    if let Ok(path) = std::env::var("EYRIE_TINY_MODEL_DUMP") {
        let mut w = SafetensorsWriter::new();
        w.metadata("prompt", prompt_text.clone());
        let ids: Vec<i64> = all.iter().map(|&t| i64::from(t)).collect();
        w.add_i64("tokens", &[all.len()], &ids).unwrap();
        w.add_i64("prompt_len", &[1], &[prompt.len() as i64]).unwrap();
        w.add_f32("logits", &[all.len(), vocab], &full).unwrap();
        w.write(&path).unwrap();
        eprintln!("wrote {path}");
    }
}
