//! compressed-tensors `pack-quantized` INT4 weights (W4A16), after compressed-tensors 0.20
//! `compressors/pack_quantized/{base,helpers}.py`, `quantization/lifecycle/{forward,forward_helpers}.py` and
//! `quantization/utils/helpers.py` (`calculate_qparams`); format summary in `kimi-k2-formats.md` section 1.
//!
//! # On-disk layout of one quantized Linear `<p>` (`[out, in]`, `G = ceil(in / group)`)
//!
//! - `<p>.weight_packed`, I32 `[out, ceil(in/8)]`: word `k` of row `o` holds columns `8k..8k+7`, column `8k+j` in
//!   bits `[4j, 4j+3]` (LSB first), stored offset-binary `u = q + 8`; a tail that is not a multiple of 8 is padded
//!   with `u = 0` (`pack_to_int32` pads with zeros *after* adding the offset).
//! - `<p>.weight_scale`, the original weight dtype (`initialize_qparams`: BF16, F16 or F32), `[out, G]`.
//! - `<p>.weight_zero_point` (asymmetric `group`/`channel` only), I32 packed along dim 0: `[ceil(out/8), G]`, word
//!   `(k, g)` holds the zero points of rows `8k..8k+7` of group `g`, same nibble order and `+8` offset.
//! - `<p>.weight_shape`, I32 or I64 `[2]`: the original `[out, in]`.
//!
//! # Decompression, bit for bit
//!
//! `PackedQuantizationCompressor.decompress` calls `unpack_from_int32` (signed int8 `q`, padding trimmed to
//! `weight_shape`), then `dequantize(x_q, scale, zero_point, args)` with `dtype = scale.dtype`. For the `group`
//! strategy `_process_group` reshapes the columns into `[G, group]` and `_dequantize` computes
//! `x_q.to(scale.dtype) - zero_point.to(scale.dtype)`, then `* scale`, all in the scale dtype; `channel` reaches
//! the same `_dequantize` with a `[out, 1]` scale. `q - zp` lies in `[-15, 15]`, exact in BF16/F16/F32. A BF16
//! (resp. F16) product of that small integer and the scale is exact in f32 (at most 8 + 4, resp. 11 + 4,
//! significant bits) and torch rounds it once (to nearest, ties to even) to the scale dtype; for F32 scales it is the
//! plain f32 product. [`PackedInt4::dequantize_rows_into`] computes exactly that, so its output is bit-identical to
//! the library's (checked against the library by `tests/golden_compressed_tensors.rs`).
//!
//! Partial groups (`in % group != 0`): the library's `_process_group` rejects them (`tensor column shape must be
//! divisible by the given group_size`); this module accepts them with `G = ceil(in / group)` and a shorter last
//! group, the layout vLLM and the initialisation code (`strategy_cdiv`) assume. `g_idx` (activation ordering
//! `group`) is not supported here.

use std::ops::Range;

use half::{bf16, f16};

use crate::{Dtype, QuantError, Result};

/// Number of INT4 values in one packed 32-bit word.
pub const VALUES_PER_WORD: usize = 8;
/// Smallest signed INT4 value.
pub const Q_MIN: i8 = -8;
/// Largest signed INT4 value.
pub const Q_MAX: i8 = 7;
/// Offset between the signed value `q` and the stored nibble `u = q + 8`.
const OFFSET: i32 = 8;

/// The pack-quantized INT4 weight of one Linear (`[out_features, in_features]`), as stored by compressed-tensors.
///
/// Invariants (checked by [`PackedInt4::new`]): `group_size > 0`; `packed` is `[out, ceil(in/8)]`; `scales` is
/// `[out, ceil(in/group_size)]` and each scale is exactly representable in `scale_dtype` (BF16, F16 or F32);
/// `zero_points`, when present, has the shape of `scales` and values in `[-8, 7]`.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedInt4 {
    out_features: usize,
    in_features: usize,
    group_size: usize,
    /// `[out, ceil(in/8)]`, LSB-first nibbles `u = q + 8`.
    packed: Vec<u32>,
    /// `[out, ceil(in/group)]`, values representable in `scale_dtype`.
    scales: Vec<f32>,
    scale_dtype: Dtype,
    /// `[out, ceil(in/group)]`, signed, asymmetric schemes only.
    zero_points: Option<Vec<i8>>,
}

