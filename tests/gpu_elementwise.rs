//! The elementwise family of the GPU backend (`kernels-cuda/elementwise.cu`): rms_norm, rope,
//! silu_mul, add_assign, each against `cpu::Reference` over proptest shapes.
//!
//! Every op runs on each emulated backend (`--features memwall/emulate`: the kernels compiled as
//! host C++ under three thread schedules) and, ignored unless asked for, on a CUDA or ROCm device
//! (`--features memwall/cuda` or `memwall/hip`, `-- --ignored`; `MEMWALL_REQUIRE_GPU=1` makes a missing device fail).
//! Inputs are made on the host and uploaded to both backends; outputs are poisoned (NaN) first;
//! each tolerance is derived in a comment next to it. Notation as tests/ops.rs: u = 2^-24 (f32
//! unit roundoff), gamma(n) = n u / (1 - n u), U64 = 2^-53.
//!
//! Each op also runs on tensors at fewer rows than their storage holds (`Tensor::set_rows`): the
//! result must equal the exactly sized run byte for byte, and the spare rows must keep their
//! poison.

#![cfg_attr(
    not(any(feature = "emulate", feature = "cuda", feature = "hip")),
    allow(dead_code, unused_imports)
)]

mod common;

use common::spare::{f32_pair, pair, same};
use common::{Rng, *};
use memwall_runtime::cpu::Reference;
use memwall_runtime::{Backend, DType, Llama3RopeScaling, Rope};
use proptest::prelude::*;
use proptest::sample::select;

static REF: Reference = Reference;

const ROW_SIZES: [usize; 5] = [1, 2, 3, 5, 17];
/// Odd tails, the warp-per-row rms_norm up to 1024 columns, the block-per-row one above (1028 and
/// 4096 vectorised, 4097 not).
const COL_SIZES: [usize; 8] = [1, 3, 17, 64, 130, 1028, 4096, 4097];

/// The seed of this suite's proptest cases (`common::run_cases`).
const SEED: u64 = 0x6770_7565_6c65_6d21;

// ---------------------------------------------------------------------------------------------
// rms_norm

fn rms_norm_case<B: Backend>(b: &B, rows: usize, cols: usize, wdtype: DType, eps: f32, seed: u64) {
    let who = b.name();
    let mut rng = Rng::new(seed);
    let xv = random_values(&mut rng, DType::F32, rows * cols);
    let wv = random_values(&mut rng, wdtype, cols);
    let x_ref = upload(&REF, DType::F32, &[rows, cols], &xv);
    let w_ref = upload(&REF, wdtype, &[cols], &wv);
    let mut y_ref = poisoned(&REF, DType::F32, &[rows, cols]);
    REF.rms_norm(&x_ref, &w_ref, eps, &mut y_ref).unwrap_or_else(|e| panic!("reference rms_norm: {e}"));
    let want = read_f32(&REF, &y_ref);

    let x = upload(b, DType::F32, &[rows, cols], &xv);
    let w = upload(b, wdtype, &[cols], &wv);
    let mut y = poisoned(b, DType::F32, &[rows, cols]);
    b.rms_norm(&x, &w, eps, &mut y).unwrap_or_else(|e| panic!("{who} rms_norm: {e}"));
    let got = read_f32(b, &y);

    let mut bound = vec![0f64; rows * cols];
    for i in 0..rows {
        let row = &xv[i * cols..(i + 1) * cols];
        let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / cols as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        for j in 0..cols {
            let e = (row[j] as f64 * inv * wv[j] as f64).abs();
            // GPU, relative to |ref| (every factor is a product): the sum of squares of cols
            // positive terms in f32, in any order, gamma(cols); the mean, + eps, sqrt and
            // reciprocal in f64 (sqrt halves the sum's error; a few f64 roundings, 4 U64), rounded
            // to f32 (u); times x (u), times weight (u). Total gamma(cols) / 2 + 3u + 4 U64.
            let gpu = 0.5 * gamma(cols) + 3.0 * U32 + 4.0 * U64;
            // Reference (tests/ops.rs): f64 throughout, gamma64(cols + 8), rounded to f32 (u).
            let reference = gamma64(cols + 8) + U32;
            bound[i * cols + j] = (gpu + reference) * e;
        }
    }
    let what = format!("{who} rms_norm {rows}x{cols} weight {wdtype} eps {eps:e}");
    assert_close(&what, &got, &want, &bound);
}

