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
//! Algorithm: a task is a span of one tile's positions, for all its heads. A tile is a run of up
//! to `TILE_ROWS` consecutive rows of one slot (a prefill chunk; in decode, each row is its own
//! tile): each cached position is one contiguous run of `kv_heads * head_dim` keys (and values),
//! read once for every query head of every row of the tile, so the cache streams in order and a
//! chunk of R rows reads it about R / `TILE_ROWS` times; each row's scores past its own position
//! are masked and its values summed over its own positions only. A tile's positions are split
//! into several spans where the tiles alone would leave threads idle (decode at batch 1:
//! flash-decoding's split along the sequence); each span keeps its running max, denominator and
//! unnormalised output per head, and a merge per tile rescales them to the common max. Positions
//! go in blocks of `POS_BLOCK`: the block's scores are computed (several positions per pass over
//! q, each dot one FMA chain, their lane sums reduced four at a time), with the keys and values
//! of later positions prefetched, then the running max, the softmax denominator and the output
//! accumulator are rescaled once per block (online softmax in f32), and the block's values are
//! added with vector FMAs.
//!
//! A prefill tile (more than one row) whose query heads of a KV head fill at least a vector runs
//! [`Wide`] instead, with those heads in the vector lanes: no lane sums, no scalar score stores,
//! the softmax on whole vectors (see its doc). Measured (Intel Xeon VM, AVX-512, one thread, bf16
//! cache, 64 rows of one slot at positions 8128-8191 in tiles of 8, 32 / 8 heads, alternated runs,
//! best of 7): heads of 128 95-97 GFLOP/s against 41 before, heads of 64 86-87 against 26.5; on
//! the same host's AVX2 kernels 52-53 against 39 and 46-48 against 31; two threads, heads of 128:
//! 135-181 against 94-99 (three rounds; this host's noise). Tiles of 16: see [`TILE_ROWS`].
//! Its scratch starting on a cache line (`SCRATCH_ALIGN`; the transposed rows are whole
//! vectors, so no load then straddles two lines): heads of 128 109-111 GFLOP/s against 97-102,
//! heads of 64 91-100 against 71-93 (same loop, three alternated rounds).
//!
//! Measured before [`Wide`] (AMD EPYC Zen 3, AVX2, 2 threads, the decode bench's model at an 8K
//! context): a 64-token prefill chunk took 1.7-2.3 s with tiles and 1.8-2.7 s without
//! (alternated runs), so no gain there: the chunk's attention is bound by arithmetic (about 50
//! GFLOP in about 1.2 s), not by the cache reads the tiles save.
//!
//! Decode is bound in the core first on that host too: one thread read about 9.5 GB/s of bf16
//! cache with the cache in L2 or L3, and only 1.3-1.8x less from memory; with 4 query heads per KV
//! head each bf16 element takes 4 FMAs, so the read peak would need about 95% of the FMA rate
//! (README, CPU decode attention).

use std::ops::Range;

use half::{bf16, f16};

use super::simd::{Elem, Kernel, Simd, Vector};
use super::{Fast, SPANS_F32, TASK_F32, WIDE_F32, with_scratch};
use crate::ops::{AttnDims, KvCacheLayer};
use crate::{DType, Error, Float, HostStorage, HostTensor, Result};

/// Positions scored before the accumulator is rescaled.
const POS_BLOCK: usize = 32;
/// Vectors of each head's output a value pass holds in registers: with 4 heads, 8 accumulators,
/// 2 values and a weight, which fit in AVX2's 16 registers too.
const ACC_VECTORS: usize = 2;
/// Fewest positions a span covers when a row is split: below it the merge and the spans' own
/// setup cost more than another thread gives.
const MIN_SPAN: usize = 256;
/// Tasks per worker thread that splitting rows aims for.
const TASKS_PER_THREAD: usize = 4;

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
    attention_spans(fast, d, q, cache, table, slots, positions, scale, out, MIN_SPAN)
}

