//! `linear` on the GPU backend: the GEMV of `kernels-cuda/gemv.cu` (m <= 16 rows) and, for m > 16,
//! the tensor-core GEMM of `kernels-cuda/gemm_tc.cu` or the CUDA-core GEMM of `kernels-cuda/gemm.cu`
//! (as `gemm::gemm_path` routes), each weight dtype x scale kind x activation dtypes, against
//! `cpu::Reference`, over shapes that exercise every path and tail: k = 1, 3, 17, 4097 (scalar
//! paths; CUDA-core GEMM), k multiples of 8 / 16 (the 16-byte vector paths; the tensor-core GEMM)
//! with odd n, block scales of sizes that do and do not divide the 16-byte chunk or the GEMM's
//! k tile, rows at fewer than allocated, and exact cases that need all of the tensor-core GEMM's
//! bf16 parts of x and of f16 weights. Also `gate_up_silu`: the fused gate/up GEMV of `gemv.cu`
//! (m <= 4) and its composed path above, against `cpu::Reference` over the same shapes.
//!
//! Runs on each emulated backend (`--features memwall/emulate`) and, ignored unless asked for, on
//! a CUDA or ROCm device (`--features memwall/cuda` or `memwall/hip`, `-- --ignored`; `MEMWALL_REQUIRE_GPU=1` makes a missing
//! device fail). Outputs are poisoned (NaN) first; the tolerance is derived next to it.

#![cfg_attr(
    not(any(feature = "emulate", feature = "cuda", feature = "hip")),
    allow(dead_code, unused_imports)
)]

mod common;

use std::fmt::Debug;

use common::gpu::linear_to_backend;
use common::{Rng, *};
use memwall_runtime::cpu::Reference;
use memwall_runtime::gpu::ops::gemm::{GemmPath, gemm_path};
use memwall_runtime::gpu::{Device, DeviceInfo, Gpu, Vendor};
use memwall_runtime::ops::LinearDims;
use memwall_runtime::{Backend, DType, HostStorage, Linear, WeightScale};
use proptest::prelude::*;
use proptest::sample::select;

static REF: Reference = Reference;

/// The seed of this suite's proptest cases (`common::run_cases`).
const SEED: u64 = 0x6770_756c_696e_6561;

#[derive(Clone, Copy, Debug, PartialEq)]
enum ScaleKind {
    None,
    PerTensor,
    PerChannel,
    PerChannelColumn,
    Block(usize, usize),
}

#[derive(Clone, Debug)]
struct Case {
    m: usize,
    n: usize,
    k: usize,
    weight: DType,
    scale: ScaleKind,
    scale_dtype: DType,
    x: DType,
    y: DType,
    seed: u64,
}

/// k: scalar-path sizes (1, 3, 17, 4097 are not multiples of any chunk) and vector-path sizes
/// (multiples of 16 elements: 16 bytes of fp8, 32 of 16-bit, 64 of f32 weights; 48 and 80 are
/// not multiples of the 4-load unroll or of the GEMM's 16-wide k tile at 40).
const K_SIZES: [usize; 8] = [1, 3, 17, 40, 48, 80, 128, 4097];
const N_SIZES: [usize; 5] = [1, 3, 17, 33, 70];

fn case(rows: Vec<usize>) -> impl Strategy<Value = Case> {
    let scale = prop_oneof![
        select(vec![
            ScaleKind::None,
            ScaleKind::PerTensor,
            ScaleKind::PerChannel,
            ScaleKind::PerChannelColumn,
            ScaleKind::Block(128, 128),
            ScaleKind::Block(1, 16),
            ScaleKind::Block(2, 32),
        ]),
        (1..=9usize, 1..=9usize).prop_map(|(r, c)| ScaleKind::Block(r, c)),
    ];
    (
        select(rows),
        select(N_SIZES.to_vec()),
        select(K_SIZES.to_vec()),
        select(DType::FLOATS.to_vec()),
        scale,
        select(vec![DType::F32, DType::BF16]),
        select(DType::ACTIVATIONS.to_vec()),
        select(DType::ACTIVATIONS.to_vec()),
        any::<u64>(),
    )
        .prop_map(|(m, n, k, weight, scale, scale_dtype, x, y, seed)| Case {
            m,
            n,
            k,
            weight,
            scale,
            scale_dtype,
            x,
            y,
            seed,
        })
}

/// (block_rows, block_cols) of case `c`'s block or per-channel scale; None for unscaled or
/// per-tensor (the launchers' `scale_blocks`).
fn blocks(c: &Case) -> Option<(usize, usize)> {
    match c.scale {
        ScaleKind::None | ScaleKind::PerTensor => None,
        ScaleKind::PerChannel | ScaleKind::PerChannelColumn => Some((1, c.k)),
        ScaleKind::Block(br, bc) => Some((br, bc)),
    }
}

/// The GEMM `linear` takes for case `c` on an mma-capable device (the emulator and sm_80+, the only
/// devices these suites run on; elsewhere the CUDA-core GEMM runs, whose bound is the smaller).
fn path(c: &Case) -> Option<GemmPath> {
    if c.m <= 16 {
        return None;
    }
    let mma = DeviceInfo {
        name: "sm_80".into(),
        vendor: Vendor::Nvidia,
        arch: (8, 0),
        warp_size: 32,
        sm_count: 108,
        max_shared_per_block: 163 * 1024,
        max_threads_per_block: 1024,
        max_grid: [i32::MAX as u32, 65535, 65535],
        total_memory: 40 << 30,
    };
    Some(gemm_path(LinearDims { m: c.m, n: c.n, k: c.k }, c.weight, blocks(c), &mma))
}

/// gamma'(n) for f32 sums whose unit error is 2^-23 (truncation), as the tensor cores' bound assumes.
fn gamma_trunc(n: usize) -> f64 {
    let nu = n as f64 * 2.0 * U32;
    assert!(nu < 0.5, "gamma'({n}) is not meaningful in f32");
    nu / (1.0 - nu)
}

