//! The selection family of the GPU backend (`kernels-cuda/select.cu`): argmax, router_topk and
//! sample against `cpu::Reference`, over odd row lengths, exact ties, special values (NaN, ±inf,
//! ±0) and every sampling setting, plus the C++ `sample_uniform` against the Rust one (through
//! `sample` itself: a one-candidate-per-uniform row would be circular, so the draws are compared
//! with the reference's over many seeds and steps).
//!
//! argmax and the router's ids must equal the reference exactly (no arithmetic decides them).
//! Router weights: see the tolerance below. Sampled tokens must equal the reference's except
//! where u, or top_p, lies within `BOUNDARY` of a cumulative probability of the reference's
//! distribution (the kernel's fixed-point masses and the reference's f64 sums may then round to
//! different sides); such cases are counted and must be rare.
//!
//! Runs on each emulated backend (`--features memwall/emulate`) and, ignored unless asked for, on
//! a CUDA or ROCm device (`--features memwall/cuda` or `memwall/hip`, `-- --ignored`; `MEMWALL_REQUIRE_GPU=1` makes a missing
//! device fail). Outputs are poisoned first.

#![cfg_attr(
    not(any(feature = "emulate", feature = "cuda", feature = "hip")),
    allow(dead_code, unused_imports)
)]

mod common;

use std::cell::Cell;
use std::fmt::Debug;

use common::{Rng, *};
use memwall_runtime::cpu::Reference;
use memwall_runtime::ops::sample_uniform;
use memwall_runtime::{Backend, DType, SamplingParams};
use proptest::prelude::*;
use proptest::sample::select;

/// The seed of this suite's proptest cases (`common::run_cases`).
const SEED: u64 = 0x6770_7573_656c_6563;

/// How a row's values are made.
#[derive(Clone, Copy, Debug)]
enum Values {
    /// Uniform in (-1, 1) times a spread (distinct, no ties in practice).
    Random(f32),
    /// A coarse grid: many exact ties.
    Ties,
    /// Random with NaN, ±inf and ±0 sprinkled in.
    Special,
}

fn make_row(rng: &mut Rng, values: Values, n: usize) -> Vec<f32> {
    match values {
        Values::Random(spread) => random_values(rng, DType::F32, n).into_iter().map(|v| v * spread).collect(),
        Values::Ties => grid_values(rng, n, 2, 3),
        Values::Special => (0..n)
            .map(|_| match rng.below(12) {
                0 => f32::NAN,
                1 => f32::NEG_INFINITY,
                2 => f32::INFINITY,
                3 => -0.0,
                4 => 0.0,
                _ => rng.unit() * 4.0,
            })
            .collect(),
    }
}

fn values() -> impl Strategy<Value = Values> {
    prop_oneof![
        3 => select(vec![0.5f32, 4.0, 30.0]).prop_map(Values::Random),
        1 => Just(Values::Ties),
        1 => Just(Values::Special),
    ]
}

/// A matrix of rows; with `special_rows`, some rows are all NaN or all -inf or all +inf.
fn make_rows(rng: &mut Rng, values: Values, rows: usize, cols: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * cols);
    for _ in 0..rows {
        let row = match (values, rng.below(8)) {
            (Values::Special, 0) => vec![f32::NAN; cols],
            (Values::Special, 1) => vec![f32::NEG_INFINITY; cols],
            (Values::Special, 2) => {
                let mut r = vec![f32::NAN; cols];
                r[rng.below(cols)] = f32::NEG_INFINITY;
                r
            }
            _ => make_row(rng, values, cols),
        };
        out.extend(row);
    }
    out
}

const COLS: [usize; 7] = [1, 2, 3, 17, 256, 4097, 33_001];

// ---------------------------------------------------------------------------------------------
// argmax