/// [`attention`] with rows split into spans of at least `min_span` positions (the tests make
/// short rows split).
#[allow(clippy::too_many_arguments)]
fn attention_spans(
    fast: &Fast,
    d: AttnDims,
    q: &HostTensor,
    cache: &KvCacheLayer<HostStorage>,
    table: &HostTensor,
    slots: &HostTensor,
    positions: &HostTensor,
    scale: f32,
    out: &mut HostTensor,
    min_span: usize,
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
            attend_all(fast, job, out, min_span);
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

/// Spans per row: one where the rows give every thread work, else enough for
/// `TASKS_PER_THREAD` tasks per thread, each of at least `min_span` of the longest row's
/// positions.
fn spans_per_row(rows: usize, longest: usize, threads: usize, min_span: usize) -> usize {
    if threads <= 1 {
        return 1;
    }
    let want = (threads * TASKS_PER_THREAD).div_ceil(rows.max(1));
    want.min(longest.div_ceil(min_span.max(1))).max(1)
}

/// Most rows of one slot in a tile. Consecutive rows of one slot (a prefill chunk) share each
/// cached position's reads: a chunk of R rows reads the cache about R / `TILE_ROWS` times
/// rather than R. Each row still attends to its own positions only. With [`Wide`], 16 rows
/// rather than 8 measured 98-101 GFLOP/s against 86-96 (Intel Xeon VM, AVX-512, one thread, heads
/// of 128, alternated runs; 91-92 against 85-87 with heads of 64, AVX2 57-58 against 53-55): each
/// key and value element, widened once per tile, feeds twice the FMAs. 32 rows measured alike or
/// worse (88-95 against 99-100, two rounds on a busy host, before the scratch was aligned; each
/// KV head's transposed queries and accumulator, 64 KB each at heads of 128, then leave L1); so
/// did asking for the next KV head's keys and values while the current one is scored, with or
/// without the positions 4 ahead.
const TILE_ROWS: usize = 16;

/// The tiles of a call: runs of consecutive rows of one slot, at most `TILE_ROWS` each.
fn tiles(slots: &[u32]) -> Vec<Range<usize>> {
    let mut tiles = Vec::new();
    let mut r0 = 0;
    for r in 1..=slots.len() {
        if r == slots.len() || slots[r] != slots[r0] || r - r0 == TILE_ROWS {
            tiles.push(r0..r);
            r0 = r;
        }
    }
    tiles
}

/// A tile of `n` rows runs `n * heads` query heads, ordered kv head first: `(g n + r) group + j`
/// is row r's head `g group + j`, so each kv head's query heads, of every row, lie together.
/// Returns (row in the tile, head) of tile head `th`.
#[inline]
fn tile_head(th: usize, n: usize, group: usize) -> (usize, usize) {
    let (s, j) = (th / group, th % group);
    (s % n, (s / n) * group + j)
}

/// The tile's queries in tile-head order (`q`: `[tile.len() * heads, hd]`).
fn gather_q<K, C>(job: Job<'_, K, C>, tile: Range<usize>, q: &mut [f32]) {
    let (heads, hd) = (job.d.heads, job.d.head_dim);
    let (n, group) = (tile.len(), heads / job.d.kv_heads);
    for (th, dst) in q.chunks_exact_mut(hd).enumerate() {
        let (r, h) = tile_head(th, n, group);
        dst.copy_from_slice(&job.q[((tile.start + r) * heads + h) * hd..][..hd]);
    }
}

fn attend_all<K: Elem, C: Elem>(fast: &Fast, job: Job<'_, K, C>, out: &mut [f32], min_span: usize) {
    let d = job.d;
    let (heads, hd) = (d.heads, d.head_dim);
    let group = heads / d.kv_heads;
    let rows = job.positions.len();
    let len_of = |row: usize| job.positions[row] as usize + 1;
    let tiles = tiles(job.slots);
    // A tile reads the cache up to its longest row.
    let reach = |t: &Range<usize>| t.clone().map(len_of).max().unwrap_or(0);
    let longest = tiles.iter().map(reach).max().unwrap_or(0);
    let widest = tiles.iter().map(|t| t.len()).max().unwrap_or(1);
    // Work: every query head reads its row's cached positions.
    let work = (0..rows).map(len_of).sum::<usize>() * heads * hd;
    let spans = spans_per_row(tiles.len(), longest, fast.threads, min_span);
    let simd = fast.simd;
    // Scores scratch of a tile of `th` query heads: `Wide`'s is its own.
    let scores_len = |t: &Range<usize>, th: usize| {
        if is_wide(t.len(), group, simd.lanes()) { 0 } else { th * POS_BLOCK }
    };
    // Each tile's rows of `out`.
    let mut outs: Vec<&mut [f32]> = Vec::with_capacity(tiles.len());
    let mut rest = out;
    for t in &tiles {
        let (this, after) = std::mem::take(&mut rest).split_at_mut(t.len() * heads * hd);
        outs.push(this);
        rest = after;
    }
    if spans == 1 {
        // Each task owns its tile's rows of the output: the accumulator, normalised at the end.
        fast.for_each_chunk(&mut outs, 1, work, |t, out| {
            let tile = tiles[t].clone();
            let th = tile.len() * heads;
            let sl = scores_len(&tile, th);
            with_scratch(&TASK_F32, th * (2 * hd + 2) + sl, 0.0, |scratch| {
                let (q, rest) = scratch.split_at_mut(th * hd);
                let (acc, rest) = rest.split_at_mut(th * hd);
                let (scores, stats) = rest.split_at_mut(sl);
                let (maxes, denoms) = stats.split_at_mut(th);
                gather_q(job, tile.clone(), q);
                let p1 = reach(&tile);
                run_span(simd, Span { job, tile, q, p0: 0, p1, acc: &mut *acc, maxes, denoms, scores });
                for (i, (a, &den)) in acc.chunks_exact(hd).zip(&*denoms).enumerate() {
                    let (r, h) = tile_head(i, th / heads, group);
                    let inv = 1.0 / den;
                    for (o, &a) in out[0][(r * heads + h) * hd..][..hd].iter_mut().zip(a) {
                        *o = a * inv;
                    }
                }
            });
        });
        return;
    }
    // Each span's accumulator, maxima and denominators: `th * hd + 2 * th` for a tile of `th`
    // query heads, in parts sized for the widest tile; the spans of a tile together.
    let part = widest * heads * (hd + 2);
    with_scratch(&SPANS_F32, tiles.len() * spans * part, 0.0, |parts| {
        fast.for_each_chunk(parts, part, work, |i, part| {
            let (tile, span) = (tiles[i / spans].clone(), i % spans);
            let th = tile.len() * heads;
            let len = reach(&tile);
            let per = len.div_ceil(spans);
            let (p0, p1) = ((span * per).min(len), ((span + 1) * per).min(len));
            let (acc, stats) = part.split_at_mut(th * hd);
            let (maxes, rest) = stats.split_at_mut(th);
            let denoms = &mut rest[..th];
            with_scratch(&TASK_F32, th * hd + scores_len(&tile, th), 0.0, |scratch| {
                let (q, scores) = scratch.split_at_mut(th * hd);
                gather_q(job, tile.clone(), q);
                run_span(simd, Span { job, tile, q, p0, p1, acc, maxes, denoms, scores });
            });
        });
        let parts: &[f32] = parts;
        fast.for_each_chunk(&mut outs, 1, tiles.len() * spans * part, |t, out| {
            let parts = &parts[t * spans * part..][..spans * part];
            merge(parts, part, tiles[t].len(), d, out[0]);
        });
    });
}

/// A tile's output (`out`, its rows) from its spans' partial results (`parts`: per span, in
/// `part` floats each, the unnormalised accumulator `[th, hd]`, then `th` maxima and `th`
/// denominators, for the tile's `th = n * heads` query heads): each span is weighed by
/// `exp(its max - the head's max)`. An empty span (max -inf, nothing summed) weighs 0.
fn merge(parts: &[f32], part: usize, n: usize, d: AttnDims, out: &mut [f32]) {
    let (heads, hd) = (d.heads, d.head_dim);
    let th = n * heads;
    for i in 0..th {
        let (r, h) = tile_head(i, n, heads / d.kv_heads);
        let o = &mut out[(r * heads + h) * hd..][..hd];
        let max_of = |p: &[f32]| p[th * hd + i];
        let m = parts.chunks_exact(part).map(max_of).fold(f32::NEG_INFINITY, f32::max);
        o.fill(0.0);
        let mut den = 0.0;
        for p in parts.chunks_exact(part) {
            if max_of(p) == f32::NEG_INFINITY {
                continue;
            }
            let w = (max_of(p) - m).exp();
            den += w * p[th * hd + th + i];
            for (e, &a) in o.iter_mut().zip(&p[i * hd..(i + 1) * hd]) {
                *e += w * a;
            }
        }
        let inv = 1.0 / den;
        o.iter_mut().for_each(|e| *e *= inv);
    }
}

/// Positions `p0..p1` of one tile, every query head of each row (in tile-head order, see
/// [`tile_head`]), each row's only up to its own position: the unnormalised output, the running
/// maxima and the denominators (`maxes` -inf and `denoms` 0 for a head with no position in the
/// span), with `scores` as scratch.
struct Span<'a, 'b, K, C> {
    job: Job<'a, K, C>,
    /// Rows of one slot.
    tile: Range<usize>,
    /// `[th, hd]`, for the tile's `th = tile.len() * heads` query heads.
    q: &'b [f32],
    p0: usize,
    p1: usize,
    /// `[th, hd]`.
    acc: &'b mut [f32],
    maxes: &'b mut [f32],
    denoms: &'b mut [f32],
    /// `th * POS_BLOCK`; empty where the tile takes [`Wide`], which has its own.
    scores: &'b mut [f32],
}

impl<K: Elem, C: Elem> Kernel for Span<'_, '_, K, C> {
    type Output = ();

    #[inline(always)]
    fn run<V: Vector>(self, v: V) {
        let Span { job, tile, q, p0, p1, acc, maxes, denoms, scores } = self;
        let d = job.d;
        let (heads, hd) = (d.heads, d.head_dim);
        let group = heads / d.kv_heads;
        let width = d.kv_heads * hd;
        let slot = job.slots[tile.start] as usize;
        let n_rows = tile.len();
        // Positions each row attends to: its position + 1.
        let mut limits = [0usize; TILE_ROWS];
        for (l, &p) in limits.iter_mut().zip(&job.positions[tile]) {
            *l = p as usize + 1;
        }
        let limits = &limits[..n_rows];
        maxes.fill(f32::NEG_INFINITY);
        denoms.fill(0.0);
        acc.fill(0.0);

        let mut b0 = p0;
        while b0 < p1 {
            let b1 = p1.min(b0 + POS_BLOCK);
            // Each position's offset in the cache (kv head 0), once per block, and those of the
            // AHEAD positions after it for the prefetch: both passes use them.
            let (n, known) = (b1 - b0, p1.min(b1 + AHEAD) - b0);
            let mut offsets = [0usize; POS_BLOCK + AHEAD];
            for (i, at) in offsets[..known].iter_mut().enumerate() {
                *at = cache_at(d, job.table, slot, b0 + i, 0);
            }
            let ahead = &offsets[..known];
            // Scores of the block: each position's keys, all kv heads, in one run; several
            // positions at a time (as registers allow), each query vector loaded once for them.
            let mut i = 0;
            while i < n {
                let take = if V::LANES >= 16 && i + 4 <= n {
                    4
                } else if i + 2 <= n {
                    2
                } else {
                    1
                };
                for &at in ahead.iter().skip(i + AHEAD).take(take) {
                    prefetch(&job.k[at..at + width]);
                    prefetch(&job.v[at..at + width]);
                }
                let at = &offsets[i..i + take];
                let first = b0 + i;
                match take {
                    4 => score_positions::<V, K, 4>(v, job.k, at, i, first, q, d, limits, job.scale, scores),
                    2 => score_positions::<V, K, 2>(v, job.k, at, i, first, q, d, limits, job.scale, scores),
                    _ => score_positions::<V, K, 1>(v, job.k, at, i, first, q, d, limits, job.scale, scores),
                }
                i += take;
            }
            // Online softmax: rescale what was summed under the old maximum.
            for h in 0..n_rows * heads {
                let s = &mut scores[h * POS_BLOCK..h * POS_BLOCK + n];
                // Positions past the row's own are not its context (nor scored for it).
                let limit = limits[(h / group) % n_rows];
                if limit < b1 {
                    s[limit.saturating_sub(b0)..].fill(f32::NEG_INFINITY);
                }
                // A compare and a select per score (NaN scores are passed over, as by f32::max).
                let block_max = s.iter().fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
                let new_max = maxes[h].max(block_max);
                if new_max == f32::NEG_INFINITY {
                    // No position of this row yet (a span past it): nothing to add.
                    s.fill(0.0);
                    continue;
                }
                if new_max > maxes[h] {
                    let c = (maxes[h] - new_max).exp();
                    denoms[h] *= c;
                    scale_in_place(v, &mut acc[h * hd..(h + 1) * hd], c);
                    maxes[h] = new_max;
                }
                for e in s.iter_mut() {
                    *e = exp_nonpositive(*e - new_max);
                }
                denoms[h] += s.iter().sum::<f32>();
            }
            // Weighted values: per kv head, the block's value rows into each of its query heads'
            // accumulators, which stay in registers across the block; each row's heads over its
            // own positions only.
            let mut rows: [&[C]; POS_BLOCK] = [&[]; POS_BLOCK];
            for g in 0..d.kv_heads {
                for (row, &at) in rows[..n].iter_mut().zip(&offsets) {
                    let at = at + g * hd;
                    *row = &job.v[at..at + hd];
                }
                for (r, &limit) in limits.iter().enumerate() {
                    let m = limit.saturating_sub(b0).min(n);
                    if m == 0 {
                        continue;
                    }
                    // The row's heads of the group in sets of 4, 2 or 1, each value vector widened
                    // once per set.
                    let (mut h, end) = ((g * n_rows + r) * group, (g * n_rows + r + 1) * group);
                    while h < end {
                        let (ys, w) = (&mut acc[h * hd..end * hd], &scores[h * POS_BLOCK..]);
                        h += match end - h {
                            4.. => axpy_rows::<V, C, ACC_VECTORS, 4>(v, ys, hd, w, &rows[..m]),
                            2 | 3 => axpy_rows::<V, C, ACC_VECTORS, 2>(v, ys, hd, w, &rows[..m]),
                            _ => axpy_rows::<V, C, ACC_VECTORS, 1>(v, ys, hd, w, &rows[..m]),
                        };
                    }
                }
            }
            b0 = b1;
        }
    }
}

/// Runs a span on [`Span`]'s kernel, or on [`Wide`]'s where the tile takes it ([`is_wide`]).
fn run_span<K: Elem, C: Elem>(simd: Simd, span: Span<'_, '_, K, C>) {
    let d = span.job.d;
    let (n, group) = (span.tile.len(), d.heads / d.kv_heads);
    if !is_wide(n, group, simd.lanes()) {
        return simd.run(span);
    }
    let hp = (n * group).next_multiple_of(simd.lanes());
    // Transposed queries and accumulators, maxima and denominators per kv head; scores, two
    // rows of per-lane factors, a block of widened keys or values.
    let len = 2 * d.kv_heads * (d.head_dim + 1) * hp + (POS_BLOCK + 2) * hp + POS_BLOCK * d.head_dim;
    with_scratch(&WIDE_F32, len, 0.0, |work| simd.run(Wide { span, work }));
}

/// Whether a tile of `n` rows, `group` query heads per KV head, takes [`Wide`]: a prefill tile
/// (more than one row) whose query heads of a KV head fill at least one vector of `lanes`. Decode
/// rows (tiles of one) keep [`Span`], which is bound by the cache's reads, not by arithmetic.
fn is_wide(n: usize, group: usize, lanes: usize) -> bool {
    n > 1 && n * group >= lanes
}

/// [`Span`] with the query heads of a KV head in vector lanes, for prefill tiles, whose attention
/// is bound by arithmetic: per position block and KV head, the keys are widened to f32 once, each
/// score vector (one position, `LANES` heads) is a chain of FMAs of a broadcast key element with
/// a row of the transposed queries, with no lane sums and no scalar stores; the softmax runs on
/// whole vectors of heads; the values, widened once, go into a transposed accumulator
/// (`[hd, heads]`) the same way. Positions every row of the tile attends take this path; the few
/// past a row's own position (the tile's last rows) are masked per lane and their values summed
/// per lane.
struct Wide<'a, 'b, K, C> {
    span: Span<'a, 'b, K, C>,
    /// Scratch, see [`run_span`] for its length.
    work: &'b mut [f32],
}

impl<K: Elem, C: Elem> Kernel for Wide<'_, '_, K, C> {
    type Output = ();

    #[inline(always)]
    fn run<V: Vector>(self, v: V) {
        let Wide { span, work } = self;
        let Span { job, tile, q, p0, p1, acc, maxes, denoms, scores: _ } = span;
        let d = job.d;
        let (kvh, hd) = (d.kv_heads, d.head_dim);
        let group = d.heads / kvh;
        let slot = job.slots[tile.start] as usize;
        let n_rows = tile.len();
        // Lanes: the tile's query heads of one KV head, in tile-head order (row-major over the
        // tile's rows), padded with zero queries to whole vectors.
        let h = n_rows * group;
        let hp = h.next_multiple_of(V::LANES);
        let mut limits = [0usize; TILE_ROWS];
        for (l, &p) in limits.iter_mut().zip(&job.positions[tile]) {
            *l = p as usize + 1;
        }
        let limits = &limits[..n_rows];
        // Positions before `every` are in every row's context.
        let every = limits.iter().copied().min().unwrap_or(0);

        let (qt, rest) = work.split_at_mut(kvh * hd * hp);
        let (ot, rest) = rest.split_at_mut(kvh * hd * hp);
        let (mx, rest) = rest.split_at_mut(kvh * hp);
        let (dn, rest) = rest.split_at_mut(kvh * hp);
        let (s, rest) = rest.split_at_mut(POS_BLOCK * hp);
        let (base, rest) = rest.split_at_mut(hp);
        let (rescale, rest) = rest.split_at_mut(hp);
        let rows = &mut rest[..POS_BLOCK * hd];
        // qt[g][e][l] = q of tile head g h + l, element e.
        qt.fill(0.0);
        for g in 0..kvh {
            for l in 0..h {
                let src = &q[(g * h + l) * hd..][..hd];
                for (e, &x) in src.iter().enumerate() {
                    qt[(g * hd + e) * hp + l] = x;
                }
            }
        }
        ot.fill(0.0);
        mx.fill(f32::NEG_INFINITY);
        dn.fill(0.0);

        for b0 in (p0..p1).step_by(POS_BLOCK) {
            let b1 = p1.min(b0 + POS_BLOCK);
            let (n, known) = (b1 - b0, p1.min(b1 + AHEAD) - b0);
            let mut offsets = [0usize; POS_BLOCK + AHEAD];
            for (i, at) in offsets[..known].iter_mut().enumerate() {
                *at = cache_at(d, job.table, slot, b0 + i, 0);
            }
            // Positions of the block in every row's context; the rest are past some rows'.
            let full = every.clamp(b0, b1) - b0;
            for g in 0..kvh {
                let (qt, ot) = (&qt[g * hd * hp..][..hd * hp], &mut ot[g * hd * hp..][..hd * hp]);
                let (mx, dn) = (&mut mx[g * hp..][..hp], &mut dn[g * hp..][..hp]);
                for i in 0..n {
                    // This kv head's keys and values of a later position.
                    if let Some(&at) = offsets[..known].get(i + AHEAD) {
                        prefetch(&job.k[at + g * hd..][..hd]);
                        prefetch(&job.v[at + g * hd..][..hd]);
                    }
                    widen_row(v, &job.k[offsets[i] + g * hd..][..hd], &mut rows[i * hd..][..hd]);
                }
                let mut l0 = 0;
                while l0 < hp {
                    l0 += match (hp - l0) / V::LANES {
                        2.. => wide_product::<V, 2, false>(v, rows, qt, s, hd, hp, l0, n, job.scale),
                        _ => wide_product::<V, 1, false>(v, rows, qt, s, hd, hp, l0, n, job.scale),
                    };
                }
                // Scores past a row's own position are not its context.
                for i in full..n {
                    for (l, x) in s[i * hp..][..h].iter_mut().enumerate() {
                        if limits[l / group] <= b0 + i {
                            *x = f32::NEG_INFINITY;
                        }
                    }
                }
                // Online softmax per lane: the block's maximum (NaN scores passed over, as by
                // f32::max), what was summed under the old maximum rescaled, the weights. A lane
                // with no position yet has maximum -inf; subtracting 0 instead gives it weights 0.
                base.copy_from_slice(mx);
                for i in 0..n {
                    for (m, &x) in base.iter_mut().zip(&s[i * hp..][..hp]) {
                        *m = if x > *m { x } else { *m };
                    }
                }
                let mut moved = false;
                for (((b, c), m), den) in
                    base.iter_mut().zip(rescale.iter_mut()).zip(mx.iter_mut()).zip(dn.iter_mut())
                {
                    moved |= *b > *m;
                    let sub = if *b == f32::NEG_INFINITY { 0.0 } else { *b };
                    *c = exp_nonpositive(*m - sub);
                    *den *= *c;
                    (*m, *b) = (*b, sub);
                }
                if moved {
                    for o in ot.chunks_exact_mut(hp) {
                        for (o, &c) in o.iter_mut().zip(&*rescale) {
                            *o *= c;
                        }
                    }
                }
                for i in 0..n {
                    for ((x, &b), den) in s[i * hp..][..hp].iter_mut().zip(&*base).zip(dn.iter_mut()) {
                        *x = exp_nonpositive(*x - b);
                        *den += *x;
                    }
                }
                // Values: the full positions for every lane, the others lane by lane.
                for i in 0..n {
                    widen_row(v, &job.v[offsets[i] + g * hd..][..hd], &mut rows[i * hd..][..hd]);
                }
                let mut l0 = 0;
                while l0 < hp {
                    l0 += match (hp - l0) / V::LANES {
                        2.. => wide_product::<V, 2, true>(v, rows, s, ot, hd, hp, l0, full, 1.0),
                        _ => wide_product::<V, 1, true>(v, rows, s, ot, hd, hp, l0, full, 1.0),
                    };
                }
                for i in full..n {
                    for l in 0..h {
                        if limits[l / group] > b0 + i {
                            let w = s[i * hp + l];
                            for (e, &x) in rows[i * hd..][..hd].iter().enumerate() {
                                ot[e * hp + l] += w * x;
                            }
                        }
                    }
                }
            }
        }
        // Back to tile-head order.
        for g in 0..kvh {
            for l in 0..h {
                let th = g * h + l;
                for (e, a) in acc[th * hd..][..hd].iter_mut().enumerate() {
                    *a = ot[(g * hd + e) * hp + l];
                }
                maxes[th] = mx[g * hp + l];
                denoms[th] = dn[g * hp + l];
            }
        }
    }
}

/// `out = row` widened to f32.
#[inline(always)]
fn widen_row<V: Vector, T: Elem>(v: V, row: &[T], out: &mut [f32]) {
    debug_assert!(T::POST == 1.0);
    assert!(out.len() >= row.len());
    let mut l = 0;
    while l + V::LANES <= row.len() {
        // SAFETY: l + LANES <= row.len() <= out.len().
        unsafe { v.store(out.as_mut_ptr().add(l), v.load_elem(row.as_ptr().add(l))) };
        l += V::LANES;
    }
    for (o, x) in out[l..].iter_mut().zip(&row[l..]) {
        *o = x.widen();
    }
}

/// The two products of [`Wide`], each `out[a hp + l] (+)= sum_k A(a, k) b[k hp + l]` for lanes
/// `l0..l0 + NV LANES`, with `b` read in vectors and each element of `A` (from `rows`, `[n, hd]`,
/// the block's widened keys or values) broadcast:
/// - scores (`VALUES` false): `a` a position (`0..n`), `k` an element (`0..hd`), `A(a, k) =
///   rows[a hd + k]`, `b` the transposed queries (`[hd, hp]`); `out`, the block's scores
///   (`[n, hp]`), is written, times `scale`.
/// - values (`VALUES` true): `a` an element (`0..hd`), `k` a position (`0..n`), `A(a, k) =
///   rows[k hd + a]`, `b` the weights (`[n, hp]`); `out`, the transposed accumulator (`[hd,
///   hp]`), is added to.
///
/// Several `a` at a time, as registers allow. Returns `NV LANES`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn wide_product<V: Vector, const NV: usize, const VALUES: bool>(
    v: V,
    rows: &[f32],
    b: &[f32],
    out: &mut [f32],
    hd: usize,
    hp: usize,
    l0: usize,
    n: usize,
    scale: f32,
) -> usize {
    let (an, kn) = if VALUES { (hd, n) } else { (n, hd) };
    assert!(l0 + NV * V::LANES <= hp && rows.len() >= n * hd && b.len() >= kn * hp && out.len() >= an * hp);
    let mut a = 0;
    while a < an {
        // SAFETY: a + R <= an, with the lengths asserted above.
        a += unsafe {
            match an - a {
                8.. if V::LANES >= 16 => {
                    wide_step::<V, NV, 8, VALUES>(v, rows, b, out, hd, hp, l0, kn, a, scale)
                }
                4.. => wide_step::<V, NV, 4, VALUES>(v, rows, b, out, hd, hp, l0, kn, a, scale),
                2 | 3 => wide_step::<V, NV, 2, VALUES>(v, rows, b, out, hd, hp, l0, kn, a, scale),
                _ => wide_step::<V, NV, 1, VALUES>(v, rows, b, out, hd, hp, l0, kn, a, scale),
            }
        };
    }
    NV * V::LANES
}

