//! Linear layers and the embedding gather: the ops that read weights.
//!
//! Contract (`ops::check_linear`): `y[m, n] = x[m, k] . W[n, k]^T`. x and y are f32, bf16 or f16;
//! W is any float type, row-major `[n, k]` (the `nn.Linear` layout), read in place. Its scale is
//! none, one per tensor or one per output row (multiplying a row's dot product after the
//! reduction), or one per `block_rows x block_cols` block (multiplying each block's partial sum).
//! x is widened once to f32 (per-thread scratch); the result is rounded once into y.
//!
//! Algorithm:
//! - Threads: the n output rows are cut into `tasks` contiguous ranges (a few per thread, each a
//!   multiple of the tile), so each worker streams its own long run of weight memory.
//! - GEMV (m = 1): a tile is `GEMV_ROWS` weight rows reduced together, each vector of x loaded
//!   once for all of them, one accumulator per row (independent FMA chains, several streams of
//!   cache-line misses in flight). Weights are widened in registers by `Vector::load_elem`; fp8
//!   loads are exact multiples `1 / POST` of the stored value, and POST is applied with the scale
//!   after the reduction. For the fp8 formats whose NaN codes load as finite values, each tile
//!   scans its rows' codes once afterwards (from cache) and makes those rows NaN.
//! - fp8 GEMV on AVX-512 VBMI (`Simd::Avx512Vbmi`): the same tiles, but each step widens 64
//!   codes of a row into four f32 vectors with two `vpermi2b` table lookups and seven integer
//!   ops (`Vbmi::widen64`): 9 instructions where four `load_elem`s take 16 (two of them
//!   `vcvtph2ps`, two uops each), and e4m3fn's NaN codes stay NaN, so its NaN scan goes. The fp8
//!   GEMV was bound by the widening, not by memory (README, Benchmarks: 1.4-1.8x on one core in
//!   cache, 1.07-1.35x on two from memory). The lookups leave the columns interleaved within each
//!   block of 64, so x is permuted the same way once per call (`permute_x64`, zero-padded to a
//!   multiple of 64) and the weights are still read in place. Block scales need blocks of a
//!   multiple of 64 columns here (128 in every published checkpoint); other widths take the
//!   vector path. GEMMs keep the vector path: at 4 x rows the widening is shared by the rows and
//!   the two paths measured the same (FMA-bound).
//! - GEMM (m > 1): an `MR x NR` tile of x rows by weight rows (8 x 3 with AVX-512's 32
//!   registers, 4 x 4 there below 8 rows; 4 x 3 with 16), each widened weight vector used for
//!   MR rows of x. x is cut into blocks of rows that fit in L2 (`X_BLOCK_BYTES`); for each block
//!   a task walks its weight rows once, so each weight row is read from memory once per block of
//!   x rows (once for a whole prompt of a few dozen tokens), and the NR rows of a tile stay in L1
//!   while the x rows of the block pass over them. A block's last rows, fewer than MR, take one
//!   or two tiles of 1 to 4 rows.
//! - Block scales: each block's vector accumulators are multiplied by the block's scale into a
//!   second set (a broadcast and an FMA per vector) and summed across lanes once per row, where
//!   the registers hold both sets (`scaled_vectors_fit`: AVX-512's GEMV). Elsewhere (every GEMM
//!   tile, AVX2's GEMV), for blocks of at least `FOLD_MIN_ROWS` rows, x is multiplied by a row
//!   block's column scales into scratch once per block of x rows and row block, and the unscaled
//!   tiles run on that copy (`FoldedTask`); smaller blocks are summed and scaled block by block.
//!   NaN codes are looked for once per row, not once per block.
//! - Tails (k not a multiple of the vector width) go through zero-padded copies on the stack, so
//!   the same vector code handles them; weight rows past the end of a task repeat its last row
//!   and their results are dropped.
//!
//! Accumulation is f32 (per lane, then a horizontal sum per row or per block), so results differ
//! from the f64 reference by the usual `k * eps_f32` bound.

use half::{bf16, f16};

#[cfg(target_arch = "x86_64")]
use super::X_PERMUTED;
#[cfg(target_arch = "x86_64")]
use super::simd::{Avx512, Fp8Bytes, Fp8Regs, Vbmi, VbmiKernel, run_vbmi, x64_column};
use super::simd::{Elem, Kernel, MAX_LANES, Vector};
use super::{Fast, INPUT_F32, X_FOLDED, with_scratch};
use crate::ops::{GatherDims, Linear, LinearDims, WeightScale};
use crate::{DType, Error, Float, HostStorage, HostTensor, Result, with_float_type};

/// Weight rows a GEMV tile reduces together, sharing each load of x. Measured on the AMD EPYC
/// (Zen 4) dev machine, one core, bf16 at k = 4096: 1 row ~14 GB/s, 4 rows ~18, 8 rows ~22-24
/// of a 27-30 GB/s single-stream read (12 rows: no better): more rows keep more cache-line misses
/// in flight. Software prefetch (T0 or T1, 0.5-4 KiB ahead) and walking the rows in longer
/// bursts did not help. With two cores each needs only half the bandwidth, and the GEMV reaches
/// 92-98% of the two-core read when the host gives the VM ~35 GB/s.
pub(crate) const GEMV_ROWS: usize = 8;
/// x rows and weight rows of a GEMM tile with 32 vector registers (AVX-512): 8 x 3
/// accumulators, 3 widened weight vectors and one x vector. Measured on the Intel Xeon (AVX-512)
/// VM, one thread, bf16 weights in cache at k = 4096: 95 / 108 / 113 GFLOP/s at m = 8 / 16 / 64
/// against 82 / 92 / 98 with 4 x 4 (4 x 6 measured as 4 x 4, 6 x 4 between). The choice came from
/// a port model (widening a bf16 vector is two instructions on the FMA ports, so the FMAs' share
/// is MR / (MR + 2)), which predicted the direction but is not the limit: halving the widening
/// cost (branch `experiment/bf16-pairs`) made the tile no faster. What holds it at ~77% of the
/// FMA peak is not settled.
const GEMM_WIDE: (usize, usize) = (8, 3);
/// The AVX-512 tile for fewer than `GEMM_WIDE.0` rows (decode batches of 2 to 7), whose rows
/// would all take the 4-row rest tile: 4 x 4 spends one x load on 4 FMAs where 4 x 3 spends it on
/// 3. The decode bench at batch 4 on the Xeon VM: 41-42 tok/s with 4 x 3, 43-47 with 4 x 4.
const GEMM_WIDE_FEW: (usize, usize) = (4, 4);
/// x rows and weight rows of a GEMM tile with 16 vector registers (AVX2, portable): 4 x 3
/// accumulators, 3 widened weight vectors and one x vector. Measured on the AMD EPYC (Zen 3)
/// VM, one thread, bf16 weights in cache at k = 4096, m = 4 to 64: 74-78 GFLOP/s (about 75% of
/// the core's FMA rate), against 56-61 with the 2 x 4 tile before (each weight vector widened
/// for 2 x rows, not 4).
const GEMM_NARROW: (usize, usize) = (4, 3);
/// The tallest tile a GEMM block's last rows (fewer than MR) take; more take two tiles.
const REST_ROWS: usize = 4;
/// Bytes of widened x kept hot while the weight rows of a task pass over it (about half an L2).
const X_BLOCK_BYTES: usize = 256 << 10;
/// The fewest rows a block of scales must span for [`FoldedTask`]: multiplying a block of x rows
/// by a row block's column scales costs one multiply per element of x, against `rows` FMAs per
/// element in the tiles that use the copy.
const FOLD_MIN_ROWS: usize = 16;
/// Tasks per worker thread: enough to even out uneven progress, few enough that each streams a
/// long contiguous run of weights.
const TASKS_PER_THREAD: usize = 4;