fn argmax_cases<B: Backend>(b: &B, who: &str, cases: u32) {
    let strategy = (select(vec![1usize, 2, 5]), select(COLS.to_vec()), values(), any::<u64>());
    run_cases(SEED, who, cases, strategy, |(rows, cols, values, seed)| {
        let mut rng = Rng::new(seed);
        let v = make_rows(&mut rng, values, rows, cols);
        let want: Vec<u32> = v.chunks(cols).map(Reference::argmax_row).collect();
        let logits = upload(b, DType::F32, &[rows, cols], &v);
        let mut out = poisoned(b, DType::U32, &[rows]);
        b.argmax(&logits, &mut out).unwrap_or_else(|e| panic!("{} argmax: {e}", b.name()));
        assert_same_u32(&format!("{} argmax {rows}x{cols} {values:?}", b.name()), &read_u32(b, &out), &want);
    });
}

// ---------------------------------------------------------------------------------------------
// router_topk

fn router_cases<B: Backend>(b: &B, who: &str, cases: u32) {
    let strategy = (
        select(vec![1usize, 3, 70]),
        select(vec![1usize, 2, 8, 9, 64, 257]),
        any::<u64>(),
        values(),
        any::<u64>(),
    );
    run_cases(SEED, who, cases, strategy, |(rows, experts, k_pick, values, seed)| {
        let k = 1 + (k_pick as usize) % experts.min(9);
        let mut rng = Rng::new(seed);
        let v = make_rows(&mut rng, values, rows, experts);
        let logits = upload(b, DType::F32, &[rows, experts], &v);
        let mut ids = poisoned(b, DType::U32, &[rows, k]);
        let mut weights = poisoned(b, DType::F32, &[rows, k]);
        b.router_topk(&logits, k, &mut ids, &mut weights)
            .unwrap_or_else(|e| panic!("{} router_topk: {e}", b.name()));
        let (mut want_ids, mut want_w) = (Vec::new(), Vec::new());
        for row in v.chunks(experts) {
            for (id, w) in Reference::router_row(row, k) {
                want_ids.push(id);
                want_w.push(w as f32);
            }
        }
        let name = format!("{} router_topk {rows}x{experts} k {k} {values:?}", b.name());
        assert_same_u32(&name, &read_u32(b, &ids), &want_ids);
        // Both compute the softmax and the renormalisation in f64 (the reference in the same
        // order; exp may differ by an ulp on a GPU): a relative 1e-15 before both round to f32,
        // so within one f32 rounding of each other: 2u |w| (plus the smallest subnormal).
        let bound: Vec<f64> = want_w.iter().map(|w| 2.0 * U32 * w.abs() as f64 + 1e-45).collect();
        assert_close(&name, &read_f32(b, &weights), &want_w, &bound);
    });
}

// ---------------------------------------------------------------------------------------------
// sample

/// How close (in probability) u or top_p may come to a cumulative boundary of the reference's
/// distribution before the two may round to different sides: the kernel's masses are within
/// cols * 2^-62 of the f64 probabilities, the reference's cumulative sums within cols * 2^-52;
/// 1e-9 covers both for every row length here with margin.
const BOUNDARY: f64 = 1e-9;

#[derive(Clone, Debug)]
struct SampleCase {
    rows: usize,
    cols: usize,
    values: Values,
    params: SamplingParams,
    seed: u64,
}

fn sample_case() -> impl Strategy<Value = SampleCase> {
    let params = (
        select(vec![0.0f32, 0.25, 0.7, 1.0, 2.5]),
        select(vec![0usize, 1, 2, 5, 40, 100_000]),
        select(vec![1.0f32, 0.9, 0.5, 1e-6]),
    )
        .prop_map(|(temperature, top_k, top_p)| SamplingParams { temperature, top_k, top_p });
    (select(vec![1usize, 3, 4]), select(COLS.to_vec()), values(), params, any::<u64>())
        .prop_map(|(rows, cols, values, params, seed)| SampleCase { rows, cols, values, params, seed })
}

/// Whether `x` lies within BOUNDARY of a cumulative sum of `dist`.
fn near_boundary(dist: &[(u32, f64)], x: f64) -> bool {
    let mut cumulative = 0.0;
    dist.iter().any(|&(_, p)| {
        cumulative += p;
        (cumulative - x).abs() < BOUNDARY
    })
}

