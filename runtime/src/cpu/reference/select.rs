//! Picking from a row of logits: router top-k, argmax and seeded sampling, as pure per-row
//! functions that other backends' tests can call.
//!
//! Softmax (f64): NaN and -inf logits have probability 0; otherwise `p_i = exp(z_i - max) / sum`.
//! If some logit is +inf, the +inf logits share the probability equally (the limit of growing
//! logits). A row with no logit above -inf has no softmax: the router then treats every expert
//! as equally likely (the first k experts, weights 1/k), and sampling returns the argmax.
//!
//! Ranking: probability descending, then index ascending.

use super::Reference;
use crate::ops::{RowsDims, SamplingParams, TopKDims, sample_uniform};
use crate::{HostTensor, Result};

/// The softmax of `z` as described in the module docs; `None` when no entry is above -inf.
fn softmax(z: &[f64]) -> Option<Vec<f64>> {
    let max = z.iter().copied().filter(|v| !v.is_nan()).fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return None;
    }
    let weights: Vec<f64> = if max == f64::INFINITY {
        z.iter().map(|&v| if v == f64::INFINITY { 1.0 } else { 0.0 }).collect()
    } else {
        // exp(-inf) = 0 for -inf logits; NaN logits are set to 0 explicitly.
        z.iter().map(|&v| if v.is_nan() { 0.0 } else { (v - max).exp() }).collect()
    };
    let total: f64 = weights.iter().sum();
    Some(weights.iter().map(|w| w / total).collect())
}

/// Indices of `p` ordered by probability descending, then index ascending. `p` holds no NaN.
fn ranked(p: &[f64]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    order
}

impl Reference {
    /// The index of the largest value: the lowest index among equals; NaN never wins; a row of
    /// only NaN gives 0.
    pub fn argmax_row(logits: &[f32]) -> u32 {
        let mut best: Option<(usize, f32)> = None;
        for (i, &v) in logits.iter().enumerate() {
            if v.is_nan() {
                continue;
            }
            if best.is_none_or(|(_, b)| v > b) {
                best = Some((i, v));
            }
        }
        // `check_pick` guarantees the vocabulary fits u32.
        best.map_or(0, |(i, _)| i as u32)
    }

    /// The router's choice for one row: the `k` most probable experts under the softmax of
    /// `logits` (probability descending, then index ascending) with their probabilities
    /// renormalised over the chosen `k` (they sum to 1). `k` is clamped to the row length; the
    /// row is shorter than 2^32.
    pub fn router_row(logits: &[f32], k: usize) -> Vec<(u32, f64)> {
        let z: Vec<f64> = logits.iter().map(|&v| f64::from(v)).collect();
        let k = k.min(z.len());
        let Some(p) = softmax(&z) else {
            // No expert has probability: all equally likely.
            return (0..k).map(|i| (i as u32, 1.0 / k as f64)).collect();
        };
        let chosen = &ranked(&p)[..k];
        let total: f64 = chosen.iter().map(|&i| p[i]).sum();
        chosen.iter().map(|&i| (i as u32, p[i] / total)).collect()
    }

    /// The distribution `sample_row` draws from: candidates in draw order (probability
    /// descending, then index ascending), each with its probability; they sum to 1.
    ///
    /// Temperature 0 is the argmax with probability 1. Otherwise `p = softmax(logits /
    /// temperature)` (NaN and -inf logits have probability 0 and are never candidates); keep the
    /// first `top_k` candidates if `top_k > 0`; then, if `top_p < 1`, the shortest prefix whose
    /// cumulative probability, renormalised over the survivors, reaches `top_p` (at least one);
    /// renormalise. A row where no logit is above -inf gives its argmax.
    pub fn sample_distribution(logits: &[f32], params: &SamplingParams) -> Vec<(u32, f64)> {
        let greedy = || vec![(Self::argmax_row(logits), 1.0)];
        if params.temperature == 0.0 {
            return greedy();
        }
        let temperature = f64::from(params.temperature);
        let z: Vec<f64> = logits.iter().map(|&v| f64::from(v) / temperature).collect();
        let Some(p) = softmax(&z) else {
            return greedy();
        };
        let mut kept: Vec<usize> = ranked(&p).into_iter().filter(|&i| p[i] > 0.0).collect();
        if params.top_k > 0 {
            kept.truncate(params.top_k);
        }
        if params.top_p < 1.0 {
            let top_p = f64::from(params.top_p);
            let total: f64 = kept.iter().map(|&i| p[i]).sum();
            let mut cumulative = 0.0;
            let mut len = kept.len();
            for (n, &i) in kept.iter().enumerate() {
                cumulative += p[i] / total;
                if cumulative >= top_p {
                    len = n + 1;
                    break;
                }
            }
            kept.truncate(len);
        }
        let total: f64 = kept.iter().map(|&i| p[i]).sum();
        // `check_pick` guarantees the vocabulary fits u32.
        kept.iter().map(|&i| (i as u32, p[i] / total)).collect()
    }

