//! Golden test against compressed-tensors itself: `fixtures/quant/` holds a 2-shard pack-quantized checkpoint, its
//! config.json and the library's own decompression (`expected.safetensors`), all written by
//! `scripts/fixtures_quant.py` (compressed-tensors 0.20.1, `PackedQuantizationCompressor`).

use std::path::PathBuf;

use eyrie_quant::config::{GroupSize, QuantScheme};
use eyrie_quant::{Checkpoint, Dtype, PackedInt4, QuantizationConfig};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/quant")
}

/// (module, group size, symmetric) of every quantized Linear in the fixture (see `CASES` in the script).
const QUANTIZED: [(&str, GroupSize, bool); 6] = [
    ("model.layers.1.mlp.experts.0.gate_proj", GroupSize::Columns(32), true),
    ("model.layers.1.mlp.experts.1.gate_proj", GroupSize::Columns(128), true),
    ("model.layers.1.mlp.experts.2.gate_proj", GroupSize::Columns(32), false),
    ("model.layers.1.mlp.experts.3.gate_proj", GroupSize::Columns(20), true),
    ("model.layers.1.mlp.experts.4.gate_proj", GroupSize::Columns(40), false),
    ("model.layers.1.mlp.experts.5.gate_proj", GroupSize::WholeRow, false),
];

/// Dense Linears that Kimi's `ignore` list keeps out of the `Linear` target.
const DENSE: [&str; 4] = [
    "lm_head",
    "model.layers.1.self_attn.o_proj",
    "model.layers.1.mlp.shared_experts.gate_proj",
    "model.layers.0.mlp.gate_proj",
];

/// Builds a module's [`PackedInt4`] from its checkpoint tensors, checking every dtype and shape.
fn load(ckpt: &Checkpoint, prefix: &str, group_size: GroupSize, symmetric: bool) -> PackedInt4 {
    let shape = ckpt.tensor(&format!("{prefix}.weight_shape")).unwrap();
    shape.expect_dtype(&[Dtype::I32, Dtype::I64]).unwrap();
    let dims = shape.to_i64_vec().unwrap();
    let (out, inp) = (dims[0] as usize, dims[1] as usize);
    let group = group_size.columns(inp);
    let n_groups = inp.div_ceil(group);

    let packed = ckpt.tensor(&format!("{prefix}.weight_packed")).unwrap();
    packed.expect_dtype(&[Dtype::I32]).unwrap();
    packed.expect_shape(&[out, inp.div_ceil(8)]).unwrap();
    let scale = ckpt.tensor(&format!("{prefix}.weight_scale")).unwrap();
    scale.expect_dtype(&[Dtype::BF16]).unwrap();
    scale.expect_shape(&[out, n_groups]).unwrap();

    let zp_name = format!("{prefix}.weight_zero_point");
    let zero_points = if symmetric {
        assert!(!ckpt.contains(&zp_name), "{zp_name} present for a symmetric scheme");
        None
    } else {
        let zp = ckpt.tensor(&zp_name).unwrap();
        zp.expect_dtype(&[Dtype::I32]).unwrap();
        zp.expect_shape(&[out.div_ceil(8), n_groups]).unwrap();
        Some(PackedInt4::from_packed_zero_points(&zp.to_u32_vec().unwrap(), out, n_groups).unwrap())
    };
    let w = PackedInt4::new(
        out,
        inp,
        group,
        packed.to_u32_vec().unwrap(),
        scale.to_f32_vec().unwrap(),
        scale.dtype,
        zero_points,
    )
    .unwrap();
    if !symmetric {
        // Re-packing the zero points gives the library's words back.
        let words = ckpt.tensor(&zp_name).unwrap().to_u32_vec().unwrap();
        assert_eq!(w.packed_zero_points(), Some(words), "{prefix}");
    }
    w
}

