//! linear and embedding: a weight `[n, k]` of any float dtype, dequantised by its scale.
//!
//! `W_real[j][l] = weight[j][l] * scale(j, l)`, where `scale(j, l)` is 1 (no scale), the
//! per-tensor scale, `scales[j]` (per channel: one per output row, or per token for an
//! embedding table), or `scales[j / block_rows][l / block_cols]` (blocks).
//!
//! linear: `y[i][j] = sum_l x[i][l] * W_real[j][l]`, with the scale applied after the reduction
//! where the layout allows: to the row's full sum for per-tensor and per-channel scales, to each
//! `block_cols`-wide partial sum for block scales.

use std::ops::Range;

use super::values::{Floats, floats, indices, store, widen};
use crate::ops::{GatherDims, Linear, LinearDims, WeightScale};
use crate::{Error, HostStorage, HostTensor, Result};

/// How the stored weight values are scaled, with the scale tensors widened to f64.
enum Scale {
    None,
    PerTensor(f64),
    /// One scale per weight row.
    PerChannel(Vec<f64>),
    /// Row-major `[ceil(n / rows), ceil(k / cols)]` grid of block scales.
    Block {
        rows: usize,
        cols: usize,
        grid: Vec<f64>,
        grid_cols: usize,
    },
}

/// A weight `[n, k]` and its scale.
struct Weight<'a> {
    values: Floats<'a>,
    k: usize,
    scale: Scale,
}

impl<'a> Weight<'a> {
    fn new(op: &'static str, w: &'a Linear<HostStorage>, k: usize) -> Result<Self> {
        let scale = match &w.scale {
            WeightScale::None => Scale::None,
            WeightScale::PerTensor(s) => Scale::PerTensor(f64::from(*s)),
            // `[n]` and `[n, 1]` hold the same n values.
            WeightScale::PerChannel(s) => Scale::PerChannel(widen(op, "scale", s)?),
            WeightScale::Block { block_rows, block_cols, scales } => Scale::Block {
                rows: *block_rows,
                cols: *block_cols,
                grid: widen(op, "scale", scales)?,
                grid_cols: k.div_ceil(*block_cols),
            },
        };
        Ok(Weight { values: floats(op, "weight", &w.weight)?, k, scale })
    }

    /// The stored (unscaled) value `weight[j][l]`.
    fn stored(&self, j: usize, l: usize) -> f64 {
        self.values.at(j * self.k + l)
    }

    /// `sum_{l in cols} x[l] * weight[j][l]`, unscaled.
    fn partial_dot(&self, j: usize, cols: Range<usize>, x: &[f64]) -> f64 {
        let mut acc = 0.0;
        for l in cols {
            acc += x[l] * self.stored(j, l);
        }
        acc
    }

    /// `sum_l x[l] * W_real[j][l]`, each scale applied to the sum it covers.
    fn dot_row(&self, j: usize, x: &[f64]) -> f64 {
        let k = self.k;
        match &self.scale {
            Scale::None => self.partial_dot(j, 0..k, x),
            Scale::PerTensor(s) => s * self.partial_dot(j, 0..k, x),
            Scale::PerChannel(s) => s[j] * self.partial_dot(j, 0..k, x),
            Scale::Block { rows, cols, grid, grid_cols } => {
                let mut acc = 0.0;
                for b in 0..*grid_cols {
                    let block = b * cols..((b + 1) * cols).min(k);
                    acc += grid[(j / rows) * grid_cols + b] * self.partial_dot(j, block, x);
                }
                acc
            }
        }
    }

    /// `W_real[j][l]`.
    fn dequantised(&self, j: usize, l: usize) -> f64 {
        let w = self.stored(j, l);
        match &self.scale {
            Scale::None => w,
            Scale::PerTensor(s) => w * s,
            Scale::PerChannel(s) => w * s[j],
            Scale::Block { rows, cols, grid, grid_cols } => w * grid[(j / rows) * grid_cols + l / cols],
        }
    }
}

/// `y[m, n] = x[m, k] . W_real[n, k]^T`.
pub(super) fn linear(
    d: LinearDims,
    x: &HostTensor,
    w: &Linear<HostStorage>,
    y: &mut HostTensor,
) -> Result<()> {
    let op = "linear";
    let x = widen(op, "x", x)?;
    let weight = Weight::new(op, w, d.k)?;
    let mut out = vec![0.0; d.m * d.n];
    for i in 0..d.m {
        let x_row = &x[i * d.k..(i + 1) * d.k];
        for j in 0..d.n {
            out[i * d.n + j] = weight.dot_row(j, x_row);
        }
    }
    store(op, "y", y, &out)
}

/// `out[i][j] = silu(g) * u`, `g = sum_l x[i][l] * W_gate[j][l]`, `u` the same over `W_up`, all
/// in f64 (`silu(g) = g / (1 + exp(-g))`), rounded once to f32. The scratch is not used.
pub(super) fn gate_up_silu(
    d: LinearDims,
    x: &HostTensor,
    w_gate: &Linear<HostStorage>,
    w_up: &Linear<HostStorage>,
    out: &mut HostTensor,
) -> Result<()> {
    let op = "gate_up_silu";
    let x = widen(op, "x", x)?;
    let gate = Weight::new(op, w_gate, d.k)?;
    let up = Weight::new(op, w_up, d.k)?;
    let mut v = vec![0.0; d.m * d.n];
    for i in 0..d.m {
        let x_row = &x[i * d.k..(i + 1) * d.k];
        for j in 0..d.n {
            let g = gate.dot_row(j, x_row);
            v[i * d.n + j] = g / (1.0 + (-g).exp()) * up.dot_row(j, x_row);
        }
    }
    store(op, "out", out, &v)
}

/// `out[r] = W_real[ids[r]]`; any id beyond the table is `TokenOutOfRange` before anything is
/// written.
pub(super) fn embedding(
    d: GatherDims,
    table: &Linear<HostStorage>,
    ids: &HostTensor,
    out: &mut HostTensor,
) -> Result<()> {
    let op = "embedding";
    let ids = indices(op, "ids", ids)?;
    for (row, &id) in ids.iter().enumerate() {
        if id as usize >= d.rows {
            return Err(Error::TokenOutOfRange { op, row, id, vocab: d.rows });
        }
    }
    let weight = Weight::new(op, table, d.cols)?;
    let mut values = vec![0.0; d.picked * d.cols];
    for (r, &id) in ids.iter().enumerate() {
        for c in 0..d.cols {
            values[r * d.cols + c] = weight.dequantised(id as usize, c);
        }
    }
    store(op, "out", out, &values)
}
