//! FP8 decoding (E4M3 `fn`, E5M2) and the block-scaled FP8 weights of DeepSeek-V3 / Kimi-K2-Instruct, after the
//! OCP FP8 spec (`torch.float8_e4m3fn`, `torch.float8_e5m2`) and DeepSeek-V3 `inference/kernel.py`
//! (`weight_dequant`); format summary in `kimi-k2-formats.md` section 1 (last paragraph) and section 3.
//!
//! A block-quantized Linear `<p>` stores `<p>.weight` (F8_E4M3, `[out, in]`) and `<p>.weight_scale_inv`
//! (F32, `[ceil(out/128), ceil(in/128)]`); the dequantized weight is `W[o, i] = f32(w[o, i]) * s[o/128, i/128]`
//! computed in f32 and stored in the default dtype (bf16), i.e. rounded once to bf16.

use half::bf16;

use crate::{QuantError, Result};

/// The block size of the DeepSeek-V3 / Kimi-K2 FP8 release (`weight_block_size: [128, 128]`).
pub const DEFAULT_BLOCK: (usize, usize) = (128, 128);

/// Decodes one FP8 E4M3 value, the `fn` variant (`torch.float8_e4m3fn`): exponent bias 7, no infinities,
/// `0x7F`/`0xFF` are NaN, exponent 0 is subnormal (`m/8 * 2^-6`). The largest finite value is 448.
pub const fn e4m3_to_f32(bits: u8) -> f32 {
    let sign = ((bits as u32) >> 7) << 31;
    let exp = ((bits >> 3) & 0xF) as u32;
    let man = (bits & 0x7) as u32;
    if exp == 0xF && man == 0x7 {
        return f32::from_bits(sign | 0x7FC0_0000);
    }
    if exp == 0 {
        // m * 2^-9, exact in f32.
        let magnitude = man as f32 * (1.0 / 512.0);
        return if sign != 0 { -magnitude } else { magnitude };
    }
    f32::from_bits(sign | ((exp + 127 - 7) << 23) | (man << 20))
}

/// Decodes one FP8 E5M2 value (`torch.float8_e5m2`, IEEE-like): exponent bias 15, exponent 31 is infinity
/// (mantissa 0) or NaN, exponent 0 is subnormal (`m/4 * 2^-14`).
pub const fn e5m2_to_f32(bits: u8) -> f32 {
    let sign = ((bits as u32) >> 7) << 31;
    let exp = ((bits >> 2) & 0x1F) as u32;
    let man = (bits & 0x3) as u32;
    if exp == 0x1F {
        return f32::from_bits(sign | if man == 0 { 0x7F80_0000 } else { 0x7FC0_0000 });
    }
    if exp == 0 {
        // m * 2^-16, exact in f32.
        let magnitude = man as f32 * (1.0 / 65536.0);
        return if sign != 0 { -magnitude } else { magnitude };
    }
    f32::from_bits(sign | ((exp + 127 - 15) << 23) | (man << 21))
}

/// All 256 E4M3 values, for table lookups in hot loops.
static E4M3_TABLE: [f32; 256] = {
    let mut table = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        table[i] = e4m3_to_f32(i as u8);
        i += 1;
    }
    table
};

