//! The fast CPU backend: the default, and the one the benches hold against the memory wall.
//!
//! Same semantics as `cpu::Reference` (each op's math is documented in `ops.rs`), computed with
//! f32 accumulation in vector registers on a rayon pool the backend owns:
//! - `linear.rs`: GEMV/GEMM over output rows, weights of every float type widened in registers
//!   (fp8 through f16 bit tricks, or byte tables on CPUs with AVX-512 VBMI), several weight rows
//!   per tile sharing each load of x.
//! - `attention.rs`: KV-cache store and causal grouped-query attention (online softmax), one task
//!   per (row, kv head).
//! - `misc.rs`: the elementwise and per-row ops, embedding, routing, argmax and sampling.
//! - `simd.rs`: the vector types (AVX-512, AVX2+FMA+F16C, portable), the widening loads, the fp8
//!   byte tables (AVX-512 VBMI) and the `#[target_feature]` dispatch. The instruction set is
//!   detected when the backend is made.
//!
//! Data-dependent checks (token ids, slots, positions, gather indices) run over every row before
//! anything is written. Nothing allocates per call on the hot path: per-thread scratch buffers are
//! reused. Weights are read in place, never copied or converted up front.
//!
//! Tests: the unit tests of each file check the micro-kernels and widening against f64 loops;
//! the workspace's proptest suite checks every op against the reference.

mod attention;
mod linear;
mod misc;
mod simd;

use std::cell::Cell;
use std::thread::LocalKey;

use rayon::prelude::*;

use self::simd::Simd;
use crate::ops::{
    AttnDims, GatherDims, KvCacheLayer, Linear, LinearDims, RopeDims, RowsDims, SamplingParams, TopKDims,
};
use crate::{Backend, Error, HostStorage, HostTensor, Result, Rope};

/// Work (elements touched) below which an op runs on the calling thread: waking the pool costs
/// microseconds, more than a few thousand elements of work.
const PAR_MIN_WORK: usize = 1 << 15;

/// The fast CPU backend: rayon over output rows, vectorised inner loops.
#[derive(Debug)]
pub struct Fast {
    pool: rayon::ThreadPool,
    threads: usize,
    simd: Simd,
}

impl Default for Fast {
    fn default() -> Self {
        Fast::new()
    }
}

impl Fast {
    /// A backend using every core this process may run on, with the best instruction set.
    ///
    /// # Panics
    /// If the operating system refuses to start even one worker thread.
    pub fn new() -> Fast {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        match Fast::with_threads(threads).or_else(|_| Fast::with_threads(1)) {
            Ok(f) => f,
            Err(e) => panic!("cannot start the CPU backend's worker thread: {e}"),
        }
    }

    /// A backend with a pool of `threads` workers, with the best instruction set.
    pub fn with_threads(threads: usize) -> Result<Fast> {
        Fast::build(threads, Simd::detect())
    }

    /// A backend with a pool of `threads` workers and the named instruction set (one of
    /// [`Fast::simd_available`]: `avx512vbmi`, `avx512`, `avx2`, `portable`). For tests and
    /// benches that compare the kernels of each instruction set.
    pub fn with_simd(threads: usize, simd: &str) -> Result<Fast> {
        let level = Simd::from_name(simd).ok_or_else(|| Error::Unsupported {
            backend: "cpu",
            op: "with_simd",
            reason: format!(
                "instruction set `{simd}` is unknown or missing on this CPU (available: {:?})",
                Fast::simd_available()
            ),
        })?;
        Fast::build(threads, level)
    }

