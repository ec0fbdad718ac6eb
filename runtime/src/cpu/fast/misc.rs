//! The per-row and elementwise ops: RMSNorm, rotary embedding, SiLU-gated multiply, residual add,
//! router top-k, argmax, sampling, row gather and scatter-add. Their math is documented in
//! `ops.rs`; here each is a plain loop over rows or elements (the compiler vectorises the
//! elementwise ones), spread over the pool when there is enough work to pay for it.
//!
//! Where the reference's rounding is easy to follow cheaply (rope angles, probabilities, the
//! scatter-add), the arithmetic is f64 like the reference; reductions over long rows are f32.
//!
//! Sampling (`sample`): temperature 0 is argmax. Otherwise `p = softmax(logits / T)`; candidates
//! ordered by (p descending, index ascending); the first `top_k` kept (0 keeps all); of those,
//! renormalised, the shortest prefix whose cumulative probability reaches `top_p`; renormalised
//! again; the first candidate whose cumulative probability exceeds
//! `u = ops::sample_uniform(seed, step, row)` is drawn (the last one if rounding leaves none).

use std::cell::Cell;
use std::cmp::Ordering;

use super::simd::Elem;
use super::{Fast, TASK_F32, TASK_F64, TASK_U32, with_scratch};
use crate::ops::{GatherDims, RopeDims, RowsDims, SamplingParams, TopKDims, sample_uniform};
use crate::{DType, Error, HostTensor, Result, Rope, with_float_type};

/// Lanes of the f32 partial sums of a row reduction (enough for the compiler to vectorise).
const SUM_LANES: usize = 16;

/// RMSNorm: `y = x / sqrt(mean(x^2) + eps) * weight`, per row.
pub(crate) fn rms_norm(
    fast: &Fast,
    d: RowsDims,
    x: &HostTensor,
    weight: &HostTensor,
    eps: f32,
    y: &mut HostTensor,
) -> Result<()> {
    let op = "rms_norm";
    let x = x.as_slice::<f32>();
    let y = y.as_mut_slice::<f32>(op, "y")?;
    with_float_type!(weight.dtype(), W => {
        let w = weight.as_slice::<W>();
        fast.for_each_chunk(y, d.cols, d.rows * d.cols, |r, y| {
            let x = &x[r * d.cols..(r + 1) * d.cols];
            let mean = sum_squares(x) / d.cols as f64;
            let inv = (1.0 / (mean + eps as f64).sqrt()) as f32;
            for ((y, &x), w) in y.iter_mut().zip(x).zip(w) {
                *y = x * inv * w.widen();
            }
        });
        Ok(())
    }, else => Err(Error::DType { op, tensor: "weight", got: weight.dtype(), allowed: DType::FLOATS.into() }))
}

/// Sum of squares: f32 partial sums in `SUM_LANES` lanes, combined in f64.
fn sum_squares(x: &[f32]) -> f64 {
    let mut acc = [0.0f32; SUM_LANES];
    let mut chunks = x.chunks_exact(SUM_LANES);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v * v;
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&v| (v as f64) * (v as f64)).sum();
    acc.iter().map(|&a| a as f64).sum::<f64>() + tail
}

thread_local! {
    /// The inverse frequencies of the last rope seen on this thread.
    static ROPE_CACHE: Cell<Option<(Rope, Vec<f64>)>> = const { Cell::new(None) };
}

/// Rotary embedding in place: dimension `i` pairs with `i + head_dim / 2`, angle
/// `positions[row] * inv_freq[i]` (f64, like the reference).
pub(crate) fn rope(
    fast: &Fast,
    d: RopeDims,
    x: &mut HostTensor,
    positions: &HostTensor,
    rope: &Rope,
) -> Result<()> {
    let x = x.as_mut_slice::<f32>("rope", "x")?;
    let positions = positions.as_slice::<u32>();
    let half = d.head_dim / 2;
    // The inverse frequencies are a function of the rope alone: kept from the last call.
    let cached = ROPE_CACHE.with(Cell::take).filter(|(r, _)| r == rope);
    let (rope_key, inv_freq) = cached.unwrap_or_else(|| (rope.clone(), rope.inv_freq()));
    let width = d.heads * d.head_dim;
    let freqs = &inv_freq;
    fast.for_each_chunk(x, width, d.rows * width, |r, row| {
        let pos = positions[r] as f64;
        with_scratch(&TASK_F32, 2 * half, 0.0, |cs| {
            let (cos, sin) = cs.split_at_mut(half);
            for i in 0..half {
                let (s, c) = (pos * freqs[i]).sin_cos();
                cos[i] = c as f32;
                sin[i] = s as f32;
            }
            for head in row.chunks_exact_mut(d.head_dim) {
                let (a, b) = head.split_at_mut(half);
                for i in 0..half {
                    let (x0, x1) = (a[i] as f64, b[i] as f64);
                    let (c, s) = (cos[i] as f64, sin[i] as f64);
                    a[i] = (x0 * c - x1 * s) as f32;
                    b[i] = (x1 * c + x0 * s) as f32;
                }
            }
        });
    });
    ROPE_CACHE.with(|c| c.set(Some((rope_key, inv_freq))));
    Ok(())
}

