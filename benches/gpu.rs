//! GEMV on an NVIDIA GPU against the device's memory ceiling, in one run (feature `cuda`:
//! `cargo bench --features cuda --bench gpu`; scripts/device-check.sh runs the built executable):
//! 1. the copy peak: `cuMemcpyDtoDAsync` of 1 GiB, read + written bytes over CUDA-event time,
//!    best of 10;
//! 2. GEMV (`y[1, n] = x[1, k] . W[n, k]^T`, f32 activations) through the `Backend` trait at the
//!    Llama 3.1 8B layer shapes, weights bf16 (no scale) and e4m3fn with per-channel f32 scales,
//!    each shape rotating over enough copies of its weight to fill 1 GiB (above 3x the L2 of
//!    every current NVIDIA part), so each call reads its weight from HBM; criterion times calls
//!    with CUDA events (`iter_custom`), and the summary takes the best full rotation of 10;
//! 3. the peer: cuBLAS `cublasGemmEx` (bf16 W and x, f32 y and compute: the closest it offers
//!    to our f32-activation GEMV; its bytes are counted the same way) on the same weight copies;
//!    fp8 has no plain cuBLAS GEMV (cublasLt only), so those lines have no peer yet;
//! 4. the fused gate/up GEMV with its SiLU product (`gate_up_silu`) at the 8B MLP shape (n 14336,
//!    k 4096), gate and up rotating in pairs over the same working set; bytes are
//!    `memwall_runtime::cost::gate_up_silu_traffic` (both weights and scales, x once, out), so the
//!    line compares with the two gemv lines it replaces;
//! 5. one line per shape and dtype:
//!    `<kernel> <shape>: <GB/s> = <pct>% of measured copy peak; <ratio>x cuBLAS`.
//!
//! Bytes are `memwall_runtime::cost::linear_bytes` (weight + scales + x + y), decimal GB. Before
//! timing, a few rows of each shape are checked against an f64 dot product, so a kernel that
//! returns without computing cannot score. Without a CUDA device the bench prints why and exits
//! 0, or 1 with `MEMWALL_REQUIRE_GPU=1`.

use std::time::Duration;

use criterion::{Criterion, SamplingMode, Throughput};
use memwall::runtime::cost::{ScaleLayout, gate_up_silu_traffic, linear_bytes};
use memwall::runtime::dtype::decode_f32;
use memwall::runtime::gpu::cuda::CudaDevice;
use memwall::runtime::gpu::{Device, Gpu};
use memwall::runtime::{Backend, DType, Linear, Tensor, WeightScale};
use rayon::prelude::*;

use memwall::runtime::gpu::cuda::cudarc::cublas::{result as cublas, sys as cublas_sys};

/// Llama 3.1 8B projections of one layer, `(n rows, k cols)`.
const SHAPES: [(usize, usize); 4] = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)];
const WEIGHT_DTYPES: [DType; 2] = [DType::BF16, DType::F8E4M3Fn];
/// Llama 3.1 8B gate and up projections, `(n, k)` each.
const GATE_UP: (usize, usize) = (14336, 4096);
const WORKING_SET: usize = 1 << 30;
const ROTATIONS: usize = 10;

type CudaGpu = Gpu<CudaDevice>;
type Storage = <CudaGpu as Backend>::Storage;

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `len` f32 values uniform in [-1, 1).
fn random_unit(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..len).map(|_| (splitmix(&mut s) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0).collect()
}

/// Random non-zero finite weight bytes of `dtype`, magnitudes at most 1.
fn random_weight_bytes(dtype: DType, n: usize, k: usize, seed: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; n * k * dtype.size()];
    bytes.par_chunks_mut(1 << 16).enumerate().for_each(|(i, chunk)| {
        let mut s = seed ^ ((i as u64) << 24);
        match dtype {
            DType::BF16 => {
                for e in chunk.chunks_exact_mut(2) {
                    let u = (splitmix(&mut s) >> 40) as f32 / (1u64 << 24) as f32;
                    let v = half::bf16::from_f32((0.25 + 0.75 * u) * if s & 1 == 0 { 1.0 } else { -1.0 });
                    e.copy_from_slice(&v.to_bits().to_le_bytes());
                }
            }
            // e4m3fn codes with exponent field 1..=7 (magnitudes in [2^-6, 1)): no zero, no NaN.
            _ => {
                for e in chunk.iter_mut() {
                    let r = splitmix(&mut s);
                    *e = (((r & 7) as u8 + 1) << 3) | ((r >> 3) & 7) as u8 | (((r >> 6) & 1) as u8) << 7;
                }
            }
        }
    });
    bytes
}

