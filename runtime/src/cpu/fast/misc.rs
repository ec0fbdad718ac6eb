//! The per-row and elementwise ops: RMSNorm, rotary embedding, SiLU-gated multiply, residual add,
//! router top-k, argmax, sampling, row gather and scatter-add. Their math is documented in
//! `ops.rs`; here each is a plain loop over rows or elements (the compiler vectorises the
//! elementwise ones), spread over the pool when there is enough work to pay for it.
//!
//! Where the reference's rounding is easy to follow cheaply (rope angles, probabilities, the
//! scatter-add), the arithmetic is f64 like the reference; reductions over long rows are f32.
//!
//! Softmax (router and sampling, f64, as the reference): NaN and -inf logits have probability 0;
//! +inf logits share it equally; a row with no logit above -inf has none (the router then picks
//! the first k experts at 1/k, sampling takes the argmax).
//!
//! Sampling (`sample`): temperature 0 is argmax. Otherwise `p = softmax(logits / T)`; candidates
//! are the tokens with p > 0, ordered by (p descending, index ascending); the first `top_k` kept
//! (0 keeps all); if `top_p < 1`, of those, renormalised, the shortest prefix whose cumulative
//! probability reaches `top_p`; then `p / sum(kept)`, and the first candidate whose cumulative
//! probability exceeds `u = ops::sample_uniform(seeds[r], steps[r], 0)` is drawn (the last one
//! if rounding leaves none).

use std::cell::Cell;
use std::cmp::Ordering;