/// A host scale of `kind` for an `[n, k]` weight, and the scale of every element, row-major.
fn make_scale(
    rng: &mut Rng,
    kind: ScaleKind,
    dtype: DType,
    n: usize,
    k: usize,
) -> (WeightScale<HostStorage>, Vec<f64>) {
    match kind {
        ScaleKind::None => (WeightScale::None, vec![1.0; n * k]),
        ScaleKind::PerTensor => {
            let s = random_positive(rng, DType::F32, 1)[0];
            (WeightScale::PerTensor(s), vec![s as f64; n * k])
        }
        ScaleKind::PerChannel | ScaleKind::PerChannelColumn => {
            let s = random_positive(rng, dtype, n);
            let shape: &[usize] = if kind == ScaleKind::PerChannel { &[n] } else { &[n, 1] };
            (
                WeightScale::PerChannel(upload(&REF, dtype, shape, &s)),
                (0..n * k).map(|i| s[i / k] as f64).collect(),
            )
        }
        ScaleKind::Block(br, bc) => {
            let (nb, kb) = (n.div_ceil(br), k.div_ceil(bc));
            let s = random_positive(rng, dtype, nb * kb);
            let per_elem = (0..n * k).map(|i| s[(i / k / br) * kb + (i % k) / bc] as f64).collect();
            let scales = upload(&REF, dtype, &[nb, kb], &s);
            (WeightScale::Block { block_rows: br, block_cols: bc, scales }, per_elem)
        }
    }
}

/// The bound on |acc - exact| for one output of `linear` before y's rounding: acc the kernel's f32
/// accumulation of the k terms x w s whose magnitudes sum to `abs` (and the |w s| to `abs_ws`),
/// on the path case `c` takes: `tc_splits` 0 for the CUDA-core kernels, else the tensor cores'
/// (gemm_tc.cu: 1; gemv_tc.cu: its runs of k, whose sums it adds at the end).
fn accumulation_error(c: &Case, tc_splits: usize, abs: f64, abs_ws: f64) -> f64 {
    let k = c.k;
    if tc_splits > 0 {
        // gemm_tc.cu (its contract): x = 3 bf16 parts within 2^-24 |x| (plus, should the
        // hardware flush bf16 subnormal parts, 2^-126 per part: 2^-124 sum|w s|); weights
        // exact in 1 (2 for f16) bf16 parts; N = 3 parts k products (6 k for f16) summed in
        // f32 by the mma with unit error 2^-23 in any order: gamma'(N) sum|t|, sum|t| <=
        // (1 + 2^-7)^2 sum|x w s|; then the scale: one multiply (plain) or, per k-block of
        // min(bc, k) columns, a multiply and an add (ceil(k / bc) + 1 roundings of u, on
        // values at most 1.01 sum|x w s|); with k in S runs (gemv_tc.cu), up to S - 1 more
        // k-blocks (runs end them) and the S - 1 additions of the runs' sums.
        let parts = if c.weight == DType::F16 { 6 } else { 3 };
        let scale_roundings = match c.scale {
            ScaleKind::None | ScaleKind::PerTensor => 1,
            ScaleKind::PerChannel | ScaleKind::PerChannelColumn => 2,
            ScaleKind::Block(_, bc) => k.div_ceil(bc.min(k)) + 1,
        } + 2 * (tc_splits - 1);
        return (1.0 + 2f64.powi(-7)).powi(2) * gamma_trunc(parts * k) * abs
            + U32 * abs
            + 2f64.powi(-124) * abs_ws
            + 1.01 * gamma(scale_roundings) * abs;
    }
    // The other kernels accumulate in f32 from exactly widened x, w and s: each term meets at
    // most k + 8 roundings (x * w, the scale multiply, the chunk / lane / warp-tree sums of the
    // GEMV; x * w * s and k additions of the GEMM), so |acc - exact| <= gamma(k + 8) sum|x w s|.
    gamma(k + 8) * abs
}

fn check<B: Backend>(b: &B, c: &Case) {
    check_on(b, c, usize::from(path(c) == Some(GemmPath::TensorCore)));
}

/// `check` with the path's tensor-core runs of k given (`accumulation_error`'s `tc_splits`).
fn check_on<B: Backend>(b: &B, c: &Case, tc_splits: usize) {
    let (m, n, k) = (c.m, c.n, c.k);
    let mut rng = Rng::new(c.seed);
    let (x, xv) = random_tensor(&REF, &mut rng, c.x, &[m, k]);
    let (w, _) = random_tensor(&REF, &mut rng, c.weight, &[n, k]);
    let (scale, sv) = make_scale(&mut rng, c.scale, c.scale_dtype, n, k);
    let wv = read_f32(&REF, &w);
    let lin = Linear { weight: w, scale };
    let mut y_ref = poisoned(&REF, c.y, &[m, n]);
    REF.linear(&x, &lin, &mut y_ref).unwrap_or_else(|e| panic!("reference linear {c:?}: {e}"));
    let want = read_f32(&REF, &y_ref);

    let (uo, eta) = (unit_roundoff(c.y), underflow_abs(c.y));
    let mut bound = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let (mut sum, mut abs, mut abs_ws) = (0f64, 0f64, 0f64);
            for l in 0..k {
                let ws = wv[j * k + l] as f64 * sv[j * k + l];
                let t = xv[i * k + l] as f64 * ws;
                sum += t;
                abs += t.abs();
                abs_ws += ws.abs();
            }
            // |acc - exact| (the kernel's f32 sum) plus the f64 reference's own error; then y's
            // rounding: the reference's f64 rounded to y, possibly via f32 ((u_out + u) |exact| +
            // eta), ours acc rounded to y (u_out |acc| + eta). So |got - want| <= (1 + u_out)
            // |acc - exact| + gamma64(k + 1) sum|x w s| + (2 u_out + u) |exact| + 2 eta.
            bound[i * n + j] = (1.0 + uo) * accumulation_error(c, tc_splits, abs, abs_ws)
                + gamma64(k + 1) * abs
                + (2.0 * uo + U32) * sum.abs()
                + 2.0 * eta;
        }
    }
    let (xg, wg) = (gpu::to_backend(b, &x), linear_to_backend(b, &lin));
    let mut y = poisoned(b, c.y, &[m, n]);
    b.linear(&xg, &wg, &mut y).unwrap_or_else(|e| panic!("{} linear {c:?}: {e}", b.name()));
    assert_close(&format!("{} linear {c:?}", b.name()), &read_f32(b, &y), &want, &bound);
}

