//! The KV cache store and causal grouped-query attention.
//!
//! Contract (`ops::check_kv_store`, `ops::check_attention`): the cache layer's `k` and `v` are
//! `[slots, capacity, kv_heads, head_dim]`, each f32, bf16 or f16 (independently). `kv_store`
//! writes `k, v [rows, kv_heads, head_dim]` (f32, rounded to the cache type) at
//! `(slots[r], positions[r])`, rows in order. `attention` gives each query row `r` and head `h`
//! `softmax(scale * q . K^T) V` over the positions `0..=positions[r]` of its slot, reading kv head
//! `h / (heads / kv_heads)`. Both check every row's slot (`SlotOutOfRange`) and position
//! (`ContextOverflow`) before writing anything.
//!
//! Algorithm: one task per (row, kv head), which serves the `heads / kv_heads` query heads of the
//! group, so each cached key and value row is read once per group. Positions go in blocks of
//! `POS_BLOCK`: the block's scores are computed, then the running max, the softmax denominator and
//! the output accumulator (the output rows themselves) are rescaled once per block (online
//! softmax in f32), and the block's values are added with vector FMAs.

use half::{bf16, f16};

use super::simd::{Elem, Kernel, Vector};
use super::{Fast, TASK_F32, with_scratch};
use crate::ops::{AttnDims, KvCacheLayer};
use crate::{DType, Error, Float, HostStorage, HostTensor, Result};

/// Positions scored before the accumulator is rescaled.
const POS_BLOCK: usize = 32;

/// Runs `$body` with `$T` bound to the Rust type of the cache dtype `$dtype` (f32, bf16, f16).
macro_rules! with_cache_type {
    ($op:expr, $name:expr, $dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::BF16 => {
                type $T = bf16;
                $body
            }
            DType::F16 => {
                type $T = f16;
                $body
            }
            other => Err(Error::DType {
                op: $op,
                tensor: $name,
                got: other,
                allowed: vec![DType::F32, DType::BF16, DType::F16],
            }),
        }
    };
}

/// Every row's slot and position must lie inside the cache.
fn check_rows(op: &'static str, d: AttnDims, slots: &[u32], positions: &[u32]) -> Result<()> {
    for (row, (&slot, &pos)) in slots.iter().zip(positions).enumerate() {
        if slot as usize >= d.slots {
            return Err(Error::SlotOutOfRange { op, row, slot, slots: d.slots });
        }
        if pos as usize >= d.capacity {
            return Err(Error::ContextOverflow { op, row, pos, capacity: d.capacity });
        }
    }
    Ok(())
}

/// Offset of `cache[slot, pos, kv_head, 0]`.
#[inline(always)]
fn cache_at(d: AttnDims, slot: usize, pos: usize, kv_head: usize) -> usize {
    ((slot * d.capacity + pos) * d.kv_heads + kv_head) * d.head_dim
}

pub(crate) fn kv_store(
    d: AttnDims,
    k: &HostTensor,
    v: &HostTensor,
    cache: &mut KvCacheLayer<HostStorage>,
    slots: &HostTensor,
    positions: &HostTensor,
) -> Result<()> {
    let op = "kv_store";
    let slots = slots.as_slice::<u32>();
    let positions = positions.as_slice::<u32>();
    check_rows(op, d, slots, positions)?;
    let (k, v) = (k.as_slice::<f32>(), v.as_slice::<f32>());
    let (kd, vd) = (cache.k.dtype(), cache.v.dtype());
    with_cache_type!(op, "k_cache", kd, K => {
        store(d, k, cache.k.as_mut_slice::<K>(op, "k_cache")?, slots, positions);
        Ok(())
    })?;
    with_cache_type!(op, "v_cache", vd, C => {
        store(d, v, cache.v.as_mut_slice::<C>(op, "v_cache")?, slots, positions);
        Ok(())
    })
}

