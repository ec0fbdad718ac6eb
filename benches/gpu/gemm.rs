//! GEMM for prefill (`y[m, n] = x[m, k] . W[n, k]^T` through `Backend::linear` above
//! `GEMV_MAX_ROWS` rows), m = 512 and 2048 rows at the Llama 3.1 8B layer shapes, bf16 weights, f32
//! x and y, against cuBLAS `cublasGemmEx` (bf16 W and x, f32 y and compute) at the same shapes on
//! the same weight copies. Compute-bound (2mnk FLOPs over at most a few hundred MB), so the figure
//! is TFLOP/s of the product's 2mnk, never a percentage of bandwidth; the ratio is cuBLAS's time
//! over ours. Not the same arithmetic: our tensor-core GEMM (kernels-cuda/gemm_tc.cu) splits f32 x
//! into three bf16 parts for f32 accuracy, so it issues three bf16 products per product cuBLAS
//! issues on bf16 x. Where the device has wgmma (sm_90), each shape also runs on the warpgroup GEMM
//! (kernels-cuda/gemm_wg.cu, `Gpu::set_gemm_warpgroup`; its lines end in `wg`), same arithmetic.
//!
//! Checked before timing, ours and cuBLAS's: twelve outputs (first, middle and last rows by four
//! columns) against an f64 dot product, within gemm_tc.cu's bound (f32 sums of 3k exact products,
//! truncating: gamma'(3k) (1 + 2^-7) plus the split's 2^-24, of sum |x w|), and for cuBLAS, against
//! the product of bf16-rounded x within gamma'(k) of sum |x w|.

use criterion::{Criterion, SamplingMode, Throughput};
use memwall::runtime::{Backend, DType, Linear, Tensor};

use super::gemv::SHAPES;
use super::{
    Ctx, CudaGpu, Storage, WORKING_SET, best_rotation, gamma, random_bytes, random_unit, timed_calls,
};

const ROWS: [usize; 2] = [512, 2048];
/// Truncating f32 unit (the mma's sums: gemm_tc.cu assumes truncation).
const U_TRUNC: f64 = 1.0 / (1u64 << 23) as f64;

struct Shape {
    weights: Vec<Linear<Storage>>,
    x: Tensor<Storage>,
    y: Tensor<Storage>,
}

fn bf16_at(bytes: &[u8], e: usize) -> f64 {
    f64::from(half::bf16::from_le_bytes([bytes[2 * e], bytes[2 * e + 1]]))
}

/// Outputs of `y` at rows (0, m/2, m-1) x columns (0, 1, n/2, n-1) against the f64 product of `w`
/// and `x`: `bound(sum |x w|)` each.
#[allow(clippy::too_many_arguments)]
fn check_product(
    what: &str,
    y: &[f32],
    (m, n, k): (usize, usize, usize),
    w: &[u8],
    x: &[f32],
    x_round: impl Fn(f32) -> f64,
    bound: impl Fn(f64) -> f64,
) {
    for i in [0, m / 2, m - 1] {
        for j in [0, 1, n / 2, n - 1] {
            let (mut dot, mut abs) = (0f64, 0f64);
            for l in 0..k {
                let t = x_round(x[i * k + l]) * bf16_at(w, j * k + l);
                dot += t;
                abs += t.abs();
            }
            super::expect_close(&format!("{what} y[{i}][{j}]"), y[i * n + j], dot, bound(abs));
        }
    }
}

/// cuBLAS's `y = x W^T` on bf16 `x` (rounded from `x_host`) against the f64 product of the same
/// bf16 operands: any order of f32 sums, truncating, is within gamma'(k) of sum |x w|.
pub fn check_cublas(
    gpu: &CudaGpu,
    blas: &super::Cublas,
    (m, n, k): (usize, usize, usize),
    w: &Tensor<Storage>,
    x: &Tensor<Storage>,
    x_host: &[f32],
    y: &mut Tensor<Storage>,
) {
    let w_bytes = gpu.read(w).expect("read the weight back");
    super::poison(gpu, y);
    blas.gemm_bf16((m, n, k), w, x, y).expect("cuBLAS gemm");
    let got = super::read_f32(gpu, y);
    let round = |v: f32| f64::from(half::bf16::from_f32(v));
    let what = format!("cuBLAS {m}x{n}x{k}");
    check_product(&what, &got, (m, n, k), &w_bytes, x_host, round, |abs| gamma(k, U_TRUNC) * abs);
}