// ---------------------------------------------------------------------------------------------
// gate_up_silu: the fused gate/up GEMV of gemv.cu (m <= 4), composed from linear + silu_mul above

/// `(sum, sum|t|, sum|w s|)` of the terms `t = x[l] w[l] s[l]` of one dot product, in f64 (exact
/// products of f32 values; the sums within gamma64(k) of exact, counted in the bounds).
fn dot_terms(x: &[f32], w: &[f32], s: &[f64]) -> (f64, f64, f64) {
    let (mut sum, mut abs, mut abs_ws) = (0f64, 0f64, 0f64);
    for ((&x, &w), &s) in x.iter().zip(w).zip(s) {
        let ws = w as f64 * s;
        let t = x as f64 * ws;
        sum += t;
        abs += t.abs();
        abs_ws += ws.abs();
    }
    (sum, abs, abs_ws)
}

/// `gate_up_silu` of case `c` (its `y` is ignored: out is f32) on `b` against `cpu::Reference`:
/// gate and up of the same dtype and scale kind, with their own random values and scales.
fn check_gate_up<B: Backend>(b: &B, c: &Case) {
    let (m, n, k) = (c.m, c.n, c.k);
    let mut rng = Rng::new(c.seed);
    let (x, xv) = random_tensor(&REF, &mut rng, c.x, &[m, k]);
    let mut weight = || {
        let (w, _) = random_tensor(&REF, &mut rng, c.weight, &[n, k]);
        let (scale, sv) = make_scale(&mut rng, c.scale, c.scale_dtype, n, k);
        (read_f32(&REF, &w), sv, Linear { weight: w, scale })
    };
    let (gwv, gsv, gate) = weight();
    let (uwv, usv, up) = weight();
    let scratch = || (poisoned(&REF, DType::F32, &[m, n]), poisoned(&REF, DType::F32, &[m, n]));
    let (mut s0, mut s1) = scratch();
    let mut out_ref = poisoned(&REF, DType::F32, &[m, n]);
    REF.gate_up_silu(&x, &gate, &up, (&mut s0, &mut s1), &mut out_ref)
        .unwrap_or_else(|e| panic!("reference gate_up_silu {c:?}: {e}"));
    let want = read_f32(&REF, &out_ref);

    let tc_splits = usize::from(path(c) == Some(GemmPath::TensorCore));
    let mut bound = vec![0f64; m * n];
    for i in 0..m {
        let x_row = &xv[i * k..(i + 1) * k];
        for j in 0..n {
            let (g, g_abs, g_ws) = dot_terms(x_row, &gwv[j * k..(j + 1) * k], &gsv[j * k..(j + 1) * k]);
            let (u, u_abs, u_ws) = dot_terms(x_row, &uwv[j * k..(j + 1) * k], &usv[j * k..(j + 1) * k]);
            // The backend's g and u: each within its accumulation error of exact (as `linear`'s),
            // plus, where the op is composed, the rounding of the product to f32 in the scratch
            // (u |acc| <= u (|exact| + err)).
            let err = |abs: f64, abs_ws: f64, exact: f64| {
                let e = accumulation_error(c, tc_splits, abs, abs_ws);
                (1.0 + U32) * e + U32 * exact.abs()
            };
            let (e_g, e_u) = (err(g_abs, g_ws, g), err(u_abs, u_ws, u));
            let silu = g / (1.0 + (-g).exp());
            // |silu'| <= 1.1 everywhere (its maximum is 1.0998 near g = 2.4), so the backend's
            // silu(g~) is within 1.1 e_g of silu(g), and |silu(g~) u~ - silu(g) u| <= 1.1 e_g |u~|
            // + |silu(g)| e_u with |u~| <= |u| + e_u. Its f32 evaluation of silu(g~) * u~ (expf
            // within 4 ulps: 8u; 1 + e, the division and the product: 3u; as silu_mul's bound)
            // adds 12u |silu(g~) u~|.
            let (s_max, u_max) = (silu.abs() + 1.1 * e_g, u.abs() + e_u);
            let backend = 1.1 * e_g * u_max + silu.abs() * e_u + 12.0 * U32 * s_max * u_max;
            // The reference: g and u in f64 (gamma64(k + 1) of their sum|t| each, through silu as
            // above), silu and the product in f64 (16 f64 ulps), rounded to f32 (u |out|, and
            // half a subnormal spacing eta for each of the two roundings to f32).
            let out = silu * u;
            let reference = 1.1 * gamma64(k + 1) * g_abs * u_max
                + silu.abs() * gamma64(k + 1) * u_abs
                + (U32 + 16.0 * U64) * out.abs();
            bound[i * n + j] = backend + reference + 2.0 * underflow_abs(DType::F32);
        }
    }
    let xg = gpu::to_backend(b, &x);
    let (gg, ug) = (linear_to_backend(b, &gate), linear_to_backend(b, &up));
    let (mut s0, mut s1) = (poisoned(b, DType::F32, &[m, n]), poisoned(b, DType::F32, &[m, n]));
    let mut out = poisoned(b, DType::F32, &[m, n]);
    b.gate_up_silu(&xg, &gg, &ug, (&mut s0, &mut s1), &mut out)
        .unwrap_or_else(|e| panic!("{} gate_up_silu {c:?}: {e}", b.name()));
    assert_close(&format!("{} gate_up_silu {c:?}", b.name()), &read_f32(b, &out), &want, &bound);
}