fn rms_norm_cases<B: Backend>(b: &B, who: &str, cases: u32) {
    let shapes = (
        select(ROW_SIZES.to_vec()),
        select(COL_SIZES.to_vec()),
        select(DType::FLOATS.to_vec()),
        select(vec![1e-5f32, 1e-6]),
        any::<u64>(),
    );
    run_cases(SEED, who, cases, shapes, |(rows, cols, w, eps, seed)| {
        rms_norm_case(b, rows, cols, w, eps, seed)
    });
    // Wide rows (Llama 3 70B's 8192 and beyond), vectorised and not.
    for (cols, w) in [(16388, DType::BF16), (16385, DType::F8E4M3Fn)] {
        rms_norm_case(b, 2, cols, w, 1e-5, cols as u64);
    }
}

// ---------------------------------------------------------------------------------------------
// rope

fn rope_strategy() -> impl Strategy<Value = Rope> {
    (
        prop_oneof![1..=64usize, Just(256usize)],
        select(vec![10_000.0f64, 500_000.0]),
        prop_oneof![
            Just(None),
            // Llama 3.1's own settings, and a small original context so short heads reach the blend.
            (select(vec![8.0f64, 2.0, 32.0]), select(vec![8192usize, 64])).prop_map(|(factor, orig)| Some(
                Llama3RopeScaling {
                    factor,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: orig,
                }
            )),
        ],
    )
        .prop_map(|(half, theta, scaling)| Rope { head_dim: 2 * half, theta, scaling })
}

fn rope_case<B: Backend>(b: &B, rows: usize, heads: usize, rope: &Rope, max_pos: u32, seed: u64) {
    let who = b.name();
    let mut rng = Rng::new(seed);
    let hd = rope.head_dim;
    let half = hd / 2;
    let xv = random_values(&mut rng, DType::F32, rows * heads * hd);
    let pv: Vec<u32> = (0..rows).map(|_| rng.range(0, max_pos as usize) as u32).collect();
    let mut x_ref = upload(&REF, DType::F32, &[rows, heads, hd], &xv);
    let pos_ref = upload_u32(&REF, &[rows], &pv);
    REF.rope(&mut x_ref, &pos_ref, rope).unwrap_or_else(|e| panic!("reference rope: {e}"));
    let want = read_f32(&REF, &x_ref);

    let mut x = upload(b, DType::F32, &[rows, heads, hd], &xv);
    let pos = upload_u32(b, &[rows], &pv);
    b.rope(&mut x, &pos, rope).unwrap_or_else(|e| panic!("{who} rope: {e}"));
    let got = read_f32(b, &x);

    let inv_freq = rope.inv_freq();
    let mut bound = vec![0f64; rows * heads * hd];
    for (row, &position) in pv.iter().enumerate() {
        for h in 0..heads {
            let base = (row * heads + h) * hd;
            for (i, &freq) in inv_freq.iter().enumerate() {
                let theta = position as f64 * freq;
                let (a, b) = (xv[base + i] as f64, xv[base + i + half] as f64);
                let pair = (a * a + b * b).sqrt();
                // GPU: the angle is the reference's own f64 product (bit for bit). Its sine and
                // cosine: the f64 reduction modulo pi/2 and the polynomials err by at most about
                // 32 U64 absolute (every intermediate is below 2 in magnitude); each rounded to
                // f32 (u relative). The rotation in f32: two products and a sum, each rounded
                // once (an fma only removes a rounding). With |a cos| + |b sin| <= sqrt(2) |pair|
                // and |out| <= |pair|: the trig roundings sqrt(2) u, the products sqrt(2) u, the
                // sum u, the f64 trig error sqrt(2) 32 U64: under |pair| (4u + 64 U64).
                let gpu = pair * (4.0 * U32 + 64.0 * U64);
                // Reference (tests/ops.rs): f64 angle and trig, a few f64 ulps of the angle
                // (8 U64 (|theta| + 1) |pair|), rounded to f32 (u |pair|).
                let reference = pair * (U32 + 8.0 * U64 * (theta.abs() + 1.0));
                bound[base + i] = gpu + reference;
                bound[base + i + half] = gpu + reference;
            }
        }
    }
    let what = format!("{who} rope {rows}x{heads}x{hd} {rope:?} positions {pv:?}");
    assert_close(&what, &got, &want, &bound);
}

