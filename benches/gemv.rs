//! The memory wall on this machine, in one run (`cargo bench`):
//! 1. the memory ceiling (`memwall::peak`): streaming read and copy on every thread, over a working
//!    set of `max(3 x LLC, 1 GiB)`;
//! 2. GEMV (`y[1, n] = x[1, k] . W[n, k]^T`, f32 activations) through the `Backend` trait on the
//!    default backend, at the Llama 3.1 8B layer shapes, weights bf16 (no scale) and e4m3fn with
//!    per-channel f32 scales. Each shape rotates over enough copies of its weight (and scales) to
//!    fill the same working set, so every call reads its weight from memory, not from cache.
//!    Where the default level is `avx512vbmi` (fp8 widened through byte tables), e4m3fn at the
//!    down_proj shape runs once more on the `avx512` level (f16 widening), for the ratio; and
//!    e4m3fn with 128 x 128 block scales (DeepSeek-style checkpoints) runs at the down_proj
//!    shape, with its ratio to per-channel scales;
//! 3. decode attention (`gemv/attention.rs`) at the Llama 3.1 8B heads over 8192 cached
//!    positions, bf16 cache at batch 1, 4 and 16 and f32 at batch 1, each rotated over cache
//!    copies that fill the same working set;
//! 4. one line per GEMV shape and dtype and per attention case against the read peak, like with
//!    like: the figure is its best full rotation (every copy once: at least the working set
//!    streamed, timed here call by call in the same loop criterion times), the read peak is the
//!    best read pass (the working set streamed once). Read passes are also taken before each
//!    case and after the last, so a machine shared with other work is not judged by one quiet or
//!    busy moment.
//!
//! `MEMWALL_BENCH_SIMD=<level>` (`avx512vbmi`, `avx512`, `avx2`, `portable`; one this CPU has)
//! runs the GEMV and attention cases on that instruction set's kernels instead of the best.
//!
//! Bytes are `memwall_runtime::cost::linear_bytes` (weight + scales + x + y) and `StreamBuffers::
//! bytes_per_pass` (read + written), in decimal GB. A GEMV above the read peak is a bench bug (or
//! a read kernel that is not the ceiling); the summary says so when it happens.
//! Sized for a few minutes on 2 cores: 10 samples, short warm-up and measurement times, no plots
//! (`cargo bench -- --plotting-backend plotters` draws them).

use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{Bencher, BenchmarkGroup, Criterion, SamplingMode, Throughput};
use memwall::peak::{self, Kernel, StreamBuffers};
use memwall::runtime::cost::{ScaleLayout, linear_bytes};
use memwall::runtime::dtype::decode_f32;
use memwall::runtime::{Backend, DType, HostStorage, HostTensor, Linear, WeightScale};
use rayon::ThreadPool;

#[path = "gemv/attention.rs"]
mod attention;
#[path = "shared/common.rs"]
mod common;
use common::splitmix;
use rayon::prelude::*;

/// Llama 3.1 8B projections of one layer, `(n rows, k cols)`.
const SHAPES: [(usize, usize); 4] = [
    // q_proj and o_proj.
    (4096, 4096),
    // q, k and v fused: 4096 + 2 x 1024.
    (6144, 4096),
    // gate and up fused: 2 x 14336.
    (28672, 4096),
    // down_proj.
    (4096, 14336),
];

const WEIGHT_DTYPES: [DType; 2] = [DType::BF16, DType::F8E4M3Fn];

/// The block scales of the block-scaled run: f32 per 128 x 128, as published fp8 checkpoints with
/// a `weight_block_size` ship them.
const BLOCK_128: ScaleLayout = ScaleLayout::Block { block_rows: 128, block_cols: 128, dtype: DType::F32 };

/// The scales the bench gives a weight of `dtype` by default: per-channel f32 for fp8, else none.
fn default_scale(dtype: DType) -> ScaleLayout {
    if dtype.is_fp8() { ScaleLayout::PerChannel(DType::F32) } else { ScaleLayout::None }
}

/// Read passes taken before each GEMV shape and after the last.
const READ_PASSES_BETWEEN: usize = 5;

/// What the summary needs from one GEMV benchmark.
struct GemvRun {
    /// The fast backend's instruction set when it is not the default's (the comparison run).
    level: Option<&'static str>,
    dtype: DType,
    scale: ScaleLayout,
    n: usize,
    k: usize,
    timed: Rotated,
}