/// Fused rows (every row tile and the counts between) and a few composed ones (the GEMM tails).
fn gate_up_cases<B: Backend>(b: &B, who: &str, fused: u32, composed: u32) {
    let f32_out = |c: Case| Case { y: DType::F32, ..c };
    run_cases(SEED, who, fused, case(GEMV_ROWS.to_vec()).prop_map(f32_out), |c| check_gate_up(b, &c));
    run_cases(SEED, who, composed, case(vec![17, 31]).prop_map(f32_out), |c| check_gate_up(b, &c));
}

/// Every weight dtype and scale kind of the fused kernel once on its vector path (k = 128) and its
/// scalar path (k = 17), at 1, 3 and 16 rows (both row tiles, and the composed path), x f32 or bf16.
fn gate_up_every_instantiation<B: Backend>(b: &B) {
    let mut seed = 0x6a7e_0001u64;
    for weight in DType::FLOATS {
        for (scale, scale_dtype) in [
            (ScaleKind::None, DType::F32),
            (ScaleKind::PerTensor, DType::F32),
            (ScaleKind::PerChannel, DType::BF16),
            (ScaleKind::Block(128, 128), DType::F32),
            (ScaleKind::Block(3, 5), DType::BF16),
        ] {
            for (m, k) in [(1, 128), (3, 17), (16, 128)] {
                seed += 1;
                let x = if seed.is_multiple_of(2) { DType::F32 } else { DType::BF16 };
                let c = Case { m, n: 19, k, weight, scale, scale_dtype, x, y: DType::F32, seed };
                check_gate_up(b, &c);
            }
        }
    }
}

/// GEMV rows (every row tile and the in-between counts) and GEMM rows (tails of the 64-row tiles
/// of both GEMMs, and of their 32-row warp tiles).
const GEMV_ROWS: [usize; 6] = [1, 2, 3, 4, 5, 16];
const GEMM_ROWS: [usize; 6] = [17, 31, 64, 70, 129, 200];

fn gemv_cases<B: Backend>(b: &B, who: &str, cases: u32) {
    run_cases(SEED, who, cases, case(GEMV_ROWS.to_vec()), |c| check(b, &c));
}

fn gemm_cases<B: Backend>(b: &B, who: &str, cases: u32) {
    run_cases(SEED, who, cases, case(GEMM_ROWS.to_vec()), |c| check(b, &c));
}

/// Every weight dtype and scale kind once on the vector path of the GEMV and of the GEMM the
/// shape routes to (k = 128: tensor cores for all but f32 weights and 3 x 5 blocks), and on the
/// CUDA-core GEMM (k = 17), so no instantiation is left to chance.
fn every_instantiation<B: Backend>(b: &B) {
    let mut seed = 0x11ea_0001u64;
    for weight in DType::FLOATS {
        for (scale, scale_dtype) in [
            (ScaleKind::None, DType::F32),
            (ScaleKind::PerTensor, DType::F32),
            (ScaleKind::PerChannel, DType::F32),
            (ScaleKind::Block(128, 128), DType::BF16),
            (ScaleKind::Block(3, 5), DType::F32),
        ] {
            for (m, k) in [(1, 128), (3, 128), (9, 128), (20, 128), (20, 17)] {
                seed += 1;
                let c = Case { m, n: 19, k, weight, scale, scale_dtype, x: DType::F32, y: DType::F32, seed };
                let tc = weight != DType::F32 && k == 128 && scale != ScaleKind::Block(3, 5);
                if m > 16 {
                    assert_eq!(path(&c) == Some(GemmPath::TensorCore), tc, "{c:?}");
                }
                check(b, &c);
            }
        }
    }
}

/// One tensor-core case at the 8B model's k (4096) with 128 x 128 block scales: 128 k tiles, 32
/// scale k-blocks, a partial row tile.
fn long_k<B: Backend>(b: &B) {
    for weight in [DType::BF16, DType::F8E4M3Fn] {
        let c = Case {
            m: 20,
            n: 70,
            k: 4096,
            weight,
            scale: ScaleKind::Block(128, 128),
            scale_dtype: DType::BF16,
            x: DType::F32,
            y: DType::F32,
            seed: 0x4096,
        };
        assert_eq!(path(&c), Some(GemmPath::TensorCore));
        check(b, &c);
    }
}

/// The GEMV and the fused gate/up GEMV at k = 4096 with block scales whose block columns hold
/// from one to several warps' worth of a lane's 16-byte chunks, so each lane's chunks (a warp
/// apart) cross block columns at every kind of stride the vector path's cursor (`ChunkColumns` of
/// linear.cuh) takes: fp8 blocks of 48, 128 and 640 columns are 3, 8 and 40 chunks, per channel
/// 256; 16-bit and f32 weights double and quadruple those. 640 leaves a partial last block
/// column, 5-row blocks a partial last block row. At 1, 4 and 13 rows (every GEMV row tile's loop;
/// the 16-row tile scales the widened weights, `SCALE_WEIGHTS` of gemv.cu); the fused gate/up at
/// the rows it is fused for.
fn block_columns_at_long_k<B: Backend>(b: &B) {
    let mut seed = 0xb10c_0001u64;
    for weight in [DType::F8E4M3Fn, DType::F8E5M2, DType::BF16, DType::F32] {
        for scale in [
            ScaleKind::PerChannel,
            ScaleKind::Block(128, 128),
            ScaleKind::Block(5, 48),
            ScaleKind::Block(2, 640),
        ] {
            for m in [1, 4, 13] {
                seed += 1;
                let scale_dtype = if seed.is_multiple_of(2) { DType::F32 } else { DType::BF16 };
                let c = Case {
                    m,
                    n: 19,
                    k: 4096,
                    weight,
                    scale,
                    scale_dtype,
                    x: DType::F32,
                    y: DType::F32,
                    seed,
                };
                check(b, &c);
                if m <= 4 {
                    check_gate_up(b, &c);
                }
            }
        }
    }
}