/// `out = silu(gate) * up`, `silu(g) = g / (1 + exp(-g))`.
pub(crate) fn silu_mul(
    fast: &Fast,
    d: RowsDims,
    gate: &HostTensor,
    up: &HostTensor,
    out: &mut HostTensor,
) -> Result<()> {
    let (gate, up) = (gate.as_slice::<f32>(), up.as_slice::<f32>());
    let out = out.as_mut_slice::<f32>("silu_mul", "out")?;
    let chunk = PAR_CHUNK.min(d.rows * d.cols);
    fast.for_each_chunk(out, chunk, d.rows * d.cols * 8, |c, out| {
        let at = c * chunk;
        for ((o, &g), &u) in out.iter_mut().zip(&gate[at..]).zip(&up[at..]) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    });
    Ok(())
}

/// Elements per task of the elementwise ops.
const PAR_CHUNK: usize = 1 << 14;

/// `x += y`.
pub(crate) fn add_assign(fast: &Fast, d: RowsDims, x: &mut HostTensor, y: &HostTensor) -> Result<()> {
    let x = x.as_mut_slice::<f32>("add_assign", "x")?;
    let y = y.as_slice::<f32>();
    let chunk = PAR_CHUNK.min(d.rows * d.cols);
    fast.for_each_chunk(x, chunk, d.rows * d.cols, |c, x| {
        for (x, &y) in x.iter_mut().zip(&y[c * chunk..]) {
            *x += y;
        }
    });
    Ok(())
}

/// Candidates in sampling and routing order: probability descending, then index ascending.
#[inline]
fn by_prob_then_index(p: &[f64]) -> impl Fn(&u32, &u32) -> Ordering + '_ {
    |&a, &b| p[b as usize].total_cmp(&p[a as usize]).then(a.cmp(&b))
}

/// Softmax of `z` into `p` (f64): `exp(z - max) / sum`.
fn softmax_into(z: impl Iterator<Item = f64> + Clone, p: &mut [f64]) {
    let max = z.clone().fold(f64::NEG_INFINITY, f64::max);
    let mut sum = 0.0;
    for (p, z) in p.iter_mut().zip(z) {
        *p = (z - max).exp();
        sum += *p;
    }
    for p in p.iter_mut() {
        *p /= sum;
    }
}

/// Router: softmax over experts, the `k` most probable (ties to the lower index), renormalised.
pub(crate) fn router_topk(
    d: TopKDims,
    logits: &HostTensor,
    ids: &mut HostTensor,
    weights: &mut HostTensor,
) -> Result<()> {
    let op = "router_topk";
    let logits = logits.as_slice::<f32>();
    let ids = ids.as_mut_slice::<u32>(op, "ids")?;
    let weights = weights.as_mut_slice::<f32>(op, "weights")?;
    // Rows are short (a handful of experts): one pass on the calling thread.
    with_scratch(&TASK_F64, d.experts, 0.0, |p| {
        with_scratch(&TASK_U32, d.experts, 0, |order| {
            for r in 0..d.rows {
                let row = &logits[r * d.experts..(r + 1) * d.experts];
                softmax_into(row.iter().map(|&l| l as f64), p);
                for (i, o) in order.iter_mut().enumerate() {
                    *o = i as u32;
                }
                order.sort_unstable_by(by_prob_then_index(p));
                let top = &order[..d.k];
                let sum: f64 = top.iter().map(|&i| p[i as usize]).sum();
                for (j, &i) in top.iter().enumerate() {
                    ids[r * d.k + j] = i;
                    weights[r * d.k + j] = (p[i as usize] / sum) as f32;
                }
            }
        })
    });
    Ok(())
}