// ---------------------------------------------------------------------------------------------
// Scales

/// A scale tensor, f32 or bf16.
#[derive(Clone, Copy)]
pub(crate) enum ScaleView<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

impl<'a> ScaleView<'a> {
    fn new(op: &'static str, t: &'a HostTensor) -> Result<ScaleView<'a>> {
        match t.dtype() {
            DType::F32 => Ok(ScaleView::F32(t.as_slice())),
            DType::BF16 => Ok(ScaleView::Bf16(t.as_slice())),
            other => {
                Err(Error::DType { op, tensor: "scale", got: other, allowed: vec![DType::F32, DType::BF16] })
            }
        }
    }

    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        match self {
            ScaleView::F32(s) => s[i],
            ScaleView::Bf16(s) => s[i].widen(),
        }
    }
}

/// How a weight's stored values are scaled (the checked `WeightScale`, borrowed).
#[derive(Clone, Copy)]
pub(crate) enum Scale<'a> {
    None,
    PerTensor(f32),
    PerChannel(ScaleView<'a>),
    /// `per_row` blocks across a row: `scales[(row / rows) * per_row + col / cols]`.
    Block {
        rows: usize,
        cols: usize,
        per_row: usize,
        view: ScaleView<'a>,
    },
}

impl<'a> Scale<'a> {
    pub(crate) fn new(op: &'static str, s: &'a WeightScale<HostStorage>, k: usize) -> Result<Scale<'a>> {
        Ok(match s {
            WeightScale::None => Scale::None,
            WeightScale::PerTensor(v) => Scale::PerTensor(*v),
            WeightScale::PerChannel(t) => Scale::PerChannel(ScaleView::new(op, t)?),
            WeightScale::Block { block_rows, block_cols, scales } => Scale::Block {
                rows: *block_rows,
                cols: *block_cols,
                per_row: k.div_ceil(*block_cols),
                view: ScaleView::new(op, scales)?,
            },
        })
    }

    /// The scale of the whole row `j` (1 for block scales, applied per block).
    #[inline(always)]
    fn row(&self, j: usize) -> f32 {
        match self {
            Scale::None | Scale::Block { .. } => 1.0,
            Scale::PerTensor(s) => *s,
            Scale::PerChannel(v) => v.get(j),
        }
    }

    /// The scale of element `(j, l)` (for the embedding gather).
    #[inline(always)]
    fn at(&self, j: usize, l: usize) -> f32 {
        match self {
            Scale::Block { rows, cols, per_row, view } => view.get((j / rows) * per_row + l / cols),
            _ => self.row(j),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Planning (pure functions of the shape, unit-tested)

/// How a linear layer is cut into tasks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Weight rows per task (a multiple of the tile's weight rows, except the last task's).
    pub rows_per_task: usize,
    pub tasks: usize,
    /// x rows per block (a multiple of the tile's x rows, at least one tile).
    pub x_block: usize,
}

pub(crate) fn plan(d: LinearDims, threads: usize, x_tile: usize, w_tile: usize) -> Plan {
    let want_tasks = threads.max(1) * TASKS_PER_THREAD;
    let rows_per_task = d.n.div_ceil(want_tasks).next_multiple_of(w_tile).max(w_tile);
    let x_rows_fit = (X_BLOCK_BYTES / (d.k * 4).max(1)) / x_tile * x_tile;
    let x_block = x_rows_fit.max(x_tile).min(d.m.next_multiple_of(x_tile));
    Plan { rows_per_task, tasks: d.n.div_ceil(rows_per_task), x_block }
}

// ---------------------------------------------------------------------------------------------
// Kernels

/// Output `y[m, n]` written by several tasks at once, each to its own columns.
struct OutPtr<Y> {
    ptr: *mut Y,
    len: usize,
    cols: usize,
}

impl<Y> Clone for OutPtr<Y> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<Y> Copy for OutPtr<Y> {}

// SAFETY: `OutPtr` is shared only by the tasks of one `linear` call, which own disjoint column
// ranges of `y` (their weight rows) and write only there, while `linear` holds `&mut y`.
unsafe impl<Y: Send> Send for OutPtr<Y> {}
// SAFETY: as above.
unsafe impl<Y: Send> Sync for OutPtr<Y> {}

impl<Y: Float> OutPtr<Y> {
    /// The rows from `i0` on.
    fn rows_from(self, i0: usize) -> Self {
        let at = i0 * self.cols;
        assert!(at <= self.len, "linear output rows out of bounds");
        // SAFETY: `at <= len`, inside (or one past the end of) the output.
        OutPtr { ptr: unsafe { self.ptr.add(at) }, len: self.len - at, cols: self.cols }
    }

    /// # Safety
    /// No other thread may access element `(i, j)` during the call.
    #[inline(always)]
    unsafe fn write(self, i: usize, j: usize, v: f32) {
        let at = i * self.cols + j;
        assert!(at < self.len, "linear output index out of bounds");
        // SAFETY: `at` is in bounds (asserted); exclusivity is the caller's contract.
        unsafe { self.ptr.add(at).write(Y::from_f32(v)) }
    }
}

/// One task of a linear layer: weight rows `j0..j1` against every row of x.
struct LinearTask<'a, W, Y> {
    /// x's rows, `x_stride` apart (k, or a multiple of 64 for the byte-table kernel's permuted
    /// copy).
    x: &'a [f32],
    x_stride: usize,
    m: usize,
    k: usize,
    w: &'a [W],
    scale: Scale<'a>,
    x_block: usize,
    j0: usize,
    j1: usize,
    y: OutPtr<Y>,
}

impl<W: Elem, Y: Float> Kernel for LinearTask<'_, W, Y> {
    type Output = ();

    #[inline(always)]
    fn run<V: Vector>(self, v: V) {
        task_tiles(VectorTiler(v), &self);
    }
}

/// A [`LinearTask`] with block scales whose tile has no registers for a second set of
/// accumulators ([`scaled_vectors_fit`]: every GEMM tile, AVX2's GEMV), which would sum and scale
/// each tile's accumulators once per block (an 8 x 3 tile: 24 lane sums per 128 columns, as many
/// instructions as its FMAs). Instead, for each block of x rows and each run of the task's weight
/// rows that shares a row of scales, x's columns are multiplied by that row's scales into
/// `folded` once, and the run goes through the unscaled tiles: `sum_b s_b sum_(c in b) x_c w_c =
/// sum_c (x_c s_(b(c))) w_c`, one more rounding per term.
///
/// Measured (Intel Xeon VM, AVX-512, one thread, weights in cache, 1024 x 4096 with 128 x 128
/// f32 scales, old and new binaries alternated, two rounds): bf16 at m = 16 / 64 95-99 / 102-103
/// GFLOP/s against 60-62 / 63 before (unscaled: 98-110 / 110), e4m3fn 76-79 / 82 against 52-53
/// / 54 (unscaled 86-88). On the same host's AVX2 kernels, e4m3fn at m = 16: 35-46 against 36
/// (the fp8 widening, not the scales, bounds it there). Without the scratch's cache-line
/// alignment (`SCRATCH_ALIGN`) the copy cost a third of this.
struct FoldedTask<'a, W, Y> {
    /// Its scale is `Scale::Block`.
    task: LinearTask<'a, W, Y>,
    /// `min(x_block, m) * k`.
    folded: &'a mut [f32],
}

