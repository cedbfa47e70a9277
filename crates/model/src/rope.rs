//! Rotary position embedding (Su et al. 2021, arXiv:2104.09864) with YaRN context extension (Peng et al. 2023,
//! arXiv:2309.00071), as transformers' `DeepseekV3RotaryEmbedding` and `apply_rotary_pos_emb_interleave`.
//!
//! The inverse frequencies come from [`ModelConfig::rope_inv_freq`]; cos/sin tables are built on the host in f32
//! (`freqs = pos * inv_freq`, `cos(freqs) * attention_factor`), as transformers does.
//!
//! Layout: with `rope_interleave` (DeepSeek's weights, the default) the pairs rotated together are
//! `(x[2i], x[2i+1])`; without it they are `(x[i], x[i + d/2])` (rotate-half). Either way the OUTPUT is written
//! as `[x1*cos - x2*sin | x2*cos + x1*sin]` (first members of all pairs, then second members), exactly as
//! transformers returns it. Queries and keys use the same layout, so their dot products are the paper's; a KV
//! cache must store rotated keys in this same layout.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::config::ModelConfig;

/// RoPE parameters of one model.
#[derive(Debug, Clone, PartialEq)]
pub struct RotaryEmbedding {
    /// `[rope_dim / 2]` inverse frequencies.
    pub inv_freq: Vec<f32>,
    /// cos/sin multiplier (YaRN's attention factor; 1 for plain RoPE).
    pub attention_factor: f32,
    /// Interleaved-pair layout (see the module docs).
    pub interleave: bool,
}

/// cos and sin for a run of positions, `[seq, rope_dim / 2]` each.
#[derive(Debug, Clone)]
pub struct RopeTables<B: Backend> {
    /// `cos(pos * inv_freq) * attention_factor`.
    pub cos: Tensor<B, 2>,
    /// `sin(pos * inv_freq) * attention_factor`.
    pub sin: Tensor<B, 2>,
}

impl RotaryEmbedding {
    /// The model's RoPE.
    pub fn new(config: &ModelConfig) -> Self {
        Self {
            inv_freq: config.rope_inv_freq(),
            attention_factor: config.rope_attention_factor() as f32,
            interleave: config.rope_interleave,
        }
    }

    /// Host tables for positions `start..start + len`: `(cos, sin)`, each `len * rope_dim/2` values, row-major.
    pub fn host_tables(&self, start: usize, len: usize) -> (Vec<f32>, Vec<f32>) {
        let half = self.inv_freq.len();
        let (mut cos, mut sin) = (Vec::with_capacity(len * half), Vec::with_capacity(len * half));
        for pos in start..start + len {
            for &f in &self.inv_freq {
                let angle = pos as f32 * f;
                cos.push(angle.cos() * self.attention_factor);
                sin.push(angle.sin() * self.attention_factor);
            }
        }
        (cos, sin)
    }

    /// Device tables for positions `start..start + len`.
    pub fn tables<B: Backend>(&self, start: usize, len: usize, device: &B::Device) -> RopeTables<B> {
        let half = self.inv_freq.len();
        let (cos, sin) = self.host_tables(start, len);
        RopeTables {
            cos: Tensor::from_data(TensorData::new(cos, [len, half]), device),
            sin: Tensor::from_data(TensorData::new(sin, [len, half]), device),
        }
    }

    /// Rotates columns `off..off + d` of every row of `x` `[n * group, cols]` (rows of token `t` are
    /// `t * group..(t + 1) * group`, e.g. one per head) by the tables' positions (`n` rows) -> `[n * group, d]`. The
    /// same values as [`Self::apply`]; on CUDA one kernel launch (`cuda_ops::rope_rows`) instead of about ten ops.
    pub fn apply_rows<B: Backend>(
        &self,
        x: Tensor<B, 2>,
        off: usize,
        d: usize,
        group: usize,
        tables: &RopeTables<B>,
    ) -> Tensor<B, 2> {
        #[cfg(feature = "cuda")]
        if let Some(y) = crate::cuda_ops::rope_rows(&x, off, d, group, &tables.cos, &tables.sin, self.interleave) {
            return y;
        }
        let rows = x.dims()[0];
        let n = rows / group.max(1);
        // [n * group, d] -> [1, group, n, d] for `apply`, and back.
        let part = x.narrow(1, off, d).reshape([1, n, group, d]).swap_dims(1, 2);
        self.apply(part, tables).swap_dims(1, 2).reshape([rows, d])
    }