/// Index of the largest value: the lowest index among equals; NaN never wins; 0 if all are NaN.
pub(crate) fn argmax_row(row: &[f32]) -> u32 {
    let mut best = 0;
    let mut best_v = f32::NAN;
    for (i, &v) in row.iter().enumerate() {
        if v > best_v || (best_v.is_nan() && !v.is_nan()) {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

pub(crate) fn argmax(fast: &Fast, d: RowsDims, logits: &HostTensor, out: &mut HostTensor) -> Result<()> {
    let logits = logits.as_slice::<f32>();
    let out = out.as_mut_slice::<u32>("argmax", "out")?;
    fast.for_each_chunk(out, 1, d.rows * d.cols, |r, o| {
        o[0] = argmax_row(&logits[r * d.cols..(r + 1) * d.cols]);
    });
    Ok(())
}

pub(crate) fn sample(
    fast: &Fast,
    d: RowsDims,
    logits: &HostTensor,
    params: &SamplingParams,
    seed: u64,
    step: u64,
    out: &mut HostTensor,
) -> Result<()> {
    let logits = logits.as_slice::<f32>();
    let out = out.as_mut_slice::<u32>("sample", "out")?;
    let params = *params;
    fast.for_each_chunk(out, 1, d.rows * d.cols * 16, |r, o| {
        let row = &logits[r * d.cols..(r + 1) * d.cols];
        o[0] = if params.temperature == 0.0 {
            argmax_row(row)
        } else {
            with_scratch(&TASK_F64, d.cols, 0.0, |p| {
                with_scratch(&TASK_U32, d.cols, 0, |order| {
                    sample_row(row, &params, sample_uniform(seed, step, r as u64), p, order)
                })
            })
        };
    });
    Ok(())
}

/// One draw from a row (temperature > 0); `p` and `order` are scratch of the row's length.
fn sample_row(row: &[f32], params: &SamplingParams, u: f64, p: &mut [f64], order: &mut [u32]) -> u32 {
    let t = params.temperature as f64;
    softmax_into(row.iter().map(|&l| l as f64 / t), p);
    for (i, o) in order.iter_mut().enumerate() {
        *o = i as u32;
    }
    let cmp = by_prob_then_index(p);
    let kept = if params.top_k > 0 && params.top_k < order.len() {
        order.select_nth_unstable_by(params.top_k - 1, &cmp);
        params.top_k
    } else {
        order.len()
    };
    let cand = &mut order[..kept];
    cand.sort_unstable_by(&cmp);
    // Top-p over the top-k survivors, renormalised.
    let sum_k: f64 = cand.iter().map(|&i| p[i as usize]).sum();
    let top_p = params.top_p as f64;
    let mut nucleus = cand.len();
    let mut cum = 0.0;
    for (n, &i) in cand.iter().enumerate() {
        cum += p[i as usize] / sum_k;
        if cum >= top_p {
            nucleus = n + 1;
            break;
        }
    }
    let cand = &cand[..nucleus];
    let sum_p: f64 = cand.iter().map(|&i| p[i as usize] / sum_k).sum();
    let mut cum = 0.0;
    for &i in cand {
        cum += p[i as usize] / sum_k / sum_p;
        if cum > u {
            return i;
        }
    }
    cand[cand.len() - 1]
}

fn check_indices(op: &'static str, idx: &[u32], len: usize) -> Result<()> {
    for (row, &index) in idx.iter().enumerate() {
        if index as usize >= len {
            return Err(Error::IndexOutOfRange { op, row, index, len });
        }
    }
    Ok(())
}

/// `out[i] = src[idx[i]]`.
pub(crate) fn gather_rows(
    fast: &Fast,
    d: GatherDims,
    src: &HostTensor,
    idx: &HostTensor,
    out: &mut HostTensor,
) -> Result<()> {
    let op = "gather_rows";
    let idx = idx.as_slice::<u32>();
    check_indices(op, idx, d.rows)?;
    let src = src.as_slice::<f32>();
    let out = out.as_mut_slice::<f32>(op, "out")?;
    fast.for_each_chunk(out, d.cols, d.picked * d.cols, |i, o| {
        let j = idx[i] as usize;
        o.copy_from_slice(&src[j * d.cols..(j + 1) * d.cols]);
    });
    Ok(())
}

/// `dst[idx[i]] += weights[i] * src[i]`, in order of i (rows may repeat), each update rounded
/// once from f64 like the reference.
pub(crate) fn scatter_add_rows(
    d: GatherDims,
    dst: &mut HostTensor,
    idx: &HostTensor,
    src: &HostTensor,
    weights: &HostTensor,
) -> Result<()> {
    let op = "scatter_add_rows";
    let idx = idx.as_slice::<u32>();
    check_indices(op, idx, d.rows)?;
    let (src, weights) = (src.as_slice::<f32>(), weights.as_slice::<f32>());
    let dst = dst.as_mut_slice::<f32>(op, "dst")?;
    for (i, &j) in idx.iter().enumerate() {
        let w = weights[i] as f64;
        let j = j as usize;
        let row = &src[i * d.cols..(i + 1) * d.cols];
        for (o, &s) in dst[j * d.cols..(j + 1) * d.cols].iter_mut().zip(row) {
            *o = (*o as f64 + w * s as f64) as f32;
        }
    }
    Ok(())
}