impl<W: Elem, Y: Float> Kernel for FoldedTask<'_, W, Y> {
    type Output = ();

    #[inline(always)]
    fn run<V: Vector>(self, v: V) {
        let FoldedTask { task: t, folded } = self;
        let Scale::Block { rows, cols, per_row, view } = t.scale else {
            unreachable!("a folded task has block scales")
        };
        let k = t.k;
        let mut i0 = 0;
        while i0 < t.m {
            let i1 = t.m.min(i0 + t.x_block);
            let x = &mut folded[..(i1 - i0) * k];
            let mut j0 = t.j0;
            while j0 < t.j1 {
                let rb = j0 / rows;
                let j1 = t.j1.min((rb + 1) * rows);
                for (f, xr) in x.chunks_exact_mut(k).zip(t.x[i0 * t.x_stride..].chunks(t.x_stride)) {
                    for (b, (f, xr)) in f.chunks_mut(cols).zip(xr[..k].chunks(cols)).enumerate() {
                        let s = view.get(rb * per_row + b);
                        for (f, &x) in f.iter_mut().zip(xr) {
                            *f = x * s;
                        }
                    }
                }
                let run = LinearTask {
                    x: &*x,
                    x_stride: k,
                    m: i1 - i0,
                    k,
                    w: t.w,
                    scale: Scale::None,
                    x_block: i1 - i0,
                    j0,
                    j1,
                    y: t.y.rows_from(i0),
                };
                task_tiles(VectorTiler(v), &run);
                j0 = j1;
            }
            i0 = i1;
        }
    }
}

/// Runs a task with the tile [`tile_of`] picks for its rows on the tiler's vectors.
#[inline(always)]
fn task_tiles<W: Elem, Y: Float, T>(tiler: T, t: &LinearTask<'_, W, Y>)
where
    T: Tiler<W, 1, GEMV_ROWS>
        + Tiler<W, 2, GEMV_ROWS>
        + Tiler<W, 3, GEMV_ROWS>
        + Tiler<W, 4, GEMV_ROWS>
        + Tiler<W, 8, 3>
        + Tiler<W, 4, 4>
        + Tiler<W, 3, 4>
        + Tiler<W, 2, 4>
        + Tiler<W, 1, 4>
        + Tiler<W, 4, 3>
        + Tiler<W, 3, 3>
        + Tiler<W, 2, 3>
        + Tiler<W, 1, 3>,
{
    let lanes = <<T as Tiler<W, 1, GEMV_ROWS>>::V as Vector>::LANES;
    match tile_of(t.m, lanes) {
        (1, _) => task::<W, Y, _, 1, GEMV_ROWS>(tiler, t),
        GEMM_WIDE_FEW => task::<W, Y, _, { GEMM_WIDE_FEW.0 }, { GEMM_WIDE_FEW.1 }>(tiler, t),
        GEMM_WIDE => task::<W, Y, _, { GEMM_WIDE.0 }, { GEMM_WIDE.1 }>(tiler, t),
        _ => task::<W, Y, _, { GEMM_NARROW.0 }, { GEMM_NARROW.1 }>(tiler, t),
    }
}

/// How a task reduces a tile of `MR` x rows by `NR` weight rows: [`VectorTiler`] (any
/// instruction set) or, for fp8 GEMVs on AVX-512 VBMI, [`BytesTiler`]. Each gives the vector
/// accumulators of a column range; the sums, the NaN rows and the block scales are shared.
trait Tiler<W: Elem, const MR: usize, const NR: usize>: Copy {
    type V: Vector;
    /// What the tile's sums are multiplied by: they are in the weights' load domain.
    const POST: f32;
    fn vector(self) -> Self::V;
    /// Whether the loads may widen a NaN code to a finite value, so rows need [`nan_rows`].
    fn nan_codes(self) -> bool;
    /// Accumulators whose lanes sum to the dot products of the rows over columns `c0..c1`.
    fn tile_acc(
        self,
        x: &[&[f32]; MR],
        w: &[&[W]; NR],
        c0: usize,
        c1: usize,
    ) -> [[<Self::V as Vector>::F; NR]; MR];

    /// The dot products over columns `c0..c1`.
    #[inline(always)]
    fn tile(self, x: &[&[f32]; MR], w: &[&[W]; NR], c0: usize, c1: usize) -> [[f32; NR]; MR] {
        let sums = hsums(self.vector(), &self.tile_acc(x, w, c0, c1));
        if self.nan_codes() { nan_rows(w, c0, c1, sums) } else { sums }
    }

    /// The dot products over all `k` columns with each block of `s.cols` columns multiplied by
    /// its scale. Where the registers hold a second set of accumulators, the scale multiplies
    /// the block's vectors (a broadcast and an FMA each) and the lanes are summed once per row at
    /// the end; elsewhere each block is summed and scaled (a second set spilled inside the loop:
    /// AVX2's GEMV measured 2.5x slower so). Either way the NaN rows are found once per row.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)]
    fn tile_blocked(
        self,
        x: &[&[f32]; MR],
        w: &[&[W]; NR],
        k: usize,
        s: &BlockScales<'_, NR>,
    ) -> [[f32; NR]; MR] {
        let v = self.vector();
        let (mut c0, mut b) = (0, 0);
        let sums = if scaled_vectors_fit::<Self::V>(MR, NR) {
            let mut total = [[v.zero(); NR]; MR];
            while c0 < k {
                let c1 = k.min(c0 + s.cols);
                let acc = self.tile_acc(x, w, c0, c1);
                for r in 0..NR {
                    let sv = v.splat(s.get(r, b));
                    for q in 0..MR {
                        total[q][r] = v.fma(acc[q][r], sv, total[q][r]);
                    }
                }
                c0 = c1;
                b += 1;
            }
            hsums(v, &total)
        } else {
            let mut total = [[0.0f32; NR]; MR];
            while c0 < k {
                let c1 = k.min(c0 + s.cols);
                let part = hsums(v, &self.tile_acc(x, w, c0, c1));
                for r in 0..NR {
                    let sr = s.get(r, b);
                    for q in 0..MR {
                        total[q][r] += part[q][r] * sr;
                    }
                }
                c0 = c1;
                b += 1;
            }
            total
        };
        if self.nan_codes() { nan_rows(w, 0, k, sums) } else { sums }
    }
}

/// Whether an `mr x nr` tile's accumulators, a second set for the scaled block sums, and an
/// operand per row fit in `V`'s registers.
const fn scaled_vectors_fit<V: Vector>(mr: usize, nr: usize) -> bool {
    scaled_fit(mr, nr, V::LANES)
}

/// [`scaled_vectors_fit`] for vectors of `lanes` lanes (32 registers with 16 lanes: AVX-512;
/// else 16).
const fn scaled_fit(mr: usize, nr: usize, lanes: usize) -> bool {
    2 * mr * nr + mr + nr <= if lanes >= 16 { 32 } else { 16 }
}

/// The block scales of a tile's `NR` weight rows: row `r`'s scale for its `b`-th block of `cols`
/// columns is `view[base[r] + b]`.
struct BlockScales<'a, const NR: usize> {
    view: ScaleView<'a>,
    base: [usize; NR],
    cols: usize,
}

