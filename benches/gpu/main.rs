//! The kernels of a decode and a prefill on an NVIDIA GPU against the device's ceilings, in one run
//! (feature `cuda`: `cargo bench --features cuda --bench gpu`; scripts/device-check.sh runs the
//! built executable):
//! 1. the copy peak: `cuMemcpyDtoDAsync` of 1 GiB, read + written bytes over CUDA-event time,
//!    best of 10, before and after the kernels;
//! 2. GEMV at the Llama 3.1 8B layer shapes (bf16, e4m3fn per-channel), batch 1, and batched decode
//!    (4 and 16 rows) at the fused gate/up matrix, against the copy peak and cuBLAS (`gemv.rs`);
//! 3. decode attention at 8192 positions of context, Llama 3.1 8B heads (32 query, 8 KV, head_dim
//!    128, bf16 paged KV cache), batch 1, 4 and 16, against the copy peak (`attention.rs`);
//! 4. Mixtral 8x7B's experts (one layer, top 2, bf16 and e4m3fn), batch 1, 4 and 16, routed on the
//!    device, against the copy peak and the host-routed path (`experts.rs`);
//! 5. GEMM (prefill, 512 and 2048 rows) at the same layer shapes, bf16 weights, against cuBLAS in
//!    TFLOP/s: compute-bound, so no percentage of bandwidth (`gemm.rs`);
//! 6. one closing line per kernel and shape after `summary`:
//!    `<kernel> <shape>: <GB/s> = <pct>% of measured copy peak; <ratio>x cuBLAS` (GEMV, attention;
//!    experts: `<ratio>x host-routed`) and `<kernel> <shape>: <TFLOP/s> TFLOP/s (compute-bound); <ratio>x cuBLAS` (GEMM).
//!
//! Every working set rotates over enough copies to fill 1 GiB (above 3x the L2 of every current
//! NVIDIA part), so each call reads its operands from HBM. Criterion times calls with CUDA events
//! (`iter_custom`); the summary takes the best full rotation of 10. Bytes come from
//! `memwall_runtime::cost` (decimal GB); a ratio to cuBLAS above 1 means ours is faster. Before
//! timing, every kernel's output (and the cuBLAS peer's) is checked on a subset of elements against
//! an f64 host reference with a derived bound, into an output poisoned with NaN first, so a bench
//! cannot time a wrong kernel. The whole run stops starting new shapes after
//! `MEMWALL_BENCH_BUDGET_S` seconds (default 200; the device check gives it 240): the summary then
//! names what it skipped. Without a CUDA device the bench prints why and exits 0, or 1 with
//! `MEMWALL_REQUIRE_GPU=1`.

mod attention;
#[path = "../shared/common.rs"]
mod common;
mod experts;
mod gemm;
mod gemv;

use std::time::{Duration, Instant};

use criterion::Criterion;
use memwall::runtime::gpu::cuda::CudaDevice;
use memwall::runtime::gpu::cuda::cudarc::cublas::{result as cublas, sys as cublas_sys};
use memwall::runtime::gpu::{Device, Gpu};
use memwall::runtime::{Backend, DType, Tensor};
use rayon::prelude::*;

pub use common::{gamma, shuffled, splitmix};

pub const WORKING_SET: usize = 1 << 30;
pub const ROTATIONS: usize = 10;

pub type CudaGpu = Gpu<CudaDevice>;
pub type Storage = <CudaGpu as Backend>::Storage;

/// What every part of the bench shares: the backend, the cuBLAS peer, the copy peak measured
/// first, and the time budget.
pub struct Ctx {
    pub gpu: CudaGpu,
    pub blas: Result<Cublas, String>,
    pub peak_gb_s: f64,
    started: Instant,
    budget: Duration,
}

impl Ctx {
    /// Whether the run is past its budget; then `what` is noted as skipped in `lines`.
    pub fn out_of_time(&self, what: &str, lines: &mut Vec<String>) -> bool {
        let over = self.started.elapsed() > self.budget;
        if over {
            lines.push(format!("{what}: skipped (past the bench's {} s budget)", self.budget.as_secs()));
        }
        over
    }
}

/// `len` f32 values uniform in [-1, 1).
pub fn random_unit(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..len).map(|_| (splitmix(&mut s) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0).collect()
}

/// Random non-zero finite bytes of `len` elements of `dtype` (bf16 or e4m3fn), magnitudes in
/// [1/4, 1] (bf16) or [2^-6, 1) (e4m3fn), random signs.
pub fn random_bytes(dtype: DType, len: usize, seed: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; len * dtype.size()];
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

/// Fills an f32 tensor with NaN, so an element a kernel leaves unwritten fails the check.
pub fn poison(gpu: &CudaGpu, t: &mut Tensor<Storage>) {
    let bytes = vec![0xffu8; t.nbytes()];
    gpu.write(t, &bytes).expect("poison the output");
}

pub fn read_f32(gpu: &CudaGpu, t: &Tensor<Storage>) -> Vec<f32> {
    gpu.read_f32(t).expect("read the output")
}

/// Fails the bench where `got` is not within `bound` of `want` (NaN never is).
pub fn expect_close(what: &str, got: f32, want: f64, bound: f64) {
    let err = (f64::from(got) - want).abs();
    assert!(err <= bound, "{what}: got {got}, want {want} (error {err:.3e} > bound {bound:.3e})");
}