/// Exact products that need every bf16 part of gemm_tc.cu: x = +-(1 + b 2^-9 + c 2^-18) (bf16 parts
/// 1, b 2^-9 and c 2^-18 with b in {1, 2}, c in {1, 2, 3}, varying with the index) against w = +-1
/// (bf16, e4m3fn) over k = 32, or x = +-(1 + b 2^-9) against f16 w = +-(1 + 2^-10) or +-1 (bf16 parts
/// 1 and 2^-10) over k = 16. Every product and partial sum is a multiple of 2^-18 (2^-19) below 2^6
/// (2^5): 24 bits, exact in f32 in any order and rounding, so y (f32) must equal the f64 sum exactly;
/// a dropped part is off by a multiple of 2^-18 (2^-19).
fn exact_parts<B: Backend>(b: &B) {
    exact_parts_at(b, 20);
}

/// `exact_parts` at `m` rows (20: gemm_tc.cu; at most 16: the GEMV, gemv_tc.cu where it is on).
fn exact_parts_at<B: Backend>(b: &B, m: usize) {
    let n = 19;
    for weight in [DType::BF16, DType::F8E4M3Fn, DType::F16] {
        let f16 = weight == DType::F16;
        let k = if f16 { 16 } else { 32 };
        let sign = |a: usize, b: usize| if (a * 7 + b * 3) % 5 < 2 { -1.0 } else { 1.0 };
        let xv: Vec<f32> = (0..m * k)
            .map(|e| {
                let (i, l) = (e / k, e % k);
                let mid = (1 + (i + l) % 2) as f32 * 2f32.powi(-9);
                let lo = if f16 { 0.0 } else { (1 + (i * l) % 3) as f32 * 2f32.powi(-18) };
                sign(i, l) * (1.0 + mid + lo)
            })
            .collect();
        let wv: Vec<f32> = (0..n * k)
            .map(|e| {
                let (j, l) = (e / k, e % k);
                let lo = if f16 && (j + l) % 3 != 0 { 2f32.powi(-10) } else { 0.0 };
                sign(l, j + 1) * (1.0 + lo)
            })
            .collect();
        let c = Case {
            m,
            n,
            k,
            weight,
            scale: ScaleKind::None,
            scale_dtype: DType::F32,
            x: DType::F32,
            y: DType::F32,
            seed: 0,
        };
        assert!(m <= 16 || path(&c) == Some(GemmPath::TensorCore));
        let lin = linear_to_backend(b, &Linear::plain(upload(&REF, weight, &[n, k], &wv)));
        assert_eq!(read_f32(&REF, &upload(&REF, weight, &[n, k], &wv)), wv, "{weight} holds w exactly");
        let x = upload(b, DType::F32, &[m, k], &xv);
        let mut y = poisoned(b, DType::F32, &[m, n]);
        b.linear(&x, &lin, &mut y).unwrap_or_else(|e| panic!("{} linear exact {weight}: {e}", b.name()));
        let want: Vec<f32> = (0..m * n)
            .map(|e| {
                let (i, j) = (e / n, e % n);
                let s: f64 = (0..k).map(|l| xv[i * k + l] as f64 * wv[j * k + l] as f64).sum();
                s as f32
            })
            .collect();
        assert_close(
            &format!("{} linear exact parts {weight}", b.name()),
            &read_f32(b, &y),
            &want,
            &vec![0.0; m * n],
        );
    }
}

/// The 4-row GEMV with four output features per warp (`Gpu::set_gemv_warp_rows(4)`: gemv_j4 of
/// gemv.cu) against the reference within the GEMV's bound: every weight dtype and scale kind on the
/// scalar (k = 17) and vector (k = 128) paths at 2 to 4 rows, with output counts that leave 1 to 4
/// features in the last group of four (n = 1, 5, 18, 71); then 4 rows at k = 4096 with block
/// columns of every stride (as `block_columns_at_long_k`). Other row counts keep their tiles (1, 9,
/// 13 and 16 rows here), and the setting takes only 1 or 4.
fn gemv_four_features_per_warp<D: Device>(g: &Gpu<D>) {
    assert!(g.set_gemv_warp_rows(3).is_err() && g.set_gemv_warp_rows(0).is_err());
    g.set_gemv_warp_rows(4).expect("4 features per warp");
    assert_eq!(g.gemv_warp_rows(), 4);
    let mut seed = 0x04f0_0001u64;
    let shapes = [(2, 1), (3, 5), (4, 18), (4, 71), (1, 19), (9, 19), (16, 6), (13, 33)];
    for weight in DType::FLOATS {
        for (scale, scale_dtype) in [
            (ScaleKind::None, DType::F32),
            (ScaleKind::PerTensor, DType::F32),
            (ScaleKind::PerChannel, DType::BF16),
            (ScaleKind::Block(128, 128), DType::BF16),
            (ScaleKind::Block(3, 5), DType::F32),
            (ScaleKind::Block(2, 32), DType::F32),
        ] {
            for (i, &(m, n)) in shapes.iter().enumerate() {
                seed += 1;
                let k = if i % 2 == 0 { 128 } else { 17 };
                let (x, y) = if i == 2 { (DType::BF16, DType::BF16) } else { (DType::F32, DType::F32) };
                check(g, &Case { m, n, k, weight, scale, scale_dtype, x, y, seed });
            }
        }
    }
    for weight in [DType::F8E4M3Fn, DType::BF16] {
        for (m, scale) in
            [(4, ScaleKind::PerChannel), (4, ScaleKind::Block(5, 48)), (4, ScaleKind::Block(2, 640))]
        {
            seed += 1;
            let c = Case {
                m,
                n: 19,
                k: 4096,
                weight,
                scale,
                scale_dtype: DType::F32,
                x: DType::F32,
                y: DType::F32,
                seed,
            };
            check(g, &c);
        }
    }
    g.set_gemv_warp_rows(1).expect("back to 1");
}