impl<const NR: usize> BlockScales<'_, NR> {
    #[inline(always)]
    fn get(&self, r: usize, b: usize) -> f32 {
        self.view.get(self.base[r] + b)
    }
}

#[derive(Clone, Copy)]
struct VectorTiler<V>(V);

impl<V: Vector, W: Elem, const MR: usize, const NR: usize> Tiler<W, MR, NR> for VectorTiler<V> {
    type V = V;
    const POST: f32 = W::POST;
    #[inline(always)]
    fn vector(self) -> V {
        self.0
    }
    #[inline(always)]
    fn nan_codes(self) -> bool {
        W::NAN_CODES
    }
    #[inline(always)]
    fn tile_acc(self, x: &[&[f32]; MR], w: &[&[W]; NR], c0: usize, c1: usize) -> [[V::F; NR]; MR] {
        tile_acc::<V, W, MR, NR>(self.0, x, w, c0, c1)
    }
}

/// The (x rows, weight rows) tile for `m` rows on vectors of `lanes` lanes: the one choice
/// [`task_tiles`] and `plan`'s caller share.
fn tile_of(m: usize, lanes: usize) -> (usize, usize) {
    if m == 1 {
        (1, GEMV_ROWS)
    } else if lanes >= 16 && m < GEMM_WIDE.0 {
        GEMM_WIDE_FEW
    } else if lanes >= 16 {
        GEMM_WIDE
    } else {
        GEMM_NARROW
    }
}

#[inline(always)]
fn task<W: Elem, Y: Float, T, const MR: usize, const NR: usize>(tiler: T, t: &LinearTask<'_, W, Y>)
where
    T: Tiler<W, MR, NR> + Tiler<W, 1, NR> + Tiler<W, 2, NR> + Tiler<W, 3, NR> + Tiler<W, 4, NR>,
{
    const { assert!(MR <= 2 * REST_ROWS, "a block's last rows take at most two tiles") };
    let k = t.k;
    let mut i0 = 0;
    while i0 < t.m {
        let i1 = t.m.min(i0 + t.x_block);
        let mut j = t.j0;
        while j < t.j1 {
            // Rows past the end repeat the last row; their results are dropped.
            let w_rows: [&[W]; NR] = std::array::from_fn(|r| {
                let jr = (j + r).min(t.j1 - 1);
                &t.w[jr * k..(jr + 1) * k]
            });
            let mut i = i0;
            while i + MR <= i1 {
                tile_rows::<W, Y, T, MR, NR>(tiler, t, i, j, &w_rows);
                i += MR;
            }
            // The block's last rows, fewer than MR, take tiles of their own height (up to
            // REST_ROWS, while the weight rows are still in L1), not a full tile of repeated rows.
            // A GEMV (MR = 1) has none, and its instances leave this out.
            if MR > 1 {
                while i < i1 {
                    let h = (i1 - i).min(REST_ROWS);
                    match h {
                        1 => tile_rows::<W, Y, T, 1, NR>(tiler, t, i, j, &w_rows),
                        2 => tile_rows::<W, Y, T, 2, NR>(tiler, t, i, j, &w_rows),
                        3 => tile_rows::<W, Y, T, 3, NR>(tiler, t, i, j, &w_rows),
                        _ => tile_rows::<W, Y, T, REST_ROWS, NR>(tiler, t, i, j, &w_rows),
                    }
                    i += h;
                }
            }
            j += NR;
        }
        i0 = i1;
    }
}

/// x rows `i..i + MR` by the weight rows `w_rows` (rows `j..` of W, the last repeated past
/// `t.j1`), written to `y`.
#[inline(always)]
fn tile_rows<W: Elem, Y: Float, T: Tiler<W, MR, NR>, const MR: usize, const NR: usize>(
    tiler: T,
    t: &LinearTask<'_, W, Y>,
    i: usize,
    j: usize,
    w_rows: &[&[W]; NR],
) {
    let x_rows: [&[f32]; MR] = std::array::from_fn(|s| &t.x[(i + s) * t.x_stride..][..t.x_stride]);
    let total = if let Scale::Block { rows, cols, per_row, view } = t.scale {
        let base = std::array::from_fn(|r| ((j + r).min(t.j1 - 1) / rows) * per_row);
        tiler.tile_blocked(&x_rows, w_rows, t.k, &BlockScales { view, base, cols })
    } else {
        tiler.tile(&x_rows, w_rows, 0, t.k)
    };
    for (q, row) in total.iter().enumerate() {
        for (r, &acc) in row.iter().enumerate().take(t.j1 - j) {
            // SAFETY: this task owns columns j0..j1 of y; j + r < j1 and i + q < m.
            unsafe { t.y.write(i + q, j + r, acc * T::POST * t.scale.row(j + r)) };
        }
    }
}

/// The horizontal sums of a tile's accumulators.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn hsums<V: Vector, const MR: usize, const NR: usize>(v: V, acc: &[[V::F; NR]; MR]) -> [[f32; NR]; MR] {
    let mut sums = [[0.0f32; NR]; MR];
    for q in 0..MR {
        for r in 0..NR {
            sums[q][r] = v.hsum(acc[q][r]);
        }
    }
    sums
}

/// `sums` with the results of every weight row that holds a NaN code in `c0..c1` made NaN: the
/// vector loads of `W::NAN_CODES` types widen NaN codes to finite values, and a NaN weight makes
/// its dot product NaN. The codes were just read, so this pass runs from cache.
#[inline(always)]
fn nan_rows<W: Elem, const MR: usize, const NR: usize>(
    w: &[&[W]; NR],
    c0: usize,
    c1: usize,
    mut sums: [[f32; NR]; MR],
) -> [[f32; NR]; MR] {
    if W::NAN_CODES {
        for (r, row) in w.iter().enumerate() {
            if W::any_nan(&row[c0..c1]) {
                for s in sums.iter_mut() {
                    s[r] = f32::NAN;
                }
            }
        }
    }
    sums
}

/// The accumulators of `MR` rows of x by `NR` weight rows over columns `c0..c1`, in the weights'
/// load domain (divided by `W::POST`): their lanes sum to the dot products.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn tile_acc<V: Vector, W: Elem, const MR: usize, const NR: usize>(
    v: V,
    x: &[&[f32]; MR],
    w: &[&[W]; NR],
    c0: usize,
    c1: usize,
) -> [[V::F; NR]; MR] {
    const { assert!(V::LANES <= MAX_LANES) };
    assert!(c0 <= c1 && x.iter().all(|r| r.len() >= c1) && w.iter().all(|r| r.len() >= c1));
    let len = c1 - c0;
    let full = len - len % V::LANES;
    // Thin pointers, so the loop keeps them all in registers. Plain loops, not
    // `array::from_fn`: its closures are separate functions that would not be compiled with the
    // caller's target features, so the intrinsics in them would become calls.
    let mut xp = [std::ptr::null::<f32>(); MR];
    let mut wp = [std::ptr::null::<W>(); NR];
    for q in 0..MR {
        xp[q] = x[q][c0..].as_ptr();
    }
    for r in 0..NR {
        wp[r] = w[r][c0..].as_ptr();
    }
    let mut acc = [[v.zero(); NR]; MR];
    let mut l = 0;
    while l < full {
        // SAFETY: l + LANES <= full <= len, and every row has `len` elements from its pointer
        // (asserted above).
        unsafe { step::<V, W, MR, NR>(v, &xp, &wp, l, &mut acc) };
        l += V::LANES;
    }
    if full < len {
        // Zero padding: the zero code is +0 in every float type.
        let mut wt = [[W::zeroed(); MAX_LANES]; NR];
        let mut xt = [[0.0f32; MAX_LANES]; MR];
        for r in 0..NR {
            wt[r][..len - full].copy_from_slice(&w[r][c0 + full..c1]);
            wp[r] = wt[r].as_ptr();
        }
        for q in 0..MR {
            xt[q][..len - full].copy_from_slice(&x[q][c0 + full..c1]);
            xp[q] = xt[q].as_ptr();
        }
        // SAFETY: the padded buffers hold MAX_LANES >= LANES elements.
        unsafe { step::<V, W, MR, NR>(v, &xp, &wp, 0, &mut acc) };
    }
    acc
}