/// Rows in order (a later row overwrites an earlier one at the same place); the slots and
/// positions are checked.
fn store<C: Float>(d: AttnDims, src: &[f32], cache: &mut [C], slots: &[u32], positions: &[u32]) {
    let width = d.kv_heads * d.head_dim;
    for (r, src) in src.chunks_exact(width).enumerate() {
        let at = cache_at(d, slots[r] as usize, positions[r] as usize, 0);
        for (c, &s) in cache[at..at + width].iter_mut().zip(src) {
            *c = C::from_f32(s);
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    fast: &Fast,
    d: AttnDims,
    q: &HostTensor,
    cache: &KvCacheLayer<HostStorage>,
    slots: &HostTensor,
    positions: &HostTensor,
    scale: f32,
    out: &mut HostTensor,
) -> Result<()> {
    let op = "attention";
    let slots = slots.as_slice::<u32>();
    let positions = positions.as_slice::<u32>();
    check_rows(op, d, slots, positions)?;
    let q = q.as_slice::<f32>();
    let out = out.as_mut_slice::<f32>(op, "out")?;
    with_cache_type!(op, "k_cache", cache.k.dtype(), K => {
        with_cache_type!(op, "v_cache", cache.v.dtype(), C => {
            let job = Job {
                d,
                q,
                k: cache.k.as_slice::<K>(),
                v: cache.v.as_slice::<C>(),
                slots,
                positions,
                scale,
            };
            attend_all(fast, job, out);
            Ok(())
        })
    })
}

/// The shared inputs of one attention call.
struct Job<'a, K, C> {
    d: AttnDims,
    q: &'a [f32],
    k: &'a [K],
    v: &'a [C],
    slots: &'a [u32],
    positions: &'a [u32],
    scale: f32,
}

impl<K, C> Clone for Job<'_, K, C> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<K, C> Copy for Job<'_, K, C> {}

fn attend_all<K: Elem, C: Elem>(fast: &Fast, job: Job<'_, K, C>, out: &mut [f32]) {
    let d = job.d;
    let group = d.heads / d.kv_heads;
    // Work: every query head reads its row's cached positions.
    let work = job.positions.iter().map(|&p| p as usize + 1).sum::<usize>() * d.heads * d.head_dim;
    let simd = fast.simd;
    fast.for_each_chunk(out, group * d.head_dim, work, |t, out| {
        with_scratch(&TASK_F32, group * (POS_BLOCK + 2), 0.0, |scratch| {
            simd.run(Group { job, task: t, out, scratch });
        });
    });
}

/// One (row, kv head) task: the query heads of the group, their output rows and scratch.
struct Group<'a, 'b, K, C> {
    job: Job<'a, K, C>,
    task: usize,
    out: &'b mut [f32],
    /// `group * POS_BLOCK` scores, then `group` running maxima and `group` denominators.
    scratch: &'b mut [f32],
}

impl<K: Elem, C: Elem> Kernel for Group<'_, '_, K, C> {
    type Output = ();

    #[inline(always)]
    fn run<V: Vector>(self, v: V) {
        let Group { job, task, out, scratch } = self;
        let d = job.d;
        let hd = d.head_dim;
        let group = d.heads / d.kv_heads;
        let (row, kv_head) = (task / d.kv_heads, task % d.kv_heads);
        let slot = job.slots[row] as usize;
        let len = job.positions[row] as usize + 1;
        let q = &job.q[(row * d.heads + kv_head * group) * hd..][..group * hd];
        let (scores, stats) = scratch.split_at_mut(group * POS_BLOCK);
        let (maxes, denoms) = stats.split_at_mut(group);
        maxes.fill(f32::NEG_INFINITY);
        denoms.fill(0.0);
        out.fill(0.0);

        let mut p0 = 0;
        while p0 < len {
            let p1 = len.min(p0 + POS_BLOCK);
            // Scores of the block.
            for p in p0..p1 {
                let at = cache_at(d, slot, p, kv_head);
                let key = &job.k[at..at + hd];
                for h in 0..group {
                    scores[h * POS_BLOCK + p - p0] = job.scale * dot(v, &q[h * hd..(h + 1) * hd], key);
                }
            }
            // Online softmax: rescale what was summed under the old maximum.
            for h in 0..group {
                let s = &mut scores[h * POS_BLOCK..h * POS_BLOCK + p1 - p0];
                let block_max = s.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let new_max = maxes[h].max(block_max);
                if new_max > maxes[h] {
                    let c = (maxes[h] - new_max).exp();
                    denoms[h] *= c;
                    scale_in_place(v, &mut out[h * hd..(h + 1) * hd], c);
                    maxes[h] = new_max;
                }
                for e in s.iter_mut() {
                    *e = (*e - new_max).exp();
                    denoms[h] += *e;
                }
            }
            // Weighted values.
            for p in p0..p1 {
                let at = cache_at(d, slot, p, kv_head);
                let value = &job.v[at..at + hd];
                for h in 0..group {
                    axpy(v, &mut out[h * hd..(h + 1) * hd], scores[h * POS_BLOCK + p - p0], value);
                }
            }
            p0 = p1;
        }
        for h in 0..group {
            scale_in_place(v, &mut out[h * hd..(h + 1) * hd], 1.0 / denoms[h]);
        }
    }
}

/// `a . b`, f32 accumulation (b widened; cache types have `POST == 1`).
#[inline(always)]
pub(crate) fn dot<V: Vector, T: Elem>(v: V, a: &[f32], b: &[T]) -> f32 {
    debug_assert!(T::POST == 1.0 && a.len() == b.len());
    let len = a.len().min(b.len());
    let (mut acc0, mut acc1) = (v.zero(), v.zero());
    let mut l = 0;
    while l + 2 * V::LANES <= len {
        // SAFETY: l + 2 * LANES <= len, the length of both slices.
        unsafe {
            acc0 = v.fma(v.load(a.as_ptr().add(l)), v.load_elem(b.as_ptr().add(l)), acc0);
            let m = l + V::LANES;
            acc1 = v.fma(v.load(a.as_ptr().add(m)), v.load_elem(b.as_ptr().add(m)), acc1);
        }
        l += 2 * V::LANES;
    }
    if l + V::LANES <= len {
        // SAFETY: l + LANES <= len.
        unsafe { acc0 = v.fma(v.load(a.as_ptr().add(l)), v.load_elem(b.as_ptr().add(l)), acc0) };
        l += V::LANES;
    }
    let mut s = v.hsum(v.add(acc0, acc1));
    for (x, y) in a[l..len].iter().zip(&b[l..len]) {
        s += x * y.widen();
    }
    s
}

/// `y += a * x` (x widened; cache types have `POST == 1`).
#[inline(always)]
pub(crate) fn axpy<V: Vector, T: Elem>(v: V, y: &mut [f32], a: f32, x: &[T]) {
    debug_assert!(T::POST == 1.0 && y.len() == x.len());
    let len = y.len().min(x.len());
    let av = v.splat(a);
    let mut l = 0;
    while l + V::LANES <= len {
        // SAFETY: l + LANES <= len, the length of both slices.
        unsafe {
            let p = y.as_mut_ptr().add(l);
            v.store(p, v.fma(av, v.load_elem(x.as_ptr().add(l)), v.load(p)));
        }
        l += V::LANES;
    }
    for (y, x) in y[l..len].iter_mut().zip(&x[l..len]) {
        *y += a * x.widen();
    }
}

/// `y *= c`.
#[inline(always)]
fn scale_in_place<V: Vector>(v: V, y: &mut [f32], c: f32) {
    let cv = v.splat(c);
    let mut l = 0;
    while l + V::LANES <= y.len() {
        // SAFETY: l + LANES <= y.len().
        unsafe {
            let p = y.as_mut_ptr().add(l);
            v.store(p, v.mul(cv, v.load(p)));
        }
        l += V::LANES;
    }
    for y in &mut y[l..] {
        *y *= c;
    }
}