use super::simd::Elem;
use super::{Fast, TASK_F64, TASK_U32, with_scratch};
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
        with_scratch(&TASK_F64, 2 * half, 0.0, |cs| {
            let (cos, sin) = cs.split_at_mut(half);
            for i in 0..half {
                (sin[i], cos[i]) = (pos * freqs[i]).sin_cos();
            }
            for head in row.chunks_exact_mut(d.head_dim) {
                let (a, b) = head.split_at_mut(half);
                for i in 0..half {
                    let (x0, x1) = (a[i] as f64, b[i] as f64);
                    a[i] = (x0 * cos[i] - x1 * sin[i]) as f32;
                    b[i] = (x1 * cos[i] + x0 * sin[i]) as f32;
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

/// Softmax of `z` into `p` (f64), as the reference: NaN and -inf have probability 0; if some
/// entry is +inf, the +inf entries share the probability equally; otherwise
/// `exp(z - max) / sum`. Returns false (and leaves `p` unspecified) when no entry is above -inf.
fn softmax_into(z: impl Iterator<Item = f64> + Clone, p: &mut [f64]) -> bool {
    let max = z.clone().filter(|v| !v.is_nan()).fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return false;
    }
    for (p, z) in p.iter_mut().zip(z) {
        *p = if max == f64::INFINITY {
            if z == f64::INFINITY { 1.0 } else { 0.0 }
        } else if z.is_nan() {
            0.0
        } else {
            (z - max).exp()
        };
    }
    let total: f64 = p.iter().sum();
    for p in p.iter_mut() {
        *p /= total;
    }
    true
}

/// Router: softmax over experts, the `k` most probable (ties to the lower index), renormalised.
/// A row with no logit above -inf picks the first `k` experts with weight `1 / k`.
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
                let (ids, weights) = (&mut ids[r * d.k..(r + 1) * d.k], &mut weights[r * d.k..(r + 1) * d.k]);
                let row = &logits[r * d.experts..(r + 1) * d.experts];
                if !softmax_into(row.iter().map(|&l| l as f64), p) {
                    for (j, (id, w)) in ids.iter_mut().zip(weights.iter_mut()).enumerate() {
                        *id = j as u32;
                        *w = (1.0 / d.k as f64) as f32;
                    }
                    continue;
                }
                for (i, o) in order.iter_mut().enumerate() {
                    *o = i as u32;
                }
                order.sort_unstable_by(by_prob_then_index(p));
                let top = &order[..d.k];
                let total: f64 = top.iter().map(|&i| p[i as usize]).sum();
                for (&i, (id, w)) in top.iter().zip(ids.iter_mut().zip(weights.iter_mut())) {
                    *id = i;
                    *w = (p[i as usize] / total) as f32;
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
    seeds: &HostTensor,
    steps: &HostTensor,
    out: &mut HostTensor,
) -> Result<()> {
    let logits = logits.as_slice::<f32>();
    let (seeds, steps) = (seeds.as_slice::<u32>(), steps.as_slice::<u32>());
    let out = out.as_mut_slice::<u32>("sample", "out")?;
    let params = *params;
    // A row costs an exp and a sort step per logit.
    fast.for_each_chunk(out, 1, d.rows * d.cols * 16, |r, o| {
        let row = &logits[r * d.cols..(r + 1) * d.cols];
        o[0] = with_scratch(&TASK_F64, d.cols, 0.0, |p| {
            with_scratch(&TASK_U32, d.cols, 0, |order| {
                sample_row(
                    row,
                    &params,
                    sample_uniform(u64::from(seeds[r]), u64::from(steps[r]), 0),
                    p,
                    order,
                )
            })
        });
    });
    Ok(())
}

/// One draw from a row; `p` and `order` are scratch of the row's length.
fn sample_row(row: &[f32], params: &SamplingParams, u: f64, p: &mut [f64], order: &mut [u32]) -> u32 {
    if params.temperature == 0.0 {
        return argmax_row(row);
    }
    let t = params.temperature as f64;
    if !softmax_into(row.iter().map(|&l| l as f64 / t), p) {
        return argmax_row(row);
    }
    // Candidates: tokens with probability, in rank order, the first `top_k` of them.
    let mut len = 0;
    for (i, &pi) in p.iter().enumerate() {
        if pi > 0.0 {
            order[len] = i as u32;
            len += 1;
        }
    }
    let cmp = by_prob_then_index(p);
    let kept = if params.top_k > 0 && params.top_k < len {
        order[..len].select_nth_unstable_by(params.top_k - 1, &cmp);
        params.top_k
    } else {
        len
    };
    let mut cand = &mut order[..kept];
    cand.sort_unstable_by(&cmp);
    if params.top_p < 1.0 {
        let top_p = params.top_p as f64;
        let total: f64 = cand.iter().map(|&i| p[i as usize]).sum();
        let mut cumulative = 0.0;
        let mut n = cand.len();
        for (j, &i) in cand.iter().enumerate() {
            cumulative += p[i as usize] / total;
            if cumulative >= top_p {
                n = j + 1;
                break;
            }
        }
        cand = &mut cand[..n];
    }
    let total: f64 = cand.iter().map(|&i| p[i as usize]).sum();
    let mut cumulative = 0.0;
    for &i in cand.iter() {
        cumulative += p[i as usize] / total;
        if cumulative > u {
            return i;
        }
    }
    // Rounding left the total at or below u: the last candidate (there is at least one).
    cand.last().copied().unwrap_or(0)
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
    crate::cpu::check_indices(op, idx, d.rows)?;
    let src = src.as_slice::<f32>();
    let out = out.as_mut_slice::<f32>(op, "out")?;
    fast.for_each_chunk(out, d.cols, d.picked * d.cols, |i, o| {
        let j = idx[i] as usize;
        o.copy_from_slice(&src[j * d.cols..(j + 1) * d.cols]);
    });
    Ok(())
}

/// `dst[idx[i]] += weights[i] * src[i]`, in order of i (rows may repeat). As the reference, each
/// destination element accumulates in f64 over all its updates and is rounded to f32 once.
pub(crate) fn scatter_add_rows(
    d: GatherDims,
    dst: &mut HostTensor,
    idx: &HostTensor,
    src: &HostTensor,
    weights: &HostTensor,
) -> Result<()> {
    let op = "scatter_add_rows";
    let idx = idx.as_slice::<u32>();
    crate::cpu::check_indices(op, idx, d.rows)?;
    let (src, weights) = (src.as_slice::<f32>(), weights.as_slice::<f32>());
    let dst = dst.as_mut_slice::<f32>(op, "dst")?;
    let cols = d.cols;
    with_scratch(&TASK_F64, cols, 0.0, |acc| {
        for (first, &j) in idx.iter().enumerate() {
            // Each destination row once, at its first update (picked is small: tokens x top-k).
            if idx[..first].contains(&j) {
                continue;
            }
            let out = &mut dst[j as usize * cols..(j as usize + 1) * cols];
            for (a, &o) in acc.iter_mut().zip(out.iter()) {
                *a = o as f64;
            }
            for i in first..idx.len() {
                if idx[i] == j {
                    let w = weights[i] as f64;
                    for (a, &s) in acc.iter_mut().zip(&src[i * cols..(i + 1) * cols]) {
                        *a += w * s as f64;
                    }
                }
            }
            for (o, &a) in out.iter_mut().zip(acc.iter()) {
                *o = a as f32;
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::Reference;
    use crate::cpu::fast::testutil::{Rng, assert_close, backends};
    use crate::{Backend, Llama3RopeScaling};

    const EPS32: f64 = 1.0 / (1u64 << 24) as f64;

    #[test]
    fn rms_norm_matches_reference() {
        let r = Reference;
        for fast in backends() {
            for wt in DType::FLOATS {
                for (rows, cols) in [(1, 1), (3, 17), (2, 4097)] {
                    let mut rng = Rng::new(cols as u64);
                    let x = fast.upload_f32(DType::F32, &[rows, cols], &rng.vec(rows * cols)).unwrap();
                    let w = fast.upload_f32(wt, &[cols], &rng.vec(cols)).unwrap();
                    let (mut y, mut y_ref) = (
                        fast.alloc(DType::F32, &[rows, cols]).unwrap(),
                        r.alloc(DType::F32, &[rows, cols]).unwrap(),
                    );
                    fast.rms_norm(&x, &w, 1e-5, &mut y).unwrap();
                    r.rms_norm(&x, &w, 1e-5, &mut y_ref).unwrap();
                    let want: Vec<f64> = r.read_f32(&y_ref).unwrap().iter().map(|&v| v as f64).collect();
                    // The mean of squares in f32 lanes: relative error <= (cols + 4) eps, halved by
                    // the square root; two more f32 multiplies; plus the reference's output rounding.
                    let tol: Vec<f64> =
                        want.iter().map(|v| v.abs() * ((cols as f64 / 2.0 + 8.0) * EPS32)).collect();
                    assert_close(
                        &format!("rms_norm {} {wt} {rows}x{cols}", fast.simd()),
                        &fast.read_f32(&y).unwrap(),
                        &want,
                        &tol,
                    );
                }
            }
        }
    }

    #[test]
    fn rope_matches_reference() {
        let r = Reference;
        let ropes = [
            Rope { head_dim: 2, theta: 10000.0, scaling: None },
            Rope { head_dim: 34, theta: 500000.0, scaling: None },
            Rope {
                head_dim: 128,
                theta: 500000.0,
                scaling: Some(Llama3RopeScaling {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 8192,
                }),
            },
        ];
        let fast = Fast::with_threads(2).unwrap();
        for rope in &ropes {
            for _ in 0..2 {
                // The second call uses the cached inverse frequencies.
                let (rows, heads) = (5, 3);
                let n = rows * heads * rope.head_dim;
                let mut rng = Rng::new(rope.head_dim as u64);
                let vals = rng.vec(n);
                let pos = fast.upload_u32(&[rows], &[0, 1, 17, 4097, 131071]).unwrap();
                let mut x = fast.upload_f32(DType::F32, &[rows, heads, rope.head_dim], &vals).unwrap();
                let mut x_ref = r.upload_f32(DType::F32, &[rows, heads, rope.head_dim], &vals).unwrap();
                fast.rope(&mut x, &pos, rope).unwrap();
                r.rope(&mut x_ref, &pos, rope).unwrap();
                let want: Vec<f64> = r.read_f32(&x_ref).unwrap().iter().map(|&v| v as f64).collect();
                // Same f64 arithmetic, one rounding each: at most one ulp apart.
                let tol: Vec<f64> = want.iter().map(|v| v.abs() * 2.0 * EPS32 + 1e-30).collect();
                assert_close(&format!("rope {rope:?}"), &fast.read_f32(&x).unwrap(), &want, &tol);
            }
        }
    }

    #[test]
    fn elementwise_and_rows_match_reference_exactly() {
        let r = Reference;
        for fast in [Fast::with_threads(1).unwrap(), Fast::with_threads(3).unwrap()] {
            for (rows, cols) in [(1, 3), (7, 17), (3, 40000)] {
                let mut rng = Rng::new(rows as u64 * 7 + cols as u64);
                let n = rows * cols;
                let (g, u) = (
                    fast.upload_f32(DType::F32, &[rows, cols], &rng.vec(n)).unwrap(),
                    fast.upload_f32(DType::F32, &[rows, cols], &rng.vec(n)).unwrap(),
                );
                let (mut o1, mut o2) = (
                    fast.alloc(DType::F32, &[rows, cols]).unwrap(),
                    fast.alloc(DType::F32, &[rows, cols]).unwrap(),
                );
                fast.silu_mul(&g, &u, &mut o1).unwrap();
                r.silu_mul(&g, &u, &mut o2).unwrap();
                let (a, b) = (fast.read_f32(&o1).unwrap(), r.read_f32(&o2).unwrap());
                for (a, b) in a.iter().zip(&b) {
                    // f32 vs f64 arithmetic, four operations: a few ulps.
                    assert!(
                        (a - b).abs() <= 8.0 * f32::EPSILON * b.abs().max(f32::MIN_POSITIVE),
                        "silu {a} {b}"
                    );
                }
                fast.add_assign(&mut o1, &u).unwrap();
                r.add_assign(&mut o2, &u).unwrap();
                // One f32 addition either way when the inputs agree; compare against inputs + u.
                let sum: Vec<f32> = a.iter().zip(fast.read_f32(&u).unwrap()).map(|(a, u)| a + u).collect();
                assert_eq!(fast.read_f32(&o1).unwrap(), sum);

                // gather / scatter: exact.
                let idx = [rows - 1, 0, rows / 2, rows - 1, 0];
                let idx: Vec<u32> = idx.iter().map(|&i| i as u32).collect();
                let it = fast.upload_u32(&[idx.len()], &idx).unwrap();
                let (mut gf, mut gr) = (
                    fast.alloc(DType::F32, &[idx.len(), cols]).unwrap(),
                    r.alloc(DType::F32, &[idx.len(), cols]).unwrap(),
                );
                fast.gather_rows(&g, &it, &mut gf).unwrap();
                r.gather_rows(&g, &it, &mut gr).unwrap();
                assert_eq!(fast.read(&gf).unwrap(), r.read(&gr).unwrap());
                let wts = fast.upload_f32(DType::F32, &[idx.len()], &rng.vec(idx.len())).unwrap();
                let vals = rng.vec(n);
                let (mut df, mut dr) = (
                    fast.upload_f32(DType::F32, &[rows, cols], &vals).unwrap(),
                    r.upload_f32(DType::F32, &[rows, cols], &vals).unwrap(),
                );
                fast.scatter_add_rows(&mut df, &it, &gf, &wts).unwrap();
                r.scatter_add_rows(&mut dr, &it, &gr, &wts).unwrap();
                assert_eq!(fast.read(&df).unwrap(), r.read(&dr).unwrap());
                let bad = fast.upload_u32(&[2], &[0, rows as u32]).unwrap();
                let mut g2 = fast.alloc(DType::F32, &[2, cols]).unwrap();
                assert_eq!(
                    fast.gather_rows(&g, &bad, &mut g2).unwrap_err(),
                    Error::IndexOutOfRange { op: "gather_rows", row: 1, index: rows as u32, len: rows }
                );
                let before = fast.read(&df).unwrap();
                let w2 = fast.upload_f32(DType::F32, &[2], &[1.0, 1.0]).unwrap();
                assert!(fast.scatter_add_rows(&mut df, &bad, &g2, &w2).is_err());
                assert_eq!(fast.read(&df).unwrap(), before, "an index error writes nothing");
            }
        }
    }

    /// Rows with special values and ties, then random ones.
    fn logit_rows(rng: &mut Rng, cols: usize) -> Vec<Vec<f32>> {
        let (inf, nan) = (f32::INFINITY, f32::NAN);
        let mut rows = vec![
            vec![nan; cols],
            vec![-inf; cols],
            vec![0.5; cols],
            (0..cols).map(|i| if i % 3 == 0 { nan } else { -(i as f32) }).collect(),
            (0..cols).map(|i| if i == cols / 2 || i == cols - 1 { inf } else { i as f32 }).collect(),
            (0..cols).map(|i| if i % 2 == 0 { 1.0 } else { -inf }).collect(),
            (0..cols).map(|i| (i % 4) as f32).collect(),
            (0..cols).map(|i| -1000.0 * i as f32).collect(),
        ];
        for _ in 0..20 {
            rows.push((0..cols).map(|_| 4.0 * rng.uniform()).collect());
        }
        rows
    }

    #[test]
    fn argmax_router_and_sampling_match_reference_exactly() {
        let mut rng = Rng::new(42);
        for cols in [1, 2, 8, 17, 1000] {
            for row in logit_rows(&mut rng, cols) {
                assert_eq!(argmax_row(&row), Reference::argmax_row(&row), "argmax {row:?}");
                let mut p = vec![0.0; cols];
                let mut order = vec![0; cols];
                for params in [
                    SamplingParams::GREEDY,
                    SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0 },
                    SamplingParams { temperature: 0.7, top_k: 3, top_p: 1.0 },
                    SamplingParams { temperature: 1.3, top_k: 0, top_p: 0.6 },
                    SamplingParams { temperature: 0.5, top_k: 5, top_p: 0.9 },
                    SamplingParams { temperature: 2.0, top_k: cols + 3, top_p: 0.01 },
                ] {
                    for step in 0..6 {
                        let u = sample_uniform(7, step, 3);
                        assert_eq!(
                            sample_row(&row, &params, u, &mut p, &mut order),
                            Reference::sample_row(&row, &params, u),
                            "sample {params:?} u {u} row {row:?}"
                        );
                    }
                }
            }
        }
        // The router through the backend (f32 weights), every k.
        let r = Reference;
        let fast = Fast::with_threads(2).unwrap();
        for experts in [1, 3, 8] {
            let rows = logit_rows(&mut rng, experts);
            let flat: Vec<f32> = rows.concat();
            let logits = fast.upload_f32(DType::F32, &[rows.len(), experts], &flat).unwrap();
            for k in 1..=experts {
                let mut out = [
                    (
                        fast.alloc(DType::U32, &[rows.len(), k]).unwrap(),
                        fast.alloc(DType::F32, &[rows.len(), k]).unwrap(),
                    ),
                    (
                        r.alloc(DType::U32, &[rows.len(), k]).unwrap(),
                        r.alloc(DType::F32, &[rows.len(), k]).unwrap(),
                    ),
                ];
                let [(fi, fw), (ri, rw)] = &mut out;
                fast.router_topk(&logits, k, fi, fw).unwrap();
                r.router_topk(&logits, k, ri, rw).unwrap();
                assert_eq!(fast.read(fi).unwrap(), r.read(ri).unwrap(), "router ids {experts} {k}");
                assert_eq!(fast.read(fw).unwrap(), r.read(rw).unwrap(), "router weights {experts} {k}");
            }
        }
        // Sampling through the backend: per-row uniforms.
        let rows = logit_rows(&mut rng, 50);
        let logits = fast.upload_f32(DType::F32, &[rows.len(), 50], &rows.concat()).unwrap();
        let params = SamplingParams { temperature: 0.9, top_k: 10, top_p: 0.8 };
        let n = rows.len() as u32;
        let seeds = fast.upload_u32(&[rows.len()], &(0..n).map(|i| 123 + i % 3).collect::<Vec<_>>()).unwrap();
        let steps = fast.upload_u32(&[rows.len()], &(0..n).map(|i| 4 + i).collect::<Vec<_>>()).unwrap();
        let (mut a, mut b) =
            (fast.alloc(DType::U32, &[rows.len()]).unwrap(), r.alloc(DType::U32, &[rows.len()]).unwrap());
        fast.sample(&logits, &params, &seeds, &steps, &mut a).unwrap();
        r.sample(&logits, &params, &seeds, &steps, &mut b).unwrap();
        assert_eq!(fast.read(&a).unwrap(), r.read(&b).unwrap());
    }
}