/// One step of [`wide_product`]: `a0..a0 + R`, `R NV` accumulators held in registers over the
/// `kn` terms, each vector of `b` loaded once for the `R` rows of `A` and each element of `A`
/// broadcast once for the `NV` vectors. Returns `R`.
///
/// # Safety
/// `a0 + R` is at most `hd` (values) or `n` (scores), and the lengths [`wide_product`] asserts.
#[inline(always)]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
unsafe fn wide_step<V: Vector, const NV: usize, const R: usize, const VALUES: bool>(
    v: V,
    rows: &[f32],
    b: &[f32],
    out: &mut [f32],
    hd: usize,
    hp: usize,
    l0: usize,
    kn: usize,
    a0: usize,
    scale: f32,
) -> usize {
    // SAFETY (every access): the caller's contract.
    unsafe {
        let o = out.as_mut_ptr().add(a0 * hp + l0);
        // A(a0 + j, k) = r[j sa + k sk].
        let (r, sa, sk) =
            if VALUES { (rows.as_ptr().add(a0), 1, hd) } else { (rows.as_ptr().add(a0 * hd), hd, 1) };
        let b = b.as_ptr().add(l0);
        let mut acc = [[v.zero(); NV]; R];
        if VALUES {
            for j in 0..R {
                for c in 0..NV {
                    acc[j][c] = v.load(o.add(j * hp + c * V::LANES));
                }
            }
        }
        for k in 0..kn {
            let mut bv = [v.zero(); NV];
            for c in 0..NV {
                bv[c] = v.load(b.add(k * hp + c * V::LANES));
            }
            for j in 0..R {
                let x = v.splat(*r.add(j * sa + k * sk));
                for c in 0..NV {
                    acc[j][c] = v.fma(x, bv[c], acc[j][c]);
                }
            }
        }
        let sc = v.splat(scale);
        for j in 0..R {
            for c in 0..NV {
                let y = if VALUES { acc[j][c] } else { v.mul(sc, acc[j][c]) };
                v.store(o.add(j * hp + c * V::LANES), y);
            }
        }
    }
    R
}

