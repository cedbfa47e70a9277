//! RoPE of row groups in one launch (eyrie-model's `RotaryEmbedding::apply_rows` on CUDA launches it; kept here so
//! `cargo xtask kernels` compiles it for every architecture). CPU reference: eyrie-model's generic RoPE ops,
//! checked against this kernel by its `gpu_ops` program.

use burn::cubecl;
use cubecl::prelude::*;

/// RoPE of columns `off..off + d` of each row of `x` `[rows, cols]` (row `i` at position row `i / group` of the
/// tables), written as `[x1 cos - x2 sin | x2 cos + x1 sin]` into `out` `[rows, d]` (`rope::RotaryEmbedding`'s
/// layout). One thread per rotated pair.
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn rope_rows_kernel(
    x: &Array<f32>,
    cos: &Array<f32>,
    sin: &Array<f32>,
    out: &mut Array<f32>,
    pairs: u32,
    cols: u32,
    off: u32,
    group: u32,
    #[comptime] half: usize,
    #[comptime] interleave: bool,
) {
    let idx = ABSOLUTE_POS;
    if idx < pairs as usize {
        let row = idx / half;
        let i = idx % half;
        let tok = row / group as usize;
        let base = row * cols as usize + off as usize;
        let mut a = x[base + i];
        let mut b = x[base + half + i];
        if interleave {
            a = x[base + 2 * i];
            b = x[base + 2 * i + 1];
        }
        let c = cos[tok * half + i];
        let s = sin[tok * half + i];
        out[row * 2 * half + i] = a * c - b * s;
        out[row * 2 * half + half + i] = b * c + a * s;
    }
}