/// The GEMV on matrix units (`Gpu::set_gemv_tensor_core_rows`: gemv_tc.cu on NVIDIA and the
/// warp-32 emulator, gemv_mfma.cu on AMD CDNA and the warp-64 one) against the reference within
/// its bound (gemm_tc.cu's, plus its runs of k): every tensor-core weight dtype and scale
/// kind at 1 to 16 rows (both row tiles and rows short of them), n leaving partial m16 tiles, warps
/// and blocks, k of partial 64-column steps and 128-column x tiles, 16-bit x and y; then k = 4096
/// and 4160 (a partial last tile) at 16 and 5 rows with scale blocks of one step, of five tiles
/// (runs of whole k-blocks, a short last run) and per channel, where k is cut into runs (counted:
/// the merge of the runs' sums is tested); shapes it does not take (f32 weights, k not a multiple
/// of a word, 3 x 5 or 48-column blocks) still right on gemv.cu; and the exact-parts cases at 16
/// rows, which fail if any bf16 part of x or of an f16 weight is dropped.
fn gemv_tensor_cores<D: Device>(g: &Gpu<D>) {
    use memwall_runtime::gpu::ops::linear::{GemvMatrix, gemv_tc_applies, gemv_tc_plan};
    assert!(g.set_gemv_tensor_core_rows(Some(0)).is_err() && g.set_gemv_tensor_core_rows(Some(17)).is_err());
    g.set_gemv_tensor_core_rows(Some(1)).expect("every GEMV on tensor cores");
    assert_eq!(g.gemv_tensor_core_rows(), Some(1));
    let info = g.device().info().clone();
    let (mut matrix_cases, mut split_cases) = (0, 0);
    let mut run = |c: &Case| {
        let d = LinearDims { m: c.m, n: c.n, k: c.k };
        let splits = if gemv_tc_applies(d, c.weight, blocks(c), &info) {
            let (_, _, splits) = gemv_tc_plan(d, c.weight, blocks(c).map(|b| b.1), &info).expect("plan");
            splits as usize
        } else {
            0
        };
        matrix_cases += usize::from(splits > 0);
        split_cases += usize::from(splits > 1);
        check_on(g, c, splits);
    };
    let mut seed = 0x7c6e_0001u64;
    let shapes =
        [(1, 19, 128), (5, 3, 48), (8, 130, 192), (9, 70, 80), (16, 33, 128), (13, 257, 320), (16, 5, 17)];
    for weight in DType::FLOATS {
        for (scale, scale_dtype) in [
            (ScaleKind::None, DType::F32),
            (ScaleKind::PerTensor, DType::F32),
            (ScaleKind::PerChannel, DType::BF16),
            (ScaleKind::Block(128, 128), DType::BF16),
            (ScaleKind::Block(3, 64), DType::F32),
            (ScaleKind::Block(3, 5), DType::F32),
        ] {
            for (i, &(m, n, k)) in shapes.iter().enumerate() {
                seed += 1;
                let (x, y) = if i == 3 { (DType::BF16, DType::BF16) } else { (DType::F32, DType::F32) };
                run(&Case { m, n, k, weight, scale, scale_dtype, x, y, seed });
            }
        }
    }
    for weight in [DType::F8E4M3Fn, DType::BF16, DType::F16] {
        for (m, k, scale) in [
            (16, 4096, ScaleKind::None),
            (16, 4160, ScaleKind::Block(128, 64)),
            (5, 4096, ScaleKind::Block(2, 640)),
            (16, 4160, ScaleKind::PerChannel),
            (16, 4096, ScaleKind::Block(5, 48)),
        ] {
            seed += 1;
            let x = if seed.is_multiple_of(3) { DType::F16 } else { DType::F32 };
            let c = Case { m, n: 19, k, weight, scale, scale_dtype: DType::F32, x, y: DType::F32, seed };
            run(&c);
        }
    }
    if GemvMatrix::of(&info).is_some() {
        assert!(matrix_cases >= 150, "only {matrix_cases} cases ran on the matrix units");
        assert!(split_cases >= 6, "only {split_cases} cases ran in runs of k");
    }
    if gemv_tc_applies(LinearDims { m: 16, n: 19, k: 32 }, DType::BF16, None, &info) {
        exact_parts_at(g, 16);
    }
    g.set_gemv_tensor_core_rows(None).expect("back to gemv.cu");
}