/// `e^x` for `x <= 0` (a softmax term), within 2 ulps of the exact value, in plain f32 and
/// integer arithmetic with no branch or call, so that a loop over a block's scores compiles to
/// vector code: `x = n ln 2 + r` with `n = round(x log2 e)` and `|r| <= ln 2 / 2` (ln 2 in two
/// parts, so `n ln2_hi` is exact), `e^r` by its Taylor polynomial of degree 7 (truncation under
/// 0.2 ulp), times `2^n` built in the exponent field. Below `-87.3` (where `e^x` leaves the
/// normal range) the result is 0, an absolute error under 1.2e-38; NaN stays NaN.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75; // 0x3f317200: 16 significant bits
    const LN2_LO: f32 = 1.428_606_8e-6; // ln 2 - LN2_HI
    // 1.5 * 2^23: adding it rounds to an integer (to nearest even), held in the low bits.
    const SHIFT: f32 = 12_582_912.0;
    const LOWEST: f32 = -87.336_54; // ln(2^-126)
    let t = x * LOG2E + SHIFT;
    let n = t - SHIFT;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.0 / 5040.0;
    for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = p * r + c;
    }
    // n from t's low bits (no float-to-int conversion); in [-126, 0] for x in [LOWEST, 0].
    let ni = (t.to_bits() as i32).wrapping_sub(SHIFT.to_bits() as i32);
    let two_n = f32::from_bits((ni.wrapping_add(127) as u32) << 23);
    if x < LOWEST { 0.0 } else { p * two_n }
}