impl PackedInt4 {
    /// Builds a weight from its packed parts, validating every length.
    ///
    /// `packed` is `weight_packed` read as u32 (`[out, ceil(in/8)]`), `scales` the `weight_scale` values widened to
    /// f32 (`[out, ceil(in/group_size)]`), `scale_dtype` the dtype `weight_scale` is stored in, `zero_points` the
    /// unpacked signed zero points (see [`PackedInt4::from_packed_zero_points`]) or `None` for a symmetric scheme.
    pub fn new(
        out_features: usize,
        in_features: usize,
        group_size: usize,
        packed: Vec<u32>,
        scales: Vec<f32>,
        scale_dtype: Dtype,
        zero_points: Option<Vec<i8>>,
    ) -> Result<Self> {
        let dims = Dims::new(out_features, in_features, group_size)?;
        check_len("packed", packed.len(), dims.packed_len, "[out, ceil(in/8)]", out_features, dims.row_words)?;
        check_len("scales", scales.len(), dims.scale_len, "[out, ceil(in/group_size)]", out_features, dims.n_groups)?;
        check_scale_dtype(scale_dtype)?;
        if let Some(i) = scales.iter().position(|&s| !representable(s, scale_dtype)) {
            return Err(QuantError::invalid(
                "scales",
                format!("scale {i} = {:e} is not exactly representable in {scale_dtype}", scales[i]),
            ));
        }
        if let Some(zp) = &zero_points {
            check_len(
                "zero_points",
                zp.len(),
                dims.scale_len,
                "[out, ceil(in/group_size)]",
                out_features,
                dims.n_groups,
            )?;
            check_q_range("zero_points", zp)?;
        }
        Ok(Self { out_features, in_features, group_size, packed, scales, scale_dtype, zero_points })
    }

    /// Packs signed INT4 values `q` (`[out, in]` row-major, each in `[-8, 7]`) with their scales and zero points.
    pub fn pack(
        q: &[i8],
        out_features: usize,
        in_features: usize,
        group_size: usize,
        scales: Vec<f32>,
        scale_dtype: Dtype,
        zero_points: Option<Vec<i8>>,
    ) -> Result<Self> {
        let dims = Dims::new(out_features, in_features, group_size)?;
        check_len("q", q.len(), dims.weight_len, "[out, in]", out_features, in_features)?;
        check_q_range("q", q)?;
        let mut packed = vec![0u32; dims.packed_len];
        if in_features > 0 {
            for (row_q, row_words) in q.chunks_exact(in_features).zip(packed.chunks_exact_mut(dims.row_words)) {
                for (word, chunk) in row_words.iter_mut().zip(row_q.chunks(VALUES_PER_WORD)) {
                    *word = pack_word(chunk);
                }
            }
        }
        Self::new(out_features, in_features, group_size, packed, scales, scale_dtype, zero_points)
    }

    /// Unpacks the signed values `q` (`[out, in]` row-major), padding stripped.
    pub fn unpack(&self) -> Vec<i8> {
        let mut q = Vec::with_capacity(self.out_features * self.in_features);
        if self.in_features == 0 {
            return q;
        }
        for row_words in self.packed.chunks_exact(self.packed_row_words()) {
            let row_start = q.len();
            for &word in row_words {
                for j in 0..VALUES_PER_WORD {
                    q.push(nibble(word, j) as i8 - OFFSET as i8);
                }
            }
            q.truncate(row_start + self.in_features);
        }
        q
    }

    /// Dequantizes rows `rows` into `out` (`[rows.len(), in]` row-major), bit-exact with compressed-tensors'
    /// decompression: each value is `(q - zp) * scale` rounded once to the scale dtype, then widened to f32.
    ///
    /// Rows are independent, so parallel callers may hand disjoint row ranges to different threads.
    pub fn dequantize_rows_into(&self, rows: Range<usize>, out: &mut [f32]) -> Result<()> {
        self.check_rows(&rows, out.len())?;
        self.write_rows(rows, out);
        Ok(())
    }

    /// Like [`PackedInt4::dequantize_rows_into`], writing bf16 (see [`PackedInt4::dequantize_bf16`]).
    pub fn dequantize_rows_bf16_into(&self, rows: Range<usize>, out: &mut [bf16]) -> Result<()> {
        self.check_rows(&rows, out.len())?;
        self.write_rows_bf16(rows, out);
        Ok(())
    }