struct Shape {
    dtype: DType,
    n: usize,
    k: usize,
    weights: Vec<Linear<Storage>>,
    x: Tensor<Storage>,
    y: Tensor<Storage>,
    bytes_per_call: u64,
}

fn setup(gpu: &CudaGpu, dtype: DType, n: usize, k: usize) -> Shape {
    let w_bytes = random_weight_bytes(dtype, n, k, 0x5eed ^ n as u64 ^ (k as u64) << 32);
    let scales: Option<Vec<f32>> =
        dtype.is_fp8().then(|| random_unit(n, 3).iter().map(|u| (0.75 + 0.25 * u) / 448.0).collect());
    let copies = WORKING_SET.div_ceil(w_bytes.len()).max(2);
    let weights = (0..copies)
        .map(|_| Linear {
            weight: gpu.upload(dtype, &[n, k], &w_bytes).expect("upload weight"),
            scale: match &scales {
                Some(s) => {
                    WeightScale::PerChannel(gpu.upload_f32(DType::F32, &[n], s).expect("upload scales"))
                }
                None => WeightScale::None,
            },
        })
        .collect();
    let x_values = random_unit(k, 7);
    let x = gpu.upload_f32(DType::F32, &[1, k], &x_values).expect("upload x");
    let y = gpu.alloc(DType::F32, &[1, n]).expect("allocate y");
    let layout = if dtype.is_fp8() { ScaleLayout::PerChannel(DType::F32) } else { ScaleLayout::None };
    let bytes_per_call = linear_bytes(1, n, k, dtype, layout, DType::F32).expect("bytes");
    let mut s = Shape { dtype, n, k, weights, x, y, bytes_per_call };
    check(gpu, &mut s, &w_bytes, scales.as_deref(), &x_values);
    s
}

/// A few rows of y against an f64 dot product (f32 accumulation bound, as benches/gemv.rs).
fn check(gpu: &CudaGpu, s: &mut Shape, w: &[u8], scales: Option<&[f32]>, x: &[f32]) {
    gpu.linear(&s.x, &s.weights[0], &mut s.y).expect("linear");
    let y: Vec<f32> = gpu
        .read(&s.y)
        .expect("read y")
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let row_bytes = s.k * s.dtype.size();
    for row in [0, 1, s.n / 2, s.n - 1] {
        let wr = decode_f32(s.dtype, &w[row * row_bytes..(row + 1) * row_bytes]).expect("decode row");
        let sc = scales.map_or(1.0, |v| f64::from(v[row]));
        let dot: f64 = wr.iter().zip(x).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum::<f64>() * sc;
        let abs: f64 = wr.iter().zip(x).map(|(&a, &b)| (f64::from(a) * f64::from(b)).abs()).sum::<f64>() * sc;
        let tol = s.k as f64 * f64::from(f32::EPSILON) * abs;
        let got = f64::from(y[row]);
        assert!(
            (got - dot).abs() <= tol,
            "{} {}x{} row {row}: got {got}, want {dot} (tol {tol})",
            s.dtype,
            s.n,
            s.k
        );
    }
}

/// The best of `ROTATIONS` full rotations (every copy once), in seconds per call.
fn best_rotation(gpu: &CudaGpu, s: &mut Shape) -> f64 {
    let dev = gpu.device();
    let mut best = f64::INFINITY;
    for _ in 0..ROTATIONS {
        let Shape { weights, x, y, .. } = s;
        let t = dev
            .time(|| {
                for w in weights.iter() {
                    gpu.linear(x, w, y)?;
                }
                Ok(())
            })
            .expect("timed rotation");
        best = best.min(t / weights.len() as f64);
    }
    best
}

/// A cuBLAS handle on the backend's stream, if libcublas can be loaded.
struct Cublas(cublas_sys::cublasHandle_t);

impl Cublas {
    fn new(dev: &CudaDevice) -> Result<Cublas, String> {
        // SAFETY: only tries to open the library.
        if !unsafe { cublas_sys::is_culib_present() } {
            return Err("libcublas not found".into());
        }
        let h = cublas::create_handle().map_err(|e| format!("cublasCreate: {e:?}"))?;
        // SAFETY: a live handle; the stream lives as long as `dev`, which outlives the handle.
        unsafe { cublas::set_stream(h, dev.cu_stream() as cublas_sys::cudaStream_t) }
            .map_err(|e| format!("cublasSetStream: {e:?}"))?;
        Ok(Cublas(h))
    }
}