    /// Rotates `x` `[batch, heads, seq, rope_dim]` by the tables' positions (`seq` rows).
    pub fn apply<B: Backend>(&self, x: Tensor<B, 4>, tables: &RopeTables<B>) -> Tensor<B, 4> {
        let [b, h, s, d] = x.dims();
        let half = d / 2;
        let (x1, x2) = if self.interleave {
            // [b, h, s, half, 2]: member 0 and member 1 of each pair.
            let pairs = x.reshape([b, h, s, half, 2]);
            (pairs.clone().narrow(4, 0, 1).reshape([b, h, s, half]), pairs.narrow(4, 1, 1).reshape([b, h, s, half]))
        } else {
            (x.clone().narrow(3, 0, half), x.narrow(3, half, half))
        };
        // [s, half] -> [1, 1, s, half]
        let cos = tables.cos.clone().unsqueeze::<4>();
        let sin = tables.sin.clone().unsqueeze::<4>();
        let first = x1.clone() * cos.clone() - x2.clone() * sin.clone();
        let second = x2 * cos + x1 * sin;
        // [b, h, s, d]
        Tensor::cat(vec![first, second], 3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    /// Scalar reference: rotate pair i of every row by `pos * inv_freq[i]`, output in HF's layout.
    fn reference(x: &[f32], s: usize, d: usize, rope: &RotaryEmbedding, start: usize) -> Vec<f32> {
        let half = d / 2;
        let mut out = vec![0.0; x.len()];
        for (r, row) in x.chunks(d).enumerate() {
            let pos = start + r % s;
            for i in 0..half {
                let (a, b) = if rope.interleave { (row[2 * i], row[2 * i + 1]) } else { (row[i], row[i + half]) };
                let angle = pos as f32 * rope.inv_freq[i];
                let (c, sn) = (angle.cos() * rope.attention_factor, angle.sin() * rope.attention_factor);
                out[r * d + i] = a * c - b * sn;
                out[r * d + half + i] = b * c + a * sn;
            }
        }
        out
    }

    #[test]
    fn apply_rows_rotates_each_tokens_group_of_rows() {
        // 3 tokens x 2 heads, each row [nope (3) | rope (4)]: rows of token t use position start + t.
        let device = Default::default();
        let (n, group, cols, off, d) = (3, 2, 7, 3, 4);
        let x: Vec<f32> = (0..n * group * cols).map(|i| ((i * 29 % 53) as f32 - 26.0) / 13.0).collect();
        for interleave in [true, false] {
            let rope = RotaryEmbedding { inv_freq: vec![1.0, 0.2], attention_factor: 1.1, interleave };
            let t = Tensor::<Flex, 2>::from_data(TensorData::new(x.clone(), [n * group, cols]), &device);
            let got = rope.apply_rows(t, off, d, group, &rope.tables::<Flex>(5, n, &device));
            let got = got.into_data().to_vec::<f32>().unwrap();
            for tok in 0..n {
                for g in 0..group {
                    let row = tok * group + g;
                    let part = &x[row * cols + off..row * cols + off + d];
                    let want = reference(part, 1, d, &rope, 5 + tok);
                    for (a, b) in got[row * d..(row + 1) * d].iter().zip(&want) {
                        assert!(
                            (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                            "interleave={interleave} token {tok} head {g}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn both_layouts_match_the_scalar_reference() {
        let device = Default::default();
        let (b, h, s, d) = (2, 3, 5, 8);
        let x: Vec<f32> = (0..b * h * s * d).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
        for interleave in [true, false] {
            let rope = RotaryEmbedding { inv_freq: vec![1.0, 0.3, 0.05, 0.001], attention_factor: 1.2, interleave };
            let t = Tensor::<Flex, 4>::from_data(TensorData::new(x.clone(), [b, h, s, d]), &device);
            let got = rope.apply(t, &rope.tables::<Flex>(7, s, &device)).into_data().to_vec::<f32>().unwrap();
            let want = reference(&x, s, d, &rope, 7);
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "interleave={interleave}: {g} vs {w}");
            }
        }
    }
}
