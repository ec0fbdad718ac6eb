//! The memory wall on this machine, in one run (`cargo bench`):
//! 1. the memory ceiling (`memwall::peak`): streaming read and copy on every thread, over a working
//!    set of `max(3 x LLC, 1 GiB)`;
//! 2. GEMV (`y[1, n] = x[1, k] . W[n, k]^T`, f32 activations) through the `Backend` trait on the
//!    default backend, at the Llama 3.1 8B layer shapes, weights bf16 (no scale) and e4m3fn with
//!    per-channel f32 scales. Each shape rotates over enough copies of its weight (and scales) to
//!    fill the same working set, so every call reads its weight from memory, not from cache;
//! 3. one line per shape and dtype: the median achieved GB/s over the rotation (timed here, call by
//!    call, in the same loop criterion times) against the median read pass of step 1 (like with
//!    like: on a shared machine the best pass catches moments when neighbours are quiet; the best
//!    read and copy passes are printed too).
//!
//! Bytes are `memwall::bytes::linear_bytes` (weight + scales + x + y) and `StreamBuffers::
//! bytes_per_pass` (read + written), in decimal GB. A GEMV above the read peak is a bench bug.
//! Sized for a few minutes on 2 cores: 10 samples, short warm-up and measurement times, no plots
//! (`cargo bench -- --plotting-backend plotters` draws them).

use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, SamplingMode, Throughput};
use memwall::bytes::{ScaleLayout, linear_bytes};
use memwall::peak::{self, Kernel, StreamBuffers};
use memwall::runtime::dtype::decode_f32;
use memwall::runtime::{Backend, DType, HostStorage, HostTensor, Linear, WeightScale};
use rayon::ThreadPool;
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

/// What the summary needs from one GEMV benchmark.
struct GemvRun {
    dtype: DType,
    n: usize,
    k: usize,
    bytes_per_call: u64,
    calls: Vec<Duration>,
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
    println!(
        "memwall bench: LLC {llc_text}, working set {:.3} GB = max({} x LLC, 1 GiB), {threads} threads",
        working_set as f64 / 1e9,
        peak::LLC_FACTOR
    );

    let ceiling = bench_peak(&mut c, working_set, threads);

    let backend = memwall::default_backend();
    let mut runs = Vec::new();
    for dtype in WEIGHT_DTYPES {
        for (n, k) in SHAPES {
            runs.push(bench_gemv(&mut c, &backend, dtype, n, k, working_set));
        }
    }
    c.final_summary();

    println!();
    println!(
        "memory ceiling ({threads} threads, median pass / best pass): read {:.1} / {:.1} GB/s, copy {:.1} / \
         {:.1} GB/s",
        ceiling.read.median, ceiling.read.best, ceiling.copy.median, ceiling.copy.best
    );
    println!("gemv: median call over the rotation, against the median read pass (like with like)");
    for run in &runs {
        let Some(median) = median(&run.calls) else {
            continue;
        };
        let achieved = peak::gb_per_s(run.bytes_per_call, median);
        let read_peak = ceiling.read.median;
        let pct = 100.0 * achieved / read_peak;
        println!(
            "gemv {} {}x{}: {achieved:.1} GB/s = {pct:.1}% of measured read peak {:.1} GB/s",
            run.dtype.name(),
            run.n,
            run.k,
            read_peak
        );
        if pct > 100.0 {
            println!("  warning: above the read peak: the weights are not all coming from memory");
        }
    }
    println!("bench wall time: {:.1} s", started.elapsed().as_secs_f64());
}

/// One streaming kernel's passes in step 1, in GB/s.
struct StreamRate {
    median: f64,
    best: f64,
}

/// The memory ceiling of step 1.
struct Ceiling {
    read: StreamRate,
    copy: StreamRate,
}

fn bench_peak(c: &mut Criterion, working_set: u64, threads: usize) -> Ceiling {
    let mut buffers = StreamBuffers::new(working_set).expect("allocate the peak working set");
    let pool = peak::thread_pool(threads).expect("start the peak thread pool");
    let mut group = c.benchmark_group("peak");
    // One pass is tens of milliseconds: flat sampling keeps the pass count small.
    group.sampling_mode(SamplingMode::Flat).measurement_time(Duration::from_secs(1));
    let read = bench_stream(&mut group, &mut buffers, &pool, Kernel::Read);
    let copy = bench_stream(&mut group, &mut buffers, &pool, Kernel::Copy);
    group.finish();
    Ceiling { read, copy }
}

/// One streaming kernel as a criterion benchmark; returns the median and best of its passes.
fn bench_stream(
    group: &mut BenchmarkGroup<'_, WallTime>,
    buffers: &mut StreamBuffers,
    pool: &ThreadPool,
    kernel: Kernel,
) -> StreamRate {
    let bytes = buffers.bytes_per_pass(kernel);
    group.throughput(Throughput::BytesDecimal(bytes));
    let mut passes = Vec::new();
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
    // Filtered out on the command line: measure outside criterion, the summary needs it.
    if passes.is_empty() {
        buffers.pass(kernel, pool).expect("peak warm-up pass");
        passes = (0..9).map(|_| buffers.pass(kernel, pool).expect("peak pass")).collect();
    }
    let median = median(&passes).expect("at least one pass");
    let best = passes.iter().copied().min().expect("at least one pass");
    StreamRate { median: peak::gb_per_s(bytes, median), best: peak::gb_per_s(bytes, best) }
}

