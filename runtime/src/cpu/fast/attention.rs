//! The KV cache store and causal grouped-query attention.
//!
//! Contract (`ops::check_kv_store`, `ops::check_attention`): the cache layer's `k` and `v` are
//! `[num_blocks, block_size, kv_heads, head_dim]`, each f32, bf16 or f16 (independently), paged
//! through the block table `[slots, max_blocks]` (position p of slot s is row `p % block_size` of
//! block `table[s][p / block_size]`). `kv_store` writes `k, v [rows, kv_heads, head_dim]` (f32,
//! rounded to the cache type) at position `positions[r]` of slot `slots[r]`, rows in order.
//! `attention` gives each query row `r` and head `h` `softmax(scale * q . K^T) V` over the
//! positions `0..=positions[r]` of its slot, reading kv head `h / (heads / kv_heads)`. Both check
//! every row's slot (`SlotOutOfRange`), position (`ContextOverflow`) and the table entries it
//! reads (`BlockOutOfRange`) before writing anything.
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

/// Offset of `(slot, pos, kv_head, 0)` through the block table.
#[inline(always)]
fn cache_at(d: AttnDims, table: &[u32], slot: usize, pos: usize, kv_head: usize) -> usize {
    crate::cpu::paged_offset(d, table, slot, pos, kv_head)
}

pub(crate) fn kv_store(
    d: AttnDims,
    k: &HostTensor,
    v: &HostTensor,
    cache: &mut KvCacheLayer<HostStorage>,
    table: &HostTensor,
    slots: &HostTensor,
    positions: &HostTensor,
) -> Result<()> {
    let op = "kv_store";
    let table = table.as_slice::<u32>();
    let slots = slots.as_slice::<u32>();
    let positions = positions.as_slice::<u32>();
    crate::cpu::check_cache_rows(op, d, table, slots, positions, false)?;
    let (k, v) = (k.as_slice::<f32>(), v.as_slice::<f32>());
    let (kd, vd) = (cache.k.dtype(), cache.v.dtype());
    // Both caches are borrowed writable before either is written.
    let KvCacheLayer { k: k_cache, v: v_cache } = cache;
    with_cache_type!(op, "k_cache", kd, K => {
        let k_cache = k_cache.as_mut_slice::<K>(op, "k_cache")?;
        with_cache_type!(op, "v_cache", vd, C => {
            let v_cache = v_cache.as_mut_slice::<C>(op, "v_cache")?;
            store(d, k, k_cache, table, slots, positions);
            store(d, v, v_cache, table, slots, positions);
            Ok(())
        })
    })
}