/// The timed calls of a benchmark that rotates over `copies` copies of its operands.
struct Rotated {
    bytes_per_call: u64,
    copies: usize,
    /// Every timed call, in order: call `i` used copy `i % copies`.
    calls: Vec<Duration>,
}

impl Rotated {
    fn rotations(&self) -> Vec<Duration> {
        self.calls.chunks_exact(self.copies).map(|r| r.iter().sum()).collect()
    }

    fn gb_per_s(&self, rotation: Duration) -> f64 {
        peak::gb_per_s(self.bytes_per_call * self.copies as u64, rotation)
    }

    /// The rate of the shortest complete rotation (copies `0..copies` once each, at least the
    /// working set streamed).
    fn best(&self) -> Option<f64> {
        self.rotations().into_iter().min().map(|r| self.gb_per_s(r))
    }

    /// The rate of the median full rotation: compared with the median read pass, a figure that
    /// one bursty pass of either cannot move (this VM's read bandwidth jumps between ~35 and ~60
    /// GB/s).
    fn median(&self) -> Option<f64> {
        median(&self.rotations()).map(|r| self.gb_per_s(r))
    }

    /// Times `call(copy)` in criterion's loop, the copies in turn from `next`, each call's time
    /// kept.
    fn time(&mut self, bench: &mut Bencher<'_>, next: &mut usize, mut call: impl FnMut(usize)) {
        bench.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let copy = *next % self.copies;
                *next += 1;
                let start = Instant::now();
                call(copy);
                let dt = start.elapsed();
                total += dt;
                self.calls.push(dt);
            }
            total
        })
    }

    /// `<label>: X GB/s = P% of measured read peak R GB/s (median ...)`, or None before any
    /// full rotation.
    fn line(&self, label: &str, read: &Rates) -> Option<String> {
        let best = self.best()?;
        let median = self.median().map_or(String::new(), |m| {
            format!(
                " (median {m:.1} GB/s = {:.1}% of median read {:.1} GB/s)",
                100.0 * m / read.median,
                read.median
            )
        });
        Some(format!(
            "{label}: {best:.1} GB/s = {:.1}% of measured read peak {:.1} GB/s{median}",
            100.0 * best / read.best,
            read.best
        ))
    }
}