/// Dequantizes a block-scaled FP8 E4M3 weight (`[out, in]` row-major raw bytes) with its inverse scales
/// (`weight_scale_inv`, `[ceil(out/block.0), ceil(in/block.1)]` row-major) to bf16:
/// `W[o, i] = bf16(e4m3(w[o, i]) * scale_inv[o / block.0, i / block.1])`, the product taken in f32 as in
/// DeepSeek-V3's `weight_dequant`.
pub fn dequant_block_fp8(
    weight: &[u8],
    scale_inv: &[f32],
    out_features: usize,
    in_features: usize,
    block: (usize, usize),
) -> Result<Vec<bf16>> {
    let (block_rows, block_cols) = block;
    if block_rows == 0 || block_cols == 0 {
        return Err(QuantError::invalid("block", format!("block sizes must be positive, got {block:?}")));
    }
    let weight_len = out_features
        .checked_mul(in_features)
        .ok_or_else(|| QuantError::invalid("weight", format!("size {out_features} x {in_features} overflows")))?;
    if weight.len() != weight_len {
        return Err(QuantError::invalid(
            "weight",
            format!("has {} values, expected [out, in] = [{out_features}, {in_features}] = {weight_len}", weight.len()),
        ));
    }
    let (scale_rows, scale_cols) = (out_features.div_ceil(block_rows), in_features.div_ceil(block_cols));
    if scale_inv.len() != scale_rows * scale_cols {
        return Err(QuantError::invalid(
            "weight_scale_inv",
            format!(
                "has {} values, expected [ceil(out/{block_rows}), ceil(in/{block_cols})] = [{scale_rows}, {scale_cols}]",
                scale_inv.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(weight_len);
    if in_features == 0 {
        return Ok(out);
    }
    for (o, row) in weight.chunks_exact(in_features).enumerate() {
        let scales = &scale_inv[(o / block_rows) * scale_cols..(o / block_rows + 1) * scale_cols];
        for (chunk, &s) in row.chunks(block_cols).zip(scales) {
            out.extend(chunk.iter().map(|&b| bf16::from_f32(E4M3_TABLE[b as usize] * s)));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()` as f32 bits (torch 2.15).
    const TORCH_E4M3: [u32; 256] = [
        0x00000000, 0x3b000000, 0x3b800000, 0x3bc00000, 0x3c000000, 0x3c200000, 0x3c400000, 0x3c600000, 0x3c800000,
        0x3c900000, 0x3ca00000, 0x3cb00000, 0x3cc00000, 0x3cd00000, 0x3ce00000, 0x3cf00000, 0x3d000000, 0x3d100000,
        0x3d200000, 0x3d300000, 0x3d400000, 0x3d500000, 0x3d600000, 0x3d700000, 0x3d800000, 0x3d900000, 0x3da00000,
        0x3db00000, 0x3dc00000, 0x3dd00000, 0x3de00000, 0x3df00000, 0x3e000000, 0x3e100000, 0x3e200000, 0x3e300000,
        0x3e400000, 0x3e500000, 0x3e600000, 0x3e700000, 0x3e800000, 0x3e900000, 0x3ea00000, 0x3eb00000, 0x3ec00000,
        0x3ed00000, 0x3ee00000, 0x3ef00000, 0x3f000000, 0x3f100000, 0x3f200000, 0x3f300000, 0x3f400000, 0x3f500000,
        0x3f600000, 0x3f700000, 0x3f800000, 0x3f900000, 0x3fa00000, 0x3fb00000, 0x3fc00000, 0x3fd00000, 0x3fe00000,
        0x3ff00000, 0x40000000, 0x40100000, 0x40200000, 0x40300000, 0x40400000, 0x40500000, 0x40600000, 0x40700000,
        0x40800000, 0x40900000, 0x40a00000, 0x40b00000, 0x40c00000, 0x40d00000, 0x40e00000, 0x40f00000, 0x41000000,
        0x41100000, 0x41200000, 0x41300000, 0x41400000, 0x41500000, 0x41600000, 0x41700000, 0x41800000, 0x41900000,
        0x41a00000, 0x41b00000, 0x41c00000, 0x41d00000, 0x41e00000, 0x41f00000, 0x42000000, 0x42100000, 0x42200000,
        0x42300000, 0x42400000, 0x42500000, 0x42600000, 0x42700000, 0x42800000, 0x42900000, 0x42a00000, 0x42b00000,
        0x42c00000, 0x42d00000, 0x42e00000, 0x42f00000, 0x43000000, 0x43100000, 0x43200000, 0x43300000, 0x43400000,
        0x43500000, 0x43600000, 0x43700000, 0x43800000, 0x43900000, 0x43a00000, 0x43b00000, 0x43c00000, 0x43d00000,
        0x43e00000, 0x7ff00000, 0x80000000, 0xbb000000, 0xbb800000, 0xbbc00000, 0xbc000000, 0xbc200000, 0xbc400000,
        0xbc600000, 0xbc800000, 0xbc900000, 0xbca00000, 0xbcb00000, 0xbcc00000, 0xbcd00000, 0xbce00000, 0xbcf00000,
        0xbd000000, 0xbd100000, 0xbd200000, 0xbd300000, 0xbd400000, 0xbd500000, 0xbd600000, 0xbd700000, 0xbd800000,
        0xbd900000, 0xbda00000, 0xbdb00000, 0xbdc00000, 0xbdd00000, 0xbde00000, 0xbdf00000, 0xbe000000, 0xbe100000,
        0xbe200000, 0xbe300000, 0xbe400000, 0xbe500000, 0xbe600000, 0xbe700000, 0xbe800000, 0xbe900000, 0xbea00000,
        0xbeb00000, 0xbec00000, 0xbed00000, 0xbee00000, 0xbef00000, 0xbf000000, 0xbf100000, 0xbf200000, 0xbf300000,
        0xbf400000, 0xbf500000, 0xbf600000, 0xbf700000, 0xbf800000, 0xbf900000, 0xbfa00000, 0xbfb00000, 0xbfc00000,
        0xbfd00000, 0xbfe00000, 0xbff00000, 0xc0000000, 0xc0100000, 0xc0200000, 0xc0300000, 0xc0400000, 0xc0500000,
        0xc0600000, 0xc0700000, 0xc0800000, 0xc0900000, 0xc0a00000, 0xc0b00000, 0xc0c00000, 0xc0d00000, 0xc0e00000,
        0xc0f00000, 0xc1000000, 0xc1100000, 0xc1200000, 0xc1300000, 0xc1400000, 0xc1500000, 0xc1600000, 0xc1700000,
        0xc1800000, 0xc1900000, 0xc1a00000, 0xc1b00000, 0xc1c00000, 0xc1d00000, 0xc1e00000, 0xc1f00000, 0xc2000000,
        0xc2100000, 0xc2200000, 0xc2300000, 0xc2400000, 0xc2500000, 0xc2600000, 0xc2700000, 0xc2800000, 0xc2900000,
        0xc2a00000, 0xc2b00000, 0xc2c00000, 0xc2d00000, 0xc2e00000, 0xc2f00000, 0xc3000000, 0xc3100000, 0xc3200000,
        0xc3300000, 0xc3400000, 0xc3500000, 0xc3600000, 0xc3700000, 0xc3800000, 0xc3900000, 0xc3a00000, 0xc3b00000,
        0xc3c00000, 0xc3d00000, 0xc3e00000, 0xfff00000,
    ];

    /// `torch.arange(256, dtype=torch.uint8).view(torch.float8_e5m2).float()` as f32 bits (torch 2.15).
    const TORCH_E5M2: [u32; 256] = [
        0x00000000, 0x37800000, 0x38000000, 0x38400000, 0x38800000, 0x38a00000, 0x38c00000, 0x38e00000, 0x39000000,
        0x39200000, 0x39400000, 0x39600000, 0x39800000, 0x39a00000, 0x39c00000, 0x39e00000, 0x3a000000, 0x3a200000,
        0x3a400000, 0x3a600000, 0x3a800000, 0x3aa00000, 0x3ac00000, 0x3ae00000, 0x3b000000, 0x3b200000, 0x3b400000,
        0x3b600000, 0x3b800000, 0x3ba00000, 0x3bc00000, 0x3be00000, 0x3c000000, 0x3c200000, 0x3c400000, 0x3c600000,
        0x3c800000, 0x3ca00000, 0x3cc00000, 0x3ce00000, 0x3d000000, 0x3d200000, 0x3d400000, 0x3d600000, 0x3d800000,
        0x3da00000, 0x3dc00000, 0x3de00000, 0x3e000000, 0x3e200000, 0x3e400000, 0x3e600000, 0x3e800000, 0x3ea00000,
        0x3ec00000, 0x3ee00000, 0x3f000000, 0x3f200000, 0x3f400000, 0x3f600000, 0x3f800000, 0x3fa00000, 0x3fc00000,
        0x3fe00000, 0x40000000, 0x40200000, 0x40400000, 0x40600000, 0x40800000, 0x40a00000, 0x40c00000, 0x40e00000,
        0x41000000, 0x41200000, 0x41400000, 0x41600000, 0x41800000, 0x41a00000, 0x41c00000, 0x41e00000, 0x42000000,
        0x42200000, 0x42400000, 0x42600000, 0x42800000, 0x42a00000, 0x42c00000, 0x42e00000, 0x43000000, 0x43200000,
        0x43400000, 0x43600000, 0x43800000, 0x43a00000, 0x43c00000, 0x43e00000, 0x44000000, 0x44200000, 0x44400000,
        0x44600000, 0x44800000, 0x44a00000, 0x44c00000, 0x44e00000, 0x45000000, 0x45200000, 0x45400000, 0x45600000,
        0x45800000, 0x45a00000, 0x45c00000, 0x45e00000, 0x46000000, 0x46200000, 0x46400000, 0x46600000, 0x46800000,
        0x46a00000, 0x46c00000, 0x46e00000, 0x47000000, 0x47200000, 0x47400000, 0x47600000, 0x7f800000, 0x7fe00000,
        0x7fc00000, 0x7fe00000, 0x80000000, 0xb7800000, 0xb8000000, 0xb8400000, 0xb8800000, 0xb8a00000, 0xb8c00000,
        0xb8e00000, 0xb9000000, 0xb9200000, 0xb9400000, 0xb9600000, 0xb9800000, 0xb9a00000, 0xb9c00000, 0xb9e00000,
        0xba000000, 0xba200000, 0xba400000, 0xba600000, 0xba800000, 0xbaa00000, 0xbac00000, 0xbae00000, 0xbb000000,
        0xbb200000, 0xbb400000, 0xbb600000, 0xbb800000, 0xbba00000, 0xbbc00000, 0xbbe00000, 0xbc000000, 0xbc200000,
        0xbc400000, 0xbc600000, 0xbc800000, 0xbca00000, 0xbcc00000, 0xbce00000, 0xbd000000, 0xbd200000, 0xbd400000,
        0xbd600000, 0xbd800000, 0xbda00000, 0xbdc00000, 0xbde00000, 0xbe000000, 0xbe200000, 0xbe400000, 0xbe600000,
        0xbe800000, 0xbea00000, 0xbec00000, 0xbee00000, 0xbf000000, 0xbf200000, 0xbf400000, 0xbf600000, 0xbf800000,
        0xbfa00000, 0xbfc00000, 0xbfe00000, 0xc0000000, 0xc0200000, 0xc0400000, 0xc0600000, 0xc0800000, 0xc0a00000,
        0xc0c00000, 0xc0e00000, 0xc1000000, 0xc1200000, 0xc1400000, 0xc1600000, 0xc1800000, 0xc1a00000, 0xc1c00000,
        0xc1e00000, 0xc2000000, 0xc2200000, 0xc2400000, 0xc2600000, 0xc2800000, 0xc2a00000, 0xc2c00000, 0xc2e00000,
        0xc3000000, 0xc3200000, 0xc3400000, 0xc3600000, 0xc3800000, 0xc3a00000, 0xc3c00000, 0xc3e00000, 0xc4000000,
        0xc4200000, 0xc4400000, 0xc4600000, 0xc4800000, 0xc4a00000, 0xc4c00000, 0xc4e00000, 0xc5000000, 0xc5200000,
        0xc5400000, 0xc5600000, 0xc5800000, 0xc5a00000, 0xc5c00000, 0xc5e00000, 0xc6000000, 0xc6200000, 0xc6400000,
        0xc6600000, 0xc6800000, 0xc6a00000, 0xc6c00000, 0xc6e00000, 0xc7000000, 0xc7200000, 0xc7400000, 0xc7600000,
        0xff800000, 0xffe00000, 0xffc00000, 0xffe00000,
    ];

    /// E4M3 from the spec's formula, in f64: `(-1)^s * 2^(e-7) * (1 + m/8)`, subnormal `(-1)^s * 2^-6 * m/8`.
    fn e4m3_spec(bits: u8) -> f64 {
        let s = if bits & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = i32::from((bits >> 3) & 0xF);
        let m = f64::from(bits & 0x7);
        match (e, m as u8) {
            (15, 7) => f64::NAN,
            (0, _) => s * 2f64.powi(-6) * m / 8.0,
            _ => s * 2f64.powi(e - 7) * (1.0 + m / 8.0),
        }
    }

    fn same(a: f32, b: f32) -> bool {
        (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits()
    }

    #[test]
    fn e4m3_exhaustive_against_spec_and_torch() {
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            assert!(same(v, e4m3_spec(b) as f32), "byte {b:#04x}: {v} vs spec {}", e4m3_spec(b));
            assert!(same(v, f32::from_bits(TORCH_E4M3[b as usize])), "byte {b:#04x}: {v} vs torch");
            assert!(same(E4M3_TABLE[b as usize], v));
        }
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
        assert_eq!(e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn e5m2_exhaustive_against_torch() {
        for b in 0..=255u8 {
            assert!(same(e5m2_to_f32(b), f32::from_bits(TORCH_E5M2[b as usize])), "byte {b:#04x}");
        }
        assert_eq!(e5m2_to_f32(0x7C), f32::INFINITY);
        assert_eq!(e5m2_to_f32(0x7B), 57344.0);
    }

    #[test]
    fn block_dequant_uses_the_block_scale_and_rounds_to_bf16() {
        // out = 3, in = 5, blocks of 2 x 2 -> scales [2, 3].
        let weight: Vec<u8> = (0..15).map(|i| 0x38 + i as u8).collect(); // 0x38 = 1.0, 0x39 = 1.125, ...
        let scale_inv = [1.0, 2.0, 4.0, 0.5, 0.25, 3.0];
        let w = dequant_block_fp8(&weight, &scale_inv, 3, 5, (2, 2)).unwrap();
        for o in 0..3 {
            for i in 0..5 {
                let expected = bf16::from_f32(e4m3_to_f32(weight[o * 5 + i]) * scale_inv[(o / 2) * 3 + i / 2]);
                assert_eq!(w[o * 5 + i].to_bits(), expected.to_bits(), "({o}, {i})");
            }
        }
        // 1.125 * 3.0 = 3.375 is exact in bf16; 1.125 * 1.1 is rounded once.
        let w = dequant_block_fp8(&[0x39], &[1.1], 1, 1, DEFAULT_BLOCK).unwrap();
        assert_eq!(w[0], bf16::from_f32(1.125 * 1.1f32));
    }

    #[test]
    fn block_dequant_checks_sizes() {
        assert!(dequant_block_fp8(&[0; 4], &[1.0], 2, 2, (0, 128)).is_err());
        assert!(dequant_block_fp8(&[0; 3], &[1.0], 2, 2, DEFAULT_BLOCK).is_err());
        let e = dequant_block_fp8(&[0; 129 * 2], &[1.0], 129, 2, DEFAULT_BLOCK).unwrap_err();
        assert!(e.to_string().contains("weight_scale_inv"), "{e}");
        assert_eq!(dequant_block_fp8(&[0; 129 * 2], &[1.0, 1.0], 129, 2, DEFAULT_BLOCK).unwrap().len(), 258);
    }
}
