//! Tests of config.rs against realistic config.json texts (written from the published configs' keys and values,
//! kimi-k2-formats.md section 2) and the committed fixtures; expected YaRN values computed with transformers 5.24.

use std::path::Path;

use super::*;

const KIMI_K2_THINKING: &str = r#"{
  "architectures": ["DeepseekV3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "auto_map": {
    "AutoConfig": "configuration_deepseek.DeepseekV3Config",
    "AutoModel": "modeling_deepseek.DeepseekV3Model",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"
  },
  "aux_loss_alpha": 0.001,
  "bos_token_id": 163584,
  "eos_token_id": 163586,
  "ep_size": 1,
  "first_k_dense_replace": 1,
  "hidden_act": "silu",
  "hidden_size": 7168,
  "initializer_range": 0.02,
  "intermediate_size": 18432,
  "kv_lora_rank": 512,
  "max_position_embeddings": 262144,
  "model_type": "kimi_k2",
  "moe_intermediate_size": 2048,
  "moe_layer_freq": 1,
  "n_group": 1,
  "n_routed_experts": 384,
  "n_shared_experts": 1,
  "norm_topk_prob": true,
  "num_attention_heads": 64,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 61,
  "num_key_value_heads": 64,
  "num_nextn_predict_layers": 0,
  "pretraining_tp": 1,
  "q_lora_rank": 1536,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "quantization_config": {
    "config_groups": {
      "group_0": {
        "input_activations": null,
        "output_activations": null,
        "targets": ["Linear"],
        "weights": {"actorder": null, "block_structure": null, "dynamic": false, "group_size": 32,
                    "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                    "symmetric": true, "type": "int"}
      }
    },
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": null,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed"
  },
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "factor": 64.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn"
  },
  "rope_theta": 50000.0,
  "routed_scaling_factor": 2.827,
  "scoring_func": "sigmoid",
  "seq_aux": true,
  "tie_word_embeddings": false,
  "topk_group": 1,
  "topk_method": "noaux_tc",
  "torch_dtype": "bfloat16",
  "transformers_version": "4.48.3",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 163840
}"#;

const DEEPSEEK_V3: &str = r#"{
  "architectures": ["DeepseekV3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 0,
  "eos_token_id": 1,
  "ep_size": 1,
  "first_k_dense_replace": 3,
  "hidden_act": "silu",
  "hidden_size": 7168,
  "initializer_range": 0.02,
  "intermediate_size": 18432,
  "kv_lora_rank": 512,
  "max_position_embeddings": 163840,
  "model_type": "deepseek_v3",
  "moe_intermediate_size": 2048,
  "moe_layer_freq": 1,
  "n_group": 8,
  "n_routed_experts": 256,
  "n_shared_experts": 1,
  "norm_topk_prob": true,
  "num_attention_heads": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 61,
  "num_key_value_heads": 128,
  "num_nextn_predict_layers": 1,
  "q_lora_rank": 1536,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                          "weight_block_size": [128, 128]},
  "rms_norm_eps": 1e-06,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "original_max_position_embeddings": 4096, "type": "yarn"},
  "rope_theta": 10000,
  "routed_scaling_factor": 2.5,
  "scoring_func": "sigmoid",
  "tie_word_embeddings": false,
  "topk_group": 4,
  "topk_method": "noaux_tc",
  "torch_dtype": "bfloat16",
  "transformers_version": "4.46.3",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 129280
}"#;

