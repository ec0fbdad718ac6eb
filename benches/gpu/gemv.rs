//! GEMV (`y[m, n] = x[m, k] . W[n, k]^T`, f32 activations) through the `Backend` trait at the Llama
//! 3.1 8B layer shapes, weights bf16 (no scale) and e4m3fn with per-channel f32 scales, each shape
//! rotating over enough copies of its weight to fill 1 GiB: batch 1 at every shape, then batched
//! decode (`BATCHES`: 4, 8 and 16 rows, each weight read once for all rows, on gemv.cu's tiles and
//! on the alternatives: four output features per warp, `j4`, and the tensor cores of gemv_tc.cu,
//! `tc`) at the fused gate/up matrix and, at 16 rows, at 4096 x 4096. The peer: cuBLAS
//! `cublasGemmEx` (bf16 W and x, f32 y and compute: the closest it offers to our f32-activation
//! GEMV; its bytes are counted the same way) on the same weight copies; fp8 has no plain cuBLAS
//! GEMV (cublasLt only), so those lines have no peer yet. Bytes are
//! `memwall_runtime::cost::linear_bytes` (weight + scales + x + y). Before timing, four rows of y
//! (of the first and last rows of x) are checked against an f64 dot product.
//!
//! Then the fused gate/up GEMV with its SiLU product (`gate_up_silu`) at the 8B MLP shape (n
//! 14336, k 4096 each), gate and up rotating in pairs over the same working set; bytes are
//! `memwall_runtime::cost::gate_up_silu_traffic` (both weights and scales, x once, out), so its
//! line compares with the gemv line of the fused gate/up matrix (28672x4096) it replaces. Four
//! rows are checked against silu(g) * u of the separate `linear` results first.

use criterion::{Criterion, SamplingMode, Throughput};
use memwall::runtime::cost::{ScaleLayout, gate_up_silu_traffic, linear_bytes};
use memwall::runtime::dtype::decode_f32;
use memwall::runtime::{Backend, DType, Linear, Tensor, WeightScale};

use super::{Ctx, CudaGpu, Storage, WORKING_SET, best_rotation, random_bytes, random_unit, timed_calls};

/// Llama 3.1 8B projections of one layer, `(n rows, k cols)`: q, fused q/k/v, fused gate/up, down.
pub const SHAPES: [(usize, usize); 4] = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)];
const WEIGHT_DTYPES: [DType; 2] = [DType::BF16, DType::F8E4M3Fn];
/// Which batched GEMV a line times.
#[derive(Clone, Copy, PartialEq)]
enum Batched {
    /// gemv.cu's row tiles, one output feature per warp (the default).
    Simt,
    /// gemv.cu's 4-row tile with four features per warp (`Gpu::set_gemv_warp_rows(4)`).
    J4,
    /// gemv_tc.cu (`Gpu::set_gemv_tensor_core_rows`).
    TensorCores,
}

/// Batched decode: `(m rows, n, k, kernel)`, the fused gate/up matrix of the 8B at the GEMV's 4-,
/// 8- and 16-row shapes, each on gemv.cu's tile and its alternative (gemv.cu estimates its
/// batched tiles bound by x's reads through L1 and by issue; these lines measure it), and
/// gemv_tc.cu at the 4096 x 4096 projections at 16 rows, where it cuts k into runs.
const BATCHES: [(usize, usize, usize, Batched); 7] = [
    (4, 28672, 4096, Batched::Simt),
    (4, 28672, 4096, Batched::J4),
    (8, 28672, 4096, Batched::Simt),
    (8, 28672, 4096, Batched::TensorCores),
    (16, 28672, 4096, Batched::Simt),
    (16, 28672, 4096, Batched::TensorCores),
    (16, 4096, 4096, Batched::TensorCores),
];
/// Llama 3.1 8B gate and up projections, `(n, k)` each.
const GATE_UP: (usize, usize) = (14336, 4096);

struct Shape {
    dtype: DType,
    m: usize,
    n: usize,
    k: usize,
    weights: Vec<Linear<Storage>>,
    x: Tensor<Storage>,
    y: Tensor<Storage>,
    bytes_per_call: u64,
}

