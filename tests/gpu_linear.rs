//! `linear` on the GPU backend: the GEMV of `kernels-cuda/gemv.cu` (m <= 16 rows) and the tiled
//! GEMM of `kernels-cuda/gemm.cu` (m > 16), each weight dtype x scale kind x activation dtypes,
//! against `cpu::Reference`, over shapes that exercise every path and tail: k = 1, 3, 17, 4097
//! (scalar paths), k multiples of 16 (the 16-byte vector path) with odd n, block scales of sizes
//! that do and do not divide the 16-byte chunk, and rows at fewer than allocated.
//!
//! Runs on each emulated backend (`--features memwall/emulate`) and, ignored unless asked for, on
//! a CUDA device (`--features memwall/cuda -- --ignored`; `MEMWALL_REQUIRE_GPU=1` makes a missing
//! device fail). Outputs are poisoned (NaN) first; the tolerance is derived next to it.

#![cfg_attr(not(any(feature = "emulate", feature = "cuda")), allow(dead_code, unused_imports))]

mod common;

use std::fmt::Debug;

use common::gpu::linear_to_backend;
use common::{Rng, *};
use memwall_runtime::cpu::Reference;
use memwall_runtime::{Backend, DType, HostStorage, Linear, WeightScale};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::{RngSeed, TestRunner};

static REF: Reference = Reference;

fn run_cases<S: Strategy>(who: &str, cases: u32, strategy: S, test: impl Fn(S::Value))
where
    S::Value: Debug,
{
    let config = ProptestConfig {
        cases,
        rng_seed: RngSeed::Fixed(0x6770_756c_696e_6561),
        failure_persistence: None,
        max_shrink_iters: 50,
        ..ProptestConfig::default()
    };
    let mut runner = TestRunner::new(config);
    if let Err(e) = runner.run(&strategy, |v| {
        test(v);
        Ok(())
    }) {
        panic!("{who}: {e}");
    }
}

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

fn check<B: Backend>(b: &B, c: &Case) {
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
            let (mut sum, mut abs) = (0f64, 0f64);
            for l in 0..k {
                let t = xv[i * k + l] as f64 * wv[j * k + l] as f64 * sv[j * k + l];
                sum += t;
                abs += t.abs();
            }
            // The kernels accumulate in f32 from exactly widened x, w and s: each term meets at
            // most k + 8 roundings (x * w, the scale multiply, the chunk / lane / warp-tree sums
            // of the GEMV; x * w * s and k additions of the GEMM), so |acc - exact| <= gamma(k + 8)
            // sum|x w s|. The reference is f64 (gamma64(k + 1) sum|x w s|) rounded to y, possibly
            // via f32 ((u_out + u) |exact| + eta); ours rounds acc to y (u_out |acc| + eta). So
            // |got - want| <= (1 + u_out) gamma(k + 8) sum|x w s| + gamma64(k + 1) sum|x w s|
            // + (2 u_out + u) |exact| + 2 eta.
            bound[i * n + j] = (1.0 + uo) * gamma(k + 8) * abs
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

/// GEMV rows (every row tile and the in-between counts) and GEMM rows (tails of the 64-row tile).
const GEMV_ROWS: [usize; 6] = [1, 2, 3, 4, 5, 16];
const GEMM_ROWS: [usize; 4] = [17, 31, 64, 70];

fn gemv_cases<B: Backend>(b: &B, who: &str, cases: u32) {
    run_cases(who, cases, case(GEMV_ROWS.to_vec()), |c| check(b, &c));
}

fn gemm_cases<B: Backend>(b: &B, who: &str, cases: u32) {
    run_cases(who, cases, case(GEMM_ROWS.to_vec()), |c| check(b, &c));
}

/// Every weight dtype and scale kind once on the vector path of both kernels, so no
/// instantiation is left to chance.
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
            for m in [1, 3, 9, 20] {
                seed += 1;
                let c =
                    Case { m, n: 19, k: 128, weight, scale, scale_dtype, x: DType::F32, y: DType::F32, seed };
                check(b, &c);
            }
        }
    }
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
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;

    const CUDA_CASES: u32 = 256;

    #[test]
    #[ignore = "needs a CUDA device"]
    fn gemv_matches_reference() {
        if let Some(b) = gpu::cuda() {
            gemv_cases(&b, "cuda", CUDA_CASES);
        }
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn gemm_matches_reference() {
        if let Some(b) = gpu::cuda() {
            gemm_cases(&b, "cuda", CUDA_CASES);
        }
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn every_weight_dtype_and_scale_kind() {
        if let Some(b) = gpu::cuda() {
            every_instantiation(&b);
        }
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn set_rows_is_respected() {
        if let Some(b) = gpu::cuda() {
            set_rows_respected(&b);
        }
    }
}