/// DeepSeek-V2-Lite's shapes (no q_lora, 16 heads, 64 experts, 2 shared) in the V3 router form transformers runs.
const V2_LITE_STYLE: &str = r#"{
  "architectures": ["DeepseekV3ForCausalLM"],
  "model_type": "deepseek_v3",
  "vocab_size": 102400,
  "hidden_size": 2048,
  "intermediate_size": 10944,
  "moe_intermediate_size": 1408,
  "num_hidden_layers": 27,
  "num_attention_heads": 16,
  "num_key_value_heads": 16,
  "n_shared_experts": 2,
  "n_routed_experts": 64,
  "routed_scaling_factor": 1.0,
  "kv_lora_rank": 512,
  "q_lora_rank": null,
  "qk_rope_head_dim": 64,
  "v_head_dim": 128,
  "qk_nope_head_dim": 128,
  "n_group": 1,
  "topk_group": 1,
  "num_experts_per_tok": 6,
  "first_k_dense_replace": 1,
  "norm_topk_prob": false,
  "max_position_embeddings": 163840,
  "rms_norm_eps": 1e-06,
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
  "tie_word_embeddings": false
}"#;

/// An in-place edit of a parsed config.
type Edit = fn(&mut Value);

fn parse(text: &str) -> Result<ModelConfig> {
    ModelConfig::from_json_str(text, Path::new("config.json"))
}

fn edit(text: &str, f: impl FnOnce(&mut Value)) -> String {
    let mut v: Value = serde_json::from_str(text).unwrap();
    f(&mut v);
    v.to_string()
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * b.abs().max(1e-30)
}

#[test]
fn kimi_k2_thinking() {
    let c = parse(KIMI_K2_THINKING).unwrap();
    assert_eq!(c.weight_prefix, "");
    assert_eq!((c.num_heads, c.qk_head_dim(), c.kv_a_dim()), (64, 192, 576));
    assert_eq!((c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group), (384, 8, 1, 1));
    assert_eq!(c.layer_kind(0), LayerKind::Dense);
    assert_eq!(c.layer_kind(1), LayerKind::Moe);
    assert_eq!(c.layer_kind(60), LayerKind::Moe);
    assert_eq!(c.rope_theta, 50000.0);
    assert_eq!(c.rms_norm_eps, 1e-5);
    assert_eq!(c.num_nextn_predict_layers, 0);
    assert!(c.rope_interleave);
    // transformers: yarn_apply_mscale(192 ** -0.5) = 0.14467962580268923; attention factor 1.
    assert!(close(c.softmax_scale(), 0.144_679_625_802_689_23, 1e-12), "{}", c.softmax_scale());
    assert_eq!(c.rope_attention_factor(), 1.0);
    // transformers' _compute_yarn_parameters, entries 0, 1, 10, 20, 31.
    let f = c.rope_inv_freq();
    assert_eq!(f.len(), 32);
    for (i, want) in [(0, 1.0), (1, 0.713_111_1), (10, 0.034_007_277), (20, 1.807_023_4e-5), (31, 4.382_206_4e-7)] {
        assert!(close(f64::from(f[i]), want, 1e-6), "inv_freq[{i}] = {} want {want}", f[i]);
    }
    let q = c.quantization().unwrap().expect("compressed-tensors config");
    let plan = q.plan().unwrap();
    assert!(plan.scheme_for("model.layers.1.mlp.experts.0.gate_proj", "Linear").is_some());
    assert!(plan.scheme_for("model.layers.1.self_attn.q_a_proj", "Linear").is_none());
}

#[test]
fn deepseek_v3() {
    let c = parse(DEEPSEEK_V3).unwrap();
    assert_eq!((c.num_heads, c.n_group, c.topk_group, c.first_k_dense_replace), (128, 8, 4, 3));
    assert_eq!(c.layer_kind(2), LayerKind::Dense);
    assert_eq!(c.layer_kind(3), LayerKind::Moe);
    assert_eq!(c.num_nextn_predict_layers, 1);
    assert!(close(c.softmax_scale(), 0.135_233_778_860_880_1, 1e-12), "{}", c.softmax_scale());
    let f = c.rope_inv_freq();
    for (i, want) in [(0, 1.0), (1, 0.749_894_2), (10, 0.056_234_13), (15, 0.008_334_509), (20, 7.905_694e-4)] {
        assert!(close(f64::from(f[i]), want, 1e-6), "inv_freq[{i}] = {} want {want}", f[i]);
    }
    assert!(close(f64::from(f[31]), 3.333_803_5e-6, 1e-6));
    assert!(matches!(c.quantization().unwrap(), Some(eyrie_quant::QuantizationConfig::Fp8(_))));
}