fn setup(gpu: &CudaGpu, m: usize, n: usize, k: usize) -> (Shape, Vec<f32>) {
    let w_bytes = random_bytes(DType::BF16, n * k, 0x9e33 ^ n as u64 ^ (k as u64) << 32);
    let copies = WORKING_SET.div_ceil(w_bytes.len()).max(2);
    let weights = (0..copies)
        .map(|_| Linear::plain(gpu.upload(DType::BF16, &[n, k], &w_bytes).expect("upload weight")))
        .collect();
    let x_host = random_unit(m * k, 0x11 ^ m as u64);
    let x = gpu.upload_f32(DType::F32, &[m, k], &x_host).expect("upload x");
    let y = gpu.alloc(DType::F32, &[m, n]).expect("allocate y");
    let mut s = Shape { weights, x, y };
    super::poison(gpu, &mut s.y);
    gpu.linear(&s.x, &s.weights[0], &mut s.y).expect("linear");
    let y = super::read_f32(gpu, &s.y);
    // gemm_tc.cu: 3 k exact products (x in three bf16 parts) summed in f32, truncating, each part
    // at most 2^-8 of the one above; then the split's own error, 2^-24 |x|.
    let bound = |abs: f64| (gamma(3 * k, U_TRUNC) * (1.0 + 1.0 / 128.0) + 1.0 / (1u64 << 24) as f64) * abs;
    check_product(&format!("gemm {m}x{n}x{k}"), &y, (m, n, k), &w_bytes, &x_host, f64::from, bound);
    (s, x_host)
}

/// Each shape on gemm_tc.cu (mma.sync) and, where the device has wgmma (sm_90), on gemm_wg.cu
/// (`Gpu::set_gemm_warpgroup`: the same contract and check), each against cuBLAS, timed once per
/// shape.
pub fn run(ctx: &Ctx, c: &mut Criterion, lines: &mut Vec<String>) {
    let gpu = &ctx.gpu;
    let mut group = c.benchmark_group("gpu_gemm_bf16");
    group.sampling_mode(SamplingMode::Flat);
    use memwall::runtime::gpu::Device;
    let wgmma = memwall::runtime::gpu::ops::gemm::has_wgmma(gpu.device().info());
    for m in ROWS {
        for (n, k) in SHAPES {
            let mut blas = None;
            for warpgroup in [false, true] {
                if warpgroup && !wgmma {
                    continue;
                }
                gpu.set_gemm_warpgroup(warpgroup);
                let label = format!("gemm bf16 {m}x{n}x{k}{}", if warpgroup { " wg" } else { "" });
                if !ctx.out_of_time(&label, lines) {
                    shape_line(ctx, &mut group, (m, n, k), &label, &mut blas, lines);
                }
            }
            gpu.set_gemm_warpgroup(false);
        }
    }
    group.finish();
}

/// Benches `linear` at (m, n, k) on the GEMM the backend's settings pick and writes its line;
/// `blas` is cuBLAS's time per call (None where cuBLAS is unavailable), timed on the shape's first
/// line.
fn shape_line(
    ctx: &Ctx,
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    (m, n, k): (usize, usize, usize),
    label: &str,
    blas: &mut Option<Option<f64>>,
    lines: &mut Vec<String>,
) {
    let gpu = &ctx.gpu;
    let (mut s, x_host) = setup(gpu, m, n, k);
    let flops = 2.0 * (m * n * k) as f64;
    group.throughput(Throughput::Elements((2 * m * n * k) as u64));
    let copies = s.weights.len();
    let mut next = 0usize;
    group.bench_function(label.trim_start_matches("gemm bf16 ").to_string(), |b| {
        b.iter_custom(|iters| {
            let Shape { weights, x, y, .. } = &mut s;
            timed_calls(gpu, iters, copies, &mut next, |i| gpu.linear(x, &weights[i], y))
        })
    });
    let per_call = {
        let Shape { weights, x, y, .. } = &mut s;
        best_rotation(gpu, copies, |i| gpu.linear(x, &weights[i], y))
    };
    let tflops = flops / per_call / 1e12;
    let blas_time = *blas.get_or_insert_with(|| {
        let blas = ctx.blas.as_ref().ok()?;
        let x = gpu.upload_f32(DType::BF16, &[m, k], &x_host).expect("upload bf16 x");
        let mut y = gpu.alloc(DType::F32, &[m, n]).expect("allocate y");
        check_cublas(gpu, blas, (m, n, k), &s.weights[0].weight, &x, &x_host, &mut y);
        Some(best_rotation(gpu, copies, |i| blas.gemm_bf16((m, n, k), &s.weights[i].weight, &x, &mut y)))
    });
    let peer = match blas_time {
        Some(t) => format!("{:.2}x cuBLAS ({:.1} TFLOP/s on bf16 x)", t / per_call, flops / t / 1e12),
        None => "cuBLAS unavailable".into(),
    };
    lines.push(format!(
        "{:<44} {tflops:>7.1} TFLOP/s (compute-bound: FLOPs, not bytes; 3 bf16 parts of f32 x); {peer}",
        format!("{label}:")
    ));
}