/// A cuBLAS handle on the backend's stream, if libcublas can be loaded.
pub struct Cublas(cublas_sys::cublasHandle_t);

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

    /// `y[m, n] = x[m, k] . W[n, k]^T` (row-major), bf16 W and x, f32 y and compute: in cuBLAS's
    /// column-major terms `y^T (n x m, ld n) = op_T(W^T (k x n, ld k)) . x^T (k x m, ld k)`.
    pub fn gemm_bf16(
        &self,
        (m, n, k): (usize, usize, usize),
        w: &Tensor<Storage>,
        x: &Tensor<Storage>,
        y: &mut Tensor<Storage>,
    ) -> memwall::runtime::Result<()> {
        assert_eq!((w.dtype(), x.dtype(), y.dtype()), (DType::BF16, DType::BF16, DType::F32));
        assert_eq!((w.shape(), x.shape(), y.shape()), (&[n, k][..], &[m, k][..], &[m, n][..]));
        let dim = |v: usize| i32::try_from(v).expect("a cuBLAS dimension fits i32");
        let (alpha, beta) = (1.0f32, 0.0f32);
        let a = CudaDevice::address(w.storage().buffer());
        let b = CudaDevice::address(x.storage().buffer());
        let c = CudaDevice::address(y.storage().buffer());
        // SAFETY: the pointers are live device buffers of the shapes and dtypes asserted above, on
        // the handle's stream's context; alpha and beta are host scalars; y is borrowed mutably.
        unsafe {
            cublas::gemm_ex(
                self.0,
                cublas_sys::cublasOperation_t::CUBLAS_OP_T,
                cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                dim(n),
                dim(m),
                dim(k),
                (&alpha as *const f32).cast(),
                a as *const std::ffi::c_void,
                cublas_sys::cudaDataType::CUDA_R_16BF,
                dim(k),
                b as *const std::ffi::c_void,
                cublas_sys::cudaDataType::CUDA_R_16BF,
                dim(k),
                (&beta as *const f32).cast(),
                c as *mut std::ffi::c_void,
                cublas_sys::cudaDataType::CUDA_R_32F,
                dim(n),
                cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| memwall::runtime::Error::Device { device: "cublas".into(), msg: format!("{e:?}") })
    }
}

impl Drop for Cublas {
    fn drop(&mut self) {
        // SAFETY: created by cublasCreate, destroyed once.
        let _ = unsafe { cublas::destroy_handle(self.0) };
    }
}

/// The best of `ROTATIONS` runs of `call` over every index `0..copies` once, seconds per call.
pub fn best_rotation(
    gpu: &CudaGpu,
    copies: usize,
    mut call: impl FnMut(usize) -> memwall::runtime::Result<()>,
) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..ROTATIONS {
        let t = gpu
            .device()
            .time(|| {
                for i in 0..copies {
                    call(i)?;
                }
                Ok(())
            })
            .expect("timed rotation");
        best = best.min(t / copies as f64);
    }
    best
}

/// Times `iters` calls of `call` on the device for criterion's `iter_custom`, continuing the
/// rotation at `next`.
pub fn timed_calls(
    gpu: &CudaGpu,
    iters: u64,
    copies: usize,
    next: &mut usize,
    mut call: impl FnMut(usize) -> memwall::runtime::Result<()>,
) -> Duration {
    let t = gpu
        .device()
        .time(|| {
            for _ in 0..iters {
                call(*next % copies)?;
                *next += 1;
            }
            Ok(())
        })
        .expect("timed calls");
    Duration::from_secs_f64(t)
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
    let started = Instant::now();
    let gpu = match memwall::cuda_backend(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("gpu bench: skipping: {e}");
            let required = std::env::var("MEMWALL_REQUIRE_GPU").is_ok_and(|v| v == "1");
            std::process::exit(i32::from(required));
        }
    };
    let budget_s =
        std::env::var("MEMWALL_BENCH_BUDGET_S").ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(200);
    let info = gpu.device().info().clone();
    println!(
        "device: {} (sm_{}{}, {} SMs, {:.1} GB)",
        info.name,
        info.arch.0,
        info.arch.1,
        info.sm_count,
        info.total_memory as f64 / 1e9
    );
    let peak_gb_s = copy_peak(gpu.device());
    let blas = Cublas::new(gpu.device());
    if let Err(e) = &blas {
        println!("cuBLAS peer: unavailable ({e})");
    }
    println!("copy peak: {peak_gb_s:.1} GB/s (read + written, 1 GiB, best of 10)");
    let ctx = Ctx { gpu, blas, peak_gb_s, started, budget: Duration::from_secs(budget_s) };

    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .configure_from_args();
    let mut lines = Vec::new();
    gemv::run(&ctx, &mut c, &mut lines);
    attention::run(&ctx, &mut c, &mut lines);
    experts::run(&ctx, &mut lines);
    gemm::run(&ctx, &mut c, &mut lines);
    let peak_after = copy_peak(ctx.gpu.device());
    println!(
        "\nsummary (copy peak {peak_gb_s:.1} GB/s before, {peak_after:.1} after; {:.0} s):",
        started.elapsed().as_secs_f64()
    );
    for l in lines {
        println!("{l}");
    }
}