#[test]
fn dequantization_is_bit_exact_with_compressed_tensors() {
    let ckpt = Checkpoint::open(fixtures()).unwrap();
    assert!(ckpt.index_path().is_some(), "the fixture is sharded");
    assert_eq!(ckpt.shards().len(), 2);
    let expected = Checkpoint::open(fixtures().join("expected.safetensors")).unwrap();

    let mut shape_dtypes = Vec::new();
    for (prefix, group_size, symmetric) in QUANTIZED {
        shape_dtypes.push(ckpt.tensor(&format!("{prefix}.weight_shape")).unwrap().dtype);
        let w = load(&ckpt, prefix, group_size, symmetric);
        let want = expected.tensor(&format!("{prefix}.weight")).unwrap();
        want.expect_shape(&[w.out_features(), w.in_features()]).unwrap();
        let want = want.to_bf16_vec().unwrap();
        let got = w.dequantize_bf16();
        assert_eq!(got.len(), want.len());
        let mismatches: Vec<usize> = (0..got.len()).filter(|&k| got[k].to_bits() != want[k].to_bits()).collect();
        assert!(
            mismatches.is_empty(),
            "{prefix}: {} of {} values differ, first at {} ({} vs {})",
            mismatches.len(),
            got.len(),
            mismatches[0],
            got[mismatches[0]],
            want[mismatches[0]]
        );
        // The f32 path holds exactly the same values.
        let f = w.dequantize_f32();
        assert!(f.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_f32().to_bits()), "{prefix}");
    }
    assert!(shape_dtypes.contains(&Dtype::I32) && shape_dtypes.contains(&Dtype::I64), "{shape_dtypes:?}");
}

#[test]
fn quantize_minmax_reproduces_the_library() {
    let ckpt = Checkpoint::open(fixtures()).unwrap();
    let expected = Checkpoint::open(fixtures().join("expected.safetensors")).unwrap();
    for (prefix, group_size, symmetric) in QUANTIZED {
        let stored = load(&ckpt, prefix, group_size, symmetric);
        let original = expected.tensor(&format!("{prefix}.weight_original")).unwrap();
        original.expect_dtype(&[Dtype::BF16]).unwrap();
        let (out, inp) = (stored.out_features(), stored.in_features());
        let ours = PackedInt4::quantize_minmax(
            &original.to_f32_vec().unwrap(),
            out,
            inp,
            group_size.columns(inp),
            symmetric,
            Dtype::BF16,
        )
        .unwrap();
        assert_eq!(ours.scales(), stored.scales(), "{prefix}: scales");
        assert_eq!(ours.zero_points(), stored.zero_points(), "{prefix}: zero points");
        assert_eq!(ours.unpack(), stored.unpack(), "{prefix}: q");
        assert_eq!(ours, stored, "{prefix}");
    }
}

#[test]
fn config_json_parses_and_schemes_match_the_checkpoint() {
    let config = QuantizationConfig::from_config_file(&fixtures().join("config.json")).unwrap().unwrap();
    let QuantizationConfig::CompressedTensors(ct) = &config else { panic!("not compressed-tensors: {config:?}") };
    assert_eq!(ct.format.as_deref(), Some("pack-quantized"));
    assert_eq!(ct.quantization_status.as_deref(), Some("compressed"));
    assert_eq!(ct.config_groups.0.len(), QUANTIZED.len());
    let plan = config.plan().unwrap();

    for (prefix, group_size, symmetric) in QUANTIZED {
        assert_eq!(
            plan.scheme_for(prefix, "Linear"),
            Some(&QuantScheme::Int4Group { group_size, symmetric }),
            "{prefix}"
        );
    }
    let ckpt = Checkpoint::open(fixtures()).unwrap();
    for name in DENSE {
        assert_eq!(plan.scheme_for(name, "Linear"), None, "{name}");
        let weight = ckpt.tensor(&format!("{name}.weight")).unwrap();
        weight.expect_dtype(&[Dtype::BF16]).unwrap();
    }
    // Every module the plan quantizes has packed weights, every other one a dense weight, and nothing else is stored.
    let mut modules: Vec<&str> = ckpt.names().filter_map(|n| n.rsplit_once('.').map(|(m, _)| m)).collect();
    modules.dedup();
    assert_eq!(modules.len(), QUANTIZED.len() + DENSE.len(), "{modules:?}");
    for module in modules {
        let packed = ckpt.contains(&format!("{module}.weight_packed"));
        assert_eq!(plan.scheme_for(module, "Linear").is_some(), packed, "{module}");
        assert_eq!(ckpt.contains(&format!("{module}.weight")), !packed, "{module}");
    }
}