fn main() {
    let started = Instant::now();
    // No plots unless asked for (`-- --plotting-backend plotters`): on 2 cores they cost more
    // time than the measurements.
    let mut c = Criterion::default()
        .without_plots()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();

    let llc = peak::llc_bytes();
    let working_set = peak::working_set_for(llc);
    let threads = peak::max_threads();
    let llc_text = llc.map_or("unknown".to_string(), |l| format!("{} MiB", l >> 20));
    let backend = match std::env::var("MEMWALL_BENCH_SIMD") {
        // Another instruction set than the best, to time its kernels on this CPU.
        Ok(level) => {
            // `max_threads` is the count `default_backend` uses: every core this process may use.
            match memwall::runtime::cpu::Fast::with_simd(threads, &level) {
                Ok(b) => b,
                Err(e) => {
                    eprintln!("MEMWALL_BENCH_SIMD: {e}");
                    std::process::exit(2);
                }
            }
        }
        Err(_) => memwall::default_backend(),
    };
    println!(
        "memwall bench: LLC {llc_text}, working set {:.3} GB = max({} x LLC, 1 GiB), {threads} threads, \
         cpu kernels {}",
        working_set as f64 / 1e9,
        peak::LLC_FACTOR,
        backend.simd()
    );

    let mut ceiling = Ceiling::new(working_set, threads);
    ceiling.bench(&mut c);

    let mut runs = Vec::new();
    for dtype in WEIGHT_DTYPES {
        for (n, k) in SHAPES {
            ceiling.sample_read(READ_PASSES_BETWEEN);
            runs.push(bench_gemv(&mut c, &backend, None, dtype, default_scale(dtype), n, k, working_set));
        }
    }
    // Where the default widens fp8 through byte tables, the widening it replaced, at one shape
    // (down_proj), for a like-for-like ratio in this run.
    if backend.simd() == "avx512vbmi" {
        let level = "avx512";
        let other = memwall::runtime::cpu::Fast::with_simd(backend.threads(), level).expect("avx512 level");
        let (n, k) = SHAPES[3];
        ceiling.sample_read(READ_PASSES_BETWEEN);
        let scale = default_scale(DType::F8E4M3Fn);
        runs.push(bench_gemv(&mut c, &other, Some(level), DType::F8E4M3Fn, scale, n, k, working_set));
    }
    // Block scales against the per-channel run of the same shape.
    let (n, k) = SHAPES[3];
    ceiling.sample_read(READ_PASSES_BETWEEN);
    runs.push(bench_gemv(&mut c, &backend, None, DType::F8E4M3Fn, BLOCK_128, n, k, working_set));
    let mut attention_runs = Vec::new();
    for case in attention::CASES {
        ceiling.sample_read(READ_PASSES_BETWEEN);
        attention_runs.push(attention::bench_attention(&mut c, &backend, case, working_set));
    }
    ceiling.sample_read(READ_PASSES_BETWEEN);
    c.final_summary();

    println!();
    let read = ceiling.read_rates();
    let copy = ceiling.copy_rates();
    println!(
        "memory ceiling ({threads} threads): read best {:.1} GB/s, median {:.1} GB/s over {} passes; \
         copy best {:.1} GB/s, median {:.1} GB/s over {} passes",
        read.best, read.median, read.passes, copy.best, copy.median, copy.passes
    );
    println!(
        "gemv figures: best full rotation over the weight copies against the best read pass; \
         in brackets, median rotation against median read pass"
    );
    for run in &runs {
        let label = format!(
            "gemv {} {}x{}{}{}",
            run.dtype.name(),
            run.n,
            run.k,
            block_text(run.scale),
            run.level.map_or(String::new(), |l| format!(" on {l}"))
        );
        let Some(achieved) = print_figure(&label, &run.timed, &read) else {
            continue;
        };
        // A comparison run against the default's run of the same dtype and shape with the default
        // scales.
        let same = |r: &&GemvRun| {
            r.level.is_none()
                && r.scale == default_scale(r.dtype)
                && (r.dtype, r.n, r.k) == (run.dtype, run.n, run.k)
        };
        let base = runs.iter().find(same).and_then(|r| r.timed.best());
        match (run.level, base) {
            (Some(level), Some(ours)) => println!(
                "  fp8 widening: byte tables ({}) {ours:.1} GB/s = {:.2}x the f16 path ({level}) at this shape",
                backend.simd(),
                ours / achieved
            ),
            (None, Some(per_channel)) if run.scale != default_scale(run.dtype) => println!(
                "  block scales: {achieved:.1} GB/s = {:.2}x per-channel scales ({per_channel:.1} GB/s) at this \
                 shape",
                achieved / per_channel
            ),
            _ => {}
        }
    }
    println!(
        "decode attention figures: best full rotation over the cache copies against the best read \
         pass; in brackets, medians"
    );
    for run in &attention_runs {
        print_figure(&run.label(), &run.timed, &read);
    }
    println!("bench wall time: {:.1} s", started.elapsed().as_secs_f64());
}

/// Prints `timed`'s line against the read peak (with a warning above it) and returns its best
/// rate; nothing before a full rotation.
fn print_figure(label: &str, timed: &Rotated, read: &Rates) -> Option<f64> {
    let line = timed.line(label, read)?;
    println!("{line}");
    let best = timed.best()?;
    if best > read.best {
        println!("  warning: above the read peak: operands from cache, or a read kernel below the ceiling");
    }
    Some(best)
}

// ---------------------------------------------------------------------------------------------
// The memory ceiling

/// The streaming buffers, their pool, and every pass timed in this run.
struct Ceiling {
    buffers: StreamBuffers,
    pool: ThreadPool,
    read: Vec<Duration>,
    copy: Vec<Duration>,
}

/// Summary of a kernel's passes, in GB/s.
struct Rates {
    best: f64,
    median: f64,
    passes: usize,
}

impl Ceiling {
    fn new(working_set: u64, threads: usize) -> Self {
        let buffers = StreamBuffers::new(working_set).expect("allocate the peak working set");
        let pool = peak::thread_pool(threads).expect("start the peak thread pool");
        Ceiling { buffers, pool, read: Vec::new(), copy: Vec::new() }
    }