fn setup(gpu: &CudaGpu, dtype: DType, (m, n, k): (usize, usize, usize)) -> Shape {
    let w_bytes = random_bytes(dtype, n * k, 0x5eed ^ n as u64 ^ (k as u64) << 32);
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
    let x_values = random_unit(m * k, 7);
    let x = gpu.upload_f32(DType::F32, &[m, k], &x_values).expect("upload x");
    let y = gpu.alloc(DType::F32, &[m, n]).expect("allocate y");
    let layout = if dtype.is_fp8() { ScaleLayout::PerChannel(DType::F32) } else { ScaleLayout::None };
    let bytes_per_call = linear_bytes(m, n, k, dtype, layout, DType::F32).expect("bytes");
    let mut s = Shape { dtype, m, n, k, weights, x, y, bytes_per_call };
    check(gpu, &mut s, &w_bytes, scales.as_deref(), &x_values);
    s
}

/// Four rows of y for the first and last rows of x against an f64 dot product: within 4 k f32
/// roundings of the sum of |products| (the tensor cores sum 3 k products, x in three bf16 parts,
/// with truncation: tests/gpu_linear.rs derives the tight bounds).
fn check(gpu: &CudaGpu, s: &mut Shape, w: &[u8], scales: Option<&[f32]>, x: &[f32]) {
    super::poison(gpu, &mut s.y);
    gpu.linear(&s.x, &s.weights[0], &mut s.y).expect("linear");
    let y = super::read_f32(gpu, &s.y);
    let row_bytes = s.k * s.dtype.size();
    for i in [0, s.m - 1] {
        let xi = &x[i * s.k..(i + 1) * s.k];
        for row in [0, 1, s.n / 2, s.n - 1] {
            let wr = decode_f32(s.dtype, &w[row * row_bytes..(row + 1) * row_bytes]).expect("decode row");
            let sc = scales.map_or(1.0, |v| f64::from(v[row]));
            let dot: f64 = wr.iter().zip(xi).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum::<f64>() * sc;
            let abs: f64 =
                wr.iter().zip(xi).map(|(&a, &b)| (f64::from(a) * f64::from(b)).abs()).sum::<f64>() * sc;
            let tol = 4.0 * s.k as f64 * f64::from(f32::EPSILON) * abs;
            let what = format!("gemv {} {}x{}x{} x row {i} y row {row}", s.dtype, s.m, s.n, s.k);
            super::expect_close(&what, y[i * s.n + row], dot, tol);
        }
    }
}

pub fn run(ctx: &Ctx, c: &mut Criterion, lines: &mut Vec<String>) {
    let gpu = &ctx.gpu;
    for dtype in WEIGHT_DTYPES {
        let mut group = c.benchmark_group(format!("gpu_gemv_{dtype}"));
        group.sampling_mode(SamplingMode::Flat);
        let shapes = SHAPES.iter().map(|&(n, k)| (1, n, k, Batched::Simt)).chain(BATCHES);
        for (m, n, k, kernel) in shapes {
            let (label, id) = match (m, kernel) {
                (1, _) => (format!("gemv {dtype} {n}x{k}"), "simt"),
                (_, Batched::Simt) => (format!("gemv {dtype} batch {m} {n}x{k}"), "simt"),
                (_, Batched::J4) => (format!("gemv {dtype} batch {m} {n}x{k} j4"), "j4"),
                (_, Batched::TensorCores) => (format!("gemv {dtype} batch {m} {n}x{k} tc"), "tc"),
            };
            if ctx.out_of_time(&label, lines) {
                continue;
            }
            // Before setup: its check runs the kernel these settings pick.
            gpu.set_gemv_warp_rows(if kernel == Batched::J4 { 4 } else { 1 })
                .expect("output features per warp");
            gpu.set_gemv_tensor_core_rows((kernel == Batched::TensorCores).then_some(1))
                .expect("tensor-core rows");
            let mut s = setup(gpu, dtype, (m, n, k));
            group.throughput(Throughput::Bytes(s.bytes_per_call));
            let mut next = 0usize;
            group.bench_function(format!("{m}x{n}x{k}/{id}"), |b| {
                b.iter_custom(|iters| {
                    let Shape { weights, x, y, .. } = &mut s;
                    timed_calls(gpu, iters, weights.len(), &mut next, |i| gpu.linear(x, &weights[i], y))
                })
            });
            let per_call = {
                let Shape { weights, x, y, .. } = &mut s;
                best_rotation(gpu, weights.len(), |i| gpu.linear(x, &weights[i], y))
            };
            let gbs = s.bytes_per_call as f64 / per_call / 1e9;
            let peer = match (&ctx.blas, dtype) {
                (Ok(blas), DType::BF16) => {
                    let x_host = random_unit(m * k, 7);
                    let x = gpu.upload_f32(DType::BF16, &[m, k], &x_host).expect("upload bf16 x");
                    let mut y = gpu.alloc(DType::F32, &[m, n]).expect("allocate y");
                    super::gemm::check_cublas(
                        gpu,
                        blas,
                        (m, n, k),
                        &s.weights[0].weight,
                        &x,
                        &x_host,
                        &mut y,
                    );
                    let t = best_rotation(gpu, s.weights.len(), |i| {
                        blas.gemm_bf16((m, n, k), &s.weights[i].weight, &x, &mut y)
                    });
                    format!("{:.2}x cuBLAS ({:.1} GB/s)", t / per_call, s.bytes_per_call as f64 / t / 1e9)
                }
                (Ok(_), _) => "no cuBLAS peer for fp8 GEMV (cublasLt only)".into(),
                (Err(_), _) => "cuBLAS unavailable".into(),
            };
            lines.push(format!(
                "{:<44} {gbs:>7.1} GB/s = {:>5.1}% of measured copy peak; {peer}",
                format!("{label}:"),
                100.0 * gbs / ctx.peak_gb_s
            ));
            gpu.set_gemv_warp_rows(1).expect("the default");
            gpu.set_gemv_tensor_core_rows(None).expect("the default");
        }
        group.finish();
        let label = format!("gate_up_silu {dtype} 2x{}x{}", GATE_UP.0, GATE_UP.1);
        if !ctx.out_of_time(&label, lines) {
            lines.push(gate_up_line(ctx, dtype, &label));
        }
    }
}