    /// Dequantizes the whole weight to f32 (`[out, in]`); every value is exactly representable in the scale dtype.
    pub fn dequantize_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.out_features * self.in_features];
        self.write_rows(0..self.out_features, &mut out);
        out
    }

    /// Dequantizes the whole weight to bf16 (`[out, in]`). Bit-exact with the library when the scale dtype is BF16;
    /// for F16/F32 scales it is the library's output (in the scale dtype) rounded to bf16, i.e. `.to(torch.bfloat16)`.
    pub fn dequantize_bf16(&self) -> Vec<bf16> {
        let mut out = vec![bf16::ZERO; self.out_features * self.in_features];
        // Table values are exact in the scale dtype; for BF16 scales the conversion is the identity on them.
        self.write_rows_bf16(0..self.out_features, &mut out);
        out
    }

    /// Reproduces compressed-tensors' min-max calibration (`calculate_qparams` over per-group `amin`/`amax`, as the
    /// `minmax` observer and `compute_dynamic_scales_and_zp` do) followed by `quantize`, in the arithmetic torch
    /// uses for a weight of dtype `scale_dtype` (each op computed in f32, rounded to the dtype).
    ///
    /// `weight` is `[out, in]` row-major; values not representable in `scale_dtype` are first rounded to it (the
    /// weight *is* in that dtype in the library). Symmetric: `scale = max(|min|, |max|) / 7.5`; asymmetric:
    /// `scale = (max - min) / 15`, `zp = round(clamp(-8 - min / scale, -8, 7))` (min/max include 0). A zero scale
    /// becomes the dtype's epsilon; then `q = round(clamp(w / scale + zp, -8, 7))`, ties to even.
    /// `group_size >= in_features` gives one group per row (the `channel` strategy).
    pub fn quantize_minmax(
        weight: &[f32],
        out_features: usize,
        in_features: usize,
        group_size: usize,
        symmetric: bool,
        scale_dtype: Dtype,
    ) -> Result<Self> {
        let dims = Dims::new(out_features, in_features, group_size)?;
        check_len("weight", weight.len(), dims.weight_len, "[out, in]", out_features, in_features)?;
        check_scale_dtype(scale_dtype)?;
        let rd = |x: f32| round_to(x, scale_dtype);
        let eps = match scale_dtype {
            Dtype::BF16 => bf16::EPSILON.to_f32(),
            Dtype::F16 => f16::EPSILON.to_f32(),
            _ => f32::EPSILON,
        };
        let mut q = vec![0i8; dims.weight_len];
        let mut scales = Vec::with_capacity(dims.scale_len);
        let mut zero_points = (!symmetric).then(|| Vec::with_capacity(dims.scale_len));
        for row in 0..out_features {
            for g in 0..dims.n_groups {
                let start = row * in_features + g * group_size;
                let end = row * in_features + ((g + 1) * group_size).min(in_features);
                let values = weight[start..end].iter().map(|&w| rd(w));
                // torch.min/max with zeros: NaN propagates, as in torch.
                let (mut lo, mut hi) = (0.0f32, 0.0f32);
                for v in values.clone() {
                    lo = if v.is_nan() || lo.is_nan() { f32::NAN } else { lo.min(v) };
                    hi = if v.is_nan() || hi.is_nan() { f32::NAN } else { hi.max(v) };
                }
                let (scale, zp) = if symmetric {
                    (rd(lo.abs().max(hi.abs()) / 7.5), 0.0f32)
                } else {
                    let scale = rd(rd(hi - lo) / 15.0);
                    let zp = rd(f32::from(Q_MIN) - rd(lo / scale)).clamp(f32::from(Q_MIN), f32::from(Q_MAX));
                    // round_to_quantized_type_dtype: round in the dtype, then `.to(int8)` (NaN becomes 0).
                    (scale, rd(zp.round_ties_even()))
                };
                let scale = if scale == 0.0 { eps } else { scale };
                let zp_i8 = zp as i8;
                scales.push(scale);
                if let Some(zps) = zero_points.as_mut() {
                    zps.push(zp_i8);
                }
                for (dst, v) in q[start..end].iter_mut().zip(values) {
                    let scaled = rd(rd(v / scale) + f32::from(zp_i8));
                    *dst = scaled.clamp(f32::from(Q_MIN), f32::from(Q_MAX)).round_ties_even() as i8;
                }
            }
        }
        Self::pack(&q, out_features, in_features, group_size, scales, scale_dtype, zero_points)
    }

    /// Decodes the on-disk `weight_zero_point` (I32 read as u32, packed along dim 0: `[ceil(out/8), n_groups]`) into
    /// signed zero points `[out, n_groups]`.
    pub fn from_packed_zero_points(words: &[u32], out_features: usize, n_groups: usize) -> Result<Vec<i8>> {
        let word_rows = out_features.div_ceil(VALUES_PER_WORD);
        let needed = checked_mul(word_rows, n_groups, "weight_zero_point")?;
        check_len("weight_zero_point", words.len(), needed, "[ceil(out/8), n_groups]", word_rows, n_groups)?;
        let mut zp = Vec::with_capacity(checked_mul(out_features, n_groups, "zero_points")?);
        for row in 0..out_features {
            let word_row = &words[(row / VALUES_PER_WORD) * n_groups..(row / VALUES_PER_WORD + 1) * n_groups];
            zp.extend(word_row.iter().map(|&w| nibble(w, row % VALUES_PER_WORD) as i8 - OFFSET as i8));
        }
        Ok(zp)
    }

    /// Packs signed zero points `[out, n_groups]` into the on-disk `weight_zero_point` layout
    /// (`[ceil(out/8), n_groups]`, packed along dim 0, padding rows `u = 0`).
    pub fn pack_zero_points(zero_points: &[i8], out_features: usize, n_groups: usize) -> Result<Vec<u32>> {
        let needed = checked_mul(out_features, n_groups, "zero_points")?;
        check_len("zero_points", zero_points.len(), needed, "[out, n_groups]", out_features, n_groups)?;
        check_q_range("zero_points", zero_points)?;
        let word_rows = out_features.div_ceil(VALUES_PER_WORD);
        let mut words = vec![0u32; word_rows * n_groups];
        for (row, zp_row) in zero_points.chunks_exact(n_groups.max(1)).enumerate().take(out_features) {
            let shift = 4 * (row % VALUES_PER_WORD);
            let word_row = &mut words[(row / VALUES_PER_WORD) * n_groups..(row / VALUES_PER_WORD + 1) * n_groups];
            for (word, &z) in word_row.iter_mut().zip(zp_row) {
                *word |= ((i32::from(z) + OFFSET) as u32) << shift;
            }
        }
        Ok(words)
    }

    /// The zero points in the on-disk `weight_zero_point` layout (`[ceil(out/8), n_groups]`), `None` if symmetric.
    pub fn packed_zero_points(&self) -> Option<Vec<u32>> {
        let zp = self.zero_points.as_ref()?;
        // The invariants of `Self` guarantee the length and range checks pass.
        Self::pack_zero_points(zp, self.out_features, self.n_groups()).ok()
    }

    /// Output features (rows), from `weight_shape[0]`.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// Input features (columns), from `weight_shape[1]`, padding excluded.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Columns per group (`in_features` for the `channel` strategy); the last group of a row may be shorter.
    pub fn group_size(&self) -> usize {
        self.group_size
    }

    /// Groups per row: `ceil(in / group_size)`.
    pub fn n_groups(&self) -> usize {
        self.in_features.div_ceil(self.group_size)
    }

    /// Packed words per row: `ceil(in / 8)`.
    pub fn packed_row_words(&self) -> usize {
        self.in_features.div_ceil(VALUES_PER_WORD)
    }

    /// The packed words, `[out, ceil(in/8)]` row-major.
    pub fn packed(&self) -> &[u32] {
        &self.packed
    }

    /// The scales, `[out, ceil(in/group_size)]` row-major, each exactly representable in [`Self::scale_dtype`].
    pub fn scales(&self) -> &[f32] {
        &self.scales
    }

    /// The dtype of `weight_scale` (the original weight dtype), which is also the dtype of the dequantized weight.
    pub fn scale_dtype(&self) -> Dtype {
        self.scale_dtype
    }

    /// The signed zero points, `[out, ceil(in/group_size)]`, `None` for a symmetric scheme.
    pub fn zero_points(&self) -> Option<&[i8]> {
        self.zero_points.as_deref()
    }

    /// Whether the scheme is symmetric (no zero points).
    pub fn is_symmetric(&self) -> bool {
        self.zero_points.is_none()
    }

    /// Heap bytes held by this value (packed words, f32 scales, zero points).
    pub fn heap_bytes(&self) -> usize {
        self.packed.len() * 4 + self.scales.len() * 4 + self.zero_points.as_ref().map_or(0, Vec::len)
    }

    /// Bytes the weight takes in a checkpoint: `weight_packed`, `weight_scale` in its dtype, the packed
    /// `weight_zero_point` when asymmetric (`weight_shape` excluded).
    pub fn checkpoint_bytes(&self) -> usize {
        let zp_words =
            self.zero_points.as_ref().map_or(0, |_| self.out_features.div_ceil(VALUES_PER_WORD) * self.n_groups());
        self.packed.len() * 4 + self.scales.len() * self.scale_dtype.size() + zp_words * 4
    }

    /// Dequantizes `rows` into `out` (`[rows.len(), in]`); the caller has checked the range and the buffer size.
    fn write_rows(&self, rows: Range<usize>, out: &mut [f32]) {
        self.write_rows_as(rows, out, |v| v);
    }

    /// Dequantizes `rows` into `out` through a per-group table of the 16 possible values, converted once per group
    /// by `convert`; whole words are expanded eight values at a time.
    fn write_rows_as<T: Copy + Default>(&self, rows: Range<usize>, out: &mut [T], convert: impl Fn(f32) -> T) {
        if self.in_features == 0 {
            return;
        }
        let n_groups = self.n_groups();
        let row_words = self.packed_row_words();
        let word_aligned_groups = self.group_size.is_multiple_of(VALUES_PER_WORD);
        if word_aligned_groups && self.in_features.is_multiple_of(self.group_size) {
            // The common layout (compressed-tensors writes only whole groups): straight chunk walks.
            let group_words = self.group_size / VALUES_PER_WORD;
            for (row, out_row) in rows.zip(out.chunks_exact_mut(self.in_features)) {
                let words = &self.packed[row * row_words..(row + 1) * row_words];
                let scales = &self.scales[row * n_groups..(row + 1) * n_groups];
                let zps = self.zero_points.as_ref().map(|z| &z[row * n_groups..(row + 1) * n_groups]);
                for (g, (gw, go)) in
                    words.chunks_exact(group_words).zip(out_row.chunks_exact_mut(self.group_size)).enumerate()
                {
                    let table = self.group_table(scales[g], zps.map_or(0, |z| i32::from(z[g])));
                    let lut: [T; 16] = std::array::from_fn(|u| convert(table[u]));
                    for (word, o8) in gw.iter().zip(go.chunks_exact_mut(VALUES_PER_WORD)) {
                        let mut w = *word;
                        for v in o8 {
                            *v = lut[(w & 0xF) as usize];
                            w >>= 4;
                        }
                    }
                }
            }
            return;
        }
        for (row, out_row) in rows.zip(out.chunks_exact_mut(self.in_features)) {
            let words = &self.packed[row * row_words..(row + 1) * row_words];
            for g in 0..n_groups {
                let idx = row * n_groups + g;
                let zp = self.zero_points.as_ref().map_or(0, |z| i32::from(z[idx]));
                let table = self.group_table(self.scales[idx], zp);
                let lut: [T; 16] = std::array::from_fn(|u| convert(table[u]));
                let start = g * self.group_size;
                let end = (start + self.group_size).min(self.in_features);
                let whole_end =
                    if word_aligned_groups { start + (end - start) / VALUES_PER_WORD * VALUES_PER_WORD } else { start };
                let group_words = &words[start / VALUES_PER_WORD..whole_end / VALUES_PER_WORD];
                for (word, chunk) in group_words.iter().zip(out_row[start..whole_end].chunks_exact_mut(VALUES_PER_WORD))
                {
                    let mut w = *word;
                    for v in chunk {
                        *v = lut[(w & 0xF) as usize];
                        w >>= 4;
                    }
                }
                for (i, value) in (whole_end..end).zip(&mut out_row[whole_end..end]) {
                    *value = lut[nibble(words[i / VALUES_PER_WORD], i % VALUES_PER_WORD) as usize];
                }
            }
        }
    }

    /// Validates a row range and the length of the buffer it is written to.
    fn check_rows(&self, rows: &Range<usize>, out_len: usize) -> Result<()> {
        if rows.start > rows.end || rows.end > self.out_features {
            return Err(QuantError::invalid(
                "rows",
                format!("row range {rows:?} is outside 0..{} (out_features)", self.out_features),
            ));
        }
        let expected = rows.len() * self.in_features;
        if out_len != expected {
            return Err(QuantError::invalid(
                "out",
                format!(
                    "output buffer holds {out_len} values, {} rows x {} columns need {expected}",
                    rows.len(),
                    self.in_features
                ),
            ));
        }
        Ok(())
    }

    /// bf16 output: table values are truncated when they already are bf16 values (BF16 scales), rounded to nearest
    /// otherwise. Two monomorphised calls so the conversion inlines into the table loop.
    fn write_rows_bf16(&self, rows: Range<usize>, out: &mut [bf16]) {
        if self.scale_dtype == Dtype::BF16 {
            self.write_rows_as(rows, out, |v| bf16::from_bits((v.to_bits() >> 16) as u16));
        } else {
            self.write_rows_as(rows, out, |v| bf16::from_bits(bf16_bits(v)));
        }
    }

    /// The 16 dequantized values of one group, indexed by the stored nibble `u`.
    #[inline(always)]
    fn group_table(&self, scale: f32, zp: i32) -> [f32; 16] {
        // `u - 8 - zp` is in [-15, 15]: exact in every scale dtype.
        let products: [f32; 16] = std::array::from_fn(|u| (u as i32 - OFFSET - zp) as f32 * scale);
        match self.scale_dtype {
            Dtype::BF16 => products.map(|p| f32::from_bits(u32::from(bf16_bits(p)) << 16)),
            Dtype::F16 => products.map(|p| f16::from_f32(p).to_f32()),
            _ => products,
        }
    }
}