    /// The instruction sets this CPU can run, best first.
    pub fn simd_available() -> Vec<&'static str> {
        Simd::available().into_iter().map(Simd::name).collect()
    }

    /// Worker threads in the pool.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The instruction set the kernels use.
    pub fn simd(&self) -> &'static str {
        self.simd.name()
    }

    fn build(threads: usize, simd: Simd) -> Result<Fast> {
        if threads == 0 {
            return Err(Error::Argument { op: "Fast::with_threads", msg: "0 threads".into() });
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("memwall-cpu-{i}"))
            .build()
            .map_err(|e| Error::Unsupported {
                backend: "cpu",
                op: "with_threads",
                reason: format!("cannot start {threads} worker threads: {e}"),
            })?;
        Ok(Fast { pool, threads, simd })
    }

    /// Runs `f(t)` for every task `t < tasks`: on the pool, or in order on the calling thread when
    /// `work` (elements touched) is too small to pay for waking the pool.
    fn for_each_task(&self, tasks: usize, work: usize, f: impl Fn(usize) + Sync + Send) {
        if tasks <= 1 || work < PAR_MIN_WORK {
            (0..tasks).for_each(f);
        } else {
            self.pool.install(|| (0..tasks).into_par_iter().for_each(f));
        }
    }

    /// Runs `f(index, chunk)` over `data` in chunks of `chunk` elements (the last may be shorter),
    /// on the pool or, for small `work`, on the calling thread.
    fn for_each_chunk<T: Send>(
        &self,
        data: &mut [T],
        chunk: usize,
        work: usize,
        f: impl Fn(usize, &mut [T]) + Sync + Send,
    ) {
        let chunk = chunk.max(1);
        if data.len() <= chunk || work < PAR_MIN_WORK {
            data.chunks_mut(chunk).enumerate().for_each(|(i, c)| f(i, c));
        } else {
            self.pool.install(|| data.par_chunks_mut(chunk).enumerate().for_each(|(i, c)| f(i, c)));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Per-thread scratch

thread_local! {
    /// Inputs widened on the calling thread (the x of a linear layer).
    static INPUT_F32: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    /// x of a linear layer permuted for the fp8 byte-table kernel (`linear.rs`).
    #[cfg(target_arch = "x86_64")]
    static X_PERMUTED: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    /// x times a row block's column scales, per GEMM task with block scales (`linear.rs`).
    static X_FOLDED: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    /// Per-task scratch on the worker threads (attention scores, rope angles).
    static TASK_F32: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    /// A prefill tile's queries, outputs and scores with heads in vector lanes (attention).
    static WIDE_F32: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    /// Attention's partial results per span of a row, on the calling thread.
    static SPANS_F32: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    /// Per-row f64 scratch (router and sampling probabilities).
    static TASK_F64: Cell<Vec<f64>> = const { Cell::new(Vec::new()) };
    /// Per-row candidate indices (router and sampling order).
    static TASK_U32: Cell<Vec<u32>> = const { Cell::new(Vec::new()) };
}

/// Runs `f` with this thread's reusable buffer from `key`, `len` elements, filled with `fill`,
/// starting on a cache line (`SCRATCH_ALIGN`). The buffer is taken out of the cell while `f`
/// runs, so a nested use on the same thread gets a fresh one instead of aliasing; it allocates
/// only when it has to grow.
fn with_scratch<T: Copy + 'static, R>(
    key: &'static LocalKey<Cell<Vec<T>>>,
    len: usize,
    fill: T,
    f: impl FnOnce(&mut [T]) -> R,
) -> R {
    const { assert!(size_of::<T>() > 0 && SCRATCH_ALIGN.is_multiple_of(size_of::<T>())) };
    let pad = SCRATCH_ALIGN / size_of::<T>();
    let mut buf = key.with(Cell::take);
    buf.clear();
    buf.resize(len + pad, fill);
    let at = buf.as_ptr().align_offset(SCRATCH_ALIGN).min(pad);
    let r = f(&mut buf[at..at + len]);
    key.with(|c| c.set(buf));
    r
}

/// Where scratch buffers start: a cache line. The allocator aligns large buffers to 16 bytes
/// only, so every 64-byte vector load of a row of whole vectors would straddle two lines; a GEMM
/// with block scales reading x from scratch (`linear.rs`, `FoldedTask`) measured about a third
/// slower so than from a tensor (Intel Xeon VM, AVX-512, one thread).
const SCRATCH_ALIGN: usize = 64;

impl Backend for Fast {
    type Storage = HostStorage;
    /// The CPU records nothing: `capture` is `Ok(None)`.
    type Graph = std::convert::Infallible;

    fn name(&self) -> &'static str {
        "cpu"
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
        linear::linear(self, d, x, w, y)
    }
    fn exec_rms_norm(
        &self,
        d: RowsDims,
        x: &HostTensor,
        weight: &HostTensor,
        eps: f32,
        y: &mut HostTensor,
    ) -> Result<()> {
        misc::rms_norm(self, d, x, weight, eps, y)
    }
    fn exec_rope(&self, d: RopeDims, x: &mut HostTensor, positions: &HostTensor, rope: &Rope) -> Result<()> {
        misc::rope(self, d, x, positions, rope)
    }
    fn exec_silu_mul(
        &self,
        d: RowsDims,
        gate: &HostTensor,
        up: &HostTensor,
        out: &mut HostTensor,
    ) -> Result<()> {
        misc::silu_mul(self, d, gate, up, out)
    }
    fn exec_add_assign(&self, d: RowsDims, x: &mut HostTensor, y: &HostTensor) -> Result<()> {
        misc::add_assign(self, d, x, y)
    }
    fn exec_embedding(
        &self,
        d: GatherDims,
        table: &Linear<HostStorage>,
        ids: &HostTensor,
        out: &mut HostTensor,
    ) -> Result<()> {
        linear::embedding(self, d, table, ids, out)
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
        attention::attention(self, d, q, cache, table, slots, positions, scale, out)
    }
    fn exec_router_topk(
        &self,
        d: TopKDims,
        logits: &HostTensor,
        ids: &mut HostTensor,
        weights: &mut HostTensor,
    ) -> Result<()> {
        misc::router_topk(d, logits, ids, weights)
    }
    fn exec_argmax(&self, d: RowsDims, logits: &HostTensor, out: &mut HostTensor) -> Result<()> {
        misc::argmax(self, d, logits, out)
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
        misc::sample(self, d, logits, params, seeds, steps, out)
    }
    fn exec_gather_rows(
        &self,
        d: GatherDims,
        src: &HostTensor,
        idx: &HostTensor,
        out: &mut HostTensor,
    ) -> Result<()> {
        misc::gather_rows(self, d, src, idx, out)
    }
    fn exec_scatter_add_rows(
        &self,
        d: GatherDims,
        dst: &mut HostTensor,
        idx: &HostTensor,
        src: &HostTensor,
        weights: &HostTensor,
    ) -> Result<()> {
        misc::scatter_add_rows(d, dst, idx, src, weights)
    }
}