    /// Read and copy as criterion benchmarks, every pass kept.
    fn bench(&mut self, c: &mut Criterion) {
        let mut group = c.benchmark_group("peak");
        // One pass is tens of milliseconds: flat sampling keeps the pass count small.
        group.sampling_mode(SamplingMode::Flat).measurement_time(Duration::from_secs(1));
        bench_stream(&mut group, &mut self.buffers, &self.pool, Kernel::Read, &mut self.read);
        bench_stream(&mut group, &mut self.buffers, &self.pool, Kernel::Copy, &mut self.copy);
        group.finish();
    }

    /// `n` more read passes outside criterion.
    fn sample_read(&mut self, n: usize) {
        for _ in 0..n {
            self.read.push(self.buffers.pass(Kernel::Read, &self.pool).expect("read pass"));
        }
    }

    fn rates(&mut self, kernel: Kernel) -> Rates {
        let bytes = self.buffers.bytes_per_pass(kernel);
        let passes = if kernel == Kernel::Read { &mut self.read } else { &mut self.copy };
        // Filtered out on the command line: measure here, the summary needs it.
        if passes.is_empty() {
            self.buffers.pass(kernel, &self.pool).expect("warm-up pass");
            for _ in 0..5 {
                passes.push(self.buffers.pass(kernel, &self.pool).expect("pass"));
            }
        }
        let best = passes.iter().copied().min().unwrap_or(Duration::ZERO);
        let median = median(passes).unwrap_or(Duration::ZERO);
        Rates {
            best: peak::gb_per_s(bytes, best),
            median: peak::gb_per_s(bytes, median),
            passes: passes.len(),
        }
    }

    fn read_rates(&mut self) -> Rates {
        self.rates(Kernel::Read)
    }

    fn copy_rates(&mut self) -> Rates {
        self.rates(Kernel::Copy)
    }
}

/// One streaming kernel as a criterion benchmark; every pass's time goes to `passes`.
fn bench_stream(
    group: &mut BenchmarkGroup<'_, WallTime>,
    buffers: &mut StreamBuffers,
    pool: &ThreadPool,
    kernel: Kernel,
    passes: &mut Vec<Duration>,
) {
    group.throughput(Throughput::BytesDecimal(buffers.bytes_per_pass(kernel)));
    group.bench_function(format!("{kernel}/{}t", pool.current_num_threads()), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let dt = buffers.pass(kernel, pool).expect("peak pass");
                total += dt;
                passes.push(dt);
            }
            total
        })
    });
}

// ---------------------------------------------------------------------------------------------
// GEMV

/// The rotated weights of one shape and dtype, with its input and output.
struct GemvSetup {
    weights: Vec<Linear<HostStorage>>,
    x: HostTensor,
    y: HostTensor,
    next: usize,
}

#[allow(clippy::too_many_arguments)]
fn bench_gemv<B: Backend<Storage = HostStorage>>(
    c: &mut Criterion,
    backend: &B,
    level: Option<&'static str>,
    dtype: DType,
    scale: ScaleLayout,
    n: usize,
    k: usize,
    working_set: u64,
) -> GemvRun {
    let bytes_per_call = linear_bytes(1, n, k, dtype, scale, DType::F32).expect("bytes of a llama shape");
    // What one copy of the weight occupies: its elements and its scales.
    let weight_bytes = (n * k * dtype.size()) as u64 + scale.bytes(n, k).expect("scale bytes");
    let copies = usize::try_from(working_set.div_ceil(weight_bytes).max(2)).expect("copies fit usize");

    let level_suffix = level.map_or(String::new(), |l| format!("_{l}"));
    let block_suffix = block_text(scale).replace(' ', "_");
    let mut group = c.benchmark_group(format!("gemv_{}{block_suffix}{level_suffix}", dtype.name()));
    group.throughput(Throughput::BytesDecimal(bytes_per_call));
    let mut timed = Rotated { bytes_per_call, copies, calls: Vec::new() };
    // Built on the first call, so a benchmark filtered out on the command line costs nothing;
    // criterion only counts the time `iter_custom` returns.
    let mut setup: Option<GemvSetup> = None;
    let mut setup_time = Duration::ZERO;
    group.bench_function(format!("{n}x{k}"), |b| {
        let s = setup.get_or_insert_with(|| {
            let start = Instant::now();
            let weights: Vec<Linear<HostStorage>> =
                (0..copies).map(|i| random_linear(backend, dtype, scale, n, k, 1000 + i as u64)).collect();
            let x_values = random_unit_f32(k, 7);
            let x = backend.upload_f32(DType::F32, &[1, k], &x_values).expect("upload x");
            let mut y = backend.alloc(DType::F32, &[1, n]).expect("allocate y");
            check_gemv(backend, &weights[0], &x_values, &x, &mut y);
            setup_time = start.elapsed();
            GemvSetup { weights, x, y, next: 0 }
        });
        let GemvSetup { weights, x, y, next } = s;
        timed.time(b, next, |i| {
            backend.linear(x, &weights[i], y).expect("linear");
            backend.synchronize().expect("synchronize");
        });
    });
    group.finish();
    print_setup(&timed, weight_bytes, setup_time);
    // `setup` drops here: the next shape allocates into the memory this one frees.
    GemvRun { level, dtype, scale, n, k, timed }
}