/// `x` rounded to the nearest bf16 (ties to even), as bits; NaN stays NaN (quieted). Equal to
/// `half::bf16::from_f32(x).to_bits()`, without its per-call dispatch, for the hot dequantization tables.
#[inline]
fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounded = (bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16) as u16;
    let quiet_nan = ((bits >> 16) | 0x0040) as u16;
    // Branch-free select so the 16-entry table loops vectorise.
    if x.is_nan() { quiet_nan } else { rounded }
}

/// Packs up to 8 signed values (in `[-8, 7]`) into one word, element 0 in the lowest nibble, missing values `u = 0`.
pub fn pack_word(values: &[i8]) -> u32 {
    values
        .iter()
        .take(VALUES_PER_WORD)
        .enumerate()
        .fold(0u32, |word, (j, &q)| word | ((((i32::from(q) + OFFSET) as u32) & 0xF) << (4 * j)))
}

/// The stored nibble `u` (in `[0, 15]`) at position `j` (0..8) of `word`.
#[inline]
fn nibble(word: u32, j: usize) -> u32 {
    (word >> (4 * j)) & 0xF
}

/// Rounds an f32 to `dtype` (round to nearest, ties to even) and widens it back.
#[inline]
fn round_to(x: f32, dtype: Dtype) -> f32 {
    match dtype {
        Dtype::BF16 => f32::from_bits(u32::from(bf16_bits(x)) << 16),
        Dtype::F16 => f16::from_f32(x).to_f32(),
        _ => x,
    }
}