/// One vector step of a tile: `acc[q][r] += x[q][l..] * w[r][l..]` over `LANES` elements.
///
/// # Safety
/// `LANES` elements must be readable at offset `l` of every pointer.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn step<V: Vector, W: Elem, const MR: usize, const NR: usize>(
    v: V,
    xp: &[*const f32; MR],
    wp: &[*const W; NR],
    l: usize,
    acc: &mut [[V::F; NR]; MR],
) {
    let mut wv = [v.zero(); NR];
    for r in 0..NR {
        // SAFETY: the caller guarantees LANES readable elements.
        wv[r] = unsafe { v.load_elem(wp[r].add(l)) };
    }
    for q in 0..MR {
        // SAFETY: as above.
        let xv = unsafe { v.load(xp[q].add(l)) };
        for r in 0..NR {
            acc[q][r] = v.fma(xv, wv[r], acc[q][r]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// fp8 weights through byte tables (AVX-512 VBMI)

/// Columns of a byte-table step: one 64-byte load of codes per weight row.
#[cfg(target_arch = "x86_64")]
const BYTES_STEP: usize = 64;

/// The byte-table kernel's tiler: the tokens and the format's tables in registers.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct BytesTiler {
    v: Avx512,
    b: Vbmi,
    regs: Fp8Regs,
    nan_lost: bool,
}

#[cfg(target_arch = "x86_64")]
impl<W: Elem, const MR: usize, const NR: usize> Tiler<W, MR, NR> for BytesTiler {
    type V = Avx512;
    /// The tables give the exact values.
    const POST: f32 = 1.0;
    #[inline(always)]
    fn vector(self) -> Avx512 {
        self.v
    }
    /// Only where the tables widened the format's NaN code to -0 (the fnuz formats).
    #[inline(always)]
    fn nan_codes(self) -> bool {
        self.nan_lost
    }
    #[inline(always)]
    fn tile_acc(
        self,
        x: &[&[f32]; MR],
        w: &[&[W]; NR],
        c0: usize,
        c1: usize,
    ) -> [[<Avx512 as Vector>::F; NR]; MR] {
        tile_bytes_acc::<W, MR, NR>(self, x, w, c0, c1)
    }
}

/// As [`tile_acc`], for fp8 weights widened by [`Vbmi::widen64`] (exact values, no `POST`). x's
/// rows are in the permuted layout of [`permute_x64`] (zero-padded to a multiple of 64) and `c0`
/// is a multiple of 64, so each block of 64 weights meets its x columns without moving.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn tile_bytes_acc<W: Elem, const MR: usize, const NR: usize>(
    t: BytesTiler,
    x: &[&[f32]; MR],
    w: &[&[W]; NR],
    c0: usize,
    c1: usize,
) -> [[<Avx512 as Vector>::F; NR]; MR] {
    assert_eq!(size_of::<W>(), 1, "byte tables widen one-byte codes");
    assert!(c0 <= c1 && c0.is_multiple_of(BYTES_STEP));
    assert!(x.iter().all(|r| r.len() >= c1.next_multiple_of(BYTES_STEP)) && w.iter().all(|r| r.len() >= c1));
    let len = c1 - c0;
    let full = len - len % BYTES_STEP;
    let mut xp = [std::ptr::null::<f32>(); MR];
    let mut wp = [std::ptr::null::<u8>(); NR];
    for q in 0..MR {
        xp[q] = x[q][c0..].as_ptr();
    }
    for r in 0..NR {
        wp[r] = w[r][c0..].as_ptr().cast();
    }
    let mut acc = [[t.v.zero(); NR]; MR];
    let mut l = 0;
    while l < full {
        // SAFETY: l + 64 <= full <= len; every weight row has `len` codes and every x row
        // `len` rounded up to 64 values from its pointer (asserted above).
        unsafe { step_bytes::<MR, NR>(t, &xp, &wp, l, &mut acc) };
        l += BYTES_STEP;
    }
    if full < len {
        // The codes are zero-padded on the stack (the zero code is +0 in every fp8 format); x's
        // rows are zero-padded already.
        let mut wt = [[W::zeroed(); BYTES_STEP]; NR];
        for r in 0..NR {
            wt[r][..len - full].copy_from_slice(&w[r][c0 + full..c1]);
            wp[r] = wt[r].as_ptr().cast();
        }
        for q in 0..MR {
            // SAFETY: `full` < len <= the row's length from xp[q].
            xp[q] = unsafe { xp[q].add(full) };
        }
        // SAFETY: the padded codes are 64 bytes; the x rows hold 64 more values from xp[q].
        unsafe { step_bytes::<MR, NR>(t, &xp, &wp, 0, &mut acc) };
    }
    acc
}

/// One step of [`tile_bytes_acc`]: 64 columns of every row, each weight row widened once.
///
/// # Safety
/// 64 codes must be readable at offset `l` of every weight pointer and 64 f32s at offset `l` of
/// every x pointer.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn step_bytes<const MR: usize, const NR: usize>(
    t: BytesTiler,
    xp: &[*const f32; MR],
    wp: &[*const u8; NR],
    l: usize,
    acc: &mut [[<Avx512 as Vector>::F; NR]; MR],
) {
    for r in 0..NR {
        // SAFETY: the caller guarantees 64 readable codes.
        let f = unsafe { t.b.widen64(&t.regs, wp[r].add(l)) };
        for q in 0..MR {
            for (i, &fv) in f.iter().enumerate() {
                // SAFETY: the caller guarantees 64 readable f32s; 16 * i + 16 <= 64.
                let xv = unsafe { t.v.load(xp[q].add(l + 16 * i)) };
                acc[q][r] = t.v.fma(fv, xv, acc[q][r]);
            }
        }
    }
}

/// A task of a linear layer through [`BytesTiler`].
#[cfg(target_arch = "x86_64")]
struct BytesTask<'a, W, Y> {
    task: LinearTask<'a, W, Y>,
    bytes: &'static Fp8Bytes,
}

#[cfg(target_arch = "x86_64")]
impl<W: Elem, Y: Float> VbmiKernel for BytesTask<'_, W, Y> {
    type Output = ();

    #[inline(always)]
    fn run(self, v: Avx512, b: Vbmi) {
        let tiler = BytesTiler { v, b, regs: b.regs(self.bytes), nan_lost: self.bytes.nan_lost };
        task::<W, Y, _, 1, GEMV_ROWS>(tiler, &self.task);
    }
}