/// Positions ahead whose keys and values are asked for while a position's keys are scored. The
/// cache blocks are scattered and the hardware prefetchers stop at each 4 KiB page; the value
/// pass reads each position's rows 2 KB apart (one KV head at a time), which they do not follow.
/// Measured (Intel Xeon VM, 2 threads, 8192 positions, alternated runs): asking for the values
/// too took a bf16 cache from 46-49% to 54-59% of the read peak (f32 within noise); keys alone
/// were within noise of no prefetch; AHEAD 2, 4 and 8 within noise of each other; into L2 only
/// (T1) was worse (43-47%).
const AHEAD: usize = 4;

/// Asks for the cache lines of `row` (a hint: it changes no result).
#[inline(always)]
fn prefetch<T>(row: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let (p, bytes) = (row.as_ptr().cast::<i8>(), size_of_val(row));
        for off in (0..bytes).step_by(64) {
            // SAFETY: a prefetch never faults, and the address is inside `row`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.add(off)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

/// The scores of `P` positions (cache offsets `at`, kv head 0, block index `i` onward, position
/// `first` onward) for every query head of the tile's rows (`q`, `[n * heads, hd]` in tile-head
/// order, `n = limits.len()`): `scores[h * POS_BLOCK + i + j] = scale q_h . k_j`. Each kv head's
/// keys are widened once for each row's query heads of it, in sets of 4, 2 or 1; a row whose
/// positions (`limits`) end before `first` is passed over.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn score_positions<V: Vector, K: Elem, const P: usize>(
    v: V,
    k: &[K],
    at: &[usize],
    i: usize,
    first: usize,
    q: &[f32],
    d: AttnDims,
    limits: &[usize],
    scale: f32,
    scores: &mut [f32],
) {
    let hd = d.head_dim;
    let group = d.heads / d.kv_heads;
    let n = limits.len();
    for g in 0..d.kv_heads {
        let mut keys: [&[K]; P] = [&[]; P];
        for (key, &at) in keys.iter_mut().zip(at) {
            *key = &k[at + g * hd..][..hd];
        }
        for (r, &limit) in limits.iter().enumerate() {
            if limit <= first {
                continue;
            }
            let (mut h, end) = ((g * n + r) * group, (g * n + r + 1) * group);
            while h < end {
                let qs = &q[h * hd..end * hd];
                h += match end - h {
                    4.. => put(scores, h, i, scale, dots::<V, K, 4, P>(v, qs, hd, keys)),
                    2 | 3 => put(scores, h, i, scale, dots::<V, K, 2, P>(v, qs, hd, keys)),
                    _ => put(scores, h, i, scale, dots::<V, K, 1, P>(v, qs, hd, keys)),
                };
            }
        }
    }
}

/// Stores the dots of `G` heads from `h` and `P` positions from block index `i`, scaled, into
/// `scores`. Returns `G`.
#[inline(always)]
fn put<const G: usize, const P: usize>(
    scores: &mut [f32],
    h: usize,
    i: usize,
    scale: f32,
    dots: [[f32; G]; P],
) -> usize {
    for (j, at_j) in dots.iter().enumerate() {
        for (g, &dot) in at_j.iter().enumerate() {
            scores[(h + g) * POS_BLOCK + i + j] = scale * dot;
        }
    }
    G
}

/// The dot products of `G` query heads (rows of `q`, `hd` apart) with each of `P` key rows of
/// `hd` elements, f32 accumulation: `out[j][g] = q_g . keys[j]`. Each key vector is widened once
/// for all `G` and each query vector loaded once for all `P` (cache types have `POST == 1`); the
/// `G P` sums are independent chains of FMAs, reduced 4 at a time.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn dots<V: Vector, T: Elem, const G: usize, const P: usize>(
    v: V,
    q: &[f32],
    hd: usize,
    keys: [&[T]; P],
) -> [[f32; G]; P] {
    debug_assert!(T::POST == 1.0);
    assert!(q.len() >= G * hd && keys.iter().all(|k| k.len() >= hd));
    let mut acc = [[v.zero(); G]; P];
    let mut l = 0;
    while l + V::LANES <= hd {
        // SAFETY: l + LANES <= hd <= every key's length, and (G - 1) hd + l + LANES <= G hd <=
        // q.len().
        unsafe {
            let mut k = [v.zero(); P];
            for j in 0..P {
                k[j] = v.load_elem(keys[j].as_ptr().add(l));
            }
            for g in 0..G {
                let qv = v.load(q.as_ptr().add(g * hd + l));
                for j in 0..P {
                    acc[j][g] = v.fma(qv, k[j], acc[j][g]);
                }
            }
        }
        l += V::LANES;
    }
    let mut out = [[0.0; G]; P];
    for j in 0..P {
        let mut g = 0;
        while g + 4 <= G {
            let s = v.hsum4([acc[j][g], acc[j][g + 1], acc[j][g + 2], acc[j][g + 3]]);
            out[j][g..g + 4].copy_from_slice(&s);
            g += 4;
        }
        while g < G {
            out[j][g] = v.hsum(acc[j][g]);
            g += 1;
        }
        for g in 0..G {
            for e in l..hd {
                out[j][g] += q[g * hd + e] * keys[j][e].widen();
            }
        }
    }
    out
}