fn rope_cases<B: Backend>(b: &B, who: &str, cases: u32) {
    let shapes = (
        select(ROW_SIZES.to_vec()),
        select(vec![1usize, 2, 3, 8]),
        rope_strategy(),
        // Short and long contexts, Llama 3.1's 128K, and the largest position a u32 holds.
        select(vec![16u32, 4096, 131_072, u32::MAX]),
        any::<u64>(),
    );
    run_cases(SEED, who, cases, shapes, |(rows, heads, rope, max_pos, seed)| {
        rope_case(b, rows, heads, &rope, max_pos, seed)
    });
    // Llama 3.1 8B's rope, a decode row and a prefill of 40 rows up to 128K.
    let llama = Rope {
        head_dim: 128,
        theta: 500_000.0,
        scaling: Some(Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }),
    };
    rope_case(b, 1, 32, &llama, 131_072, 1);
    rope_case(b, 40, 8, &llama, 131_072, 2);
}

/// A head longer than the kernel's params hold is a typed error, not a launch.
fn rope_rejects_long_heads<B: Backend>(b: &B) {
    let rope = Rope { head_dim: 2 * 257, theta: 10_000.0, scaling: None };
    let mut x = upload(b, DType::F32, &[1, 1, rope.head_dim], &vec![0.5; rope.head_dim]);
    let pos = upload_u32(b, &[1], &[3]);
    match b.rope(&mut x, &pos, &rope) {
        Err(memwall_runtime::Error::Unsupported { op: "rope", .. }) => {}
        other => panic!("{}: rope with head_dim 514 gave {other:?}", b.name()),
    }
}

// ---------------------------------------------------------------------------------------------
// silu_mul, add_assign

fn silu_mul_case<B: Backend>(b: &B, rows: usize, cols: usize, seed: u64) {
    let who = b.name();
    let mut rng = Rng::new(seed);
    let gv = random_values(&mut rng, DType::F32, rows * cols);
    let uv = random_values(&mut rng, DType::F32, rows * cols);
    let (g_ref, u_ref) =
        (upload(&REF, DType::F32, &[rows, cols], &gv), upload(&REF, DType::F32, &[rows, cols], &uv));
    let mut o_ref = poisoned(&REF, DType::F32, &[rows, cols]);
    REF.silu_mul(&g_ref, &u_ref, &mut o_ref).unwrap_or_else(|e| panic!("reference silu_mul: {e}"));
    let want = read_f32(&REF, &o_ref);

    let (g, u) = (upload(b, DType::F32, &[rows, cols], &gv), upload(b, DType::F32, &[rows, cols], &uv));
    let mut o = poisoned(b, DType::F32, &[rows, cols]);
    b.silu_mul(&g, &u, &mut o).unwrap_or_else(|e| panic!("{who} silu_mul: {e}"));
    let got = read_f32(b, &o);

    let bound: Vec<f64> = gv
        .iter()
        .zip(&uv)
        .map(|(&g, &u)| {
            let e = (g as f64 / (1.0 + (-(g as f64)).exp()) * u as f64).abs();
            // GPU, relative: expf(-g) within 2 ulps on CUDA (CUDA guide, expf), 1 in glibc: 4u;
            // 1 + e: u, and e's error shrinks by e / (1 + e) < 1; the division u; times up u.
            // 4u + u + u + u = 7u, taken as 8u. Reference (tests/ops.rs): f64, then f32:
            // u + 16 U64.
            (8.0 * U32 + U32 + 16.0 * U64) * e
        })
        .collect();
    assert_close(&format!("{who} silu_mul {rows}x{cols}"), &got, &want, &bound);
}

fn add_assign_case<B: Backend>(b: &B, rows: usize, cols: usize, seed: u64) {
    let who = b.name();
    let mut rng = Rng::new(seed);
    let xv = random_values(&mut rng, DType::F32, rows * cols);
    let yv = random_values(&mut rng, DType::F32, rows * cols);
    let mut x = upload(b, DType::F32, &[rows, cols], &xv);
    let y = upload(b, DType::F32, &[rows, cols], &yv);
    b.add_assign(&mut x, &y).unwrap_or_else(|e| panic!("{who} add_assign: {e}"));
    // x + y of two f32 values is exact in f64, so the reference and the GPU (one f32 addition)
    // both round the same exact sum once: bit-identical, bound 0.
    let want: Vec<f32> = xv.iter().zip(&yv).map(|(&a, &b)| (a as f64 + b as f64) as f32).collect();
    assert_close(
        &format!("{who} add_assign {rows}x{cols}"),
        &read_f32(b, &x),
        &want,
        &vec![0.0; rows * cols],
    );
}