impl Drop for Cublas {
    fn drop(&mut self) {
        // SAFETY: created by cublasCreate, destroyed once.
        let _ = unsafe { cublas::destroy_handle(self.0) };
    }
}

/// cuBLAS's best rotation over the bf16 weights of `s`, seconds per call: `y = W x` as
/// column-major `W^T` (k x n, lda k) transposed times x (k x 1), bf16 in, f32 out and compute.
fn cublas_rotation(gpu: &CudaGpu, blas: &Cublas, s: &Shape, x_bf16: &Tensor<Storage>) -> f64 {
    let dev = gpu.device();
    let (alpha, beta) = (1.0f32, 0.0f32);
    let (n, k) = (s.n as i32, s.k as i32);
    let x = CudaDevice::address(x_bf16.storage().buffer());
    let y = CudaDevice::address(s.y.storage().buffer());
    let mut best = f64::INFINITY;
    for _ in 0..ROTATIONS {
        let t = dev
            .time(|| {
                for w in &s.weights {
                    let a = CudaDevice::address(w.weight.storage().buffer());
                    // SAFETY: the pointers are live device buffers of these shapes and dtypes
                    // on the handle's stream's context; alpha and beta are host scalars.
                    unsafe {
                        cublas::gemm_ex(
                            blas.0,
                            cublas_sys::cublasOperation_t::CUBLAS_OP_T,
                            cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                            n,
                            1,
                            k,
                            (&alpha as *const f32).cast(),
                            a as *const std::ffi::c_void,
                            cublas_sys::cudaDataType::CUDA_R_16BF,
                            k,
                            x as *const std::ffi::c_void,
                            cublas_sys::cudaDataType::CUDA_R_16BF,
                            k,
                            (&beta as *const f32).cast(),
                            y as *mut std::ffi::c_void,
                            cublas_sys::cudaDataType::CUDA_R_32F,
                            n,
                            cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                            cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                        )
                    }
                    .map_err(|e| memwall::runtime::Error::Device {
                        device: "cublas".into(),
                        msg: format!("{e:?}"),
                    })?;
                }
                Ok(())
            })
            .expect("timed cuBLAS rotation");
        best = best.min(t / s.weights.len() as f64);
    }
    best
}

/// The fused gate/up GEMV at `GATE_UP`: `(line, GB/s)`. Gate and up are the copies of one
/// `setup` each (half the working set apiece); out is checked against silu(g) * u from the
/// `linear` results of the same weights first, so a kernel that skips work cannot score.
fn gate_up_line(gpu: &CudaGpu, dtype: DType, peak: f64) -> String {
    let (n, k) = GATE_UP;
    let mut gate = setup(gpu, dtype, n, k);
    let copies = gate.weights.len().div_ceil(2);
    gate.weights.truncate(copies);
    let mut up = setup(gpu, dtype, n, k);
    up.weights.truncate(copies);
    let alloc = || gpu.alloc(DType::F32, &[1, n]).expect("allocate gate_up_silu buffers");
    let (mut s0, mut s1, mut out) = (alloc(), alloc(), alloc());
    let read = |t: &Tensor<Storage>| gpu.read_f32(t).expect("read");
    gpu.linear(&gate.x, &gate.weights[0], &mut gate.y).expect("gate linear");
    gpu.linear(&gate.x, &up.weights[0], &mut up.y).expect("up linear");
    let (g, u) = (read(&gate.y), read(&up.y));
    gpu.gate_up_silu(&gate.x, &gate.weights[0], &up.weights[0], (&mut s0, &mut s1), &mut out)
        .expect("gate_up_silu");
    let got = read(&out);
    for row in [0, 1, n / 2, n - 1] {
        let (g, u) = (f64::from(g[row]), f64::from(u[row]));
        let want = g / (1.0 + (-g).exp()) * u;
        // Both sums within k eps of each other (two f32 accumulations of the same terms), through
        // |silu'| <= 1.1: a loose sanity bound, not a test (tests/gpu_linear.rs derives those).
        let tol = 1e-3 * (want.abs() + 1e-3);
        assert!(
            (f64::from(got[row]) - want).abs() <= tol,
            "gate_up_silu {dtype} row {row}: {} vs {want}",
            got[row]
        );
    }
    let layout = if dtype.is_fp8() { ScaleLayout::PerChannel(DType::F32) } else { ScaleLayout::None };
    let bytes = gate_up_silu_traffic(1, n, k, dtype, layout, DType::F32).expect("bytes").total();
    let dev = gpu.device();
    let mut best = f64::INFINITY;
    for _ in 0..ROTATIONS {
        let t = dev
            .time(|| {
                for (g, u) in gate.weights.iter().zip(&up.weights) {
                    gpu.gate_up_silu(&gate.x, g, u, (&mut s0, &mut s1), &mut out)?;
                }
                Ok(())
            })
            .expect("timed gate_up_silu rotation");
        best = best.min(t / copies as f64);
    }
    let gbs = bytes as f64 / best / 1e9;
    format!(
        "gate_up_silu {dtype} 2x{n}x{k}: {gbs:.1} GB/s = {:.1}% of measured copy peak",
        100.0 * gbs / peak
    )
}