/// For each of `G` heads `g` (rows of `y`, `hd` apart; weights `w[g * POS_BLOCK + i]`):
/// `y_g += sum_i w_gi rows[i]`, rows widened (cache types have `POST == 1`), each vector of a row
/// widened once for all `G`, and `y` held in registers, `C` vectors per head at a time, across all
/// the rows. Returns `G`.
#[inline(always)]
fn axpy_rows<V: Vector, T: Elem, const C: usize, const G: usize>(
    v: V,
    y: &mut [f32],
    hd: usize,
    w: &[f32],
    rows: &[&[T]],
) -> usize {
    debug_assert!(T::POST == 1.0);
    let n = rows.len();
    assert!(y.len() >= G * hd && w.len() >= (G - 1) * POS_BLOCK + n && rows.iter().all(|r| r.len() >= hd));
    let mut l = 0;
    while l + C * V::LANES <= hd {
        // SAFETY: l + C LANES <= hd, with the lengths asserted above.
        unsafe { accumulate::<V, T, C, G>(v, y.as_mut_ptr().add(l), hd, w, rows, l) };
        l += C * V::LANES;
    }
    while l + V::LANES <= hd {
        // SAFETY: l + LANES <= hd, as above.
        unsafe { accumulate::<V, T, 1, G>(v, y.as_mut_ptr().add(l), hd, w, rows, l) };
        l += V::LANES;
    }
    for g in 0..G {
        for e in l..hd {
            for (i, row) in rows.iter().enumerate() {
                y[g * hd + e] += w[g * POS_BLOCK + i] * row[e].widen();
            }
        }
    }
    G
}