fn silu_mul_and_add_assign_cases<B: Backend>(b: &B, who: &str, cases: u32) {
    let shapes = (select(ROW_SIZES.to_vec()), select(COL_SIZES.to_vec()), any::<u64>());
    run_cases(SEED, who, cases, shapes.clone(), |(rows, cols, seed)| silu_mul_case(b, rows, cols, seed));
    run_cases(SEED, who, cases, shapes, |(rows, cols, seed)| add_assign_case(b, rows, cols, seed));
}

// ---------------------------------------------------------------------------------------------
// set_rows

fn set_rows_respected<B: Backend>(b: &B) {
    let mut rng = Rng::new(0x5e7_0005);
    for cols in [17, 1028] {
        let w = upload(b, DType::BF16, &[cols], &random_values(&mut rng, DType::BF16, cols));
        let (xe, mut xs) = f32_pair(b, &mut rng, &[cols]);
        let (mut ye, mut ys) = f32_pair(b, &mut rng, &[cols]);
        b.rms_norm(&xe, &w, 1e-5, &mut ye).unwrap();
        b.rms_norm(&xs, &w, 1e-5, &mut ys).unwrap();
        same(b, &format!("rms_norm {cols} y"), &ye, &mut ys);
        same(b, &format!("rms_norm {cols} x"), &xe, &mut xs);

        let (ge, mut gs) = f32_pair(b, &mut rng, &[cols]);
        let (mut oe, mut os) = f32_pair(b, &mut rng, &[cols]);
        b.silu_mul(&ge, &xe, &mut oe).unwrap();
        b.silu_mul(&gs, &xs, &mut os).unwrap();
        same(b, &format!("silu_mul {cols} out"), &oe, &mut os);
        same(b, &format!("silu_mul {cols} gate"), &ge, &mut gs);

        b.add_assign(&mut oe, &ge).unwrap();
        b.add_assign(&mut os, &gs).unwrap();
        same(b, &format!("add_assign {cols} x"), &oe, &mut os);
    }

    let rope = Rope { head_dim: 6, theta: 10_000.0, scaling: None };
    let (mut re, mut rs) = f32_pair(b, &mut rng, &[2, 6]);
    let (pe, mut ps) = pair(b, DType::U32, &[], bytemuck::cast_slice(&[5u32, 0, 70_000]));
    b.rope(&mut re, &pe, &rope).unwrap();
    b.rope(&mut rs, &ps, &rope).unwrap();
    same(b, "rope x", &re, &mut rs);
    same(b, "rope positions", &pe, &mut ps);
}

// ---------------------------------------------------------------------------------------------
// Backends

#[cfg(feature = "emulate")]
mod emulated {
    use super::*;

    /// Cases per op and schedule: emulation runs every GPU thread as a fiber on one core.
    const EMU_CASES: u32 = 48;

    /// Every kernel the launchers of this family may launch is in the image.
    #[test]
    fn every_kernel_is_in_the_image() {
        let have = memwall::kernels::simt_cuda().kernels();
        for name in memwall::runtime::gpu::ops::elementwise::kernel_names() {
            assert!(have.iter().any(|k| k == name), "{name} is not in the SIMT image");
        }
    }

    #[test]
    fn rms_norm_matches_reference() {
        for (name, b) in gpu::emulated() {
            rms_norm_cases(&b, &name, EMU_CASES);
        }
    }

    #[test]
    fn rope_matches_reference() {
        for (name, b) in gpu::emulated() {
            rope_cases(&b, &name, EMU_CASES);
            rope_rejects_long_heads(&b);
        }
    }

    #[test]
    fn silu_mul_and_add_assign_match_reference() {
        for (name, b) in gpu::emulated() {
            silu_mul_and_add_assign_cases(&b, &name, EMU_CASES);
        }
    }

    #[test]
    fn set_rows_is_respected() {
        for (_, b) in gpu::emulated() {
            set_rows_respected(&b);
        }
    }
}

device_tests! {
    const CASES: u32 = 64;

    fn rms_norm_matches_reference(b, who) {
        rms_norm_cases(&b, who, CASES);
    }

    fn rope_matches_reference(b, who) {
        rope_cases(&b, who, CASES);
        rope_rejects_long_heads(&b);
    }

    fn silu_mul_and_add_assign_match_reference(b, who) {
        silu_mul_and_add_assign_cases(&b, who, CASES);
    }

    fn set_rows_is_respected(b, who) {
        set_rows_respected(&b);
    }
}
