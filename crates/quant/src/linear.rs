//! A Linear layer's weight as a checkpoint stores it: dense, compressed-tensors INT4, or FP8 with block scales.
//!
//! Detection follows the tensors, not the config: `<p>.weight_packed` means INT4 (pack-quantized);
//! `<p>.weight` in F8_E4M3 with `<p>.weight_scale_inv` means FP8 block (the FP8 Kimi-K2 release); any other
//! `<p>.weight` is dense. The group size of an INT4 weight comes from the quantization config
//! ([`crate::config::QuantScheme`]) when the caller has it, else it is inferred from the shapes when unambiguous.

use half::bf16;

use crate::fp8::{DEFAULT_BLOCK, dequant_block_fp8};
use crate::int4::PackedInt4;
use crate::{Checkpoint, Dtype, QuantError, Result, TensorView};

/// How a Linear's weight is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LinearKind {
    /// Plain `<p>.weight` (BF16, F16, F32).
    Dense,
    /// compressed-tensors pack-quantized INT4 (`weight_packed`, `weight_scale`, `weight_shape`).
    Int4,
    /// FP8 E4M3 with 128x128 inverse block scales (`weight`, `weight_scale_inv`).
    Fp8Block,
}

impl LinearKind {
    /// Short lowercase name for tables and logs.
    pub const fn as_str(self) -> &'static str {
        match self {
            LinearKind::Dense => "dense",
            LinearKind::Int4 => "int4",
            LinearKind::Fp8Block => "fp8-block",
        }
    }

    /// Which kind of Linear the checkpoint holds under `prefix`, if any (no data is read).
    pub fn detect(ckpt: &Checkpoint, prefix: &str) -> Option<Self> {
        if ckpt.contains(&format!("{prefix}.weight_packed")) {
            return Some(LinearKind::Int4);
        }
        let info = ckpt.info(&format!("{prefix}.weight"))?;
        if info.dtype == Dtype::F8_E4M3 && ckpt.contains(&format!("{prefix}.weight_scale_inv")) {
            Some(LinearKind::Fp8Block)
        } else if info.shape.len() == 2 {
            Some(LinearKind::Dense)
        } else {
            None
        }
    }
}

/// The weight `[out, in]` of one Linear, borrowed from (dense, FP8) or decoded out of (INT4) a checkpoint.
#[derive(Debug, Clone)]
pub enum LinearWeight<'a> {
    /// A dense weight, still in the memory map.
    Dense(TensorView<'a>),
    /// An INT4 weight, unpacked from the checkpoint's packed words.
    Int4(PackedInt4),
    /// An FP8 E4M3 weight with its inverse block scales.
    Fp8Block {
        /// The raw FP8 weight `[out, in]`.
        weight: TensorView<'a>,
        /// `weight_scale_inv`, `[ceil(out/block.0), ceil(in/block.1)]`.
        scale_inv: Vec<f32>,
        /// The block shape (128, 128 in DeepSeek-V3 / Kimi-K2).
        block: (usize, usize),
    },
}

