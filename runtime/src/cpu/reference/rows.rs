//! Row gather and weighted scatter-add (Mixtral's expert dispatch and combine).

use super::values::{indices, store, widen};
use crate::ops::GatherDims;
use crate::{HostTensor, Result};

/// `out[i] = src[idx[i]]`.
pub(super) fn gather_rows(
    d: GatherDims,
    src: &HostTensor,
    idx: &HostTensor,
    out: &mut HostTensor,
) -> Result<()> {
    let op = "gather_rows";
    let idx = indices(op, "idx", idx)?;
    crate::cpu::check_indices(op, idx, d.rows)?;
    let src = widen(op, "src", src)?;
    let mut v = vec![0.0; d.picked * d.cols];
    for i in 0..d.picked {
        let from = idx[i] as usize;
        for c in 0..d.cols {
            v[i * d.cols + c] = src[from * d.cols + c];
        }
    }
    store(op, "out", out, &v)
}

/// `dst[idx[i]] += weights[i] * src[i]` for i in order; each destination element accumulates
/// in f64 and is rounded to f32 once.
pub(super) fn scatter_add_rows(
    d: GatherDims,
    dst: &mut HostTensor,
    idx: &HostTensor,
    src: &HostTensor,
    weights: &HostTensor,
) -> Result<()> {
    let op = "scatter_add_rows";
    let idx = indices(op, "idx", idx)?;
    crate::cpu::check_indices(op, idx, d.rows)?;
    let src = widen(op, "src", src)?;
    let weights = widen(op, "weights", weights)?;
    let mut v = widen(op, "dst", dst)?;
    for i in 0..d.picked {
        let to = idx[i] as usize;
        for c in 0..d.cols {
            v[to * d.cols + c] += weights[i] * src[i * d.cols + c];
        }
    }
    store(op, "dst", dst, &v)
}