/// The rotated weights of one shape and dtype, with its input and output.
struct GemvSetup {
    weights: Vec<Linear<HostStorage>>,
    x: HostTensor,
    y: HostTensor,
    next: usize,
}

fn bench_gemv<B: Backend<Storage = HostStorage>>(
    c: &mut Criterion,
    backend: &B,
    dtype: DType,
    n: usize,
    k: usize,
    working_set: u64,
) -> GemvRun {
    let scale = if dtype.is_fp8() { ScaleLayout::PerChannel(DType::F32) } else { ScaleLayout::None };
    let bytes_per_call = linear_bytes(1, n, k, dtype, scale, DType::F32).expect("bytes of a llama shape");
    // What one copy of the weight occupies: its elements and its scales.
    let weight_bytes = (n * k * dtype.size()) as u64 + scale.bytes(n, k).expect("scale bytes");
    let copies = working_set.div_ceil(weight_bytes).max(2);

    let mut group = c.benchmark_group(format!("gemv_{}", dtype.name()));
    group.throughput(Throughput::BytesDecimal(bytes_per_call));
    let mut calls = Vec::new();
    // Built on the first call, so a benchmark filtered out on the command line costs nothing;
    // criterion only counts the time `iter_custom` returns.
    let mut setup: Option<GemvSetup> = None;
    let mut setup_time = Duration::ZERO;
    group.bench_function(format!("{n}x{k}"), |b| {
        let s = setup.get_or_insert_with(|| {
            let start = Instant::now();
            let weights: Vec<Linear<HostStorage>> =
                (0..copies).map(|i| random_linear(backend, dtype, n, k, 1000 + i)).collect();
            let x_values = random_unit_f32(k, 7);
            let x = backend.upload_f32(DType::F32, &[1, k], &x_values).expect("upload x");
            let mut y = backend.alloc(DType::F32, &[1, n]).expect("allocate y");
            check_gemv(backend, &weights[0], &x_values, &x, &mut y);
            setup_time = start.elapsed();
            GemvSetup { weights, x, y, next: 0 }
        });
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let w = &s.weights[s.next % s.weights.len()];
                s.next += 1;
                let start = Instant::now();
                backend.linear(&s.x, w, &mut s.y).expect("linear");
                backend.synchronize().expect("synchronize");
                let dt = start.elapsed();
                total += dt;
                calls.push(dt);
            }
            total
        })
    });
    group.finish();
    if !calls.is_empty() {
        println!(
            "  (rotated {copies} copies of {:.1} MB = {:.2} GB, filled in {:.1} s; {} calls timed)",
            weight_bytes as f64 / 1e6,
            (copies * weight_bytes) as f64 / 1e9,
            setup_time.as_secs_f64(),
            calls.len()
        );
    }
    // `setup` drops here: the next shape allocates into the memory this one frees.
    GemvRun { dtype, n, k, bytes_per_call, calls }
}

fn median(d: &[Duration]) -> Option<Duration> {
    let mut v = d.to_vec();
    v.sort_unstable();
    v.get(v.len() / 2).copied()
}

// ---------------------------------------------------------------------------------------------
// Inputs

/// splitmix64: one 64-bit draw per step.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

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

/// A random weight `[n, k]`; e4m3fn weights get per-channel f32 scales in [0.5, 1) / 448, like
/// scales from a per-row amax.
fn random_linear<B: Backend<Storage = HostStorage>>(
    backend: &B,
    dtype: DType,
    n: usize,
    k: usize,
    seed: u64,
) -> Linear<HostStorage> {
    let mut weight = backend.alloc(dtype, &[n, k]).expect("allocate weight");
    fill_weight(&mut weight, seed.wrapping_mul(0x2545_f491_4f6c_dd1d));
    let scale = if dtype.is_fp8() {
        let s: Vec<f32> = random_unit_f32(n, seed).iter().map(|u| (0.75 + 0.25 * u) / 448.0).collect();
        WeightScale::PerChannel(backend.upload_f32(DType::F32, &[n], &s).expect("upload scales"))
    } else {
        WeightScale::None
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
    let scales: Option<&[f32]> = match &w.scale {
        WeightScale::PerChannel(s) => Some(s.as_slice::<f32>()),
        _ => None,
    };
    let y_values = y.as_slice::<f32>();
    for row in [0, 1, n / 2, n - 1] {
        let bytes = &w.weight.storage().bytes()[row * row_bytes..(row + 1) * row_bytes];
        let wr = decode_f32(w.weight.dtype(), bytes).expect("decode row");
        let s = scales.map_or(1.0, |s| s[row] as f64);
        let dot: f64 = wr.iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * s;
        let abs: f64 = wr.iter().zip(x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum::<f64>() * s;
        // f32 accumulation of k products: |error| <= k * u * sum |w x| (u = 2^-24; EPSILON = 2u
        // leaves room for the final scale multiply and a blocked summation order).
        let tol = k as f64 * f32::EPSILON as f64 * abs;
        let got = y_values[row] as f64;
        assert!((got - dot).abs() <= tol, "row {row}: backend gave {got}, f64 dot product {dot} (tol {tol})");
    }
}