/// `(C copies of X MB = Y GB rotated, filled in S s; N calls timed, median call R GB/s)`.
fn print_setup(timed: &Rotated, copy_bytes: u64, setup_time: Duration) {
    if let Some(median) = median(&timed.calls) {
        println!(
            "  ({} copies of {:.1} MB = {:.2} GB rotated, filled in {:.1} s; {} calls timed, median call \
             {:.1} GB/s)",
            timed.copies,
            copy_bytes as f64 / 1e6,
            (timed.copies as u64 * copy_bytes) as f64 / 1e9,
            setup_time.as_secs_f64(),
            timed.calls.len(),
            peak::gb_per_s(timed.bytes_per_call, median)
        );
    }
}

fn median(d: &[Duration]) -> Option<Duration> {
    let mut v = d.to_vec();
    v.sort_unstable();
    v.get(v.len() / 2).copied()
}

// ---------------------------------------------------------------------------------------------
// Inputs

/// splitmix64: one 64-bit draw per step.
/// A bf16 in (-1, 1) from 16 random bits: 7 mantissa bits, a sign, and an exponent below 2^0 given
/// by the leading zeros of the top byte (geometric, as for a uniform draw), capped at 7, so the
/// magnitude lies in [2^-8, 1). Never zero, subnormal, infinite or NaN.
fn bf16_unit_bits(r: u16) -> u16 {
    let mantissa = r & 0x7f;
    let sign = (r >> 7) & 1;
    let below = ((r >> 8) as u8).leading_zeros().min(7) as u16;
    (sign << 15) | ((126 - below) << 7) | mantissa
}

/// An e4m3fn (bias 7) in (-1, 1) from 8 random bits: 3 mantissa bits, a sign, and an exponent
/// field 6 minus the leading zeros of the top nibble (0..=4), so the magnitude lies in [2^-5, 1).
/// Never zero, subnormal or NaN.
fn e4m3fn_unit_bits(r: u8) -> u8 {
    let mantissa = r & 0x7;
    let sign = (r >> 3) & 1;
    let below = (r >> 4).leading_zeros() as u8 - 4;
    (sign << 7) | ((6 - below) << 3) | mantissa
}

/// Elements filled per rayon task; each task seeds its own generator.
const FILL_CHUNK: usize = 1 << 16;

fn fill_weight(w: &mut HostTensor, seed: u64) {
    match w.dtype() {
        DType::BF16 => {
            let v = w.as_mut_slice::<u16>("bench", "weight").expect("owned weight");
            v.par_chunks_mut(FILL_CHUNK).enumerate().for_each(|(i, chunk)| {
                let mut state = seed ^ ((i as u64) << 20);
                for quad in chunk.chunks_mut(4) {
                    let r = splitmix(&mut state);
                    for (j, e) in quad.iter_mut().enumerate() {
                        *e = bf16_unit_bits((r >> (16 * j)) as u16);
                    }
                }
            });
        }
        DType::F8E4M3Fn => {
            let v = w.as_mut_slice::<u8>("bench", "weight").expect("owned weight");
            v.par_chunks_mut(FILL_CHUNK).enumerate().for_each(|(i, chunk)| {
                let mut state = seed ^ ((i as u64) << 20);
                for oct in chunk.chunks_mut(8) {
                    let r = splitmix(&mut state);
                    for (j, e) in oct.iter_mut().enumerate() {
                        *e = e4m3fn_unit_bits((r >> (8 * j)) as u8);
                    }
                }
            });
        }
        other => panic!("the bench fills bf16 and e4m3fn weights, not {other}"),
    }
    // The generator must give what it promises: finite, non-zero, in [-1, 1].
    let head = &w.storage().bytes()[..4096.min(w.nbytes())];
    let values = decode_f32(w.dtype(), head).expect("decode weight");
    assert!(values.iter().all(|v| v.is_finite() && *v != 0.0 && v.abs() <= 1.0), "bad random weights");
}

