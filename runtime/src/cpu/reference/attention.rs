//! The KV cache: kv_store writes this step's keys and values, attention reads them.
//!
//! Cache layout `[num_blocks, block_size, kv_heads, head_dim]`, paged through the block table
//! `[slots, max_blocks]`: element `(slot, t, kv_head, e)` is at
//! `((table[slot][t / block_size] * block_size + t % block_size) * kv_heads + kv_head) * head_dim
//! + e`.
//!
//! attention, for query row r and head h, over cache slot `s = slots[r]` and positions
//! `t = 0..=positions[r]` (the causal mask), reading kv head `g = h / (heads / kv_heads)`:
//! `score_t = scale * sum_e q[r][h][e] * K[s][t][g][e]`,
//! `p_t = exp(score_t - max_t score_t) / sum_t exp(score_t - max_t score_t)`,
//! `out[r][h][e] = sum_t p_t * V[s][t][g][e]`.

use super::values::{ensure_writable, floats, indices, store, store_at, widen};
use crate::ops::{AttnDims, KvCacheLayer};
use crate::{HostStorage, HostTensor, Result};

/// Position `positions[r]` of slot `slots[r]` (through the block table) `= k[r]` and the same for
/// v, converted to the cache dtype.
pub(super) fn kv_store(
    d: AttnDims,
    k: &HostTensor,
    v: &HostTensor,
    cache: &mut KvCacheLayer<HostStorage>,
    table: &HostTensor,
    slots: &HostTensor,
    positions: &HostTensor,
) -> Result<()> {
    let op = "kv_store";
    let table = indices(op, "block_table", table)?;
    let slots = indices(op, "slots", slots)?;
    let positions = indices(op, "positions", positions)?;
    crate::cpu::check_cache_rows(op, d, table, slots, positions, false)?;
    ensure_writable(op, "k_cache", &cache.k)?;
    ensure_writable(op, "v_cache", &cache.v)?;
    let k = widen(op, "k", k)?;
    let v = widen(op, "v", v)?;
    // One cache entry: every kv head of one position.
    let entry = d.kv_heads * d.head_dim;
    for r in 0..d.rows {
        let at = crate::cpu::paged_offset(d, table, slots[r] as usize, positions[r] as usize, 0);
        store_at(op, "k_cache", &mut cache.k, at, &k[r * entry..(r + 1) * entry])?;
        store_at(op, "v_cache", &mut cache.v, at, &v[r * entry..(r + 1) * entry])?;
    }
    Ok(())
}

/// Causal grouped-query attention of `q [rows, heads, head_dim]` over the cache.
#[allow(clippy::too_many_arguments)]
pub(super) fn attention(
    d: AttnDims,
    q: &HostTensor,
    cache: &KvCacheLayer<HostStorage>,
    table: &HostTensor,
    slots: &HostTensor,
    positions: &HostTensor,
    scale: f32,
    out: &mut HostTensor,
) -> Result<()> {
    let op = "attention";
    let table = indices(op, "block_table", table)?;
    let slots = indices(op, "slots", slots)?;
    let positions = indices(op, "positions", positions)?;
    crate::cpu::check_cache_rows(op, d, table, slots, positions, true)?;
    let q = widen(op, "q", q)?;
    let k_cache = floats(op, "k_cache", &cache.k)?;
    let v_cache = floats(op, "v_cache", &cache.v)?;
    let scale = f64::from(scale);
    let hd = d.head_dim;
    let group = d.heads / d.kv_heads;
    let cache_index = |slot: usize, t: usize, kv_head: usize, e: usize| {
        let block = table[slot * d.max_blocks + t / d.block_size] as usize;
        ((block * d.block_size + t % d.block_size) * d.kv_heads + kv_head) * hd + e
    };

    let mut o = vec![0.0; d.rows * d.heads * hd];
    for r in 0..d.rows {
        let slot = slots[r] as usize;
        let last = positions[r] as usize;
        for h in 0..d.heads {
            let kv_head = h / group;
            let q_h = &q[(r * d.heads + h) * hd..(r * d.heads + h + 1) * hd];

            let mut scores = vec![0.0; last + 1];
            for t in 0..=last {
                let mut dot = 0.0;
                for e in 0..hd {
                    dot += q_h[e] * k_cache.at(cache_index(slot, t, kv_head, e));
                }
                scores[t] = scale * dot;
            }
            // NaN scores make the max ignore them and the sum NaN, so NaN propagates to out.
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = exps.iter().sum();

            let o_h = &mut o[(r * d.heads + h) * hd..(r * d.heads + h + 1) * hd];
            for e in 0..hd {
                let mut acc = 0.0;
                for t in 0..=last {
                    acc += exps[t] / total * v_cache.at(cache_index(slot, t, kv_head, e));
                }
                o_h[e] = acc;
            }
        }
    }
    store(op, "out", out, &o)
}