/// The cases of the tensor-core GEMMs' own suites (gemm_wg.cu, gemm_mfma.cu), each handed to `run`:
/// every tensor-core weight dtype x scale kind at shapes with partial row tiles (m = 17, 20, 129,
/// 130: of 64 and of 128 rows) and column tiles (n = 3, 19, 129, 257: of 64 and of 128 features), k
/// of one, several and partial 32-column tiles, 16-bit x and y; block rows of 1, 2, 5 and 128 (the
/// folds' cursors over a lane's columns 8 or 16 apart) and columns of one, two and four tiles; 3 x 5
/// blocks, which stay on gemm.cu; k = 4096 with 128 x 128 blocks (32 k-blocks of 4 tiles) and per
/// channel.
fn tensor_core_gemm_cases(mut run: impl FnMut(&Case)) {
    let mut seed = 0x3767_0001u64;
    let shapes = [(17, 19, 128), (130, 129, 48), (20, 257, 80), (129, 3, 160)];
    let tc_weights =
        [DType::BF16, DType::F16, DType::F8E4M3Fn, DType::F8E4M3Fnuz, DType::F8E5M2, DType::F8E5M2Fnuz];
    for weight in tc_weights {
        for (scale, scale_dtype) in [
            (ScaleKind::None, DType::F32),
            (ScaleKind::PerTensor, DType::F32),
            (ScaleKind::PerChannel, DType::BF16),
            (ScaleKind::Block(128, 128), DType::BF16),
            (ScaleKind::Block(2, 32), DType::F32),
            (ScaleKind::Block(5, 64), DType::BF16),
            (ScaleKind::Block(3, 5), DType::F32),
        ] {
            for (i, &(m, n, k)) in shapes.iter().enumerate() {
                seed += 1;
                let (x, y) = match i {
                    1 => (DType::BF16, DType::BF16),
                    2 => (DType::F16, DType::F16),
                    _ => (DType::F32, DType::F32),
                };
                run(&Case { m, n, k, weight, scale, scale_dtype, x, y, seed });
            }
        }
    }
    for weight in [DType::BF16, DType::F8E4M3Fn, DType::F16] {
        for scale in [ScaleKind::Block(128, 128), ScaleKind::PerChannel] {
            seed += 1;
            let c = Case {
                m: 20,
                n: 70,
                k: 4096,
                weight,
                scale,
                scale_dtype: DType::BF16,
                x: DType::F32,
                y: DType::F32,
                seed,
            };
            run(&c);
        }
    }
}

/// Runs `tensor_core_gemm_cases` on `g` against the reference within gemm_tc.cu's bound where
/// `gemm::gemm_kernel` routes each (with the warpgroup path as `g` has it), asserting that `path`
/// takes exactly the cases that mma.sync would (gemm_tc.cu's contract) where `has_path` (else the
/// cases run on the kernels the device keeps) and at least 100 of them; then the exact-parts
/// cases, which fail if any bf16 part of x or of an f16 weight is dropped.
fn tensor_core_gemm_on<D: Device>(g: &Gpu<D>, path_wanted: GemmPath, has_path: bool) {
    use memwall_runtime::gpu::ops::gemm::gemm_kernel;
    let info = g.device().info().clone();
    if !has_path {
        eprintln!("{}: no {path_wanted:?} GEMM: the cases run on the kernels it keeps", g.name());
    }
    let mut on_path = 0;
    tensor_core_gemm_cases(|c| {
        let d = LinearDims { m: c.m, n: c.n, k: c.k };
        let kernel = gemm_kernel(d, c.weight, blocks(c), &info, g.gemm_warpgroup());
        if has_path {
            assert_eq!(kernel == path_wanted, path(c) == Some(GemmPath::TensorCore), "{kernel:?} {c:?}");
        }
        on_path += usize::from(kernel == path_wanted);
        check_on(g, c, usize::from(kernel != GemmPath::CudaCore));
    });
    if has_path {
        assert!(on_path >= 100, "only {on_path} cases ran on {path_wanted:?}");
    }
    exact_parts_at(g, 20);
}

/// The warpgroup GEMM (`Gpu::set_gemm_warpgroup`: gemm_wg.cu, wgmma; sm_90 only) on
/// `tensor_core_gemm_cases`.
fn gemm_warpgroup<D: Device>(g: &Gpu<D>) {
    use memwall_runtime::gpu::ops::gemm::has_wgmma;
    g.set_gemm_warpgroup(true);
    assert!(g.gemm_warpgroup());
    tensor_core_gemm_on(g, GemmPath::Warpgroup, has_wgmma(g.device().info()));
    g.set_gemm_warpgroup(false);
}

/// The MFMA GEMM (gemm_mfma.cu: AMD matrix cores, and the warp-64 emulator) on
/// `tensor_core_gemm_cases`.
fn gemm_matrix_cores<D: Device>(g: &Gpu<D>) {
    use memwall_runtime::gpu::ops::gemm::has_mfma;
    tensor_core_gemm_on(g, GemmPath::MatrixCore, has_mfma(g.device().info()));
}

/// x and y at 3 of 9 allocated rows: the kernels read and write only their rows.
fn set_rows_respected<B: Backend>(b: &B) {
    let mut rng = Rng::new(0x5e7_11ea);
    for (m_max, m) in [(9, 3), (40, 20)] {
        let (n, k) = (17, 64);
        let w = linear_to_backend(b, &Linear::plain(random_tensor(&REF, &mut rng, DType::BF16, &[n, k]).0));
        let xv = random_values(&mut rng, DType::F32, m * k);
        let x_exact = upload(b, DType::F32, &[m, k], &xv);
        let mut x_spare = poisoned(b, DType::F32, &[m_max, k]);
        x_spare.set_rows(m).unwrap();
        b.write(&mut x_spare, bytemuck::cast_slice(&xv)).unwrap();
        let mut y_exact = poisoned(b, DType::F32, &[m, n]);
        let mut y_spare = poisoned(b, DType::F32, &[m_max, n]);
        y_spare.set_rows(m).unwrap();
        b.linear(&x_exact, &w, &mut y_exact).unwrap();
        b.linear(&x_spare, &w, &mut y_spare).unwrap();
        let want = read_bytes(b, &y_exact);
        y_spare.set_rows(m_max).unwrap();
        let all = read_bytes(b, &y_spare);
        let (head, tail) = all.split_at(want.len());
        assert_same_bytes(&format!("{} linear m {m} of {m_max}", b.name()), DType::F32, head, &want);
        assert_eq!(
            tail,
            &poison_bytes(DType::F32, tail.len() / 4)[..],
            "{}: spare rows of y written",
            b.name()
        );
    }
}

#[cfg(feature = "emulate")]
mod emulated {
    use super::*;
    use memwall_runtime::gpu::ops::linear::GemvMatrix;