impl<'a> LinearWeight<'a> {
    /// Loads the Linear stored under `prefix` (e.g. `model.layers.1.mlp.experts.0.gate_proj`).
    ///
    /// `group_size` is the INT4 group size from the quantization config; with `None` it is inferred as
    /// `in / n_groups` when that divides exactly (compressed-tensors only writes whole groups, so this is right
    /// for its checkpoints), and an error asks for the config otherwise.
    pub fn load(ckpt: &'a Checkpoint, prefix: &str, group_size: Option<usize>) -> Result<Self> {
        match LinearKind::detect(ckpt, prefix) {
            Some(LinearKind::Int4) => load_int4(ckpt, prefix, group_size).map(LinearWeight::Int4),
            Some(LinearKind::Fp8Block) => {
                let weight = ckpt.tensor(&format!("{prefix}.weight"))?;
                weight.expect_rank(2)?;
                let si = ckpt.tensor(&format!("{prefix}.weight_scale_inv"))?;
                si.expect_dtype(&[Dtype::F32, Dtype::BF16])?;
                let block = DEFAULT_BLOCK;
                let (out, inp) = (weight.shape[0], weight.shape[1]);
                si.expect_shape(&[out.div_ceil(block.0), inp.div_ceil(block.1)])?;
                Ok(LinearWeight::Fp8Block { weight, scale_inv: si.to_f32_vec()?, block })
            }
            Some(LinearKind::Dense) => {
                let w = ckpt.tensor(&format!("{prefix}.weight"))?;
                w.expect_dtype(&[Dtype::BF16, Dtype::F16, Dtype::F32])?;
                Ok(LinearWeight::Dense(w))
            }
            None => Err(QuantError::MissingTensor {
                checkpoint: ckpt.root().to_path_buf(),
                tensor: format!("{prefix}.weight (or {prefix}.weight_packed)"),
            }),
        }
    }

    /// The storage kind.
    pub fn kind(&self) -> LinearKind {
        match self {
            LinearWeight::Dense(_) => LinearKind::Dense,
            LinearWeight::Int4(_) => LinearKind::Int4,
            LinearWeight::Fp8Block { .. } => LinearKind::Fp8Block,
        }
    }

    /// The logical `[out, in]` shape.
    pub fn shape(&self) -> [usize; 2] {
        match self {
            LinearWeight::Dense(v) | LinearWeight::Fp8Block { weight: v, .. } => [v.shape[0], v.shape[1]],
            LinearWeight::Int4(w) => [w.out_features(), w.in_features()],
        }
    }

    /// The weight as bf16 `[out, in]` row-major: INT4 bit-exact with compressed-tensors' decompression (for BF16
    /// scales), FP8 as DeepSeek-V3's `weight_dequant`, dense F16/F32 rounded to nearest.
    pub fn dequantize_bf16(&self) -> Result<Vec<bf16>> {
        match self {
            LinearWeight::Dense(v) => match v.dtype {
                Dtype::BF16 => v.to_bf16_vec(),
                _ => Ok(v.to_f32_vec()?.into_iter().map(bf16::from_f32).collect()),
            },
            LinearWeight::Int4(w) => Ok(w.dequantize_bf16()),
            LinearWeight::Fp8Block { weight, scale_inv, block } => {
                dequant_block_fp8(weight.data, scale_inv, weight.shape[0], weight.shape[1], *block)
            }
        }
    }

    /// The weight as f32 `[out, in]` row-major (each value exactly the one [`Self::dequantize_bf16`] rounds, for
    /// INT4 and dense; FP8 values are the bf16 ones widened).
    pub fn dequantize_f32(&self) -> Result<Vec<f32>> {
        match self {
            LinearWeight::Dense(v) => v.to_f32_vec(),
            LinearWeight::Int4(w) => Ok(w.dequantize_f32()),
            LinearWeight::Fp8Block { .. } => Ok(self.dequantize_bf16()?.into_iter().map(f32::from).collect()),
        }
    }
}