#[test]
fn v2_lite_style_without_q_lora() {
    let c = parse(V2_LITE_STYLE).unwrap();
    assert_eq!(c.q_lora_rank, None);
    assert_eq!(c.rope_scaling, RopeScaling::Default);
    assert_eq!(c.shared_intermediate_size(), 2816);
    assert!(!c.norm_topk_prob);
    // No YaRN: plain 1/sqrt(192) and theta^(-2i/64).
    assert!(close(c.softmax_scale(), 192f64.powf(-0.5), 1e-15));
    let f = c.rope_inv_freq();
    assert!(close(f64::from(f[16]), 10000f64.powf(-0.5), 1e-6));
}

#[test]
fn kimi_k25_nests_text_config_and_prefixes_weights() {
    let text: Value = serde_json::from_str(KIMI_K2_THINKING).unwrap();
    let mut text_config = text.clone();
    text_config.as_object_mut().unwrap().remove("quantization_config");
    let k25 = serde_json::json!({
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "media_placeholder_token_id": 163605,
        "quantization_config": text["quantization_config"],
        "text_config": text_config,
        "vision_config": {"patch_size": 14, "vt_hidden_size": 1152, "mm_hidden_size": 1152}
    });
    let c = parse(&k25.to_string()).unwrap();
    assert_eq!(c.weight_prefix, "language_model.");
    assert_eq!(c.weight_name("model.norm.weight"), "language_model.model.norm.weight");
    assert_eq!(c.weight_name("lm_head.weight"), "language_model.lm_head.weight");
    assert_eq!(c.hidden_size, 7168);
    assert!(c.quantization().unwrap().is_some());

    // Field errors inside text_config are named with their path.
    let bad = edit(&k25.to_string(), |v| {
        v["text_config"].as_object_mut().unwrap().remove("hidden_size");
    });
    match parse(&bad).unwrap_err() {
        ModelError::MissingField { field, .. } => assert_eq!(field, "text_config.hidden_size"),
        e => panic!("{e}"),
    }
}

#[test]
fn rope_parameters_form_equals_rope_scaling_form() {
    let new_form = edit(KIMI_K2_THINKING, |v| {
        let o = v.as_object_mut().unwrap();
        let mut rp = o.remove("rope_scaling").unwrap();
        let theta = o.remove("rope_theta").unwrap();
        let rp_o = rp.as_object_mut().unwrap();
        rp_o.remove("type");
        rp_o.insert("rope_type".into(), "yarn".into());
        rp_o.insert("rope_theta".into(), theta);
        o.insert("rope_parameters".into(), rp);
    });
    let (a, b) = (parse(KIMI_K2_THINKING).unwrap(), parse(&new_form).unwrap());
    assert_eq!(a.rope_scaling, b.rope_scaling);
    assert_eq!(a.rope_theta, b.rope_theta);
    assert_eq!(a.rope_inv_freq(), b.rope_inv_freq());
    assert_eq!(a.softmax_scale(), b.softmax_scale());
}

#[test]
fn rope_theta_inside_the_dict_wins_and_defaults_apply() {
    let both = edit(V2_LITE_STYLE, |v| v["rope_theta"] = 5.0.into());
    assert_eq!(parse(&both).unwrap().rope_theta, 10000.0);
    let none = edit(V2_LITE_STYLE, |v| {
        v.as_object_mut().unwrap().remove("rope_parameters");
    });
    assert_eq!(parse(&none).unwrap().rope_theta, 10000.0);
    let top = edit(&none, |v| v["rope_theta"] = 20000.0.into());
    assert_eq!(parse(&top).unwrap().rope_theta, 20000.0);
}