    /// Cases per kernel and schedule: the emulator runs every GPU thread as a fiber on one core.
    const EMU_CASES: u32 = 40;

    #[test]
    fn every_kernel_is_in_the_image() {
        let have = memwall::kernels::simt_cuda().kernels();
        for name in memwall::runtime::gpu::ops::linear::kernel_names() {
            assert!(have.iter().any(|k| k == name), "{name} is not in the SIMT image");
        }
    }

    #[test]
    fn gemv_matches_reference() {
        for (name, b) in gpu::emulated() {
            gemv_cases(&b, &name, EMU_CASES);
        }
    }

    #[test]
    fn gemm_matches_reference() {
        for (name, b) in gpu::emulated() {
            gemm_cases(&b, &name, EMU_CASES / 2);
        }
    }

    #[test]
    fn every_weight_dtype_and_scale_kind() {
        let (_, b) = gpu::emulated().swap_remove(2);
        every_instantiation(&b);
    }

    #[test]
    fn set_rows_is_respected() {
        for (_, b) in gpu::emulated() {
            set_rows_respected(&b);
        }
    }

    #[test]
    fn tensor_core_gemm_at_long_k() {
        let (_, b) = gpu::emulated().swap_remove(2);
        long_k(&b);
    }

    /// One emulated backend per warp width: the CUDA image at 32 lanes (its random schedule) and the
    /// HIP one at 64.
    fn warp_32_and_64() -> [(String, Gpu<memwall::runtime::gpu::emu::EmuDevice>); 2] {
        let mut emulated = gpu::emulated();
        let hip = emulated.pop().expect("hip-emu");
        [emulated.swap_remove(2), hip]
    }

    #[test]
    fn gemv_tensor_cores_match_reference() {
        let (_, b) = gpu::emulated().swap_remove(2);
        assert_eq!(GemvMatrix::of(b.device().info()), Some(GemvMatrix::TensorCore));
        gemv_tensor_cores(&b);
    }

    /// gemv_mfma.cu on the HIP image (warp 64), through mfma.cuh's emulated MFMA.
    #[test]
    fn matrix_core_gemv_matches_reference() {
        let (name, b) = gpu::emulated().pop().expect("hip-emu");
        assert_eq!(GemvMatrix::of(b.device().info()), Some(GemvMatrix::MatrixCore), "{name}");
        gemv_tensor_cores(&b);
    }

    #[test]
    fn warpgroup_gemm_matches_reference() {
        let (_, b) = gpu::emulated().swap_remove(2);
        gemm_warpgroup(&b);
    }

    /// gemm_mfma.cu on the HIP image (warp 64), through mfma.cuh's emulated MFMA.
    #[test]
    fn matrix_core_gemm_matches_reference() {
        let (name, b) = gpu::emulated().pop().expect("hip-emu");
        assert!(name.contains("hip"), "{name}");
        gemm_matrix_cores(&b);
    }

    #[test]
    fn gemv_four_features_per_warp_matches_reference() {
        for (_, b) in warp_32_and_64() {
            gemv_four_features_per_warp(&b);
        }
    }

    /// The cursor's steps are a warp of chunks: 32 lanes on the CUDA image, 64 on the HIP one.
    #[test]
    fn gemv_block_columns_at_long_k() {
        for (_, b) in warp_32_and_64() {
            block_columns_at_long_k(&b);
        }
    }

    #[test]
    fn tensor_core_gemm_uses_every_part() {
        for (_, b) in gpu::emulated() {
            exact_parts(&b);
        }
    }

    #[test]
    fn gate_up_silu_matches_reference() {
        for (name, b) in gpu::emulated() {
            gate_up_cases(&b, &name, EMU_CASES / 2, 3);
        }
    }

    #[test]
    fn gate_up_silu_every_weight_dtype_and_scale_kind() {
        let (_, b) = gpu::emulated().swap_remove(2);
        gate_up_every_instantiation(&b);
    }
}

device_tests! {
    const CASES: u32 = 256;

    fn gemv_matches_reference(b, who) {
        gemv_cases(&b, who, CASES);
    }

    fn gemm_matches_reference(b, who) {
        gemm_cases(&b, who, CASES);
    }

    fn every_weight_dtype_and_scale_kind(b, who) {
        every_instantiation(&b);
    }

    fn set_rows_is_respected(b, who) {
        set_rows_respected(&b);
    }

    // On AMD the tensor-core shapes take the CUDA-core GEMM (no mma.sync there): the same checks.
    fn tensor_core_gemm_at_long_k(b, who) {
        long_k(&b);
    }

    fn tensor_core_gemm_uses_every_part(b, who) {
        exact_parts(&b);
    }

    fn gemv_block_columns_at_long_k(b, who) {
        block_columns_at_long_k(&b);
    }

    fn gemv_four_features_per_warp_matches_reference(b, who) {
        gemv_four_features_per_warp(&b);
    }

    // gemv_tc.cu on NVIDIA, gemv_mfma.cu on AMD CDNA (gemv.cu where neither runs): the same checks.
    fn gemv_tensor_cores_match_reference(b, who) {
        gemv_tensor_cores(&b);
    }

    // Only sm_90 has wgmma: elsewhere the same cases on gemm_tc.cu / gemm.cu.
    fn warpgroup_gemm_matches_reference(b, who) {
        gemm_warpgroup(&b);
    }

    // Only AMD CDNA has MFMA: elsewhere the same cases on the kernels kept there.
    fn matrix_core_gemm_matches_reference(b, who) {
        gemm_matrix_cores(&b);
    }

    fn gate_up_silu_matches_reference(b, who) {
        gate_up_cases(&b, who, CASES, CASES / 4);
    }

    fn gate_up_silu_every_weight_dtype_and_scale_kind(b, who) {
        gate_up_every_instantiation(&b);
    }
}