fn sample_one<B: Backend>(b: &B, c: &SampleCase, exempt: &Cell<usize>) {
    let mut rng = Rng::new(c.seed);
    let v = make_rows(&mut rng, c.values, c.rows, c.cols);
    let seeds: Vec<u32> = (0..c.rows).map(|_| rng.next_u64() as u32).collect();
    let steps: Vec<u32> = (0..c.rows).map(|_| rng.below(1000) as u32).collect();
    let logits = upload(b, DType::F32, &[c.rows, c.cols], &v);
    let (sd, st) = (upload_u32(b, &[c.rows], &seeds), upload_u32(b, &[c.rows], &steps));
    let mut out = poisoned(b, DType::U32, &[c.rows]);
    b.sample(&logits, &c.params, &sd, &st, &mut out)
        .unwrap_or_else(|e| panic!("{} sample {c:?}: {e}", b.name()));
    let got = read_u32(b, &out);
    for (r, row) in v.chunks(c.cols).enumerate() {
        let u = sample_uniform(u64::from(seeds[r]), u64::from(steps[r]), 0);
        let want = Reference::sample_row(row, &c.params, u);
        if got[r] == want {
            continue;
        }
        // Ties of u or top_p with a cumulative boundary: the top-k-cut distribution decides
        // where top_p cuts, the final one where u falls.
        let uncut = SamplingParams { top_p: 1.0, ..c.params };
        let near = near_boundary(&Reference::sample_distribution(row, &c.params), u)
            || (c.params.top_p < 1.0
                && near_boundary(&Reference::sample_distribution(row, &uncut), f64::from(c.params.top_p)));
        assert!(near, "{} sample {c:?} row {r} (u {u}): got {} want {want}", b.name(), got[r]);
        exempt.set(exempt.get() + 1);
    }
}

fn sample_cases<B: Backend>(b: &B, who: &str, cases: u32) {
    let exempt = Cell::new(0usize);
    run_cases(SEED, who, cases, sample_case(), |c| sample_one(b, &c, &exempt));
    // Every draw is a row; rows average ~3 per case. A boundary tie within 1e-9 is a rare event.
    assert!(
        exempt.get() * 50 <= cases as usize,
        "{who}: {} of ~{} draws needed the boundary exemption",
        exempt.get(),
        3 * cases
    );
}

/// Many draws from one fixed distribution: the counter-based uniforms of both sides agree over
/// thousands of (seed, step) pairs (an error in the C++ splitmix64 would show at once).
fn uniform_streams<B: Backend>(b: &B) {
    let cols = 64;
    let mut rng = Rng::new(0x5a3b_1e00);
    let row = make_row(&mut rng, Values::Random(2.0), cols);
    let rows = 512;
    let v: Vec<f32> = (0..rows).flat_map(|_| row.iter().copied()).collect();
    let params = SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0 };
    let seeds: Vec<u32> = (0..rows as u32).map(|i| i.wrapping_mul(0x9e37_79b9) ^ 0xdead).collect();
    let steps: Vec<u32> = (0..rows as u32).map(|i| i * 7 + 3).collect();
    let logits = upload(b, DType::F32, &[rows, cols], &v);
    let (sd, st) = (upload_u32(b, &[rows], &seeds), upload_u32(b, &[rows], &steps));
    let mut out = poisoned(b, DType::U32, &[rows]);
    b.sample(&logits, &params, &sd, &st, &mut out).unwrap();
    let got = read_u32(b, &out);
    let dist = Reference::sample_distribution(&row, &params);
    let mut mismatched = 0;
    for r in 0..rows {
        let u = sample_uniform(u64::from(seeds[r]), u64::from(steps[r]), 0);
        if got[r] != Reference::sample_row(&row, &params, u) {
            assert!(near_boundary(&dist, u), "{}: draw {r} differs away from any boundary", b.name());
            mismatched += 1;
        }
    }
    assert!(mismatched <= 2, "{}: {mismatched} of {rows} draws differ", b.name());
    // The draws are spread: more than a third of the 64 tokens appear.
    let mut seen = got.clone();
    seen.sort_unstable();
    seen.dedup();
    assert!(seen.len() > cols / 3, "{}: only {} distinct tokens drawn", b.name(), seen.len());
}