fn representable(x: f32, dtype: Dtype) -> bool {
    x.is_nan() || round_to(x, dtype).to_bits() == x.to_bits()
}

fn check_scale_dtype(dtype: Dtype) -> Result<()> {
    match dtype {
        Dtype::BF16 | Dtype::F16 | Dtype::F32 => Ok(()),
        other => Err(QuantError::invalid("scale_dtype", format!("{other} is not a scale dtype (BF16, F16 or F32)"))),
    }
}

fn check_q_range(what: &str, values: &[i8]) -> Result<()> {
    match values.iter().position(|q| !(Q_MIN..=Q_MAX).contains(q)) {
        Some(i) => {
            Err(QuantError::invalid(what, format!("value {i} = {} is outside the INT4 range [-8, 7]", values[i])))
        }
        None => Ok(()),
    }
}

fn check_len(what: &str, found: usize, expected: usize, shape: &str, rows: usize, cols: usize) -> Result<()> {
    if found == expected {
        Ok(())
    } else {
        Err(QuantError::invalid(what, format!("has {found} values, expected {shape} = [{rows}, {cols}] = {expected}")))
    }
}

fn checked_mul(a: usize, b: usize, what: &str) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| QuantError::invalid(what, format!("size {a} x {b} overflows")))
}

/// Sizes derived from `[out, in]` and the group size, overflow-checked.
struct Dims {
    row_words: usize,
    n_groups: usize,
    weight_len: usize,
    packed_len: usize,
    scale_len: usize,
}

