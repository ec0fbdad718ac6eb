//! Row-wise and elementwise ops: rms_norm, rope, silu_mul, add_assign.

use super::values::{indices, store, widen};
use crate::ops::{RopeDims, RowsDims};
use crate::{HostTensor, Result, Rope};

/// `y = x / sqrt(mean(x^2) + eps) * weight`, per row.
pub(super) fn rms_norm(
    d: RowsDims,
    x: &HostTensor,
    weight: &HostTensor,
    eps: f32,
    y: &mut HostTensor,
) -> Result<()> {
    let op = "rms_norm";
    let x = widen(op, "x", x)?;
    let weight = widen(op, "weight", weight)?;
    let mut out = vec![0.0; d.rows * d.cols];
    for r in 0..d.rows {
        let row = &x[r * d.cols..(r + 1) * d.cols];
        let mut sum_sq = 0.0;
        for &v in row {
            sum_sq += v * v;
        }
        let rms = (sum_sq / d.cols as f64 + f64::from(eps)).sqrt();
        for c in 0..d.cols {
            out[r * d.cols + c] = row[c] / rms * weight[c];
        }
    }
    store(op, "y", y, &out)
}

/// Rotates every head of row r by the angles `positions[r] * inv_freq[i]`, pairing dimension `i`
/// with `i + head_dim / 2` (Hugging Face `rotate_half`):
/// `x[i]' = x[i] cos a - x[i + d/2] sin a`, `x[i + d/2]' = x[i + d/2] cos a + x[i] sin a`.
pub(super) fn rope(d: RopeDims, x: &mut HostTensor, positions: &HostTensor, rope: &Rope) -> Result<()> {
    let op = "rope";
    let positions = indices(op, "positions", positions)?;
    let inv_freq = rope.inv_freq();
    let half = d.head_dim / 2;
    let mut v = widen(op, "x", x)?;
    for r in 0..d.rows {
        let pos = f64::from(positions[r]);
        for h in 0..d.heads {
            let head = (r * d.heads + h) * d.head_dim;
            for i in 0..half {
                let (sin, cos) = (pos * inv_freq[i]).sin_cos();
                let a = v[head + i];
                let b = v[head + i + half];
                v[head + i] = a * cos - b * sin;
                v[head + i + half] = b * cos + a * sin;
            }
        }
    }
    store(op, "x", x, &v)
}

/// `out = silu(gate) * up = gate / (1 + exp(-gate)) * up`.
pub(super) fn silu_mul(d: RowsDims, gate: &HostTensor, up: &HostTensor, out: &mut HostTensor) -> Result<()> {
    let op = "silu_mul";
    let gate = widen(op, "gate", gate)?;
    let up = widen(op, "up", up)?;
    let mut v = vec![0.0; d.rows * d.cols];
    for e in 0..v.len() {
        let g = gate[e];
        v[e] = g / (1.0 + (-g).exp()) * up[e];
    }
    store(op, "out", out, &v)
}

/// `x += y`.
pub(super) fn add_assign(d: RowsDims, x: &mut HostTensor, y: &HostTensor) -> Result<()> {
    let op = "add_assign";
    let mut v = widen(op, "x", x)?;
    let y = widen(op, "y", y)?;
    for e in 0..d.rows * d.cols {
        v[e] += y[e];
    }
    store(op, "x", x, &v)
}
