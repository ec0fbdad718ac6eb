//! The reference CPU backend: the oracle every other backend (fast CPU, CUDA, HIP) is tested
//! against. Obvious loops that read like the math, f64 accumulation everywhere, no `unsafe`, no
//! threads. Speed is not a goal.
//!
//! Every op widens its inputs exactly to f64 (`Float::to_f64`), computes in f64, and rounds each
//! output element once to its dtype through f32 (`T::from_f32(v as f32)`). For bf16 and f16
//! outputs that is a double rounding f64 -> f32 -> bf16; it can differ from a single rounding by
//! one unit in the last place of the output only when the f64 value lies within 2^-24 relative of
//! a rounding boundary, far inside any backend tolerance (which starts at half an output ulp).
//!
//! Where the op docs in `ops.rs` are silent, the reference defines the behaviour:
//! - linear: `y[i][j] = sum_l x[i][l] * W[j][l]`; per-tensor and per-channel scales multiply
//!   the row's full sum; block scales multiply each `block_cols`-wide partial sum by
//!   `scales[j / block_rows][l / block_cols]`, and the scaled partial sums are added.
//! - gate_up_silu: both rows' sums as linear's, `silu(g) * u` in f64, one rounding to f32; the
//!   scratch is left as it was.
//! - embedding: dequantised row `ids[r]`; a per-channel scale is one per row (token).
//! - kv_store: rows are written in order, so a later row wins when two rows name the same
//!   `(slot, position)`.
//! - Data-dependent errors (token ids, slots, positions, gather indices) are checked for every
//!   row before anything is written, and a read-only output fails before anything is written.
//! - scatter_add_rows: each destination element accumulates its contributions in f64, in order
//!   of `i`, and is rounded to f32 once.
//! - softmax (router and sampling): NaN and -inf logits have probability 0; if any logit is
//!   +inf the +inf logits share the probability equally. See [`select`] for the rows where no
//!   logit has probability (all NaN or -inf).
//! - argmax / sampling / top-k order: probability (or value) descending, then index ascending.
//!
//! The per-row selection functions [`Reference::argmax_row`], [`Reference::sample_row`],
//! [`Reference::sample_distribution`] and [`Reference::router_row`] are pure functions over an
//! `&[f32]` row, for other backends' tests.

// Index loops are the point here: `for t in 0..=pos { s[t] = ... }` reads like the formula.
#![allow(clippy::needless_range_loop)]

mod attention;
mod elementwise;
mod linear;
mod rows;
mod select;
mod values;

use crate::ops::{
    AttnDims, GatherDims, KvCacheLayer, Linear, LinearDims, RopeDims, RowsDims, SamplingParams, TopKDims,
};
use crate::{Backend, HostStorage, HostTensor, Result, Rope};

/// The reference CPU backend (`cpu-ref`).
#[derive(Debug, Default)]
pub struct Reference;

impl Backend for Reference {
    type Storage = HostStorage;
    /// The CPU records nothing: `capture` is `Ok(None)`.
    type Graph = std::convert::Infallible;

    fn name(&self) -> &'static str {
        "cpu-ref"
    }
    fn exec_alloc(&self, bytes: usize) -> Result<HostStorage> {
        super::host_alloc(bytes)
    }
    fn exec_write(&self, dst: &mut HostStorage, bytes: &[u8]) -> Result<()> {
        super::host_write(dst, bytes)
    }
    fn exec_read(&self, src: &HostStorage, out: &mut [u8]) -> Result<()> {
        super::host_read(src, out)
    }
    fn exec_zero(&self, dst: &mut HostStorage, bytes: usize) -> Result<()> {
        super::host_zero(dst, bytes)
    }
    fn exec_linear(
        &self,
        d: LinearDims,
        x: &HostTensor,
        w: &Linear<HostStorage>,
        y: &mut HostTensor,
    ) -> Result<()> {
        linear::linear(d, x, w, y)
    }
    fn exec_rms_norm(
        &self,
        d: RowsDims,
        x: &HostTensor,
        weight: &HostTensor,
        eps: f32,
        y: &mut HostTensor,
    ) -> Result<()> {
        elementwise::rms_norm(d, x, weight, eps, y)
    }
    fn exec_rope(&self, d: RopeDims, x: &mut HostTensor, positions: &HostTensor, rope: &Rope) -> Result<()> {
        elementwise::rope(d, x, positions, rope)
    }
    fn exec_silu_mul(
        &self,
        d: RowsDims,
        gate: &HostTensor,
        up: &HostTensor,
        out: &mut HostTensor,
    ) -> Result<()> {
        elementwise::silu_mul(d, gate, up, out)
    }
    fn exec_gate_up_silu(
        &self,
        d: LinearDims,
        x: &HostTensor,
        w_gate: &Linear<HostStorage>,
        w_up: &Linear<HostStorage>,
        _scratch: (&mut HostTensor, &mut HostTensor),
        out: &mut HostTensor,
    ) -> Result<()> {
        linear::gate_up_silu(d, x, w_gate, w_up, out)
    }
    fn exec_add_assign(&self, d: RowsDims, x: &mut HostTensor, y: &HostTensor) -> Result<()> {
        elementwise::add_assign(d, x, y)
    }
    fn exec_embedding(
        &self,
        d: GatherDims,
        table: &Linear<HostStorage>,
        ids: &HostTensor,
        out: &mut HostTensor,
    ) -> Result<()> {
        linear::embedding(d, table, ids, out)
    }
    fn exec_kv_store(
        &self,
        d: AttnDims,
        k: &HostTensor,
        v: &HostTensor,
        cache: &mut KvCacheLayer<HostStorage>,
        table: &HostTensor,
        slots: &HostTensor,
        positions: &HostTensor,
    ) -> Result<()> {
        attention::kv_store(d, k, v, cache, table, slots, positions)
    }
    fn exec_attention(
        &self,
        d: AttnDims,
        q: &HostTensor,
        cache: &KvCacheLayer<HostStorage>,
        table: &HostTensor,
        slots: &HostTensor,
        positions: &HostTensor,
        scale: f32,
        out: &mut HostTensor,
    ) -> Result<()> {
        attention::attention(d, q, cache, table, slots, positions, scale, out)
    }
    fn exec_router_topk(
        &self,
        d: TopKDims,
        logits: &HostTensor,
        ids: &mut HostTensor,
        weights: &mut HostTensor,
    ) -> Result<()> {
        select::router_topk(d, logits, ids, weights)
    }
    fn exec_argmax(&self, d: RowsDims, logits: &HostTensor, out: &mut HostTensor) -> Result<()> {
        select::argmax(d, logits, out)
    }
    fn exec_sample(
        &self,
        d: RowsDims,
        logits: &HostTensor,
        params: &SamplingParams,
        seeds: &HostTensor,
        steps: &HostTensor,
        out: &mut HostTensor,
    ) -> Result<()> {
        select::sample(d, logits, params, seeds, steps, out)
    }
    fn exec_gather_rows(
        &self,
        d: GatherDims,
        src: &HostTensor,
        idx: &HostTensor,
        out: &mut HostTensor,
    ) -> Result<()> {
        rows::gather_rows(d, src, idx, out)
    }
    fn exec_scatter_add_rows(
        &self,
        d: GatherDims,
        dst: &mut HostTensor,
        idx: &HostTensor,
        src: &HostTensor,
        weights: &HostTensor,
    ) -> Result<()> {
        rows::scatter_add_rows(d, dst, idx, src, weights)
    }
}
