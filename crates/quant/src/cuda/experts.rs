//! Host side of the fused INT4 MoE: the experts of one layer ([`MoeExperts`]), their kernel layout
//! ([`KernelLayout`], built once at load time), and the token-to-expert grouping ([`Routing`]).

use half::bf16;
use rayon::prelude::*;

use crate::{Dtype, PackedInt4, QuantError, Result};

/// Sizes of one MoE layer: `hidden` (model width), `inter` (`moe_intermediate_size`), expert count, group size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeShape {
    /// Model width (`hidden_size`, 7168 for Kimi-K2).
    pub hidden: usize,
    /// Expert width (`moe_intermediate_size`, 2048 for Kimi-K2).
    pub inter: usize,
    /// Routed experts in the layer (384 for Kimi-K2).
    pub experts: usize,
    /// INT4 group size (32 for Kimi-K2; 64 and 128 also supported).
    pub group: usize,
}

impl MoeShape {
    /// Checks what the kernels need: widths multiples of 32 (one 16-byte load is 32 values) and of the group,
    /// group a multiple of 32.
    pub fn validate(&self) -> Result<()> {
        let ok = self.experts > 0
            && self.hidden > 0
            && self.inter > 0
            && self.group > 0
            && self.group.is_multiple_of(32)
            && self.hidden.is_multiple_of(self.group)
            && self.inter.is_multiple_of(self.group);
        if ok {
            Ok(())
        } else {
            Err(QuantError::invalid(
                "moe_shape",
                format!("{self:?}: need group a multiple of 32 dividing hidden and inter, no zero size"),
            ))
        }
    }

    /// Whether the kernels take this layer's experts in the tiled layout ([`tile_words`]): both widths multiples
    /// of 128 (a tile's column block is 128 wide; the rows, `2 inter` and `hidden`, are then multiples of 16).
    /// Decided by the shape alone, so the layout a caller builds and the one the kernels read always agree.
    /// `EYRIE_MOE_TILED=0` (read once a process) keeps every shape row-major: the same binary then measures both
    /// layouts (`gpu_kernels bench`), and a device where the tiled order were slower can opt out.
    pub fn tiled(&self) -> bool {
        tiled_layout_allowed() && self.hidden.is_multiple_of(128) && self.inter.is_multiple_of(128)
    }

    /// Bytes of one expert's packed weights and BF16 scales (gate, up and down).
    pub fn expert_bytes(&self) -> usize {
        let params = 3 * self.hidden * self.inter;
        params / 2 + params / self.group * 2
    }
}

/// The routed experts of one MoE layer as the checkpoint stores them: per expert `gate_proj`, `up_proj`
/// (`[inter, hidden]`) and `down_proj` (`[hidden, inter]`), symmetric INT4 with BF16 group scales.
#[derive(Debug, Clone)]
pub struct MoeExperts {
    shape: MoeShape,
    gate: Vec<PackedInt4>,
    up: Vec<PackedInt4>,
    down: Vec<PackedInt4>,
}

impl MoeExperts {
    /// Validates the three weights of every expert against `shape` (symmetric, BF16 scales, same group size).
    pub fn new(shape: MoeShape, gate: Vec<PackedInt4>, up: Vec<PackedInt4>, down: Vec<PackedInt4>) -> Result<Self> {
        shape.validate()?;
        if gate.len() != shape.experts || up.len() != shape.experts || down.len() != shape.experts {
            return Err(QuantError::invalid(
                "experts",
                format!("{} gate, {} up, {} down for {} experts", gate.len(), up.len(), down.len(), shape.experts),
            ));
        }
        let check = |what: &str, w: &PackedInt4, out: usize, inp: usize| -> Result<()> {
            if w.out_features() != out || w.in_features() != inp {
                return Err(QuantError::invalid(
                    what,
                    format!("is [{}, {}], expected [{out}, {inp}]", w.out_features(), w.in_features()),
                ));
            }
            if w.group_size() != shape.group || w.scale_dtype() != Dtype::BF16 || !w.is_symmetric() {
                return Err(QuantError::invalid(
                    what,
                    format!(
                        "group {} scales {} symmetric {}: the fused kernel takes group {}, BF16 scales, symmetric",
                        w.group_size(),
                        w.scale_dtype(),
                        w.is_symmetric(),
                        shape.group
                    ),
                ));
            }
            Ok(())
        };
        for e in 0..shape.experts {
            check("gate_proj", &gate[e], shape.inter, shape.hidden)?;
            check("up_proj", &up[e], shape.inter, shape.hidden)?;
            check("down_proj", &down[e], shape.hidden, shape.inter)?;
        }
        Ok(Self { shape, gate, up, down })
    }