/// `len` f32 values uniform in [-1, 1).
fn random_unit_f32(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..len).map(|_| (splitmix(&mut state) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0).collect()
}

/// `" block RxC"` for block scales, else nothing (for labels).
fn block_text(scale: ScaleLayout) -> String {
    match scale {
        ScaleLayout::Block { block_rows, block_cols, .. } => format!(" block {block_rows}x{block_cols}"),
        _ => String::new(),
    }
}

/// A random weight `[n, k]` with f32 scales of the `scale` layout (none, per channel or per
/// block), each in [0.5, 1) / 448 like scales from an amax.
fn random_linear<B: Backend<Storage = HostStorage>>(
    backend: &B,
    dtype: DType,
    scale: ScaleLayout,
    n: usize,
    k: usize,
    seed: u64,
) -> Linear<HostStorage> {
    let mut weight = backend.alloc(dtype, &[n, k]).expect("allocate weight");
    fill_weight(&mut weight, seed.wrapping_mul(0x2545_f491_4f6c_dd1d));
    let values = |len: usize| -> Vec<f32> {
        random_unit_f32(len, seed).iter().map(|u| (0.75 + 0.25 * u) / 448.0).collect()
    };
    let scale = match scale {
        ScaleLayout::None => WeightScale::None,
        ScaleLayout::PerChannel(DType::F32) => {
            WeightScale::PerChannel(backend.upload_f32(DType::F32, &[n], &values(n)).expect("upload scales"))
        }
        ScaleLayout::Block { block_rows, block_cols, dtype: DType::F32 } => {
            let shape = [n.div_ceil(block_rows), k.div_ceil(block_cols)];
            let scales =
                backend.upload_f32(DType::F32, &shape, &values(shape[0] * shape[1])).expect("upload scales");
            WeightScale::Block { block_rows, block_cols, scales }
        }
        other => panic!("the bench makes no scales of layout {other:?}"),
    };
    Linear { weight, scale }
}

/// The backend must compute the product, not just return: a few rows against an f64 dot product.
fn check_gemv<B: Backend<Storage = HostStorage>>(
    backend: &B,
    w: &Linear<HostStorage>,
    x: &[f32],
    x_tensor: &HostTensor,
    y: &mut HostTensor,
) {
    backend.linear(x_tensor, w, y).expect("linear");
    backend.synchronize().expect("synchronize");
    let [n, k] = [w.weight.shape()[0], w.weight.shape()[1]];
    let row_bytes = k * w.weight.dtype().size();
    // The scale of element (row, col).
    let scale_of = |row: usize, col: usize| -> f64 {
        match &w.scale {
            WeightScale::None => 1.0,
            WeightScale::PerChannel(s) => s.as_slice::<f32>()[row] as f64,
            WeightScale::Block { block_rows, block_cols, scales } => {
                let per_row = k.div_ceil(*block_cols);
                scales.as_slice::<f32>()[(row / block_rows) * per_row + col / block_cols] as f64
            }
            WeightScale::PerTensor(s) => *s as f64,
        }
    };
    let y_values = y.as_slice::<f32>();
    for row in [0, 1, n / 2, n - 1] {
        let bytes = &w.weight.storage().bytes()[row * row_bytes..(row + 1) * row_bytes];
        let wr = decode_f32(w.weight.dtype(), bytes).expect("decode row");
        let products =
            wr.iter().zip(x).enumerate().map(|(l, (&a, &b))| a as f64 * b as f64 * scale_of(row, l));
        let (dot, abs) = products.fold((0.0, 0.0), |(d, m), p| (d + p, m + p.abs()));
        // f32 accumulation of k products: |error| <= k * u * sum |w x| (u = 2^-24; EPSILON = 2u
        // leaves room for the final scale multiply and a blocked summation order).
        let tol = k as f64 * f32::EPSILON as f64 * abs;
        let got = y_values[row] as f64;
        assert!((got - dot).abs() <= tol, "row {row}: backend gave {got}, f64 dot product {dot} (tol {tol})");
    }
}