/// One step of [`axpy_rows`]: `K` vectors of each of `G` heads' rows from `y` (head g at
/// `y + g hd`) summed over every row's `K` vectors from column `l`, and stored back.
///
/// # Safety
/// `K` LANES f32s must be readable and writable at `y + g hd` for every g < G, `K` LANES
/// elements readable at column `l` of every row, and `w` must hold `(G - 1) POS_BLOCK +
/// rows.len()` weights.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn accumulate<V: Vector, T: Elem, const K: usize, const G: usize>(
    v: V,
    y: *mut f32,
    hd: usize,
    w: &[f32],
    rows: &[&[T]],
    l: usize,
) {
    // SAFETY (every access): the caller's contract.
    unsafe {
        let mut a = [[v.zero(); K]; G];
        for g in 0..G {
            for c in 0..K {
                a[g][c] = v.load(y.add(g * hd + c * V::LANES));
            }
        }
        for (i, row) in rows.iter().enumerate() {
            let r = row.as_ptr().add(l);
            let mut x = [v.zero(); K];
            for c in 0..K {
                x[c] = v.load_elem(r.add(c * V::LANES));
            }
            for g in 0..G {
                let ws = v.splat(*w.get_unchecked(g * POS_BLOCK + i));
                for c in 0..K {
                    a[g][c] = v.fma(ws, x[c], a[g][c]);
                }
            }
        }
        for g in 0..G {
            for c in 0..K {
                v.store(y.add(g * hd + c * V::LANES), a[g][c]);
            }
        }
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
        poison: Option<(u32, u32)>,
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
        // A NaN key and value element at (slot, position): the rows that attend to it are NaN,
        // the others must not be.
        if let Some((slot, pos)) = poison {
            let mut kv = rng.vec(2 * kv_heads * hd);
            kv[hd / 2] = f32::NAN;
            kv[kv_heads * hd + hd - 1] = f32::NAN;
            let k = fast.upload_f32(DType::F32, &[1, kv_heads, hd], &kv[..kv_heads * hd]).unwrap();
            let v = fast.upload_f32(DType::F32, &[1, kv_heads, hd], &kv[kv_heads * hd..]).unwrap();
            let (s, p) = (fast.upload_u32(&[1], &[slot]).unwrap(), fast.upload_u32(&[1], &[pos]).unwrap());
            fast.kv_store(&k, &v, &mut cache, &table, &s, &p).unwrap();
            r.kv_store(&k, &v, &mut cache_ref, &table, &s, &p).unwrap();
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

        // The rows split into spans (of one position and up: some rows are shorter than their
        // spans, so some spans are empty), merged: within the same bound. The output starts
        // poisoned, so an element the merge does not write fails.
        let d = crate::ops::check_attention(&q, &cache, &table, &slots, &pos, scale, &out).unwrap();
        let spans = spans_per_row(tiles(slots_of).len(), 80, fast.threads(), 1);
        assert!(spans > 1, "{} rows on {} threads: no split", rows, fast.threads());
        fast.write(&mut out, bytemuck::cast_slice(&vec![f32::NAN; rows * heads * hd])).unwrap();
        attention_spans(fast, d, &q, &cache, &table, &slots, &pos, scale, &mut out, 1).unwrap();
        assert_close(&format!("{what} in {spans} spans"), &fast.read_f32(&out).unwrap(), &want, &tol);
    }

    #[test]
    fn attention_matches_reference() {
        for fast in backends() {
            for kt in [DType::F32, DType::BF16, DType::F16] {
                for vt in [DType::F32, DType::BF16, DType::F16] {
                    check(&fast, kt, vt, 4, 2, 17, &[0, 31, 32, 79], &[0, 1, 2, 1], 0.25, None);
                }
            }
            // Groups of 1, 2, 3 (sets of 2 and 1), 4 and 5 (4 and 1) query heads per KV head.
            for (heads, kv_heads, hd) in
                [(1, 1, 1), (3, 1, 3), (8, 8, 16), (6, 2, 64), (2, 1, 130), (8, 2, 48), (5, 1, 17)]
            {
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
                    None,
                );
            }
            // A peaked softmax.
            check(&fast, DType::F32, DType::F16, 2, 1, 8, &[79, 40], &[0, 2], 30.0, None);
            // Prefill chunks: runs of one slot's rows share tiles (of 16 and 3 rows here), whose
            // rows stop at different positions (one in another block of 32 than the tile's
            // last), beside single rows; groups of 2 and 4 query heads.
            let positions: Vec<u32> = (60..79).chain([5]).chain(0..3).chain([79, 1, 41]).collect();
            let slots_of: Vec<u32> = [[1; 19].as_slice(), &[0], &[2; 3], &[1, 2, 2]].concat();
            check(&fast, DType::BF16, DType::F16, 4, 2, 17, &positions, &slots_of, 0.25, None);
            check(&fast, DType::F32, DType::BF16, 8, 2, 32, &positions, &slots_of, 0.25, None);
            let positions: Vec<u32> = (20..36).chain([0, 70]).collect();
            check(&fast, DType::BF16, DType::BF16, 8, 2, 48, &positions, &[0; 18], 0.125, None);
            // Prefill tiles whose query heads of a KV head fill several vectors (`Wide`): 8 per
            // KV head (128 lanes in a tile of 16 rows: 4 chunks of 2 vectors, or 8), 5 (80 and 35
            // lanes: a last chunk of one vector, padded in the 35), odd head sizes; a NaN key and
            // value at position 66 of slot 1 reach rows 66 and later only, in a tile whose rows
            // end on both sides of it.
            let positions: Vec<u32> = (40..56).chain(70..77).collect();
            let slots_of: Vec<u32> = [[0; 16].as_slice(), &[2; 7]].concat();
            check(&fast, DType::BF16, DType::BF16, 16, 2, 24, &positions, &slots_of, 0.2, None);
            check(&fast, DType::F16, DType::BF16, 10, 2, 9, &positions, &slots_of, 0.3, None);
            let positions: Vec<u32> = (60..72).chain(0..4).collect();
            check(&fast, DType::BF16, DType::F32, 32, 8, 64, &positions, &[1; 16], 0.125, Some((1, 66)));
            check(&fast, DType::F32, DType::F32, 6, 2, 5, &positions, &[1; 16], 0.5, Some((1, 66)));
        }
    }

    #[test]
    fn exp_within_two_ulps() {
        // Every 97th f32 in [-88, 0] (about 11 million), and the ends.
        let (lo, hi) = ((-88.0f32).to_bits(), (-0.0f32).to_bits());
        let mut worst = (0.0f64, 0.0f32);
        for bits in (hi..=lo).step_by(97).chain([lo, hi, 0.0f32.to_bits()]) {
            let x = f32::from_bits(bits);
            let got = exp_nonpositive(x) as f64;
            let want = (x as f64).exp();
            if x < -87.336_54 {
                assert_eq!(got, 0.0, "exp({x})");
                continue;
            }
            // In ulps of the exact value's binade (its spacing: 2^(e - 23)).
            let ulp = 2f64.powi(want.log2().floor() as i32 - 23);
            let err = (got - want).abs() / ulp;
            if err > worst.0 {
                worst = (err, x);
            }
        }
        assert!(worst.0 <= 2.0, "exp: {} ulps at x = {}", worst.0, worst.1);
        assert!(exp_nonpositive(f32::NAN).is_nan());
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpositive(0.0), 1.0);
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