    /// Random experts (never-zero scales in `[2^-8, 2^-6.4)`, uniformly random nibbles), deterministic in `seed`;
    /// generated in parallel, one stream per expert and matrix.
    pub fn random(shape: MoeShape, seed: u64) -> Result<Self> {
        shape.validate()?;
        let make = |e: usize, m: usize, out: usize, inp: usize| -> Result<PackedInt4> {
            let mut rng = SplitMix64::new(seed ^ ((e as u64) << 8 | m as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let words = out * inp / 8;
            let mut packed = Vec::with_capacity(words);
            for _ in 0..words / 2 {
                let r = rng.next_u64();
                packed.push(r as u32);
                packed.push((r >> 32) as u32);
            }
            if words % 2 == 1 {
                packed.push(rng.next_u64() as u32);
            }
            let scales = (0..out * inp / shape.group)
                .map(|_| {
                    // Scale in [1/256, 1/84): outputs of a 7168-wide dot product with |x| <= 1 stay O(1).
                    let s = (1.0 + 2.0 * rng.next_f32()) / 256.0;
                    bf16::from_f32(s).to_f32()
                })
                .collect();
            PackedInt4::new(out, inp, shape.group, packed, scales, Dtype::BF16, None)
        };
        let all: Vec<[PackedInt4; 3]> = (0..shape.experts)
            .into_par_iter()
            .map(|e| {
                Ok([
                    make(e, 0, shape.inter, shape.hidden)?,
                    make(e, 1, shape.inter, shape.hidden)?,
                    make(e, 2, shape.hidden, shape.inter)?,
                ])
            })
            .collect::<Result<_>>()?;
        let (mut gate, mut up, mut down) = (Vec::new(), Vec::new(), Vec::new());
        for [g, u, d] in all {
            gate.push(g);
            up.push(u);
            down.push(d);
        }
        Self::new(shape, gate, up, down)
    }

    /// The layer's sizes.
    pub fn shape(&self) -> MoeShape {
        self.shape
    }

    /// `gate_proj` of expert `e` (`[inter, hidden]`).
    pub fn gate(&self, e: usize) -> &PackedInt4 {
        &self.gate[e]
    }

    /// `up_proj` of expert `e` (`[inter, hidden]`).
    pub fn up(&self, e: usize) -> &PackedInt4 {
        &self.up[e]
    }

    /// `down_proj` of expert `e` (`[hidden, inter]`).
    pub fn down(&self, e: usize) -> &PackedInt4 {
        &self.down[e]
    }

    /// The kernel layout, built once at load time (see [`KernelLayout`]).
    pub fn kernel_layout(&self) -> KernelLayout {
        let s = self.shape;
        let w13_expert = 2 * s.inter * s.hidden / 8;
        let s13_expert = 2 * s.inter * s.hidden / s.group;
        let w2_expert = s.hidden * s.inter / 8;
        let s2_expert = s.hidden * s.inter / s.group;
        let mut w13 = vec![0u32; s.experts * w13_expert];
        let mut s13 = vec![bf16::ZERO; s.experts * s13_expert];
        let mut w2 = vec![0u32; s.experts * w2_expert];
        let mut s2 = vec![bf16::ZERO; s.experts * s2_expert];
        let to_bf16 = |dst: &mut [bf16], src: &[f32]| {
            // Exact: the scales are BF16 values (checked by `PackedInt4::new`).
            dst.iter_mut().zip(src).for_each(|(d, s)| *d = bf16::from_f32(*s));
        };
        w13.par_chunks_mut(w13_expert)
            .zip(s13.par_chunks_mut(s13_expert))
            .zip(w2.par_chunks_mut(w2_expert).zip(s2.par_chunks_mut(s2_expert)))
            .enumerate()
            .for_each(|(e, ((w13, s13), (w2, s2)))| {
                let (wg, wu) = w13.split_at_mut(w13_expert / 2);
                wg.copy_from_slice(self.gate[e].packed());
                wu.copy_from_slice(self.up[e].packed());
                let (sg, su) = s13.split_at_mut(s13_expert / 2);
                to_bf16(sg, self.gate[e].scales());
                to_bf16(su, self.up[e].scales());
                w2.copy_from_slice(self.down[e].packed());
                to_bf16(s2, self.down[e].scales());
            });
        if s.tiled() {
            let (ng13, ng2) = (s.hidden / s.group, s.inter / s.group);
            return KernelLayout {
                shape: s,
                w13: tile_words(&w13, s.hidden),
                s13: tile_scales(&s13, ng13),
                w2: tile_words(&w2, s.inter),
                s2: tile_scales(&s2, ng2),
            };
        }
        KernelLayout { shape: s, w13, s13, w2, s2 }
    }
}

/// Whether the tiled layout may be used: not when `EYRIE_MOE_TILED=0` (any other value, or none: yes).
fn tiled_layout_allowed() -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ALLOWED.get_or_init(|| std::env::var("EYRIE_MOE_TILED").as_deref() != Ok("0"))
}

/// Index, in 16-byte vectors, of vector `v` (columns `32 v .. 32 v + 32`) of row `row` of a `[rows, k]` INT4
/// matrix in the tiled layout: per 16-row tile `T = row / 16`, per 128-column block `i = v / 4`, the 64 vectors
/// of the block are stored as `[h][g][c]` with `row % 16 = g + 8 h` and `v % 4 = c`.
///
/// Why: the tensor-core kernel's lane `(g, c)` loads vector `4 i + c` of rows `g` and `g + 8` of its tile; in the
/// checkpoint's row-major order one load instruction then reads 8 rows x 64 bytes, in this order 512 contiguous
/// bytes. Read alone, with the kernel's warps (k-split 2-3), 8 experts' gate/up weights stream at 71-75% of the
/// copy bandwidth row-major and 87-93% tiled (`scripts/moe_load_pattern.py` timed behind a copy, bench/REPORT.md
/// session 25; session 15's figures timed Python's launches). `k` a multiple of 128, `row` any row of a matrix of a
/// multiple of 16 rows.
pub fn tiled_vector(row: usize, v: usize, k: usize) -> usize {
    let nblk = k / 128;
    ((row / 16 * nblk + v / 4) * 2 + (row % 16) / 8) * 32 + (row % 8) * 4 + v % 4
}

/// Index of the scale of group `gi` of row `row` in the tiled layout (`[T][group][row % 16]`, `ng` groups a
/// row): a tile's 16 rows' scales of one group are 32 contiguous bytes.
pub fn tiled_scale(row: usize, gi: usize, ng: usize) -> usize {
    (row / 16 * ng + gi) * 16 + row % 16
}

/// Row-major packed words `[rows, k / 8]` (rows a multiple of 16, `k` a multiple of 128) in the tiled layout
/// ([`tiled_vector`]; the 4 words of a vector stay in order).
pub fn tile_words(words: &[u32], k: usize) -> Vec<u32> {
    let kv = k / 32;
    let rows = words.len() / (k / 8);
    let mut out = vec![0u32; words.len()];
    for row in 0..rows {
        for v in 0..kv {
            let at = tiled_vector(row, v, k) * 4;
            out[at..at + 4].copy_from_slice(&words[(row * kv + v) * 4..(row * kv + v) * 4 + 4]);
        }
    }
    out
}

/// Row-major scales `[rows, ng]` (rows a multiple of 16) in the tiled layout ([`tiled_scale`]).
pub fn tile_scales(scales: &[bf16], ng: usize) -> Vec<bf16> {
    let rows = scales.len() / ng;
    let mut out = vec![bf16::ZERO; scales.len()];
    for row in 0..rows {
        for gi in 0..ng {
            out[tiled_scale(row, gi, ng)] = scales[row * ng + gi];
        }
    }
    out
}

/// The experts as the kernels read them, built once at load time from the checkpoint tensors.
///
/// Per expert, `gate_proj` rows then `up_proj` rows (`w13`, `[E, 2*inter, hidden/8]`), and `down_proj` (`w2`,
/// `[E, hidden, inter/8]`), each 16-byte vector keeping the compressed-tensors word order (8 nibbles per word, LSB
/// first, offset-binary `q + 8`: one vector is 32 consecutive columns, one group of 32 or part of a larger
/// group). Scales stay BF16 (`s13`: `[E, 2*inter, hidden/group]`, `s2`: `[E, hidden, inter/group]`). Where
/// [`MoeShape::tiled`] holds (Kimi-K2's shapes) the vectors and scales of each matrix are in the tiled order
/// ([`tiled_vector`], [`tiled_scale`]; an expert's tiles stay contiguous, so experts still slice by rows);
/// otherwise rows are row-major, as the checkpoint stores them.
#[derive(Debug, Clone)]
pub struct KernelLayout {
    /// Sizes.
    pub shape: MoeShape,
    /// `[E, 2*inter, hidden/8]` packed words, gate rows then up rows.
    pub w13: Vec<u32>,
    /// `[E, 2*inter, hidden/group]` BF16 scales.
    pub s13: Vec<bf16>,
    /// `[E, hidden, inter/8]` packed words.
    pub w2: Vec<u32>,
    /// `[E, hidden, inter/group]` BF16 scales.
    pub s2: Vec<bf16>,
}

/// Token-expert pairs grouped by expert: the kernels run one block row per active expert, over the tokens routed
/// to it, so each expert's weights are streamed once per layer whatever the number of tokens routed to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routing {
    /// Tokens.
    pub m: usize,
    /// Experts per token.
    pub topk: usize,
    /// Distinct routed experts, by class (1 token, 2 tokens, 3 or more), ascending within a class.
    pub experts: Vec<u32>,
    /// `experts.len() + 1` offsets into `pairs`.
    pub offsets: Vec<u32>,
    /// Pair indices `t * topk + k`, grouped by expert (ascending within a group).
    pub pairs: Vec<u32>,
    /// Largest number of tokens routed to one expert.
    pub max_tokens: usize,
    /// Slots `class_bounds[c]..class_bounds[c + 1]` of `experts` hold the experts of class `c`: 1 token, 2 tokens,
    /// 3 or more. The kernels are specialised on the tokens they handle per pass (1, 2 or 4), one launch per class.
    pub class_bounds: [usize; 4],
}