/// Device-to-device copy of `WORKING_SET` bytes, best of 10, in GB/s counting read + written.
fn copy_peak(dev: &CudaDevice) -> f64 {
    let src = dev.alloc(WORKING_SET).expect("allocate copy source");
    let mut dst = dev.alloc(WORKING_SET).expect("allocate copy destination");
    dev.copy(&mut dst, &src).expect("warm-up copy");
    (0..10)
        .map(|_| 2.0 * WORKING_SET as f64 / dev.time(|| dev.copy(&mut dst, &src)).expect("timed copy") / 1e9)
        .fold(0.0, f64::max)
}

fn main() {
    let gpu = match memwall::cuda_backend(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("gpu bench: skipping: {e}");
            let required = std::env::var("MEMWALL_REQUIRE_GPU").is_ok_and(|v| v == "1");
            std::process::exit(i32::from(required));
        }
    };
    let info = gpu.device().info().clone();
    println!(
        "device: {} (sm_{}{}, {} SMs, {:.1} GB)",
        info.name,
        info.arch.0,
        info.arch.1,
        info.sm_count,
        info.total_memory as f64 / 1e9
    );
    let peak_before = copy_peak(gpu.device());
    let blas = Cublas::new(gpu.device());
    if let Err(e) = &blas {
        println!("cuBLAS peer: unavailable ({e})");
    }
    println!("copy peak: {peak_before:.1} GB/s (read + written, 1 GiB, best of 10)");

    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .configure_from_args();
    let mut lines = Vec::new();
    for dtype in WEIGHT_DTYPES {
        let mut group = c.benchmark_group(format!("gpu_gemv_{dtype}"));
        group.sampling_mode(SamplingMode::Flat);
        for (n, k) in SHAPES {
            let mut s = setup(&gpu, dtype, n, k);
            group.throughput(Throughput::Bytes(s.bytes_per_call));
            let mut next = 0usize;
            group.bench_function(format!("{n}x{k}"), |b| {
                b.iter_custom(|iters| {
                    let t = gpu
                        .device()
                        .time(|| {
                            for _ in 0..iters {
                                let w = &s.weights[next % s.weights.len()];
                                next += 1;
                                gpu.linear(&s.x, w, &mut s.y)?;
                            }
                            Ok(())
                        })
                        .expect("timed calls");
                    Duration::from_secs_f64(t)
                })
            });
            let per_call = best_rotation(&gpu, &mut s);
            let gbs = s.bytes_per_call as f64 / per_call / 1e9;
            let peer = match (&blas, dtype) {
                (Ok(blas), DType::BF16) => {
                    let x = gpu.upload_f32(DType::BF16, &[1, k], &random_unit(k, 7)).expect("upload bf16 x");
                    let t = cublas_rotation(&gpu, blas, &s, &x);
                    format!("{:.2}x cuBLAS ({:.1} GB/s)", t / per_call, s.bytes_per_call as f64 / t / 1e9)
                }
                (Ok(_), _) => "no cuBLAS peer for fp8 GEMV (cublasLt only)".into(),
                (Err(_), _) => "cuBLAS unavailable".into(),
            };
            lines.push(format!(
                "gemv {dtype} {n}x{k}: {gbs:.1} GB/s = {:.1}% of measured copy peak; {peer}",
                100.0 * gbs / peak_before
            ));
        }
        group.finish();
        lines.push(gate_up_line(&gpu, dtype, peak_before));
    }
    let peak_after = copy_peak(gpu.device());
    println!("\nsummary (copy peak {peak_before:.1} GB/s before, {peak_after:.1} after):");
    for l in lines {
        println!("{l}");
    }
}