/// At 3 of 9 allocated rows every op reads and writes only its rows.
fn set_rows_respected<B: Backend>(b: &B) {
    let (max, rows, cols) = (9usize, 3usize, 50usize);
    let mut rng = Rng::new(0x5e7_5e1e);
    let v = random_values(&mut rng, DType::F32, max * cols);
    let mut logits = upload(b, DType::F32, &[max, cols], &v);
    logits.set_rows(rows).unwrap();
    let ids = upload_u32(b, &[max], &[1; 9]);
    let check = |name: &str, mut t: memwall_runtime::Tensor<B::Storage>, width: usize, dtype: DType| {
        t.set_rows(max).unwrap();
        let all = read_bytes(b, &t);
        let tail = &all[rows * width * dtype.size()..];
        assert_eq!(
            tail,
            &poison_bytes(dtype, tail.len() / dtype.size())[..],
            "{}: {name} spare rows written",
            b.name()
        );
    };
    let mut out = poisoned(b, DType::U32, &[max]);
    out.set_rows(rows).unwrap();
    b.argmax(&logits, &mut out).unwrap();
    check("argmax out", out, 1, DType::U32);
    let mut s_ids = ids;
    s_ids.set_rows(rows).unwrap();
    let mut out = poisoned(b, DType::U32, &[max]);
    out.set_rows(rows).unwrap();
    let params = SamplingParams { temperature: 0.8, top_k: 10, top_p: 0.9 };
    b.sample(&logits, &params, &s_ids, &s_ids, &mut out).unwrap();
    check("sample out", out, 1, DType::U32);
    let (mut i, mut w) = (poisoned(b, DType::U32, &[max, 2]), poisoned(b, DType::F32, &[max, 2]));
    i.set_rows(rows).unwrap();
    w.set_rows(rows).unwrap();
    b.router_topk(&logits, 2, &mut i, &mut w).unwrap();
    check("router ids", i, 2, DType::U32);
    check("router weights", w, 2, DType::F32);
}

#[cfg(feature = "emulate")]
mod emulated {
    use super::*;

    const EMU_CASES: u32 = 24;

    #[test]
    fn every_kernel_is_in_the_image() {
        let have = memwall::kernels::simt_cuda().kernels();
        for name in memwall::runtime::gpu::ops::select::kernel_names() {
            assert!(have.iter().any(|k| k == name), "{name} is not in the SIMT image");
        }
    }

    #[test]
    fn argmax_matches_reference() {
        for (name, b) in gpu::emulated() {
            argmax_cases(&b, &name, EMU_CASES);
        }
    }

    #[test]
    fn router_topk_matches_reference() {
        for (name, b) in gpu::emulated() {
            router_cases(&b, &name, EMU_CASES);
        }
    }

    #[test]
    fn sample_matches_reference() {
        for (name, b) in gpu::emulated() {
            sample_cases(&b, &name, EMU_CASES);
        }
    }

    #[test]
    fn sample_uniforms_match() {
        let (_, b) = gpu::emulated().swap_remove(0);
        uniform_streams(&b);
    }

    #[test]
    fn set_rows_is_respected() {
        for (_, b) in gpu::emulated() {
            set_rows_respected(&b);
        }
    }
}

device_tests! {
    const CASES: u32 = 256;

    fn argmax_matches_reference(b, who) {
        argmax_cases(&b, who, CASES);
    }

    fn router_topk_matches_reference(b, who) {
        router_cases(&b, who, CASES);
    }

    fn sample_matches_reference(b, who) {
        sample_cases(&b, who, CASES);
    }

    fn sample_uniforms_match(b, who) {
        uniform_streams(&b);
    }

    fn set_rows_is_respected(b, who) {
        set_rows_respected(&b);
    }
}