#[cfg(test)]
pub(crate) mod testutil {
    //! Helpers shared by the unit tests of the fast backend.

    use super::Fast;

    /// splitmix64: deterministic test inputs without a dependency.
    pub(crate) struct Rng(u64);

    impl Rng {
        pub(crate) fn new(seed: u64) -> Rng {
            Rng(seed)
        }
        pub(crate) fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        /// Uniform in [-1, 1), never exactly 0 or 1 in practice.
        pub(crate) fn uniform(&mut self) -> f32 {
            ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
        pub(crate) fn vec(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.uniform()).collect()
        }
    }

    /// A two-thread backend for every instruction set this CPU has.
    pub(crate) fn backends() -> Vec<Fast> {
        Fast::simd_available().into_iter().map(|s| Fast::with_simd(2, s).expect("backend")).collect()
    }

    /// Fails with the worst element, the count of failures and the first failing index when
    /// `|got - want| > tol` anywhere (NaN must match NaN).
    #[track_caller]
    pub(crate) fn assert_close(what: &str, got: &[f32], want: &[f64], tol: &[f64]) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        let mut bad = Vec::new();
        let mut worst = (0.0f64, 0usize);
        for i in 0..got.len() {
            let (g, w) = (got[i] as f64, want[i]);
            let ok = if w.is_nan() { g.is_nan() } else { (g - w).abs() <= tol[i] };
            if !ok {
                bad.push(i);
            }
            let e =
                if w.is_nan() || g.is_nan() { 0.0 } else { (g - w).abs() / tol[i].max(f64::MIN_POSITIVE) };
            if e > worst.0 {
                worst = (e, i);
            }
        }
        if !bad.is_empty() {
            let i = bad[0];
            panic!(
                "{what}: {} of {} elements off; first at {i}: got {} want {} tol {}; worst err/tol {:.3} at {}",
                bad.len(),
                got.len(),
                got[i],
                want[i],
                tol[i],
                worst.0,
                worst.1
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn construction() {
        let f = Fast::with_threads(3).unwrap();
        assert_eq!(f.threads(), 3);
        assert_eq!(f.simd(), Fast::simd_available()[0]);
        assert!(matches!(Fast::with_threads(0), Err(Error::Argument { .. })));
        assert!(matches!(Fast::with_simd(1, "sse9"), Err(Error::Unsupported { .. })));
        assert!(Fast::simd_available().contains(&"portable"));
        assert_eq!(Fast::default().threads(), std::thread::available_parallelism().map_or(1, |n| n.get()));
        assert_eq!(Fast::new().name(), "cpu");
    }

    #[test]
    fn scratch_is_reused_and_nesting_is_safe() {
        let outer_ptr = with_scratch(&TASK_F32, 100, 1.0, |a| {
            assert!(a.iter().all(|&v| v == 1.0));
            // A nested use gets its own buffer.
            with_scratch(&TASK_F32, 10, 2.0, |b| {
                assert_ne!(a.as_ptr(), b.as_ptr());
                assert!(b.iter().all(|&v| v == 2.0));
            });
            a.as_ptr()
        });
        let again = with_scratch(&TASK_F32, 50, 0.0, |a| a.as_ptr());
        assert_eq!(outer_ptr, again, "the larger buffer is kept and reused");
    }

    #[test]
    fn scratch_starts_on_a_cache_line() {
        for len in [0, 1, 3, 17, 4097, 1 << 20, 5] {
            with_scratch(&TASK_F32, len, 0.5, |a| {
                assert_eq!((a.len(), a.as_ptr() as usize % SCRATCH_ALIGN), (len, 0));
                // Nested: a fresh buffer, aligned too.
                with_scratch(&TASK_F32, len + 1, 0.0, |b| assert_eq!(b.as_ptr() as usize % SCRATCH_ALIGN, 0));
            });
            with_scratch(&TASK_F64, len, 0.5, |a| assert_eq!(a.as_ptr() as usize % SCRATCH_ALIGN, 0));
            with_scratch(&TASK_U32, len, 7, |a| assert_eq!(a.as_ptr() as usize % SCRATCH_ALIGN, 0));
        }
    }
}