/// The fused gate/up GEMV at `GATE_UP`: its summary line. Gate and up are the copies of one
/// `setup` each (half the working set apiece); out is checked against silu(g) * u from the
/// `linear` results of the same weights first, so a kernel that skips work cannot score.
fn gate_up_line(ctx: &Ctx, dtype: DType, label: &str) -> String {
    let gpu = &ctx.gpu;
    let (n, k) = GATE_UP;
    let mut gate = setup(gpu, dtype, (1, n, k));
    let copies = gate.weights.len().div_ceil(2);
    gate.weights.truncate(copies);
    let mut up = setup(gpu, dtype, (1, n, k));
    up.weights.truncate(copies);
    let alloc = || gpu.alloc(DType::F32, &[1, n]).expect("allocate gate_up_silu buffers");
    let (mut s0, mut s1, mut out) = (alloc(), alloc(), alloc());
    gpu.linear(&gate.x, &gate.weights[0], &mut gate.y).expect("gate linear");
    gpu.linear(&gate.x, &up.weights[0], &mut up.y).expect("up linear");
    let (g, u) = (super::read_f32(gpu, &gate.y), super::read_f32(gpu, &up.y));
    super::poison(gpu, &mut out);
    gpu.gate_up_silu(&gate.x, &gate.weights[0], &up.weights[0], (&mut s0, &mut s1), &mut out)
        .expect("gate_up_silu");
    let got = super::read_f32(gpu, &out);
    for row in [0, 1, n / 2, n - 1] {
        let (g, u) = (f64::from(g[row]), f64::from(u[row]));
        let want = g / (1.0 + (-g).exp()) * u;
        // The fused sums and the separate ones add the same terms in f32, each within k eps of the
        // exact sum, through |silu'| <= 1.1: a loose sanity bound (tests/gpu_linear.rs derives the
        // tight ones).
        let bound = 1e-3 * (want.abs() + 1e-3);
        super::expect_close(&format!("{label} row {row}"), got[row], want, bound);
    }
    let layout = if dtype.is_fp8() { ScaleLayout::PerChannel(DType::F32) } else { ScaleLayout::None };
    let bytes = gate_up_silu_traffic(1, n, k, dtype, layout, DType::F32).expect("bytes").total();
    let per_call = best_rotation(gpu, copies, |i| {
        gpu.gate_up_silu(&gate.x, &gate.weights[i], &up.weights[i], (&mut s0, &mut s1), &mut out)
    });
    let gbs = bytes as f64 / per_call / 1e9;
    format!(
        "{:<44} {gbs:>7.1} GB/s = {:>5.1}% of measured copy peak; no cuBLAS peer (two GEMVs there)",
        format!("{label}:"),
        100.0 * gbs / ctx.peak_gb_s
    )
}