/// Rows in order (a later row overwrites an earlier one at the same place); the slots, positions
/// and table entries are checked.
fn store<C: Float>(
    d: AttnDims,
    src: &[f32],
    cache: &mut [C],
    table: &[u32],
    slots: &[u32],
    positions: &[u32],
) {
    let width = d.kv_heads * d.head_dim;
    for (r, src) in src.chunks_exact(width).enumerate() {
        let at = cache_at(d, table, slots[r] as usize, positions[r] as usize, 0);
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
    table: &HostTensor,
    slots: &HostTensor,
    positions: &HostTensor,
    scale: f32,
    out: &mut HostTensor,
) -> Result<()> {
    let op = "attention";
    let table = table.as_slice::<u32>();
    let slots = slots.as_slice::<u32>();
    let positions = positions.as_slice::<u32>();
    crate::cpu::check_cache_rows(op, d, table, slots, positions, true)?;
    let q = q.as_slice::<f32>();
    let out = out.as_mut_slice::<f32>(op, "out")?;
    with_cache_type!(op, "k_cache", cache.k.dtype(), K => {
        with_cache_type!(op, "v_cache", cache.v.dtype(), C => {
            let job = Job {
                d,
                q,
                k: cache.k.as_slice::<K>(),
                v: cache.v.as_slice::<C>(),
                table,
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
    table: &'a [u32],
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
                let at = cache_at(d, job.table, slot, p, kv_head);
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
                let at = cache_at(d, job.table, slot, p, kv_head);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Backend;
    use crate::cpu::Reference;
    use crate::cpu::fast::testutil::{Rng, assert_close, backends};

    const EPS32: f64 = 1.0 / (1u64 << 24) as f64;

    /// Caches filled through both backends' kv_store agree byte for byte; attention agrees with
    /// the reference within the f32 bound derived below.
    #[allow(clippy::too_many_arguments)]
    fn check(
        fast: &Fast,
        kt: DType,
        vt: DType,
        heads: usize,
        kv_heads: usize,
        hd: usize,
        positions: &[u32],
        slots_of: &[u32],
        scale: f32,
    ) {
        let r = Reference;
        // Paged: blocks of 16 positions (POS_BLOCK straddles them), the 15 blocks of the 3 slots
        // in a scrambled order (slot s, block j -> (7 (5 s + j) + 3) mod 15).
        let (n_slots, capacity, bs) = (3, 80, 16);
        let max_blocks = capacity / bs;
        let n_blocks = n_slots * max_blocks;
        let table_v: Vec<u32> = (0..n_blocks).map(|i| ((7 * i + 3) % n_blocks) as u32).collect();
        let table = fast.upload_u32(&[n_slots, max_blocks], &table_v).unwrap();
        let row_of = |slot: usize, t: usize| table_v[slot * max_blocks + t / bs] as usize * bs + t % bs;
        let rows = positions.len();
        let mut rng = Rng::new(hd as u64 + heads as u64 * 31);
        let mk = |b: &dyn Fn(DType) -> HostTensor| KvCacheLayer { k: b(kt), v: b(vt) };
        let mut cache = mk(&|t| fast.alloc(t, &[n_blocks, bs, kv_heads, hd]).unwrap());
        let mut cache_ref = mk(&|t| r.alloc(t, &[n_blocks, bs, kv_heads, hd]).unwrap());
        // Fill every position of every slot, in several kv_store calls.
        for slot in 0..n_slots as u32 {
            for chunk in (0..capacity as u32).collect::<Vec<_>>().chunks(37) {
                let n = chunk.len();
                let k = fast.upload_f32(DType::F32, &[n, kv_heads, hd], &rng.vec(n * kv_heads * hd)).unwrap();
                let v = fast.upload_f32(DType::F32, &[n, kv_heads, hd], &rng.vec(n * kv_heads * hd)).unwrap();
                let s = fast.upload_u32(&[n], &vec![slot; n]).unwrap();
                let p = fast.upload_u32(&[n], chunk).unwrap();
                fast.kv_store(&k, &v, &mut cache, &table, &s, &p).unwrap();
                r.kv_store(&k, &v, &mut cache_ref, &table, &s, &p).unwrap();
            }
        }
        assert_eq!(fast.read(&cache.k).unwrap(), r.read(&cache_ref.k).unwrap());
        assert_eq!(fast.read(&cache.v).unwrap(), r.read(&cache_ref.v).unwrap());

        let qv = rng.vec(rows * heads * hd);
        let q = fast.upload_f32(DType::F32, &[rows, heads, hd], &qv).unwrap();
        let slots = fast.upload_u32(&[rows], slots_of).unwrap();
        let pos = fast.upload_u32(&[rows], positions).unwrap();
        let mut out = fast.alloc(DType::F32, &[rows, heads, hd]).unwrap();
        let mut out_ref = r.alloc(DType::F32, &[rows, heads, hd]).unwrap();
        fast.attention(&q, &cache, &table, &slots, &pos, scale, &mut out).unwrap();
        r.attention(&q, &cache, &table, &slots, &pos, scale, &mut out_ref).unwrap();
        let want: Vec<f64> = r.read_f32(&out_ref).unwrap().iter().map(|&v| v as f64).collect();

        // Bound: each score is an f32 dot of hd terms times the scale, error
        // ds <= (hd + 2) eps scale sum|q k|; exp(s - max) then carries a relative error of at most
        // 2 ds + 4 eps, and summing T weighted values and the normaliser adds (T + 4) eps relative
        // to sum p |v|. So tol = (4 max ds + (T + hd + 16) eps) sum_t p_t |v_t|, from the inputs.
        let kc = r.read_f32(&cache_ref.k).unwrap();
        let vc = r.read_f32(&cache_ref.v).unwrap();
        let group = heads / kv_heads;
        let mut tol = vec![0.0; want.len()];
        for row in 0..rows {
            let (slot, t_len) = (slots_of[row] as usize, positions[row] as usize + 1);
            for h in 0..heads {
                let g = h / group;
                let at = |t: usize| (row_of(slot, t) * kv_heads + g) * hd;
                let qh = &qv[(row * heads + h) * hd..][..hd];
                let scores: Vec<f64> = (0..t_len)
                    .map(|t| scale as f64 * (0..hd).map(|e| qh[e] as f64 * kc[at(t) + e] as f64).sum::<f64>())
                    .collect();
                let ds = (0..t_len)
                    .map(|t| {
                        (hd as f64 + 2.0)
                            * EPS32
                            * scale as f64
                            * (0..hd).map(|e| (qh[e] * kc[at(t) + e]).abs() as f64).sum::<f64>()
                    })
                    .fold(0.0, f64::max);
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let total: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                for e in 0..hd {
                    let mag: f64 = (0..t_len)
                        .map(|t| (scores[t] - max).exp() / total * (vc[at(t) + e] as f64).abs())
                        .sum();
                    tol[(row * heads + h) * hd + e] =
                        (4.0 * ds + (t_len + hd + 16) as f64 * EPS32) * mag + 1e-30;
                }
            }
        }
        let what = format!("attention {} k={kt} v={vt} heads {heads}/{kv_heads} hd {hd}", fast.simd());
        assert_close(&what, &fast.read_f32(&out).unwrap(), &want, &tol);
    }

    #[test]
    fn attention_matches_reference() {
        for fast in backends() {
            for kt in [DType::F32, DType::BF16, DType::F16] {
                for vt in [DType::F32, DType::BF16, DType::F16] {
                    check(&fast, kt, vt, 4, 2, 17, &[0, 31, 32, 79], &[0, 1, 2, 1], 0.25);
                }
            }
            for (heads, kv_heads, hd) in [(1, 1, 1), (3, 1, 3), (8, 8, 16), (6, 2, 64), (2, 1, 130)] {
                check(
                    &fast,
                    DType::BF16,
                    DType::BF16,
                    heads,
                    kv_heads,
                    hd,
                    &[5, 0, 64, 33, 79],
                    &[2, 0, 0, 1, 2],
                    0.125,
                );
            }
            // A peaked softmax.
            check(&fast, DType::F32, DType::F16, 2, 1, 8, &[79, 40], &[0, 2], 30.0);
        }
    }

    #[test]
    fn range_errors_write_nothing() {
        let fast = Fast::with_threads(2).unwrap();
        let (slots, capacity, kvh, hd) = (2, 4, 1, 8);
        let mut cache = KvCacheLayer {
            k: fast.alloc(DType::BF16, &[slots, capacity, kvh, hd]).unwrap(),
            v: fast.alloc(DType::F32, &[slots, capacity, kvh, hd]).unwrap(),
        };
        let k = fast.upload_f32(DType::F32, &[2, kvh, hd], &[0.5; 16]).unwrap();
        let slot_err = |op| Error::SlotOutOfRange { op, row: 1, slot: 2, slots };
        let pos_err = |op| Error::ContextOverflow { op, row: 0, pos: 4, capacity };
        let block_err = |op| Error::BlockOutOfRange { op, row: 1, block: 2, blocks: slots };
        // Slot 0 in block 1 (blocks of `capacity` positions), slot 1 in block 2: no such block.
        let contiguous = fast.upload_u32(&[slots, 1], &[0, 1]).unwrap();
        let bad = fast.upload_u32(&[slots, 1], &[1, 2]).unwrap();
        let cases = [
            ([0, 2], [0, 0], &contiguous, slot_err("kv_store"), slot_err("attention")),
            ([1, 0], [4, 0], &contiguous, pos_err("kv_store"), pos_err("attention")),
            ([0, 1], [3, 0], &bad, block_err("kv_store"), block_err("attention")),
        ];
        for (s, p, table, store_err, attn_err) in cases {
            let (s, p) = (fast.upload_u32(&[2], &s).unwrap(), fast.upload_u32(&[2], &p).unwrap());
            assert_eq!(fast.kv_store(&k, &k, &mut cache, table, &s, &p).unwrap_err(), store_err);
            assert!(fast.read(&cache.k).unwrap().iter().all(|&b| b == 0));
            assert!(fast.read(&cache.v).unwrap().iter().all(|&b| b == 0));
            let q = fast.upload_f32(DType::F32, &[2, 1, hd], &[0.5; 16]).unwrap();
            let mut out = fast.upload_f32(DType::F32, &[2, 1, hd], &[7.0; 16]).unwrap();
            assert_eq!(fast.attention(&q, &cache, table, &s, &p, 1.0, &mut out).unwrap_err(), attn_err);
            assert!(fast.read_f32(&out).unwrap().iter().all(|&v| v == 7.0));
        }
    }
}