/// Class of an expert with `count` routed tokens (see [`Routing::class_bounds`]).
fn class_of(count: u32) -> usize {
    match count {
        0 | 1 => 0,
        2 => 1,
        _ => 2,
    }
}

impl Routing {
    /// Groups `ids` (`[m, topk]`, expert per token and slot) by expert; an expert appearing twice for one token
    /// is rejected (routers pick distinct experts).
    pub fn new(ids: &[u32], m: usize, topk: usize, n_experts: usize) -> Result<Self> {
        if ids.len() != m * topk || topk == 0 {
            return Err(QuantError::invalid("ids", format!("has {} values, expected [{m}, {topk}]", ids.len())));
        }
        if let Some(bad) = ids.iter().find(|&&e| e as usize >= n_experts) {
            return Err(QuantError::invalid("ids", format!("expert {bad} >= {n_experts} experts")));
        }
        for (t, row) in ids.chunks_exact(topk).enumerate() {
            let mut sorted = row.to_vec();
            sorted.sort_unstable();
            if sorted.windows(2).any(|w| w[0] == w[1]) {
                return Err(QuantError::invalid("ids", format!("token {t} selects an expert twice: {row:?}")));
            }
        }
        let mut counts = vec![0u32; n_experts];
        ids.iter().for_each(|&e| counts[e as usize] += 1);
        let mut experts: Vec<u32> = (0..n_experts as u32).filter(|&e| counts[e as usize] > 0).collect();
        experts.sort_by_key(|&e| class_of(counts[e as usize]));
        let mut class_bounds = [0usize; 4];
        for c in 0..3 {
            class_bounds[c + 1] =
                class_bounds[c] + experts.iter().filter(|&&e| class_of(counts[e as usize]) == c).count();
        }
        let mut offsets = Vec::with_capacity(experts.len() + 1);
        let mut start = vec![0u32; n_experts];
        let mut acc = 0u32;
        for &e in &experts {
            offsets.push(acc);
            start[e as usize] = acc;
            acc += counts[e as usize];
        }
        offsets.push(acc);
        let mut pairs = vec![0u32; ids.len()];
        for (p, &e) in ids.iter().enumerate() {
            pairs[start[e as usize] as usize] = p as u32;
            start[e as usize] += 1;
        }
        let max_tokens = counts.iter().copied().max().unwrap_or(0) as usize;
        Ok(Self { m, topk, experts, offsets, pairs, max_tokens, class_bounds })
    }
}