impl Dims {
    fn new(out_features: usize, in_features: usize, group_size: usize) -> Result<Self> {
        if group_size == 0 {
            return Err(QuantError::invalid("group_size", "must be greater than 0"));
        }
        let row_words = in_features.div_ceil(VALUES_PER_WORD);
        let n_groups = in_features.div_ceil(group_size);
        Ok(Self {
            row_words,
            n_groups,
            weight_len: checked_mul(out_features, in_features, "weight")?,
            packed_len: checked_mul(out_features, row_words, "packed")?,
            scale_len: checked_mul(out_features, n_groups, "scales")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_bf16_rounding_equals_half() {
        let mut s = 0x1234_5678u32;
        let specials = [0.0f32, -0.0, 1.0, f32::MAX, f32::MIN_POSITIVE, 1e-40, f32::INFINITY, f32::NEG_INFINITY];
        let randoms = (0..200_000).map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            f32::from_bits(s)
        });
        for x in specials.into_iter().chain(randoms) {
            if x.is_nan() {
                assert!(bf16::from_bits(bf16_bits(x)).is_nan());
            } else {
                assert_eq!(bf16_bits(x), bf16::from_f32(x).to_bits(), "{x:e} ({:#010x})", x.to_bits());
            }
        }
    }

    #[test]
    fn reference_doc_word() {
        // kimi-k2-formats.md section 1: signed [1,-2,3,-4,5,-6,7,-8] -> u [9,6,11,4,13,2,15,0] -> 0x0F2D4B69.
        assert_eq!(pack_word(&[1, -2, 3, -4, 5, -6, 7, -8]), 0x0F2D_4B69);
        let w = PackedInt4::pack(&[1, -2, 3, -4, 5, -6, 7, -8], 1, 8, 8, vec![1.0], Dtype::BF16, None).unwrap();
        assert_eq!(w.packed(), &[0x0F2D_4B69]);
        assert_eq!(w.unpack(), vec![1, -2, 3, -4, 5, -6, 7, -8]);
        assert_eq!(w.dequantize_f32(), vec![1.0, -2.0, 3.0, -4.0, 5.0, -6.0, 7.0, -8.0]);
    }

    #[test]
    fn tail_is_padded_with_zero_nibbles_and_trimmed() {
        // in = 3: one word per row, nibbles 3..8 are u = 0.
        let q = [7i8, -8, 0, -1, 2, 3];
        let w = PackedInt4::pack(&q, 2, 3, 2, vec![1.0; 4], Dtype::F32, None).unwrap();
        assert_eq!(w.packed(), &[0x80F, 0xBA7]);
        assert_eq!(w.unpack(), q);
        assert_eq!(w.n_groups(), 2);
        assert_eq!(w.packed_row_words(), 1);
    }

    #[test]
    fn zero_points_round_trip_and_layout() {
        // out = 9 rows, 2 groups: two word rows, the second holding only row 8.
        let zp: Vec<i8> = (0..18).map(|i| (i % 16) as i8 - 8).collect();
        let words = PackedInt4::pack_zero_points(&zp, 9, 2).unwrap();
        assert_eq!(words.len(), 4);
        // Word (0, 0) holds rows 0..8 of group 0: zp[2*o] = 2*o - 8 -> u = 2*o.
        assert_eq!(words[0], 0xECA8_6420);
        // Word (1, 1) holds row 8 of group 1 (zp[17] = 17 % 16 - 8 = -7 -> u = 1) in its lowest nibble.
        assert_eq!(words[3], 0x1);
        assert_eq!(PackedInt4::from_packed_zero_points(&words, 9, 2).unwrap(), zp);
    }

    #[test]
    fn asymmetric_dequantization_uses_zero_points() {
        let q = [-8i8, 7, 0, 1];
        let w = PackedInt4::pack(&q, 1, 4, 2, vec![0.5, 2.0], Dtype::BF16, Some(vec![-8, 1])).unwrap();
        assert_eq!(w.dequantize_f32(), vec![0.0, 7.5, -2.0, 0.0]);
    }

    #[test]
    fn dequantize_rounds_once_to_the_scale_dtype() {
        // 7 * 1.0078125 = 7.0546875 needs 10 significant bits; the nearest bf16 values are 7.03125 and 7.0625.
        let w = PackedInt4::pack(&[7], 1, 1, 1, vec![1.007_812_5], Dtype::BF16, None).unwrap();
        assert_eq!(w.dequantize_f32(), vec![7.0625]);
        let w = PackedInt4::pack(&[7], 1, 1, 1, vec![1.007_812_5], Dtype::F32, None).unwrap();
        assert_eq!(w.dequantize_f32(), vec![7.054_687_5]);
    }

    #[test]
    fn rows_into_checks_range_and_buffer() {
        let w = PackedInt4::pack(&[1, 2, 3, 4], 2, 2, 2, vec![1.0, 1.0], Dtype::F32, None).unwrap();
        let mut buf = [0.0f32; 2];
        w.dequantize_rows_into(1..2, &mut buf).unwrap();
        assert_eq!(buf, [3.0, 4.0]);
        assert!(w.dequantize_rows_into(1..3, &mut buf).is_err());
        assert!(w.dequantize_rows_into(0..2, &mut buf).is_err());
    }

    #[test]
    fn new_rejects_bad_inputs_naming_the_parameter() {
        let name = |r: Result<PackedInt4>| match r {
            Err(QuantError::Invalid { what, .. }) => what,
            other => panic!("expected Invalid, got {other:?}"),
        };
        assert_eq!(name(PackedInt4::new(1, 8, 0, vec![0], vec![1.0], Dtype::BF16, None)), "group_size");
        assert_eq!(name(PackedInt4::new(1, 9, 8, vec![0], vec![1.0; 2], Dtype::BF16, None)), "packed");
        assert_eq!(name(PackedInt4::new(1, 8, 4, vec![0], vec![1.0], Dtype::BF16, None)), "scales");
        assert_eq!(name(PackedInt4::new(1, 8, 8, vec![0], vec![1.1], Dtype::BF16, None)), "scales");
        assert_eq!(name(PackedInt4::new(1, 8, 8, vec![0], vec![1.0], Dtype::I32, None)), "scale_dtype");
        assert_eq!(name(PackedInt4::new(1, 8, 8, vec![0], vec![1.0], Dtype::BF16, Some(vec![]))), "zero_points");
        assert_eq!(name(PackedInt4::new(1, 8, 8, vec![0], vec![1.0], Dtype::BF16, Some(vec![8]))), "zero_points");
        assert_eq!(name(PackedInt4::pack(&[8], 1, 1, 1, vec![1.0], Dtype::BF16, None)), "q");
        assert!(matches!(
            PackedInt4::from_packed_zero_points(&[0], 9, 1),
            Err(QuantError::Invalid { what, .. }) if what == "weight_zero_point"
        ));
    }

    #[test]
    fn quantize_minmax_symmetric_matches_the_formula() {
        // One group of 4: max |w| = 1.5 -> scale = 1.5 / 7.5 = 0.2 (rounded to bf16 0.2001953125).
        let w = PackedInt4::quantize_minmax(&[1.5, -0.75, 0.0, 0.1], 1, 4, 4, true, Dtype::BF16).unwrap();
        let s = bf16::from_f32(0.2).to_f32();
        assert_eq!(w.scales(), &[s]);
        assert_eq!(w.unpack(), vec![7, -4, 0, 0]);
        // An all-zero group gets the bf16 epsilon as its scale.
        let w = PackedInt4::quantize_minmax(&[0.0; 4], 1, 4, 2, false, Dtype::BF16).unwrap();
        assert_eq!(w.scales(), &[0.007_812_5, 0.007_812_5]);
        assert_eq!(w.zero_points(), Some(&[0i8, 0][..]));
    }

    #[test]
    fn checkpoint_and_heap_sizes() {
        let w = PackedInt4::pack(&[0; 9 * 16], 9, 16, 8, vec![1.0; 18], Dtype::BF16, Some(vec![0; 18])).unwrap();
        assert_eq!(w.checkpoint_bytes(), 9 * 2 * 4 + 18 * 2 + 2 * 2 * 4);
        assert_eq!(w.heap_bytes(), 9 * 2 * 4 + 18 * 4 + 18);
    }
}