#[test]
fn unsupported_values_name_their_field() {
    let cases: [(&str, Edit); 8] = [
        ("rope_scaling.type", |v| v["rope_scaling"]["type"] = "dynamic".into()),
        ("scoring_func", |v| v["scoring_func"] = "softmax".into()),
        ("topk_method", |v| v["topk_method"] = "greedy".into()),
        ("hidden_act", |v| v["hidden_act"] = "gelu".into()),
        ("num_key_value_heads", |v| v["num_key_value_heads"] = 8.into()),
        ("attention_bias", |v| v["attention_bias"] = true.into()),
        ("model_type", |v| v["model_type"] = "deepseek_v2".into()),
        ("rope_scaling.partial_rotary_factor", |v| v["rope_scaling"]["partial_rotary_factor"] = 0.5.into()),
    ];
    for (field, f) in cases {
        match parse(&edit(KIMI_K2_THINKING, f)).unwrap_err() {
            ModelError::Unsupported { field: got, .. } => assert_eq!(got, field),
            e => panic!("{field}: {e}"),
        }
    }
    let invalid: [(&str, Edit); 4] = [
        ("n_group", |v| v["n_group"] = 5.into()),
        ("topk_group", |v| v["topk_group"] = 2.into()),
        ("num_experts_per_tok", |v| v["num_experts_per_tok"] = 400.into()),
        ("qk_rope_head_dim", |v| v["qk_rope_head_dim"] = 63.into()),
    ];
    for (field, f) in invalid {
        match parse(&edit(KIMI_K2_THINKING, f)).unwrap_err() {
            ModelError::InvalidConfig { field: got, .. } => assert_eq!(got, field),
            e => panic!("{field}: {e}"),
        }
    }
    match parse(&edit(KIMI_K2_THINKING, |v| v["hidden_size"] = "big".into())).unwrap_err() {
        ModelError::Json { message, .. } => assert!(message.contains("invalid type"), "{message}"),
        e => panic!("{e}"),
    }
    assert!(matches!(parse("{").unwrap_err(), ModelError::Json { .. }));
}

#[test]
fn fixture_configs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/model");
    let yarn = ModelConfig::from_dir(root.join("yarn_qlora")).unwrap();
    assert_eq!(yarn.q_lora_rank, Some(48));
    assert_eq!((yarn.n_group, yarn.topk_group, yarn.num_nextn_predict_layers), (4, 2, 1));
    let m = yarn_get_mscale(4.0, 1.0);
    assert!(close(yarn.softmax_scale(), 48f64.powf(-0.5) * m * m, 1e-15));
    assert!(matches!(yarn.rope_scaling, RopeScaling::Yarn { factor: 4.0, original_max_position_embeddings: 32, .. }));
    // The K2.5 fixture writes the same model in the published form, nested: same runtime config.
    let k25 = ModelConfig::from_dir(root.join("kimi_k25")).unwrap();
    assert_eq!(k25.weight_prefix, "language_model.");
    assert_eq!((k25.rope_scaling, k25.rope_theta), (yarn.rope_scaling, yarn.rope_theta));
    assert_eq!(k25.rope_inv_freq(), yarn.rope_inv_freq());
    let v2 = ModelConfig::from_dir(root.join("v2lite")).unwrap();
    assert_eq!((v2.q_lora_rank, v2.rope_interleave, v2.rope_scaling), (None, false, RopeScaling::Default));
    let int4 = ModelConfig::from_dir(root.join("int4_experts")).unwrap();
    assert!(int4.quantization().unwrap().is_some());
    match ModelConfig::from_dir(root.join("missing")).unwrap_err() {
        ModelError::Io { path, .. } => assert!(path.ends_with("missing/config.json")),
        e => panic!("{e}"),
    }
}