/// SplitMix64 (Steele et al. 2014): small, fast, good enough for test data.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// `n` values uniform in `[-1, 1)` (f32).
    pub fn signed(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next_f32() * 2.0 - 1.0).collect()
    }

    /// Random activations `[n]`, BF16 values never zero: magnitude in `[1/16, 1)`, random sign.
    pub fn activations(&mut self, n: usize) -> Vec<bf16> {
        (0..n)
            .map(|_| {
                let mag = 0.0625 + 0.9375 * self.next_f32();
                let v = if self.next_u64() & 1 == 0 { mag } else { -mag };
                bf16::from_f32(v)
            })
            .collect()
    }

    /// `topk` distinct experts per token among `n_experts`, and routing weights (positive, summing to 1 per
    /// token, like a normalised top-k of sigmoid scores).
    pub fn routing(&mut self, m: usize, topk: usize, n_experts: usize) -> (Vec<u32>, Vec<f32>) {
        let mut ids = Vec::with_capacity(m * topk);
        let mut weights = Vec::with_capacity(m * topk);
        for _ in 0..m {
            let mut row: Vec<u32> = Vec::with_capacity(topk);
            while row.len() < topk {
                let e = (self.next_u64() % n_experts as u64) as u32;
                if !row.contains(&e) {
                    row.push(e);
                }
            }
            let w: Vec<f32> = (0..topk).map(|_| 0.1 + self.next_f32()).collect();
            let sum: f32 = w.iter().sum();
            ids.extend(row);
            weights.extend(w.iter().map(|v| v / sum));
        }
        (ids, weights)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_groups_pairs_by_expert() {
        // m = 3, topk = 2.
        let r = Routing::new(&[4, 1, 1, 2, 4, 0], 3, 2, 5).unwrap();
        // Experts 0 and 2 get one token, 1 and 4 two: classes [0, 2], [1, 4].
        assert_eq!(r.experts, vec![0, 2, 1, 4]);
        assert_eq!(r.offsets, vec![0, 1, 2, 4, 6]);
        assert_eq!(r.pairs, vec![5, 3, 1, 2, 0, 4]);
        assert_eq!(r.max_tokens, 2);
        assert_eq!(r.class_bounds, [0, 2, 4, 4]);
        let r = Routing::new(&[0, 1, 0, 2, 0, 3], 3, 2, 4).unwrap();
        assert_eq!((r.experts.clone(), r.class_bounds), (vec![1, 2, 3, 0], [0, 3, 3, 4]));
        assert!(Routing::new(&[1, 1], 1, 2, 5).is_err());
        assert!(Routing::new(&[1, 7], 1, 2, 5).is_err());
        assert!(Routing::new(&[1], 1, 2, 5).is_err());
    }

    #[test]
    fn kernel_layout_concatenates_gate_and_up() {
        let shape = MoeShape { hidden: 64, inter: 32, experts: 2, group: 32 };
        let ex = MoeExperts::random(shape, 7).unwrap();
        let l = ex.kernel_layout();
        let half = 32 * 64 / 8;
        assert_eq!(&l.w13[2 * half..3 * half], ex.gate(1).packed());
        assert_eq!(&l.w13[3 * half..4 * half], ex.up(1).packed());
        assert_eq!(&l.w2[half..], ex.down(1).packed());
        assert_eq!(l.s2[64 * 32 / 32].to_f32(), ex.down(1).scales()[0]);
        assert!(MoeShape { hidden: 48, inter: 32, experts: 1, group: 32 }.validate().is_err());
    }

    #[test]
    fn tiled_layout_is_a_permutation_and_a_warp_load_is_contiguous() {
        let (k, rows) = (256, 48);
        let (kv, nblk) = (k / 32, k / 128);
        // Every (row, vector) has its own slot.
        let mut hit = vec![false; rows * kv];
        for row in 0..rows {
            for v in 0..kv {
                let at = tiled_vector(row, v, k);
                assert!(!hit[at], "row {row} vector {v} collides");
                hit[at] = true;
            }
        }
        // The tensor-core kernel's load of block i, row half h of tile T: lane (g, c) reads vector 4 i + c of row
        // 16 T + g + 8 h, and the 32 lanes read 32 consecutive vectors (512 bytes), in lane order.
        for tile in 0..rows / 16 {
            for i in 0..nblk {
                for h in 0..2 {
                    let first = tiled_vector(16 * tile + 8 * h, 4 * i, k);
                    for lane in 0..32 {
                        let (g, c) = (lane / 4, lane % 4);
                        assert_eq!(tiled_vector(16 * tile + g + 8 * h, 4 * i + c, k), first + lane);
                    }
                }
            }
        }
        // tile_words moves each vector's 4 words together; tile_scales likewise each scale.
        let words: Vec<u32> = (0..(rows * k / 8) as u32).collect();
        let tiled = tile_words(&words, k);
        let ng = k / 64;
        let scales: Vec<bf16> = (0..rows * ng).map(|i| bf16::from_f32(i as f32)).collect();
        let tiled_s = tile_scales(&scales, ng);
        for row in 0..rows {
            for v in 0..kv {
                let at = tiled_vector(row, v, k) * 4;
                assert_eq!(&tiled[at..at + 4], &words[(row * kv + v) * 4..(row * kv + v) * 4 + 4]);
            }
            for gi in 0..ng {
                assert_eq!(tiled_s[tiled_scale(row, gi, ng)], scales[row * ng + gi]);
            }
        }
    }

    #[test]
    fn kernel_layout_tiles_kimi_like_shapes() {
        let shape = MoeShape { hidden: 256, inter: 128, experts: 2, group: 32 };
        assert!(shape.tiled());
        let ex = MoeExperts::random(shape, 11).unwrap();
        let l = ex.kernel_layout();
        // Expert 1's down row 5, vector 3 and its scale, where the kernel looks for them.
        let (kv, ng) = (shape.inter / 32, shape.inter / 32);
        let row = shape.hidden + 5;
        let at = tiled_vector(row, 3, shape.inter) * 4;
        assert_eq!(&l.w2[at..at + 4], &ex.down(1).packed()[(5 * kv + 3) * 4..(5 * kv + 3) * 4 + 4]);
        assert_eq!(l.s2[tiled_scale(row, 3, ng)].to_f32(), ex.down(1).scales()[5 * ng + 3]);
        // Expert 1's up row 7 (gate rows first), vector 6.
        let (kv, row) = (shape.hidden / 32, 2 * shape.inter + shape.inter + 7);
        let at = tiled_vector(row, 6, shape.hidden) * 4;
        assert_eq!(&l.w13[at..at + 4], &ex.up(1).packed()[(7 * kv + 6) * 4..(7 * kv + 6) * 4 + 4]);
        assert!(!MoeShape { hidden: 384, inter: 32, experts: 1, group: 32 }.tiled());
    }
}