    /// One token drawn from [`Reference::sample_distribution`] with the uniform `u` in [0, 1)
    /// (`ops::sample_uniform(seeds[r], steps[r], 0)` in the backend): the first candidate whose
    /// cumulative probability exceeds `u` (the last one if rounding leaves the total below `u`).
    pub fn sample_row(logits: &[f32], params: &SamplingParams, u: f64) -> u32 {
        let dist = Self::sample_distribution(logits, params);
        let mut cumulative = 0.0;
        for &(id, p) in &dist {
            cumulative += p;
            if cumulative > u {
                return id;
            }
        }
        // `dist` always holds at least one candidate.
        dist.last().map_or(0, |&(id, _)| id)
    }
}

pub(super) fn router_topk(
    d: TopKDims,
    logits: &HostTensor,
    ids: &mut HostTensor,
    weights: &mut HostTensor,
) -> Result<()> {
    let op = "router_topk";
    let logits = logits.as_slice::<f32>();
    // Both outputs are borrowed before either is written.
    let ids = ids.as_mut_slice::<u32>(op, "ids")?;
    let weights = weights.as_mut_slice::<f32>(op, "weights")?;
    if u32::try_from(d.experts).is_err() {
        return Err(crate::ops::arg(op, format!("{} experts do not fit u32 ids", d.experts)));
    }
    for r in 0..d.rows {
        let chosen = Reference::router_row(&logits[r * d.experts..(r + 1) * d.experts], d.k);
        for (c, (id, w)) in chosen.into_iter().enumerate() {
            ids[r * d.k + c] = id;
            weights[r * d.k + c] = w as f32;
        }
    }
    Ok(())
}

pub(super) fn argmax(d: RowsDims, logits: &HostTensor, out: &mut HostTensor) -> Result<()> {
    let op = "argmax";
    let logits = logits.as_slice::<f32>();
    let out = out.as_mut_slice::<u32>(op, "out")?;
    for r in 0..d.rows {
        out[r] = Reference::argmax_row(&logits[r * d.cols..(r + 1) * d.cols]);
    }
    Ok(())
}

pub(super) fn sample(
    d: RowsDims,
    logits: &HostTensor,
    params: &SamplingParams,
    seeds: &HostTensor,
    steps: &HostTensor,
    out: &mut HostTensor,
) -> Result<()> {
    let op = "sample";
    let logits = logits.as_slice::<f32>();
    let (seeds, steps) = (seeds.as_slice::<u32>(), steps.as_slice::<u32>());
    let out = out.as_mut_slice::<u32>(op, "out")?;
    for r in 0..d.rows {
        // Each row its own stream: see `ops::sample_uniform`.
        let u = sample_uniform(u64::from(seeds[r]), u64::from(steps[r]), 0);
        out[r] = Reference::sample_row(&logits[r * d.cols..(r + 1) * d.cols], params, u);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_special_values() {
        let inf = f64::INFINITY;
        assert_eq!(softmax(&[f64::NAN, 0.0, -inf, 0.0]), Some(vec![0.0, 0.5, 0.0, 0.5]));
        assert_eq!(softmax(&[inf, 1.0, inf, f64::NAN]), Some(vec![0.5, 0.0, 0.5, 0.0]));
        assert_eq!(softmax(&[-inf, f64::NAN]), None);
    }

    #[test]
    fn ranking_breaks_ties_by_index() {
        assert_eq!(ranked(&[0.25, 0.5, 0.0, 0.25]), vec![1, 0, 3, 2]);
    }
}