/// x's `m` rows of `k` columns in the layout of [`Vbmi::widen64`]: rows of `k` rounded up to
/// 64, each block of 64 permuted by [`x64_column`], the padding zero.
#[cfg(target_arch = "x86_64")]
fn permute_x64(x: &[f32], m: usize, k: usize, out: &mut [f32]) {
    const COLUMN: [usize; BYTES_STEP] = {
        let mut c = [0; BYTES_STEP];
        let mut i = 0;
        while i < BYTES_STEP {
            c[i] = x64_column(i);
            i += 1;
        }
        c
    };
    let kp = k.next_multiple_of(BYTES_STEP);
    assert!(x.len() >= m * k && out.len() >= m * kp);
    for (src, dst) in x.chunks_exact(k.max(1)).zip(out.chunks_exact_mut(kp.max(1))).take(m) {
        for (b, block) in dst.chunks_exact_mut(BYTES_STEP).enumerate() {
            let src = &src[b * BYTES_STEP..];
            if let Some(src) = src.first_chunk::<BYTES_STEP>() {
                for (d, &c) in block.iter_mut().zip(&COLUMN) {
                    *d = src[c];
                }
            } else {
                for (d, &c) in block.iter_mut().zip(&COLUMN) {
                    *d = src.get(c).copied().unwrap_or(0.0);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Entry points

pub(crate) fn linear(
    fast: &Fast,
    d: LinearDims,
    x: &HostTensor,
    w: &Linear<HostStorage>,
    y: &mut HostTensor,
) -> Result<()> {
    let op = "linear";
    let scale = Scale::new(op, &w.scale, d.k)?;
    let y_dtype = y.dtype();
    with_scratch(&INPUT_F32, if x.dtype() == DType::F32 { 0 } else { d.m * d.k }, 0.0, |scratch| {
        let xf: &[f32] = match x.dtype() {
            DType::F32 => x.as_slice(),
            DType::BF16 => widen_into(x.as_slice::<bf16>(), scratch),
            DType::F16 => widen_into(x.as_slice::<f16>(), scratch),
            other => {
                return Err(Error::DType { op, tensor: "x", got: other, allowed: DType::ACTIVATIONS.into() });
            }
        };
        match y_dtype {
            DType::F32 => linear_y::<f32>(fast, d, xf, w, scale, y.as_mut_slice(op, "y")?),
            DType::BF16 => linear_y::<bf16>(fast, d, xf, w, scale, y.as_mut_slice(op, "y")?),
            DType::F16 => linear_y::<f16>(fast, d, xf, w, scale, y.as_mut_slice(op, "y")?),
            other => Err(Error::DType { op, tensor: "y", got: other, allowed: DType::ACTIVATIONS.into() }),
        }
    })
}

fn widen_into<'s, T: Elem>(src: &[T], dst: &'s mut [f32]) -> &'s [f32] {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.widen();
    }
    dst
}

fn linear_y<Y: Float>(
    fast: &Fast,
    d: LinearDims,
    x: &[f32],
    w: &Linear<HostStorage>,
    scale: Scale<'_>,
    y: &mut [Y],
) -> Result<()> {
    with_float_type!(w.weight.dtype(), W => {
        linear_wy::<W, Y>(fast, d, x, w.weight.as_slice::<W>(), scale, y);
        Ok(())
    }, else => Err(Error::DType {
        op: "linear", tensor: "weight", got: w.weight.dtype(), allowed: DType::FLOATS.into()
    }))
}

fn linear_wy<W: Elem, Y: Float>(
    fast: &Fast,
    d: LinearDims,
    x: &[f32],
    w: &[W],
    scale: Scale<'_>,
    y: &mut [Y],
) {
    let (x_tile, w_tile) = tile_of(d.m, fast.simd.lanes());
    let p = plan(d, fast.threads, x_tile, w_tile);
    let out = OutPtr { ptr: y.as_mut_ptr(), len: y.len(), cols: d.n };
    let simd = fast.simd;
    #[cfg(target_arch = "x86_64")]
    if let (Some((v, b)), Some(bytes)) = (simd.vbmi(), W::BYTES)
        && d.m == 1
        && match scale {
            Scale::Block { cols, .. } => cols.is_multiple_of(BYTES_STEP),
            _ => true,
        }
    {
        let kp = d.k.next_multiple_of(BYTES_STEP);
        with_scratch(&X_PERMUTED, d.m * kp, 0.0, |xp| {
            permute_x64(x, d.m, d.k, xp);
            let xp: &[f32] = xp;
            fast.for_each_task(p.tasks, d.m * d.n * d.k, |t| {
                let j0 = t * p.rows_per_task;
                let j1 = d.n.min(j0 + p.rows_per_task);
                let (x_block, k) = (p.x_block, d.k);
                let task = LinearTask { x: xp, x_stride: kp, m: d.m, k, w, scale, x_block, j0, j1, y: out };
                run_vbmi(v, b, BytesTask { task, bytes });
            });
        });
        return;
    }
    let fold = match scale {
        Scale::Block { rows, .. } => rows >= FOLD_MIN_ROWS && !scaled_fit(x_tile, w_tile, fast.simd.lanes()),
        _ => false,
    };
    fast.for_each_task(p.tasks, d.m * d.n * d.k, |t| {
        let j0 = t * p.rows_per_task;
        let j1 = d.n.min(j0 + p.rows_per_task);
        let task =
            LinearTask { x, x_stride: d.k, m: d.m, k: d.k, w, scale, x_block: p.x_block, j0, j1, y: out };
        if fold {
            let len = p.x_block.min(d.m) * d.k;
            with_scratch(&X_FOLDED, len, 0.0, |folded| simd.run(FoldedTask { task, folded }));
        } else {
            simd.run(task);
        }
    });
}

/// `out[r] = table[ids[r]]`, dequantised (each element times its scale).
pub(crate) fn embedding(
    fast: &Fast,
    d: GatherDims,
    table: &Linear<HostStorage>,
    ids: &HostTensor,
    out: &mut HostTensor,
) -> Result<()> {
    let op = "embedding";
    let ids = ids.as_slice::<u32>();
    for (row, &id) in ids.iter().enumerate() {
        if id as usize >= d.rows {
            return Err(Error::TokenOutOfRange { op, row, id, vocab: d.rows });
        }
    }
    let scale = Scale::new(op, &table.scale, d.cols)?;
    let out = out.as_mut_slice::<f32>(op, "out")?;
    let cols = d.cols;
    with_float_type!(table.weight.dtype(), T => {
        let t = table.weight.as_slice::<T>();
        fast.for_each_chunk(out, cols, d.picked * cols, |r, o| {
            let j = ids[r] as usize;
            for (l, (o, w)) in o.iter_mut().zip(&t[j * cols..(j + 1) * cols]).enumerate() {
                *o = w.widen() * scale.at(j, l);
            }
        });
        Ok(())
    }, else => Err(Error::DType {
        op, tensor: "table", got: table.weight.dtype(), allowed: DType::FLOATS.into()
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Backend;
    use crate::cpu::fast::simd::Simd;
    use crate::cpu::fast::testutil::{Rng, assert_close, backends};
    use crate::dtype::decode_f32;

    /// The scale layouts under test.
    #[derive(Clone, Copy, Debug)]
    enum ScaleKind {
        None,
        PerTensor,
        PerChannel(DType),
        /// block rows, block cols, scale dtype
        Block(usize, usize, DType),
    }

    /// The scale of weight element `(j, l)`, for the f64 loop.
    type ScaleOf = Box<dyn Fn(usize, usize) -> f64>;

    /// Runs `y = x . W^T` through `fast` and compares with an f64 loop over the stored values.
    ///
    /// Tolerance: each output is an f32 sum of k products (FMA: one rounding per step of a lane's
    /// chain, then a tree of LANES partial sums), times a block or row scale (one more rounding),
    /// so |err| <= (k + 4) * 2^-24 * sum |x w s| (a loose form of the gamma_n bound); plus half an
    /// ulp of y's type for the final rounding.
    #[allow(clippy::too_many_arguments)]
    fn check(
        fast: &Fast,
        m: usize,
        n: usize,
        k: usize,
        wt: DType,
        xt: DType,
        yt: DType,
        sk: ScaleKind,
        seed: u64,
    ) {
        let mut rng = Rng::new(seed);
        let x = fast.upload_f32(xt, &[m, k], &rng.vec(m * k)).unwrap();
        let weight = fast.upload_f32(wt, &[n, k], &rng.vec(n * k)).unwrap();
        let xs = decode_f32(xt, &fast.read(&x).unwrap()).unwrap();
        let ws = decode_f32(wt, &fast.read(&weight).unwrap()).unwrap();
        // Scales in [0.5, 2) with random sign, stored then decoded.
        let mut scales = |len: usize, dt: DType| {
            let v: Vec<f32> =
                (0..len).map(|_| rng.uniform() * 0.75 + 1.25 * rng.uniform().signum()).collect();
            let t = fast.upload_f32(dt, &[len], &v).unwrap();
            let vals = decode_f32(dt, &fast.read(&t).unwrap()).unwrap();
            (t, vals)
        };
        let (scale, s_of): (WeightScale<HostStorage>, ScaleOf) = match sk {
            ScaleKind::None => (WeightScale::None, Box::new(|_, _| 1.0)),
            ScaleKind::PerTensor => (WeightScale::PerTensor(-0.375), Box::new(|_, _| -0.375)),
            ScaleKind::PerChannel(dt) => {
                let (t, v) = scales(n, dt);
                (WeightScale::PerChannel(t), Box::new(move |j, _| v[j] as f64))
            }
            ScaleKind::Block(br, bc, dt) => {
                let (rows, cols) = (n.div_ceil(br), k.div_ceil(bc));
                let (t, v) = scales(rows * cols, dt);
                let t = t.reshape(&[rows, cols]).unwrap();
                (
                    WeightScale::Block { block_rows: br, block_cols: bc, scales: t },
                    Box::new(move |j, l| v[(j / br) * cols + l / bc] as f64),
                )
            }
        };
        let w = Linear { weight, scale };
        let mut y = fast.alloc(yt, &[m, n]).unwrap();
        fast.linear(&x, &w, &mut y).unwrap();
        let got = fast.read_f32(&y).unwrap();

        let mut want = vec![0.0f64; m * n];
        let mut tol = vec![0.0f64; m * n];
        let u_y = yt.unit_roundoff().unwrap();
        for i in 0..m {
            for j in 0..n {
                let (mut acc, mut mag) = (0.0f64, 0.0f64);
                for l in 0..k {
                    let p = xs[i * k + l] as f64 * ws[j * k + l] as f64 * s_of(j, l);
                    acc += p;
                    mag += p.abs();
                }
                want[i * n + j] = acc;
                tol[i * n + j] = (k as f64 + 4.0) * 2f64.powi(-24) * mag + u_y * acc.abs();
            }
        }
        let what = format!("linear {} m={m} n={n} k={k} w={wt} x={xt} y={yt} {sk:?}", fast.simd());
        assert_close(&what, &got, &want, &tol);
    }

    #[test]
    fn every_weight_type_and_odd_shape() {
        for fast in backends() {
            for wt in DType::FLOATS {
                for (m, n, k) in [
                    (1, 1, 1),
                    (1, 3, 3),
                    (1, 5, 17),
                    (1, 7, 4097),
                    (2, 3, 17),
                    (5, 9, 33),
                    (4, 4, 16),
                    (3, 4, 9),
                    (7, 5, 23),
                    (15, 7, 40),
                ] {
                    check(
                        &fast,
                        m,
                        n,
                        k,
                        wt,
                        DType::F32,
                        DType::F32,
                        ScaleKind::None,
                        (m * 31 + n * 7 + k) as u64,
                    );
                }
            }
        }
    }

    #[test]
    fn activation_types() {
        for fast in backends() {
            for xt in DType::ACTIVATIONS {
                for yt in DType::ACTIVATIONS {
                    check(&fast, 1, 5, 19, DType::BF16, xt, yt, ScaleKind::None, 1);
                    check(&fast, 3, 5, 19, DType::BF16, xt, yt, ScaleKind::None, 3);
                    check(&fast, 3, 6, 40, DType::F8E4M3Fn, xt, yt, ScaleKind::PerTensor, 2);
                }
            }
        }
    }

    #[test]
    fn scales() {
        let kinds = [
            ScaleKind::PerTensor,
            ScaleKind::PerChannel(DType::F32),
            ScaleKind::PerChannel(DType::BF16),
            ScaleKind::Block(128, 128, DType::F32),
            // Row blocks of 17 (folded, see FoldedTask): runs of weight rows that end inside tiles.
            ScaleKind::Block(17, 32, DType::BF16),
            ScaleKind::Block(3, 5, DType::BF16),
            ScaleKind::Block(2, 64, DType::BF16),
            ScaleKind::Block(1, 17, DType::F32),
            ScaleKind::Block(1, 34, DType::F32),
            ScaleKind::Block(2, 1, DType::F32),
        ];
        for fast in backends() {
            for sk in kinds {
                for wt in [DType::BF16, DType::F8E4M3Fn, DType::F8E5M2Fnuz] {
                    for (m, n, k) in [(1, 7, 300), (3, 5, 37), (6, 130, 129), (9, 7, 160)] {
                        check(&fast, m, n, k, wt, DType::F32, DType::F32, sk, 7);
                    }
                }
            }
        }
    }

    #[test]
    fn gemm_larger_than_an_x_block() {
        // k = 4100 gives x blocks of 12 rows: 12, 12 and a ragged 5 (a tile of 4 and one of 1).
        // With block scales: each x block folded once per row block (130 rows: 128 and 2).
        for fast in backends() {
            check(&fast, 29, 11, 4100, DType::BF16, DType::F32, DType::F32, ScaleKind::None, 3);
            let sk = ScaleKind::Block(128, 128, DType::F32);
            check(&fast, 29, 130, 4100, DType::F8E4M3Fn, DType::F32, DType::F32, sk, 4);
        }
    }

    #[test]
    fn thread_counts_agree() {
        let mut outs = Vec::new();
        for threads in [1, 2, 3, 8] {
            let fast = Fast::with_threads(threads).unwrap();
            let mut rng = Rng::new(9);
            let x = fast.upload_f32(DType::F32, &[1, 1000], &rng.vec(1000)).unwrap();
            let w = Linear::plain(fast.upload_f32(DType::BF16, &[300, 1000], &rng.vec(300_000)).unwrap());
            let mut y = fast.alloc(DType::F32, &[1, 300]).unwrap();
            fast.linear(&x, &w, &mut y).unwrap();
            outs.push(fast.read_f32(&y).unwrap());
        }
        // The split changes which rows a thread does, never how a row is summed: bit-identical.
        assert!(outs.windows(2).all(|w| w[0] == w[1]));
    }

    #[test]
    fn nan_weights_poison_only_their_row() {
        for fast in backends() {
            for (wt, nan_code) in [
                (DType::F8E4M3Fn, 0x7fu8),
                (DType::F8E4M3Fn, 0xff),
                (DType::F8E4M3Fnuz, 0x80),
                (DType::F8E5M2, 0x7e),
                (DType::F8E5M2Fnuz, 0x80),
            ] {
                // k = 101: whole vectors of 16 and of 64 columns, then a tail of either.
                let (n, k) = (6, 101);
                let mut codes = vec![0x38u8; n * k];
                codes[2 * k + 20] = nan_code; // row 2, vector part
                codes[4 * k + 100] = nan_code; // row 4, tail
                // GEMV and GEMM; no scale, and 2 x 64 blocks (the scaled accumulators).
                for (m, blocked) in [(1, false), (1, true), (3, false), (3, true)] {
                    let weight = fast.upload(wt, &[n, k], &codes).unwrap();
                    let w = if blocked {
                        let scales = fast.upload_f32(DType::F32, &[3, 2], &[0.5; 6]).unwrap();
                        Linear { weight, scale: WeightScale::Block { block_rows: 2, block_cols: 64, scales } }
                    } else {
                        Linear::plain(weight)
                    };
                    let x = fast.upload_f32(DType::F32, &[m, k], &vec![0.25; m * k]).unwrap();
                    // y starts finite and far from every result, so an unwritten element fails.
                    let mut y = fast.upload_f32(DType::F32, &[m, n], &vec![-1e6; m * n]).unwrap();
                    fast.linear(&x, &w, &mut y).unwrap();
                    let y = fast.read_f32(&y).unwrap();
                    // Every finite row is k copies of 0.25 x the code 0x38's value (x the scale).
                    let one = decode_f32(wt, &[0x38]).unwrap()[0] as f64;
                    let want = k as f64 * 0.25 * one * if blocked { 0.5 } else { 1.0 };
                    for (at, &v) in y.iter().enumerate() {
                        let j = at % n;
                        let what = format!("{} {wt} code {nan_code:#x} m {m} blocked {blocked}", fast.simd());
                        if j == 2 || j == 4 {
                            assert!(v.is_nan(), "{what}: row {j} = {v}, want NaN");
                        } else {
                            assert_eq!(v as f64, want, "{what}: row {j}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn plans() {
        let d = |m, n, k| LinearDims { m, n, k };
        // GEMV at a Llama shape: 8 tasks of 512 rows on 2 threads.
        assert_eq!(plan(d(1, 4096, 4096), 2, 1, 8), Plan { rows_per_task: 512, tasks: 8, x_block: 1 });
        // Tiny: one task of one tile.
        assert_eq!(plan(d(1, 3, 5), 2, 1, 4), Plan { rows_per_task: 4, tasks: 1, x_block: 1 });
        // Rows per task stay a multiple of the tile, and cover n.
        for n in [1, 5, 17, 4097, 28672] {
            for threads in [1, 2, 3, 16] {
                let p = plan(d(1, n, 64), threads, 1, 4);
                assert_eq!(p.rows_per_task % 4, 0);
                assert!(p.tasks * p.rows_per_task >= n && (p.tasks - 1) * p.rows_per_task < n);
            }
        }
        // x blocks: as many rows as fit X_BLOCK_BYTES, in whole tiles, at least one tile.
        assert_eq!(plan(d(512, 4096, 4096), 2, 4, 4).x_block, 16);
        assert_eq!(plan(d(512, 4096, 14336), 2, 4, 4).x_block, 4);
        assert_eq!(plan(d(512, 4096, 1 << 20), 2, 4, 4).x_block, 4);
        assert_eq!(plan(d(3, 4096, 64), 2, 2, 4).x_block, 4);
    }

    #[test]
    fn embedding_dequantises_rows() {
        for fast in backends() {
            let (vocab, cols) = (10, 19);
            let mut rng = Rng::new(5);
            let table = fast.upload_f32(DType::F8E4M3Fn, &[vocab, cols], &rng.vec(vocab * cols)).unwrap();
            let stored = fast.read_f32(&table).unwrap();
            let sc: Vec<f32> = (0..vocab).map(|i| 0.5 + i as f32).collect();
            let scales = fast.upload_f32(DType::F32, &[vocab, 1], &sc).unwrap();
            let table = Linear { weight: table, scale: WeightScale::PerChannel(scales) };
            let ids = fast.upload_u32(&[3], &[9, 0, 9]).unwrap();
            let mut out = fast.alloc(DType::F32, &[3, cols]).unwrap();
            fast.embedding(&table, &ids, &mut out).unwrap();
            let got = fast.read_f32(&out).unwrap();
            for (r, &id) in [9usize, 0, 9].iter().enumerate() {
                for c in 0..cols {
                    assert_eq!(got[r * cols + c], stored[id * cols + c] * sc[id]);
                }
            }
            let bad = fast.upload_u32(&[3], &[1, 10, 11]).unwrap();
            let err = fast.embedding(&table, &bad, &mut out).unwrap_err();
            assert_eq!(err, Error::TokenOutOfRange { op: "embedding", row: 1, id: 10, vocab });
        }
    }

    #[test]
    fn tile_against_f64_at_odd_lengths() {
        struct T<'a> {
            x: &'a [&'a [f32]; 2],
            w: &'a [&'a [half::bf16]; 3],
            c0: usize,
            c1: usize,
        }
        impl Kernel for T<'_> {
            type Output = [[f32; 3]; 2];
            #[inline(always)]
            fn run<V: Vector>(self, v: V) -> [[f32; 3]; 2] {
                VectorTiler(v).tile(self.x, self.w, self.c0, self.c1)
            }
        }
        let mut rng = Rng::new(11);
        for simd in Simd::available() {
            for len in [1, 3, 15, 16, 17, 31, 33, 4097] {
                let xs: Vec<Vec<f32>> = (0..2).map(|_| rng.vec(len + 5)).collect();
                let ws: Vec<Vec<half::bf16>> = (0..3)
                    .map(|_| rng.vec(len + 5).into_iter().map(half::bf16::from_f32).collect())
                    .collect();
                let x = [&xs[0][..], &xs[1][..]];
                let w = [&ws[0][..], &ws[1][..], &ws[2][..]];
                let got = simd.run(T { x: &x, w: &w, c0: 2, c1: 2 + len });
                for q in 0..2 {
                    for r in 0..3 {
                        let (mut want, mut mag) = (0.0f64, 0.0f64);
                        for l in 2..2 + len {
                            let p = x[q][l] as f64 * w[r][l].to_f64();
                            want += p;
                            mag += p.abs();
                        }
                        let tol = (len as f64 + 4.0) * 2f64.powi(-24) * mag;
                        let e = (got[q][r] as f64 - want).abs();
                        assert!(e <= tol, "{} len {len} ({q},{r}): {} vs {want}", simd.name(), got[q][r]);
                    }
                }
            }
        }
    }
}