/// Reads the compressed-tensors tensors of one INT4 Linear and validates them against each other.
fn load_int4(ckpt: &Checkpoint, prefix: &str, group_size: Option<usize>) -> Result<PackedInt4> {
    let packed = ckpt.tensor(&format!("{prefix}.weight_packed"))?;
    packed.expect_dtype(&[Dtype::I32, Dtype::U32])?;
    packed.expect_rank(2)?;
    let scale = ckpt.tensor(&format!("{prefix}.weight_scale"))?;
    scale.expect_dtype(&[Dtype::BF16, Dtype::F16, Dtype::F32])?;
    scale.expect_rank(2)?;
    let shape_t = ckpt.tensor(&format!("{prefix}.weight_shape"))?;
    shape_t.expect_dtype(&[Dtype::I32, Dtype::I64])?;
    shape_t.expect_shape(&[2])?;
    if ckpt.contains(&format!("{prefix}.weight_g_idx")) {
        return Err(QuantError::UnsupportedScheme {
            field: Some("config_groups.*.weights.actorder".into()),
            message: format!("{prefix}.weight_g_idx present: activation ordering is not supported"),
        });
    }
    let dims = shape_t.to_i64_vec()?;
    let (out, inp) = match (usize::try_from(dims[0]), usize::try_from(dims[1])) {
        (Ok(o), Ok(i)) if o > 0 && i > 0 => (o, i),
        _ => return Err(QuantError::invalid(shape_t.name, format!("weight_shape {dims:?} is not a positive shape"))),
    };
    let words = inp.div_ceil(8);
    if packed.shape != [out, words] {
        return Err(QuantError::ShapeMismatch {
            path: packed.path.to_path_buf(),
            tensor: packed.name.to_string(),
            expected: format!("[{out}, {words}] (weight_shape [{out}, {inp}], 8 values per word)"),
            found: packed.shape.to_vec(),
        });
    }
    let n_groups = scale.shape[1];
    let group = match group_size {
        Some(g) if g > 0 && inp.div_ceil(g) == n_groups => g,
        Some(g) => {
            return Err(QuantError::ShapeMismatch {
                path: scale.path.to_path_buf(),
                tensor: scale.name.to_string(),
                expected: format!("[{out}, {}] (in {inp}, group_size {g})", if g > 0 { inp.div_ceil(g) } else { 0 }),
                found: scale.shape.to_vec(),
            });
        }
        None if n_groups > 0 && inp % n_groups == 0 => inp / n_groups,
        None => {
            return Err(QuantError::invalid(
                scale.name,
                format!(
                    "cannot infer the group size from in {inp} and {n_groups} groups: pass the quantization config"
                ),
            ));
        }
    };
    scale.expect_shape(&[out, n_groups])?;
    let zero_points = match ckpt.info(&format!("{prefix}.weight_zero_point")) {
        None => None,
        Some(_) => {
            let zp = ckpt.tensor(&format!("{prefix}.weight_zero_point"))?;
            zp.expect_dtype(&[Dtype::I32, Dtype::U32])?;
            zp.expect_shape(&[out.div_ceil(8), n_groups])?;
            Some(PackedInt4::from_packed_zero_points(&zp.to_u32_vec()?, out, n_groups)?)
        }
    };
    PackedInt4::new(out, inp, group, packed.to_u32_vec()?, scale.to_f32_vec()?, scale.dtype, zero_points)
        .map_err(|e| QuantError::invalid(prefix, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::write::SafetensorsWriter;

    fn write_int4(dir: &std::path::Path, w: &PackedInt4, prefix: &str, shape_i64: bool) {
        let mut wr = SafetensorsWriter::new();
        let (o, i) = (w.out_features(), w.in_features());
        wr.add_u32_as_i32(format!("{prefix}.weight_packed"), &[o, w.packed_row_words()], w.packed()).unwrap();
        let scales: Vec<bf16> = w.scales().iter().map(|&s| bf16::from_f32(s)).collect();
        wr.add_bf16(format!("{prefix}.weight_scale"), &[o, w.n_groups()], &scales).unwrap();
        if shape_i64 {
            wr.add_i64(format!("{prefix}.weight_shape"), &[2], &[o as i64, i as i64]).unwrap();
        } else {
            wr.add_i32(format!("{prefix}.weight_shape"), &[2], &[o as i32, i as i32]).unwrap();
        }
        if let Some(zp) = w.packed_zero_points() {
            wr.add_u32_as_i32(format!("{prefix}.weight_zero_point"), &[o.div_ceil(8), w.n_groups()], &zp).unwrap();
        }
        wr.write(dir.join("model.safetensors")).unwrap();
    }

    fn sample(out: usize, inp: usize, group: usize, sym: bool) -> PackedInt4 {
        let w: Vec<f32> = (0..out * inp).map(|i| ((i * 31 % 97) as f32 - 48.0) * 0.01).collect();
        PackedInt4::quantize_minmax(&w, out, inp, group, sym, Dtype::BF16).unwrap()
    }

    #[test]
    fn loads_int4_with_and_without_group_hint() {
        for (out, inp, group, sym, i64shape) in [(16, 64, 32, true, true), (9, 40, 8, false, false)] {
            let dir = tempfile::tempdir().unwrap();
            let w = sample(out, inp, group, sym);
            write_int4(dir.path(), &w, "m.proj", i64shape);
            let ck = Checkpoint::open(dir.path()).unwrap();
            assert_eq!(LinearKind::detect(&ck, "m.proj"), Some(LinearKind::Int4));
            for hint in [None, Some(group)] {
                let lw = LinearWeight::load(&ck, "m.proj", hint).unwrap();
                assert_eq!(lw.shape(), [out, inp]);
                let LinearWeight::Int4(got) = &lw else { panic!("not int4") };
                assert_eq!(got, &w);
                assert_eq!(lw.dequantize_bf16().unwrap(), w.dequantize_bf16());
            }
        }
    }

    #[test]
    fn partial_last_group_needs_the_config() {
        let dir = tempfile::tempdir().unwrap();
        let w = sample(8, 100, 48, true); // 3 groups of 48, 48, 4 columns: 100 is no multiple of 3
        write_int4(dir.path(), &w, "p", false);
        let ck = Checkpoint::open(dir.path()).unwrap();
        let err = LinearWeight::load(&ck, "p", None).unwrap_err();
        assert!(err.to_string().contains("group size"), "{err}");
        let LinearWeight::Int4(got) = LinearWeight::load(&ck, "p", Some(48)).unwrap() else { panic!("not int4") };
        assert_eq!(got, w);
        let err = LinearWeight::load(&ck, "p", Some(64)).unwrap_err();
        assert!(matches!(err, QuantError::ShapeMismatch { .. }), "{err}");
    }

    #[test]
    fn dense_and_missing() {
        let dir = tempfile::tempdir().unwrap();
        let mut wr = SafetensorsWriter::new();
        wr.add_f32("d.weight", &[2, 3], &[1.0, -2.0, 3.5, 0.25, 1e-3, 7.0]).unwrap();
        wr.add_f32("norm.weight", &[3], &[1.0, 1.0, 1.0]).unwrap();
        wr.write(dir.path().join("model.safetensors")).unwrap();
        let ck = Checkpoint::open(dir.path()).unwrap();
        let lw = LinearWeight::load(&ck, "d", None).unwrap();
        assert_eq!(lw.kind(), LinearKind::Dense);
        assert_eq!(lw.shape(), [2, 3]);
        assert_eq!(lw.dequantize_f32().unwrap(), vec![1.0, -2.0, 3.5, 0.25, 1e-3, 7.0]);
        assert_eq!(LinearKind::detect(&ck, "norm"), None);
        let err = LinearWeight::load(&ck, "nope", None).unwrap_err();
        assert!(matches!(err, QuantError::MissingTensor { .. }), "{err}");
    }

    #[test]
    fn corrupt_weight_shape_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let w = sample(8, 64, 32, true);
        let mut wr = SafetensorsWriter::new();
        wr.add_u32_as_i32("x.weight_packed", &[8, 8], w.packed()).unwrap();
        let scales: Vec<bf16> = w.scales().iter().map(|&s| bf16::from_f32(s)).collect();
        wr.add_bf16("x.weight_scale", &[8, 2], &scales).unwrap();
        wr.add_i64("x.weight_shape", &[2], &[8, -64]).unwrap();
        wr.write(dir.path().join("model.safetensors")).unwrap();
        let ck = Checkpoint::open(dir.path()).unwrap();
        let err = LinearWeight::load(&ck, "x", None).unwrap_err();
        assert!(err.to_string().contains("x.weight_shape"), "{err}");
    }
}
