//! Every op of the fast CPU backend against the reference, over random shapes and dtypes.
//!
//! Both backends are `Backend<Storage = HostStorage>`, so each case uploads its inputs once and
//! hands the same tensors to both; each backend writes its own output tensor, poisoned with NaN
//! before the run. The fast backend runs every case once per instruction set this CPU has
//! (`avx512`, `avx2`, `portable`), each with one worker thread and with three (so work splits
//! into uneven tasks), so every kernel variant and the threaded paths meet the same cases. Where the test already computes the f64 sums its tolerance needs, it also
//! checks the reference against the op's definition, so the oracle is checked too.
//!
//! Every tolerance is per element and derived in a comment next to it (STYLE.md 12). Notation:
//! u = 2^-24 (f32 unit roundoff), u_out the unit roundoff of the output dtype, gamma(n) =
//! n u / (1 - n u) (f32 accumulation of n terms in any order), and "|ref|" the magnitude of the
//! exact value computed here in f64.
//!
//! Proptest runs with a fixed seed and no failure files, so every run checks the same cases and a
//! failure reproduces; input values come from a per-case seed through `common::Rng`.

mod common;

use std::sync::LazyLock;

use common::{Rng, *};
use memwall_runtime::cpu::{Fast, Reference};
use memwall_runtime::ops::sample_uniform;
use memwall_runtime::{
    Backend, DType, HostStorage, HostTensor, KvCacheLayer, Linear, Llama3RopeScaling, Rope, SamplingParams,
    WeightScale,
};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::RngSeed;

static REF: LazyLock<Reference> = LazyLock::new(Reference::default);
/// The fast backend under every instruction set this CPU has, with 1 and 3 worker threads.
static FASTS: LazyLock<Vec<Fast>> = LazyLock::new(|| {
    let mut v = Vec::new();
    for simd in Fast::simd_available() {
        for threads in [1, 3] {
            v.push(Fast::with_simd(threads, simd).unwrap_or_else(|e| panic!("fast {simd} x{threads}: {e}")));
        }
    }
    assert!(!v.is_empty(), "no instruction set for the fast backend");
    v
});

/// Each fast variant with its label (`avx2 x3`).
fn fasts() -> impl Iterator<Item = (String, &'static Fast)> {
    FASTS.iter().map(|f| (format!("{} x{}", f.simd(), f.threads()), f))
}

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        rng_seed: RngSeed::Fixed(0x6d65_6d77_616c_6c21),
        failure_persistence: None,
        // The cases are cheap but not free: cap the shrinking of a failure.
        max_shrink_iters: 200,
        ..ProptestConfig::default()
    }
}

const M_SIZES: [usize; 5] = [1, 2, 3, 5, 17];
const N_SIZES: [usize; 5] = [1, 3, 17, 33, 257];
const K_SIZES: [usize; 5] = [1, 3, 17, 64, 130];
const COL_SIZES: [usize; 6] = [1, 3, 17, 64, 130, 4097];
const CACHE_TYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

// ---------------------------------------------------------------------------------------------
// linear

#[derive(Clone, Copy, Debug, PartialEq)]
enum ScaleKind {
    None,
    PerTensor,
    /// `[n]`
    PerChannel,
    /// `[n, 1]`
    PerChannelColumn,
    Block(usize, usize),
}

const SCALE_KINDS: [ScaleKind; 6] = [
    ScaleKind::None,
    ScaleKind::PerTensor,
    ScaleKind::PerChannel,
    ScaleKind::PerChannelColumn,
    ScaleKind::Block(128, 128),
    ScaleKind::Block(3, 5),
];

fn scale_kind() -> impl Strategy<Value = ScaleKind> {
    prop_oneof![
        select(SCALE_KINDS.to_vec()),
        (1..=9usize, 1..=9usize).prop_map(|(r, c)| ScaleKind::Block(r, c)),
        (select(vec![1usize, 2, 64, 128, 300]), select(vec![1usize, 7, 64, 128, 200]))
            .prop_map(|(r, c)| ScaleKind::Block(r, c)),
    ]
}

#[derive(Clone, Debug)]
struct LinearCase {
    m: usize,
    n: usize,
    k: usize,
    weight: DType,
    x: DType,
    y: DType,
    scale: ScaleKind,
    scale_dtype: DType,
    seed: u64,
}

/// A weight scale of `kind` for an `[n, k]` weight, and the scale of every element, row-major.
fn make_scale(
    rng: &mut Rng,
    kind: ScaleKind,
    dtype: DType,
    n: usize,
    k: usize,
) -> (WeightScale<HostStorage>, Vec<f64>) {
    let r = &*REF;
    match kind {
        ScaleKind::None => (WeightScale::None, vec![1.0; n * k]),
        ScaleKind::PerTensor => {
            let s = random_positive(rng, DType::F32, 1)[0];
            (WeightScale::PerTensor(s), vec![s as f64; n * k])
        }
        ScaleKind::PerChannel | ScaleKind::PerChannelColumn => {
            let s = random_positive(rng, dtype, n);
            let shape: &[usize] = if kind == ScaleKind::PerChannel { &[n] } else { &[n, 1] };
            let per_elem = (0..n * k).map(|i| s[i / k] as f64).collect();
            (WeightScale::PerChannel(upload(r, dtype, shape, &s)), per_elem)
        }
        ScaleKind::Block(br, bc) => {
            let (nb, kb) = (n.div_ceil(br), k.div_ceil(bc));
            let s = random_positive(rng, dtype, nb * kb);
            let per_elem = (0..n * k).map(|i| s[(i / k / br) * kb + (i % k) / bc] as f64).collect();
            let scales = upload(r, dtype, &[nb, kb], &s);
            (WeightScale::Block { block_rows: br, block_cols: bc, scales }, per_elem)
        }
    }
}

fn run_linear(c: &LinearCase) {
    let r = &*REF;
    let (m, n, k) = (c.m, c.n, c.k);
    let mut rng = Rng::new(c.seed);
    let (x, xv) = random_tensor(r, &mut rng, c.x, &[m, k]);
    let (w, wv) = random_tensor(r, &mut rng, c.weight, &[n, k]);
    let (scale, sv) = make_scale(&mut rng, c.scale, c.scale_dtype, n, k);
    // W_real = stored weight x scale: a product of two f32 values, exact in f64.
    let w_real: Vec<f64> = wv.iter().zip(&sv).map(|(&w, &s)| w as f64 * s).collect();
    let lin = Linear { weight: w, scale };
    let mut y_ref = poisoned(r, c.y, &[m, n]);
    REF.linear(&x, &lin, &mut y_ref).unwrap_or_else(|e| panic!("reference linear {c:?}: {e}"));
    let want = read_f32(r, &y_ref);

    let (uo, eta) = (unit_roundoff(c.y), underflow_abs(c.y));
    let mut exact = vec![0f32; m * n];
    let mut bound_ref = vec![0f64; m * n];
    let mut bound_fast = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let (mut sum, mut abs) = (0f64, 0f64);
            for l in 0..k {
                let t = xv[i * k + l] as f64 * w_real[j * k + l];
                sum += t;
                abs += t.abs();
            }
            let o = i * n + j;
            exact[o] = sum as f32;
            // Reference vs our f64 value: both accumulate in f64 (gamma64(k + 1) sum|x w s| each:
            // k products, k - 1 additions), then the reference rounds to y, possibly f64 -> f32 ->
            // y (double rounding: (u_out + u) |ref| plus half a subnormal spacing eta), and we
            // round to f32 (u |ref|).
            bound_ref[o] = 2.0 * gamma64(k + 1) * abs + (uo + 2.0 * U32) * sum.abs() + eta;
            // Fast vs reference. Fast accumulates in f32: each term passes through at most k + 1
            // roundings (its product x * w, one scale multiply: W * s before the product or s *
            // partial after the reduction, per tensor / channel / block; at most k - 1 additions
            // in any order), so |acc - ref| <= gamma(k + 1) sum|x w s|. Then the output rounding
            // of both: fast RN_out(acc) (u_out |acc| + eta), the reference as above ((u_out + u)
            // |ref| + eta, and its f64 error gamma64(k + 1) sum|x w s|). So |got - want| <=
            // (1 + u_out) gamma(k + 1) sum|x w s| + (2 u_out + u) |ref| + 2 eta + gamma64(...).
            bound_fast[o] = (1.0 + uo) * gamma(k + 1) * abs
                + gamma64(k + 1) * abs
                + (2.0 * uo + U32) * sum.abs()
                + 2.0 * eta;
        }
    }
    assert_close(&format!("linear reference vs f64 definition {c:?}"), &want, &exact, &bound_ref);
    for (name, f) in fasts() {
        let mut y = poisoned(r, c.y, &[m, n]);
        f.linear(&x, &lin, &mut y).unwrap_or_else(|e| panic!("fast {name} linear {c:?}: {e}"));
        assert_close(&format!("linear fast {name} vs reference {c:?}"), &read_f32(r, &y), &want, &bound_fast);
    }
}

fn linear_case(ks: Vec<usize>) -> impl Strategy<Value = LinearCase> {
    (
        select(M_SIZES.to_vec()),
        select(N_SIZES.to_vec()),
        select(ks),
        select(DType::FLOATS.to_vec()),
        select(DType::ACTIVATIONS.to_vec()),
        select(DType::ACTIVATIONS.to_vec()),
        scale_kind(),
        select(vec![DType::F32, DType::BF16]),
        any::<u64>(),
    )
        .prop_map(|(m, n, k, weight, x, y, scale, scale_dtype, seed)| LinearCase {
            m,
            n,
            k,
            weight,
            x,
            y,
            scale,
            scale_dtype,
            seed,
        })
}

#[test]
fn linear_every_weight_dtype_scale_kind_and_activation_dtype() {
    let mut seed = 1;
    for weight in DType::FLOATS {
        for scale in SCALE_KINDS {
            for x in DType::ACTIVATIONS {
                for y in DType::ACTIVATIONS {
                    seed += 1;
                    let scale_dtype = if seed % 2 == 0 { DType::F32 } else { DType::BF16 };
                    run_linear(&LinearCase { m: 3, n: 33, k: 130, weight, x, y, scale, scale_dtype, seed });
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(config(64))]
    #[test]
    fn linear_matches_reference(c in linear_case(K_SIZES.to_vec())) {
        run_linear(&c);
    }
}

proptest! {
    #![proptest_config(config(16))]
    #[test]
    fn linear_matches_reference_k4097(c in linear_case(vec![4097])) {
        run_linear(&c);
    }
}

// ---------------------------------------------------------------------------------------------
// gate_up_silu

/// `gate_up_silu` of a `linear`-like case (its `y` ignored: out is f32): gate and up of the same
/// dtype and scale kind, each with its own random values and scales. Rows 1..16 and above.
fn run_gate_up(c: &LinearCase) {
    let r = &*REF;
    let (m, n, k) = (c.m, c.n, c.k);
    let mut rng = Rng::new(c.seed);
    let (x, xv) = random_tensor(r, &mut rng, c.x, &[m, k]);
    let mut weight = || {
        let (w, wv) = random_tensor(r, &mut rng, c.weight, &[n, k]);
        let (scale, sv) = make_scale(&mut rng, c.scale, c.scale_dtype, n, k);
        let w_real: Vec<f64> = wv.iter().zip(&sv).map(|(&w, &s)| w as f64 * s).collect();
        (w_real, Linear { weight: w, scale })
    };
    let (gw, gate) = weight();
    let (uw, up) = weight();
    let scratch = || (poisoned(r, DType::F32, &[m, n]), poisoned(r, DType::F32, &[m, n]));
    let (mut s0, mut s1) = scratch();
    let mut out_ref = poisoned(r, DType::F32, &[m, n]);
    REF.gate_up_silu(&x, &gate, &up, (&mut s0, &mut s1), &mut out_ref)
        .unwrap_or_else(|e| panic!("reference gate_up_silu {c:?}: {e}"));
    let want = read_f32(r, &out_ref);

    let eta = underflow_abs(DType::F32);
    let mut exact = vec![0f32; m * n];
    let mut bound_ref = vec![0f64; m * n];
    let mut bound_fast = vec![0f64; m * n];
    for i in 0..m {
        let x_row = &xv[i * k..(i + 1) * k];
        let dot = |w: &[f64]| {
            let (mut sum, mut abs) = (0f64, 0f64);
            for (&x, &w) in x_row.iter().zip(w) {
                sum += x as f64 * w;
                abs += (x as f64 * w).abs();
            }
            (sum, abs)
        };
        for j in 0..n {
            let (g, g_abs) = dot(&gw[j * k..(j + 1) * k]);
            let (u, u_abs) = dot(&uw[j * k..(j + 1) * k]);
            let silu = g / (1.0 + (-g).exp());
            let out = silu * u;
            let o = i * n + j;
            exact[o] = out as f32;
            // An error e_g in g moves silu(g) by at most 1.1 e_g (|silu'| <= 1.0998), an error
            // e_u in u moves the product by |silu(g)| e_u; with |u~| <= |u| + e_u:
            // |silu(g~) u~ - silu(g) u| <= 1.1 e_g (|u| + e_u) + |silu(g)| e_u.
            let through = |e_g: f64, e_u: f64| 1.1 * e_g * (u.abs() + e_u) + silu.abs() * e_u;
            // Reference vs our f64 value: g and u both accumulate in f64 here and there
            // (2 gamma64(k + 1) of their sum|t| apart), silu and the product in f64 (16 f64 ulps
            // each side), then the reference rounds to f32 (u |out| + eta) and we round (u |out|).
            let e64 = |abs: f64| 2.0 * gamma64(k + 1) * abs;
            bound_ref[o] = through(e64(g_abs), e64(u_abs)) + (2.0 * U32 + 32.0 * U64) * out.abs() + eta;
            // Fast composes linear (f32: within gamma(k + 1) sum|t|, as linear's bound, then rounded
            // to f32 in the scratch: u (|g| + that)) and silu_mul (f32 silu(g~) * u~ within 12u of
            // itself, as silu_mul's bound). The reference is within its f64 error and its f32
            // rounding (u |out| + eta) of the exact value.
            let e32 = |abs: f64, v: f64| (1.0 + U32) * gamma(k + 1) * abs + U32 * v.abs();
            let (e_g, e_u) = (e32(g_abs, g), e32(u_abs, u));
            let evaluated = 12.0 * U32 * (silu.abs() + 1.1 * e_g) * (u.abs() + e_u);
            bound_fast[o] = through(e_g, e_u)
                + evaluated
                + through(e64(g_abs) / 2.0, e64(u_abs) / 2.0)
                + (U32 + 16.0 * U64) * out.abs()
                + 2.0 * eta;
        }
    }
    assert_close(&format!("gate_up_silu reference vs f64 definition {c:?}"), &want, &exact, &bound_ref);
    for (name, f) in fasts() {
        let (mut s0, mut s1) = scratch();
        let mut out = poisoned(r, DType::F32, &[m, n]);
        f.gate_up_silu(&x, &gate, &up, (&mut s0, &mut s1), &mut out)
            .unwrap_or_else(|e| panic!("fast {name} gate_up_silu {c:?}: {e}"));
        let what = format!("gate_up_silu fast {name} vs reference {c:?}");
        assert_close(&what, &read_f32(r, &out), &want, &bound_fast);
    }
}

/// Decode rows (1..16) and prefill rows above.
const GATE_UP_ROWS: [usize; 6] = [1, 3, 5, 16, 17, 33];

fn gate_up_case(ks: Vec<usize>) -> impl Strategy<Value = LinearCase> {
    (linear_case(ks), select(GATE_UP_ROWS.to_vec())).prop_map(|(c, m)| LinearCase { m, y: DType::F32, ..c })
}

#[test]
fn gate_up_silu_every_weight_dtype_and_scale_kind() {
    let mut seed = 0x6a7e;
    for weight in DType::FLOATS {
        for scale in SCALE_KINDS {
            for x in DType::ACTIVATIONS {
                seed += 1;
                let scale_dtype = if seed % 2 == 0 { DType::F32 } else { DType::BF16 };
                let y = DType::F32;
                run_gate_up(&LinearCase { m: 3, n: 33, k: 130, weight, x, y, scale, scale_dtype, seed });
            }
        }
    }
}

proptest! {
    #![proptest_config(config(48))]
    #[test]
    fn gate_up_silu_matches_reference(c in gate_up_case(K_SIZES.to_vec())) {
        run_gate_up(&c);
    }
}

proptest! {
    #![proptest_config(config(8))]
    #[test]
    fn gate_up_silu_matches_reference_k4097(c in gate_up_case(vec![4097])) {
        run_gate_up(&c);
    }
}

// ---------------------------------------------------------------------------------------------
// rms_norm

proptest! {
    #![proptest_config(config(64))]
    #[test]
    fn rms_norm_matches_reference(
        rows in select(M_SIZES.to_vec()),
        cols in select(COL_SIZES.to_vec()),
        wdtype in select(DType::FLOATS.to_vec()),
        eps in select(vec![1e-5f32, 1e-6]),
        seed in any::<u64>(),
    ) {
        let r = &*REF;
        let mut rng = Rng::new(seed);
        let (x, xv) = random_tensor(r, &mut rng, DType::F32, &[rows, cols]);
        let (w, wv) = random_tensor(r, &mut rng, wdtype, &[cols]);
        let mut y_ref = poisoned(r, DType::F32, &[rows, cols]);
        REF.rms_norm(&x, &w, eps, &mut y_ref).unwrap_or_else(|e| panic!("reference rms_norm: {e}"));
        let want = read_f32(r, &y_ref);
        let mut exact = vec![0f32; rows * cols];
        let mut bound_ref = vec![0f64; rows * cols];
        let mut bound_fast = vec![0f64; rows * cols];
        for i in 0..rows {
            let row = &xv[i * cols..(i + 1) * cols];
            let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / cols as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            for j in 0..cols {
                let e = row[j] as f64 * inv * wv[j] as f64;
                exact[i * cols + j] = e as f32;
                // Reference: f64 throughout (a few f64 roundings per element, gamma64(cols + 8)
                // relative), then rounded to f32 (u); plus u for our own `exact as f32`.
                bound_ref[i * cols + j] = (gamma64(cols + 8) + 2.0 * U32) * e.abs();
                // Fast, relative to |ref| (every factor is a product, so errors are relative per
                // element): the sum of squares of cols positive terms in f32, gamma(cols); / cols
                // and + eps, one rounding each: the argument of sqrt is within gamma(cols + 2);
                // sqrt halves that and adds u; the reciprocal or division u; times x u; times
                // weight u. Total gamma(cols + 2) / 2 + 4u.
                bound_fast[i * cols + j] = (0.5 * gamma(cols + 2) + 4.0 * U32) * e.abs();
            }
        }
        assert_close("rms_norm reference vs f64 definition", &want, &exact, &bound_ref);
        // Fast vs reference: each is within its bound of the true value (bound_ref also counts
        // our own rounding to f32, which only loosens it).
        let bound: Vec<f64> = bound_fast.iter().zip(&bound_ref).map(|(f, r)| f + r).collect();
        for (name, f) in fasts() {
            let mut y = poisoned(r, DType::F32, &[rows, cols]);
            f.rms_norm(&x, &w, eps, &mut y).unwrap_or_else(|e| panic!("fast {name} rms_norm: {e}"));
            let what = format!("rms_norm fast {name} vs reference ({rows}x{cols}, weight {wdtype})");
            assert_close(&what, &read_f32(r, &y), &want, &bound);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// rope

fn rope_strategy() -> impl Strategy<Value = Rope> {
    (
        1..=64usize,
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

proptest! {
    #![proptest_config(config(64))]
    #[test]
    fn rope_matches_reference(
        rows in select(M_SIZES.to_vec()),
        heads in select(vec![1usize, 2, 3, 8]),
        rope in rope_strategy(),
        max_pos in select(vec![16u32, 4096, 100_000]),
        seed in any::<u64>(),
    ) {
        let r = &*REF;
        let mut rng = Rng::new(seed);
        let hd = rope.head_dim;
        let half = hd / 2;
        let xv = random_values(&mut rng, DType::F32, rows * heads * hd);
        let pv: Vec<u32> = (0..rows).map(|_| rng.range(0, max_pos as usize) as u32).collect();
        let pos = upload_u32(r, &[rows], &pv);
        let mut x_ref = upload(r, DType::F32, &[rows, heads, hd], &xv);
        REF.rope(&mut x_ref, &pos, &rope).unwrap_or_else(|e| panic!("reference rope: {e}"));
        let want = read_f32(r, &x_ref);
        let inv_freq = rope.inv_freq();
        let n = rows * heads * hd;
        let (mut exact, mut bound_ref, mut bound_fast) = (vec![0f32; n], vec![0f64; n], vec![0f64; n]);
        for (row, &position) in pv.iter().enumerate() {
            for h in 0..heads {
                let base = (row * heads + h) * hd;
                for (i, &freq) in inv_freq.iter().enumerate() {
                    let theta = position as f64 * freq;
                    let (a, b) = (xv[base + i] as f64, xv[base + i + half] as f64);
                    let (s, c) = theta.sin_cos();
                    let pair = (a * a + b * b).sqrt();
                    exact[base + i] = (a * c - b * s) as f32;
                    exact[base + i + half] = (b * c + a * s) as f32;
                    // Reference: f64 angle and trig (a few f64 ulps of the angle, |theta| 2^-52,
                    // moving the pair by that much), rounded to f32 (u |out| <= u |pair|); plus u
                    // |pair| for our own `as f32`.
                    let r_b = pair * (2.0 * U32 + 8.0 * U64 * (theta.abs() + 1.0));
                    // Fast: the angle may be formed in f32: inv_freq rounded to f32 (u) and the
                    // product rounded (u), an angle error of 2u |theta|, which moves the pair by
                    // |pair| 2u |theta|. cos and sin of it within one ulp (2u each) and the two
                    // products and the sum (2 roundings) act on |a cos| + |b sin| <= sqrt(2)
                    // |pair|: sqrt(2) (2u + 2u) < 6u. Total |pair| (2u |theta| + 6u).
                    let f_b = pair * (2.0 * U32 * theta.abs() + 6.0 * U32);
                    for o in [base + i, base + i + half] {
                        bound_ref[o] = r_b;
                        bound_fast[o] = f_b;
                    }
                }
            }
        }
        assert_close(&format!("rope reference vs f64 definition {rope:?}"), &want, &exact, &bound_ref);
        // Fast vs reference: each is within its bound of the true value (bound_ref also counts
        // our own rounding to f32, which only loosens it).
        let bound: Vec<f64> = bound_fast.iter().zip(&bound_ref).map(|(f, r)| f + r).collect();
        for (name, f) in fasts() {
            let mut x = upload(r, DType::F32, &[rows, heads, hd], &xv);
            f.rope(&mut x, &pos, &rope).unwrap_or_else(|e| panic!("fast {name} rope: {e}"));
            let what = format!("rope fast {name} vs reference {rope:?} positions {pv:?}");
            assert_close(&what, &read_f32(r, &x), &want, &bound);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// silu_mul, add_assign

proptest! {
    #![proptest_config(config(64))]
    #[test]
    fn silu_mul_matches_reference(
        rows in select(M_SIZES.to_vec()),
        cols in select(COL_SIZES.to_vec()),
        seed in any::<u64>(),
    ) {
        let r = &*REF;
        let mut rng = Rng::new(seed);
        let (g, gv) = random_tensor(r, &mut rng, DType::F32, &[rows, cols]);
        let (u, uv) = random_tensor(r, &mut rng, DType::F32, &[rows, cols]);
        let mut o_ref = poisoned(r, DType::F32, &[rows, cols]);
        REF.silu_mul(&g, &u, &mut o_ref).unwrap_or_else(|e| panic!("reference silu_mul: {e}"));
        let want = read_f32(r, &o_ref);
        let exact_f64: Vec<f64> =
            gv.iter().zip(&uv).map(|(&g, &u)| g as f64 / (1.0 + (-(g as f64)).exp()) * u as f64).collect();
        let exact: Vec<f32> = exact_f64.iter().map(|&e| e as f32).collect();
        // Reference: f64 exp (a few f64 ulps) and three f64 roundings, then f32 (u); plus u for
        // our `as f32`.
        let bound_ref: Vec<f64> = exact_f64.iter().map(|e| (2.0 * U32 + 16.0 * U64) * e.abs()).collect();
        // Fast, relative: exp(-g) within 4 ulps (8u) for g in (-1, 1); 1 + e: u, and e's error
        // shrinks by e / (1 + e) < 1; the division (or reciprocal and product with g) 2u; times up
        // u. 8u + u + 2u + u = 12u.
        let bound: Vec<f64> = exact_f64.iter().zip(&bound_ref).map(|(e, r)| 12.0 * U32 * e.abs() + r).collect();
        assert_close("silu_mul reference vs f64 definition", &want, &exact, &bound_ref);
        for (name, f) in fasts() {
            let mut o = poisoned(r, DType::F32, &[rows, cols]);
            f.silu_mul(&g, &u, &mut o).unwrap_or_else(|e| panic!("fast {name} silu_mul: {e}"));
            assert_close(&format!("silu_mul fast {name} vs reference ({rows}x{cols})"), &read_f32(r, &o), &want, &bound);
        }
    }

    #[test]
    fn add_assign_matches_reference(
        rows in select(M_SIZES.to_vec()),
        cols in select(COL_SIZES.to_vec()),
        seed in any::<u64>(),
    ) {
        let r = &*REF;
        let mut rng = Rng::new(seed);
        let xv = random_values(&mut rng, DType::F32, rows * cols);
        let (y, yv) = random_tensor(r, &mut rng, DType::F32, &[rows, cols]);
        let mut x_ref = upload(r, DType::F32, &[rows, cols], &xv);
        REF.add_assign(&mut x_ref, &y).unwrap_or_else(|e| panic!("reference add_assign: {e}"));
        // x + y of two f32 values is exact in f64, so both sides round the same exact sum once:
        // bit-identical results, bound 0.
        let exact: Vec<f32> = xv.iter().zip(&yv).map(|(&a, &b)| (a as f64 + b as f64) as f32).collect();
        let zero = vec![0.0; rows * cols];
        assert_close("add_assign reference vs definition", &read_f32(r, &x_ref), &exact, &zero);
        for (name, f) in fasts() {
            let mut x = upload(r, DType::F32, &[rows, cols], &xv);
            f.add_assign(&mut x, &y).unwrap_or_else(|e| panic!("fast {name} add_assign: {e}"));
            assert_close(&format!("add_assign fast {name} ({rows}x{cols})"), &read_f32(r, &x), &exact, &zero);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// embedding

proptest! {
    #![proptest_config(config(64))]
    #[test]
    fn embedding_matches_reference(
        (vocab, cols) in prop_oneof![
            (select(vec![1usize, 3, 17, 257]), select(vec![1usize, 3, 17, 130, 4097])),
            (Just(4097usize), select(vec![1usize, 3, 17])),
        ],
        rows in select(M_SIZES.to_vec()),
        wdtype in select(DType::FLOATS.to_vec()),
        scale in scale_kind(),
        scale_dtype in select(vec![DType::F32, DType::BF16]),
        seed in any::<u64>(),
    ) {
        let r = &*REF;
        let mut rng = Rng::new(seed);
        let (w, wv) = random_tensor(r, &mut rng, wdtype, &[vocab, cols]);
        let (scale_t, sv) = make_scale(&mut rng, scale, scale_dtype, vocab, cols);
        let table = Linear { weight: w, scale: scale_t };
        let idv = random_indices(&mut rng, rows, vocab);
        let ids = upload_u32(r, &[rows], &idv);
        let mut o_ref = poisoned(r, DType::F32, &[rows, cols]);
        REF.embedding(&table, &ids, &mut o_ref).unwrap_or_else(|e| panic!("reference embedding: {e}"));
        let mut exact = vec![0f32; rows * cols];
        let mut bound = vec![0f64; rows * cols];
        for (i, &id) in idv.iter().enumerate() {
            for c in 0..cols {
                let e = wv[id as usize * cols + c] as f64 * sv[id as usize * cols + c];
                exact[i * cols + c] = e as f32;
                // Unscaled: a copy, exact. Scaled: w * s is an exact product (two f32 values) that
                // each side rounds once to f32 (u |ref|), and so do we: the reference is within
                // 2u |ref| of `exact`, and fast within 2u |ref| of the reference.
                bound[i * cols + c] = if scale == ScaleKind::None { 0.0 } else { 2.0 * U32 * e.abs() };
            }
        }
        let what = format!("embedding {vocab}x{cols} {wdtype} scale {scale:?} ({scale_dtype}) ids {idv:?}");
        let want = read_f32(r, &o_ref);
        assert_close(&format!("{what}: reference vs definition"), &want, &exact, &bound);
        for (name, f) in fasts() {
            let mut o = poisoned(r, DType::F32, &[rows, cols]);
            f.embedding(&table, &ids, &mut o).unwrap_or_else(|e| panic!("fast {name} embedding: {e}"));
            assert_close(&format!("{what}: fast {name} vs reference"), &read_f32(r, &o), &want, &bound);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// kv_store + attention

#[derive(Clone, Debug)]
struct AttnCase {
    kv_heads: usize,
    ratio: usize,
    head_dim: usize,
    cache: DType,
    /// Cache entries written before this step: (slot, position).
    history: Vec<(u32, u32)>,
    /// This step's query rows: (slot, position); their k, v are stored first.
    rows: Vec<(u32, u32)>,
    /// The cache's blocks and block table (block sizes 1, 16, odd, or the whole capacity).
    paging: Paging,
    scale: f32,
    seed: u64,
}

/// Positions each of `slots` slots uses: one past its largest position among `entries`.
fn used_per_slot(slots: usize, entries: &[(u32, u32)]) -> Vec<usize> {
    let mut used = vec![0; slots];
    for &(s, p) in entries {
        used[s as usize] = used[s as usize].max(p as usize + 1);
    }
    used
}

/// A prefill of `len` rows of one sequence (after `start` cached positions), or a decode step of
/// `batch` sequences in distinct slots with different lengths below `max_len`.
fn attn_case(
    kv_heads: usize,
    ratio: usize,
    head_dim: usize,
    cache: DType,
    prefill: bool,
    max_len: usize,
    seed: u64,
) -> AttnCase {
    let mut rng = Rng::new(seed ^ 0xa77e);
    let (slots, capacity, history, rows);
    if prefill {
        slots = rng.range(1, 3);
        let slot = rng.below(slots) as u32;
        let start = rng.range(0, max_len);
        let len = [1, 2, 3, 5, 17][rng.below(5)];
        capacity = start + len + rng.range(0, 3);
        history = (0..start).map(|p| (slot, p as u32)).collect();
        rows = (start..start + len).map(|p| (slot, p as u32)).collect();
    } else {
        let batch = rng.range(1, 5);
        slots = batch + rng.range(0, 2);
        // Distinct slots, in a shuffled order.
        let mut order: Vec<u32> = (0..slots as u32).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i + 1));
        }
        let lens: Vec<usize> = (0..batch).map(|_| rng.range(0, max_len)).collect();
        capacity = lens.iter().max().expect("batch > 0") + 1 + rng.range(0, 3);
        let mut h = Vec::new();
        for (b, &len) in lens.iter().enumerate() {
            h.extend((0..len).map(|p| (order[b], p as u32)));
        }
        history = h;
        rows = (0..batch).map(|b| (order[b], lens[b] as u32)).collect();
    }
    // The usual 1 / sqrt(head_dim), any scale in (0, 1), and a large one whose scores overflow
    // f32 exp unless the running max is subtracted.
    let scale = match rng.below(4) {
        0 | 1 => 1.0 / (head_dim as f32).sqrt(),
        2 => rng.open01() as f32,
        _ => 64.0,
    };
    let all: Vec<(u32, u32)> = history.iter().chain(&rows).copied().collect();
    let block_size = Paging::pick_block_size(&mut rng, capacity);
    let paging = Paging::random(&mut rng, block_size, capacity, &used_per_slot(slots, &all));
    AttnCase { kv_heads, ratio, head_dim, cache, history, rows, paging, scale, seed }
}

/// Stores `entries` with random k, v in every backend's cache (`caches[0]` the reference's, then
/// one per fast variant), and records the values stored (as the cache dtype holds them) in
/// `k_all`, `v_all`, indexed like the cache.
fn store(
    c: &AttnCase,
    rng: &mut Rng,
    caches: &mut [KvCacheLayer<HostStorage>],
    entries: &[(u32, u32)],
    k_all: &mut [f64],
    v_all: &mut [f64],
) {
    if entries.is_empty() {
        return;
    }
    let r = &*REF;
    let (kvh, hd) = (c.kv_heads, c.head_dim);
    let n = entries.len();
    let (k, kv) = random_tensor(r, rng, DType::F32, &[n, kvh, hd]);
    let (v, vv) = random_tensor(r, rng, DType::F32, &[n, kvh, hd]);
    let slots = upload_u32(r, &[n], &entries.iter().map(|e| e.0).collect::<Vec<_>>());
    let positions = upload_u32(r, &[n], &entries.iter().map(|e| e.1).collect::<Vec<_>>());
    let (c_ref, c_fast) = caches.split_first_mut().expect("the reference cache");
    let table = c.paging.upload(r);
    REF.kv_store(&k, &v, c_ref, &table, &slots, &positions)
        .unwrap_or_else(|e| panic!("reference kv_store {c:?}: {e}"));
    for ((name, f), cf) in fasts().zip(c_fast.iter_mut()) {
        f.kv_store(&k, &v, cf, &table, &slots, &positions)
            .unwrap_or_else(|e| panic!("fast {name} kv_store {c:?}: {e}"));
    }
    for (i, &(s, p)) in entries.iter().enumerate() {
        for e in 0..kvh * hd {
            let at = c.paging.row(s, p) * kvh * hd + e;
            k_all[at] = round_to(c.cache, kv[i * kvh * hd + e]) as f64;
            v_all[at] = round_to(c.cache, vv[i * kvh * hd + e]) as f64;
        }
    }
    // The caches after the store: identical bytes (conversion to the cache dtype is one RNE
    // rounding on both sides), and equal to the definition, poison where nothing was stored.
    let (kr, vr) = (read_bytes(r, &c_ref.k), read_bytes(r, &c_ref.v));
    for ((name, _), cf) in fasts().zip(c_fast.iter()) {
        let (kf, vf) = (read_bytes(r, &cf.k), read_bytes(r, &cf.v));
        assert_same_bytes(&format!("kv_store k cache fast {name} vs reference {c:?}"), c.cache, &kf, &kr);
        assert_same_bytes(&format!("kv_store v cache fast {name} vs reference {c:?}"), c.cache, &vf, &vr);
    }
    let decoded_k = read_f32(r, &c_ref.k);
    let decoded_v = read_f32(r, &c_ref.v);
    for (i, (&dk, &dv)) in decoded_k.iter().zip(&decoded_v).enumerate() {
        let (wk, wv) = (k_all[i], v_all[i]);
        let ok_k = if wk.is_nan() { dk.is_nan() } else { dk as f64 == wk };
        let ok_v = if wv.is_nan() { dv.is_nan() } else { dv as f64 == wv };
        assert!(
            ok_k && ok_v,
            "kv_store reference cache element {i}: got k {dk} v {dv}, want k {wk} v {wv} ({c:?})"
        );
    }
}

fn run_attention(c: &AttnCase) {
    let r = &*REF;
    let (kvh, hd, heads) = (c.kv_heads, c.head_dim, c.kv_heads * c.ratio);
    let mut rng = Rng::new(c.seed);
    let shape = c.paging.shape(kvh, hd);
    let mut caches: Vec<_> = (0..=FASTS.len())
        .map(|_| KvCacheLayer { k: poisoned(r, c.cache, &shape), v: poisoned(r, c.cache, &shape) })
        .collect();
    let cells = shape.iter().product();
    let table = c.paging.upload(r);
    let (mut k_all, mut v_all) = (vec![f64::NAN; cells], vec![f64::NAN; cells]);
    store(c, &mut rng, &mut caches, &c.history, &mut k_all, &mut v_all);
    store(c, &mut rng, &mut caches, &c.rows, &mut k_all, &mut v_all);

    let n = c.rows.len();
    let (q, qv) = random_tensor(r, &mut rng, DType::F32, &[n, heads, hd]);
    let slots = upload_u32(r, &[n], &c.rows.iter().map(|e| e.0).collect::<Vec<_>>());
    let positions = upload_u32(r, &[n], &c.rows.iter().map(|e| e.1).collect::<Vec<_>>());
    let mut o_ref = poisoned(r, DType::F32, &[n, heads, hd]);
    REF.attention(&q, &caches[0], &table, &slots, &positions, c.scale, &mut o_ref)
        .unwrap_or_else(|e| panic!("reference attention {c:?}: {e}"));
    let want = read_f32(r, &o_ref);

    let total = n * heads * hd;
    let (mut exact, mut bound_ref, mut bound_fast) =
        (vec![0f32; total], vec![0f64; total], vec![0f64; total]);
    let scale = c.scale as f64;
    for (row, &(slot, pos)) in c.rows.iter().enumerate() {
        let t_len = pos as usize + 1;
        for h in 0..heads {
            let g = h / c.ratio;
            let qh = &qv[(row * heads + h) * hd..][..hd];
            let at = |p: usize| c.paging.row(slot, p as u32) * kvh * hd + g * hd;
            // Scores and their absolute sums A_t = scale sum |q k| (>= |s_t|).
            let mut s = vec![0f64; t_len];
            let mut a_max = 0f64;
            for (p, s_p) in s.iter_mut().enumerate() {
                let kk = &k_all[at(p)..][..hd];
                let dot: f64 = qh.iter().zip(kk).map(|(&q, &k)| q as f64 * k).sum();
                let abs: f64 = qh.iter().zip(kk).map(|(&q, &k)| (q as f64 * k).abs()).sum();
                *s_p = scale * dot;
                a_max = a_max.max(scale * abs);
            }
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|&x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            // Fast, in f32. Each score: hd products and sums plus the scale multiply (on q or
            // the dot), gamma(hd + 1) A_t; subtracting the running max, u |s_t - m| <= 2u A_max.
            // So every logit is off by at most delta = gamma(hd + 1) A_max + 2u A_max, and the
            // softmax weights by a factor within e^(+-2 delta). exp within 4 ulps (8u) on each
            // numerator and denominator term (16u), the sums of t_len weights gamma(t_len) in
            // the numerator and denominator, the final division u; an online softmax rescales
            // numerator and denominator by the same factors, with one rounding each per rescale
            // (2u per position at most). Relative to sum_t p_t |v_t|: (e^(2 delta) - 1) +
            // 2 gamma(t_len) + 2u t_len + 17u.
            let delta = (gamma(hd + 1) + 2.0 * U32) * a_max;
            let rel = (2.0 * delta).exp_m1() + 2.0 * gamma(t_len) + 2.0 * U32 * t_len as f64 + 17.0 * U32;
            for d in 0..hd {
                let (mut o, mut pv_abs) = (0f64, 0f64);
                for p in 0..t_len {
                    let v = v_all[at(p) + d];
                    o += e[p] / z * v;
                    pv_abs += e[p] / z * v.abs();
                }
                let idx = (row * heads + h) * hd + d;
                exact[idx] = o as f32;
                // Reference: f64 (gamma64 of the same counts, far below 1e-12 relative) and one
                // rounding to f32 (u |ref|); plus u |ref| for our `as f32`.
                bound_ref[idx] = 2.0 * U32 * o.abs() + 1e-12 * pv_abs;
                bound_fast[idx] = rel * pv_abs;
            }
        }
    }
    assert_close(&format!("attention reference vs f64 definition {c:?}"), &want, &exact, &bound_ref);
    // Fast vs reference: each is within its bound of the true value (bound_ref also counts our
    // own rounding to f32, which only loosens it).
    let bound: Vec<f64> = bound_fast.iter().zip(&bound_ref).map(|(f, r)| f + r).collect();
    for ((name, f), cf) in fasts().zip(&caches[1..]) {
        let mut o = poisoned(r, DType::F32, &[n, heads, hd]);
        f.attention(&q, cf, &table, &slots, &positions, c.scale, &mut o)
            .unwrap_or_else(|e| panic!("fast {name} attention {c:?}: {e}"));
        assert_close(&format!("attention fast {name} vs reference {c:?}"), &read_f32(r, &o), &want, &bound);
    }
}

fn attn_strategy(max_lens: Vec<usize>) -> impl Strategy<Value = AttnCase> {
    (
        1..=4usize,
        select(vec![1usize, 2, 4, 8]),
        prop_oneof![select(vec![1usize, 2, 3, 17, 64, 128]), 1..=128usize],
        select(CACHE_TYPES.to_vec()),
        any::<bool>(),
        select(max_lens),
        any::<u64>(),
    )
        .prop_map(|(kvh, ratio, hd, cache, prefill, max_len, seed)| {
            attn_case(kvh, ratio, hd, cache, prefill, max_len, seed)
        })
}

proptest! {
    #![proptest_config(config(64))]
    #[test]
    fn kv_store_and_attention_match_reference(c in attn_strategy(vec![0, 1, 3, 17, 40])) {
        run_attention(&c);
    }
}

proptest! {
    #![proptest_config(config(16))]
    #[test]
    fn kv_store_and_attention_match_reference_long(c in attn_strategy(vec![300])) {
        run_attention(&c);
    }
}

#[test]
fn kv_store_and_attention_every_cache_dtype_and_gqa_ratio() {
    let mut seed = 100;
    for cache in CACHE_TYPES {
        for ratio in [1, 2, 4, 8] {
            for prefill in [true, false] {
                seed += 1;
                run_attention(&attn_case(2, ratio, 33, cache, prefill, 20, seed));
            }
        }
    }
}

#[test]
fn kv_store_later_row_wins() {
    // Rows naming the same (slot, position) are stored in order: the last one wins (the
    // reference's rule), also when the rows are split across threads. Index-revealing values.
    let r = &*REF;
    let (kvh, hd) = (2, 5);
    let slots_v: Vec<u32> = vec![0, 1, 0, 0, 1, 0, 2, 0];
    let pos_v: Vec<u32> = vec![3, 3, 3, 0, 3, 3, 1, 0];
    let n = slots_v.len();
    let kv = index_values(n * kvh * hd);
    let vv: Vec<f32> = kv.iter().map(|v| -v).collect();
    let (k, v) = (upload(r, DType::F32, &[n, kvh, hd], &kv), upload(r, DType::F32, &[n, kvh, hd], &vv));
    let (slots, positions) = (upload_u32(r, &[n], &slots_v), upload_u32(r, &[n], &pos_v));
    let table = Paging::contiguous(3, 4).upload(r);
    for cache_dt in CACHE_TYPES {
        let shape = [3, 4, kvh, hd];
        let mut c_ref = KvCacheLayer { k: poisoned(r, cache_dt, &shape), v: poisoned(r, cache_dt, &shape) };
        REF.kv_store(&k, &v, &mut c_ref, &table, &slots, &positions)
            .unwrap_or_else(|e| panic!("reference kv_store: {e}"));
        // The definition: the last row naming each place.
        let got = read_f32(r, &c_ref.k);
        for (row, (&s, &p)) in slots_v.iter().zip(&pos_v).enumerate() {
            let last = (0..n).rev().find(|&j| slots_v[j] == s && pos_v[j] == p).expect("row itself");
            if last == row {
                let at = (s as usize * 4 + p as usize) * kvh * hd;
                let want: Vec<f32> =
                    kv[row * kvh * hd..][..kvh * hd].iter().map(|&x| round_to(cache_dt, x)).collect();
                assert_eq!(
                    &got[at..at + kvh * hd],
                    &want[..],
                    "reference {cache_dt} cache at slot {s} pos {p}"
                );
            }
        }
        let (kr, vr) = (read_bytes(r, &c_ref.k), read_bytes(r, &c_ref.v));
        for (name, f) in fasts() {
            let mut c = KvCacheLayer { k: poisoned(r, cache_dt, &shape), v: poisoned(r, cache_dt, &shape) };
            f.kv_store(&k, &v, &mut c, &table, &slots, &positions)
                .unwrap_or_else(|e| panic!("fast {name} kv_store: {e}"));
            assert_same_bytes(
                &format!("kv_store {cache_dt} k, repeated rows, fast {name}"),
                cache_dt,
                &read_bytes(r, &c.k),
                &kr,
            );
            assert_same_bytes(
                &format!("kv_store {cache_dt} v, repeated rows, fast {name}"),
                cache_dt,
                &read_bytes(r, &c.v),
                &vr,
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// router_topk

proptest! {
    #![proptest_config(config(64))]
    #[test]
    fn router_topk_matches_reference(
        rows in select(M_SIZES.to_vec()),
        experts in select(vec![1usize, 2, 3, 8, 17, 64]),
        k_pick in 0..64usize,
        offset in select(vec![0.0f32, 0.0, 100.0, -1000.0]),
        specials in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let r = &*REF;
        let k = 1 + k_pick % experts;
        let mut rng = Rng::new(seed);
        // Logits on a grid of 1/16 in (-4, 4): exact ties (which must go to the lower index), and
        // distinct logits 1/16 apart, far beyond any f32 rounding of the softmax.
        // Shifted by an offset (exact in f32) so that exp without the max subtracted would
        // overflow or underflow.
        let mut lv: Vec<f32> = grid_values(&mut rng, rows * experts, 16, 4).into_iter().map(|v| v + offset).collect();
        // A few NaN and -inf logits (probability 0, ranked after every finite one), never all.
        if specials {
            for row in lv.chunks_mut(experts) {
                for _ in 0..rng.below(3).min(experts - 1) {
                    let i = rng.below(experts);
                    row[i] = if rng.below(2) == 0 { f32::NAN } else { f32::NEG_INFINITY };
                }
                if row.iter().all(|v| v.is_nan() || *v == f32::NEG_INFINITY) {
                    row[0] = offset;
                }
            }
        }
        let logits = upload(r, DType::F32, &[rows, experts], &lv);
        let (mut i_ref, mut w_ref) = (poisoned(r, DType::U32, &[rows, k]), poisoned(r, DType::F32, &[rows, k]));
        REF.router_topk(&logits, k, &mut i_ref, &mut w_ref).unwrap_or_else(|e| panic!("reference router_topk: {e}"));
        // The definition: the k most probable experts (the largest logits, NaN and -inf last as
        // probability 0), ties to the lower index, in descending order.
        let mut want_ids = Vec::new();
        let mut exact = Vec::new();
        let mut bound_ref = Vec::new();
        let mut bound_fast = Vec::new();
        for row in 0..rows {
            let l: Vec<f32> = lv[row * experts..(row + 1) * experts]
                .iter()
                .map(|&v| if v.is_nan() { f32::NEG_INFINITY } else { v })
                .collect();
            let mut order: Vec<usize> = (0..experts).collect();
            order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
            let top = &order[..k];
            let m = l[top[0]] as f64;
            let z: f64 = top.iter().map(|&i| (l[i] as f64 - m).exp()).sum();
            for &i in top {
                want_ids.push(i as u32);
                let w = (l[i] as f64 - m).exp() / z;
                exact.push(w as f32);
                // Reference: f64, rounded to f32 (u), our `as f32` (u).
                bound_ref.push(2.0 * U32 * w);
                // Fast, relative: each exp within 4 ulps (8u) on the numerator and on each
                // denominator term; the softmax over all experts (sum gamma(experts), division u)
                // and the renormalisation over the k picked (sum gamma(k), division u) give
                // numerator 8u + gamma(E) + u and denominator 8u + gamma(E) + u + gamma(k), and
                // the last division u: 2 gamma(E) + gamma(k) + 19u.
                bound_fast.push((2.0 * gamma(experts) + gamma(k) + 19.0 * U32) * w);
            }
        }
        let what = format!("router_topk {rows}x{experts} k {k} offset {offset} logits {lv:?}");
        assert_same_u32(&format!("{what}: reference ids vs definition"), &read_u32(r, &i_ref), &want_ids);
        assert_close(&format!("{what}: reference weights vs definition"), &read_f32(r, &w_ref), &exact, &bound_ref);
        // Fast vs reference: each is within its bound of the true value (bound_ref also counts
        // our own rounding to f32, which only loosens it).
        let bound: Vec<f64> = bound_fast.iter().zip(&bound_ref).map(|(f, r)| f + r).collect();
        let want = read_f32(r, &w_ref);
        for (name, f) in fasts() {
            let (mut ids, mut ws) = (poisoned(r, DType::U32, &[rows, k]), poisoned(r, DType::F32, &[rows, k]));
            f.router_topk(&logits, k, &mut ids, &mut ws).unwrap_or_else(|e| panic!("fast {name} router_topk: {e}"));
            assert_same_u32(&format!("{what}: fast {name} ids"), &read_u32(r, &ids), &want_ids);
            assert_close(&format!("{what}: fast {name} weights vs reference"), &read_f32(r, &ws), &want, &bound);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// argmax, sample

/// Index of the largest logit, the lowest among equals; NaN never wins. `None` if all are NaN.
fn argmax_def(l: &[f32]) -> Option<u32> {
    let mut best: Option<usize> = None;
    for (i, &v) in l.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|b| v > l[b]) {
            best = Some(i);
        }
    }
    best.map(|b| b as u32)
}

/// Logits for picking tests: random, with NaNs, -inf and copies of the row's maximum sprinkled in
/// (never a row of only NaN).
fn pick_logits(rng: &mut Rng, rows: usize, vocab: usize, specials: bool) -> Vec<f32> {
    let mut lv = random_values(rng, DType::F32, rows * vocab);
    if specials {
        for row in lv.chunks_mut(vocab) {
            for _ in 0..rng.below(4) {
                let i = rng.below(vocab);
                row[i] = if rng.below(2) == 0 { f32::NAN } else { f32::NEG_INFINITY };
            }
            if let Some(best) = argmax_def(row) {
                let copy = rng.below(vocab);
                row[copy] = row[best as usize];
            } else {
                row[0] = 0.5;
            }
        }
    }
    lv
}

proptest! {
    #![proptest_config(config(64))]
    #[test]
    fn argmax_matches_reference(
        rows in select(M_SIZES.to_vec()),
        vocab in select(vec![1usize, 3, 17, 33, 257, 4097, 32_003]),
        specials in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let r = &*REF;
        let mut rng = Rng::new(seed);
        let lv = pick_logits(&mut rng, rows, vocab, specials);
        let logits = upload(r, DType::F32, &[rows, vocab], &lv);
        let mut o_ref = poisoned(r, DType::U32, &[rows]);
        REF.argmax(&logits, &mut o_ref).unwrap_or_else(|e| panic!("reference argmax: {e}"));
        let want: Vec<u32> = lv.chunks(vocab).map(|row| argmax_def(row).expect("a non-NaN logit")).collect();
        // Exact: an index, no rounding anywhere.
        assert_same_u32(&format!("argmax reference vs definition ({rows}x{vocab})"), &read_u32(r, &o_ref), &want);
        for (name, f) in fasts() {
            let mut o = poisoned(r, DType::U32, &[rows]);
            f.argmax(&logits, &mut o).unwrap_or_else(|e| panic!("fast {name} argmax: {e}"));
            assert_same_u32(&format!("argmax fast {name} vs definition ({rows}x{vocab})"), &read_u32(r, &o), &want);
        }
    }
}

#[test]
fn argmax_and_greedy_sample_edge_rows() {
    // Equal maxima (including -0.0 == +0.0), NaN before and between, infinities, f32::MAX.
    let rows: [&[f32]; 8] = [
        &[-1.0, -0.0, 0.0, -2.0],
        &[-1.0, 0.0, -0.0, -2.0],
        &[f32::NAN, 0.5, f32::NAN, 0.5],
        &[f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY],
        &[f32::MAX, f32::INFINITY, f32::INFINITY],
        &[f32::NAN, f32::NAN, -3.0],
        &[f32::NEG_INFINITY; 4],
        &[-f32::MAX, f32::MIN_POSITIVE, -0.0, f32::MIN_POSITIVE],
    ];
    let r = &*REF;
    let width = 4;
    let mut lv = Vec::new();
    let mut want = Vec::new();
    for row in rows {
        let mut padded = row.to_vec();
        padded.resize(width, f32::NEG_INFINITY);
        want.push(argmax_def(&padded).expect("a non-NaN logit"));
        lv.extend(padded);
    }
    let logits = upload(r, DType::F32, &[rows.len(), width], &lv);
    let run = |name: &str, out: &HostTensor| assert_same_u32(name, &read_u32(r, out), &want);
    let mut o = poisoned(r, DType::U32, &[rows.len()]);
    REF.argmax(&logits, &mut o).unwrap_or_else(|e| panic!("reference argmax: {e}"));
    run("argmax edge rows: reference", &o);
    let (seeds, steps) = (upload_u32(r, &[8], &[1; 8]), upload_u32(r, &[8], &[2; 8]));
    REF.sample(&logits, &SamplingParams::GREEDY, &seeds, &steps, &mut o)
        .unwrap_or_else(|e| panic!("reference sample: {e}"));
    run("greedy sample edge rows: reference", &o);
    for (name, f) in fasts() {
        let mut o = poisoned(r, DType::U32, &[rows.len()]);
        f.argmax(&logits, &mut o).unwrap_or_else(|e| panic!("fast {name} argmax: {e}"));
        run(&format!("argmax edge rows: fast {name}"), &o);
        let mut o = poisoned(r, DType::U32, &[rows.len()]);
        f.sample(&logits, &SamplingParams::GREEDY, &seeds, &steps, &mut o)
            .unwrap_or_else(|e| panic!("fast {name} sample: {e}"));
        run(&format!("greedy sample edge rows: fast {name}"), &o);
    }
}

/// The draw of one row, computed in f64 from the contract: softmax(logits / temperature) over
/// the tokens sorted by logit (descending, ties to the lower index), cut to the top-k, then to the
/// smallest prefix whose probability (renormalised over the top-k) reaches top-p; the token is the
/// first whose cumulative probability within that nucleus exceeds u. Returns the token, or `None`
/// when u or top-p falls within the f32 error margin of a cumulative boundary, where a correct f32
/// backend may legitimately pick a neighbour.
fn sample_def(l: &[f32], p: &SamplingParams, u: f64) -> Option<u32> {
    if p.temperature == 0.0 {
        return argmax_def(l);
    }
    // NaN and -inf logits have probability 0: never candidates.
    let mut order: Vec<usize> = (0..l.len()).filter(|&i| l[i] > f32::NEG_INFINITY).collect();
    order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
    let n = order.len();
    let kept = if p.top_k == 0 { n } else { p.top_k.min(n) };
    let t = p.temperature as f64;
    let m = l[order[0]] as f64;
    let z_max = order[..kept].iter().map(|&i| ((l[i] as f64 - m) / t).abs()).fold(0.0, f64::max);
    let l_max = order[..kept].iter().map(|&i| (l[i] as f64).abs()).fold(0.0, f64::max);
    let w: Vec<f64> = order[..kept].iter().map(|&i| ((l[i] as f64 - m) / t).exp()).collect();
    let total: f64 = w.iter().sum();
    // f32 error of a normalised cumulative sum over j of `kept` terms. Each weight's argument
    // z = l / t - m / t (or (l - m) / t) carries at most three roundings: u |l| / t and u |m| / t
    // for the divisions (or u |l - m| for the difference) and u |z| for the last step, so an error
    // of at most 2u L / t + 2u |z| (L the largest |logit|), which moves exp(z) by that relative
    // amount; exp itself 4 ulps (8u). That on the numerator and on the total (twice), plus the
    // running sum gamma(j) and the total gamma(kept), and the brief's floor of 1e-6.
    let per_term = 2.0 * (2.0 * U32 * l_max / t + 2.0 * U32 * z_max + 8.0 * U32);
    let margin = |j: usize, cum: f64| 1e-6 + (per_term + gamma(j) + gamma(kept)) * cum;
    let mut cum = 0.0;
    let mut nucleus = kept;
    let top_p = p.top_p as f64;
    for (j, wj) in w.iter().enumerate() {
        cum += wj / total;
        if j + 1 < kept && (cum - top_p).abs() <= margin(j + 1, cum) {
            return None;
        }
        if cum >= top_p && nucleus == kept {
            nucleus = j + 1;
        }
    }
    let nucleus_total: f64 = w[..nucleus].iter().sum::<f64>() / total;
    let target = u * nucleus_total;
    let mut cum = 0.0;
    let mut pick = None;
    for (j, wj) in w[..nucleus].iter().enumerate() {
        cum += wj / total;
        if (cum - target).abs() <= margin(j + 1, cum) + margin(nucleus, nucleus_total) {
            return None;
        }
        if pick.is_none() && cum > target {
            pick = Some(order[j] as u32);
        }
    }
    pick
}

proptest! {
    #![proptest_config(config(64))]
    #[test]
    fn sample_matches_reference(
        rows in select(vec![1usize, 2, 3, 5]),
        vocab in select(vec![1usize, 3, 17, 257, 4097]),
        temperature in select(vec![0.0f32, 0.3, 0.7, 1.0, 1.5]),
        top_k in select(vec![0usize, 1, 2, 5, 40, 5000]),
        top_p in select(vec![1.0f32, 0.95, 0.5, 0.1]),
        offset in select(vec![0.0f32, 0.0, 30.0, -1000.0]),
        specials in any::<bool>(),
        seed in any::<u64>(),
        step in 0..1000u64,
    ) {
        let r = &*REF;
        let params = SamplingParams { temperature, top_k, top_p };
        let mut rng = Rng::new(seed);
        // Logits on a grid of 1/8 in (-8, 8): ties (ordered by index) and distinct values far
        // apart compared with any f32 rounding, so the sort order is the same in every backend.
        // Shifted by an offset (exact in f32) so that exp without the max subtracted would
        // overflow or underflow; and with a few NaN and -inf (probability 0), never all of a row.
        let mut lv: Vec<f32> = grid_values(&mut rng, rows * vocab, 8, 8).into_iter().map(|v| v + offset).collect();
        if specials {
            for row in lv.chunks_mut(vocab) {
                for _ in 0..rng.below(4).min(vocab - 1) {
                    let i = rng.below(vocab);
                    row[i] = if rng.below(2) == 0 { f32::NAN } else { f32::NEG_INFINITY };
                }
                if row.iter().all(|v| v.is_nan() || *v == f32::NEG_INFINITY) {
                    row[0] = offset;
                }
            }
        }
        let logits = upload(r, DType::F32, &[rows, vocab], &lv);
        // One stream per row: each row its own seed and step (two rows may share a seed, as the
        // sequences of one request do, and still draw apart through their steps).
        let row_seeds: Vec<u32> = (0..rows).map(|r| (seed as u32).wrapping_add((r / 2) as u32)).collect();
        let row_steps: Vec<u32> = (0..rows).map(|r| step as u32 + 3 * r as u32).collect();
        let (seeds, steps) = (upload_u32(r, &[rows], &row_seeds), upload_u32(r, &[rows], &row_steps));
        let mut outs = vec![poisoned(r, DType::U32, &[rows])];
        let mut names = vec!["reference".to_string()];
        REF.sample(&logits, &params, &seeds, &steps, &mut outs[0])
            .unwrap_or_else(|e| panic!("reference sample: {e}"));
        for (name, f) in fasts() {
            let mut o = poisoned(r, DType::U32, &[rows]);
            f.sample(&logits, &params, &seeds, &steps, &mut o)
                .unwrap_or_else(|e| panic!("fast {name} sample: {e}"));
            outs.push(o);
            names.push(format!("fast {name}"));
        }
        let outs: Vec<Vec<u32>> = outs.iter().map(|o| read_u32(r, o)).collect();
        for row in 0..rows {
            let (row_seed, row_step) = (row_seeds[row], row_steps[row]);
            let u = sample_uniform(u64::from(row_seed), u64::from(row_step), 0);
            let what = format!(
                "sample row {row} of {rows}x{vocab} {params:?} offset {offset} specials {specials} seed \
                 {row_seed} step {row_step} u {u}"
            );
            // Rows whose u (or top-p) sits on a boundary within the f32 margin are only checked
            // to hold a token.
            let want = sample_def(&lv[row * vocab..(row + 1) * vocab], &params, u);
            for (name, o) in names.iter().zip(&outs) {
                let got = o[row];
                prop_assert!(got < vocab as u32, "{}: {} token {} out of range", what, name, got);
                if let Some(want) = want {
                    prop_assert_eq!(got, want, "{}: {} vs definition", what, name);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// gather_rows, scatter_add_rows

proptest! {
    #![proptest_config(config(64))]
    #[test]
    fn gather_rows_matches_reference(
        rows in select(vec![1usize, 3, 17, 257]),
        cols in select(vec![1usize, 3, 17, 130, 4097]),
        picked in select(M_SIZES.to_vec()),
        seed in any::<u64>(),
    ) {
        let r = &*REF;
        let mut rng = Rng::new(seed);
        // Index-revealing: element (row, col) holds row * cols + col + 0.5.
        let sv = index_values(rows * cols);
        let src = upload(r, DType::F32, &[rows, cols], &sv);
        let iv = random_indices(&mut rng, picked, rows);
        let idx = upload_u32(r, &[picked], &iv);
        let mut o_ref = poisoned(r, DType::F32, &[picked, cols]);
        REF.gather_rows(&src, &idx, &mut o_ref).unwrap_or_else(|e| panic!("reference gather_rows: {e}"));
        let want: Vec<f32> = iv.iter().flat_map(|&i| sv[i as usize * cols..][..cols].iter().copied()).collect();
        // A copy: exact.
        let zero = vec![0.0; picked * cols];
        let what = format!("gather_rows {rows}x{cols} idx {iv:?}");
        assert_close(&format!("{what}: reference"), &read_f32(r, &o_ref), &want, &zero);
        for (name, f) in fasts() {
            let mut o = poisoned(r, DType::F32, &[picked, cols]);
            f.gather_rows(&src, &idx, &mut o).unwrap_or_else(|e| panic!("fast {name} gather_rows: {e}"));
            assert_close(&format!("{what}: fast {name}"), &read_f32(r, &o), &want, &zero);
        }
    }

    #[test]
    fn scatter_add_rows_matches_reference(
        rows in select(vec![1usize, 3, 17, 257]),
        cols in select(vec![1usize, 3, 17, 130, 4097]),
        picked in select(M_SIZES.to_vec()),
        seed in any::<u64>(),
    ) {
        let r = &*REF;
        let mut rng = Rng::new(seed);
        let dv = random_values(&mut rng, DType::F32, rows * cols);
        let (src, sv) = random_tensor(r, &mut rng, DType::F32, &[picked, cols]);
        let (weights, wv) = random_tensor(r, &mut rng, DType::F32, &[picked]);
        // Few distinct rows, so several contributions land on one row.
        let iv = random_indices(&mut rng, picked, rows.min(1 + picked / 2));
        let idx = upload_u32(r, &[picked], &iv);
        let mut d_ref = upload(r, DType::F32, &[rows, cols], &dv);
        REF.scatter_add_rows(&mut d_ref, &idx, &src, &weights).unwrap_or_else(|e| panic!("reference scatter_add_rows: {e}"));
        let mut exact: Vec<f64> = dv.iter().map(|&d| d as f64).collect();
        let mut abs: Vec<f64> = exact.iter().map(|d| d.abs()).collect();
        let mut count = vec![0usize; rows];
        for (i, &row) in iv.iter().enumerate() {
            count[row as usize] += 1;
            for c in 0..cols {
                let t = wv[i] as f64 * sv[i * cols + c] as f64;
                exact[row as usize * cols + c] += t;
                abs[row as usize * cols + c] += t.abs();
            }
        }
        let want: Vec<f32> = exact.iter().map(|&e| e as f32).collect();
        // Per element of a row with c contributions, either side accumulates in f32 in order
        // (one product and one addition each: 2c roundings, gamma(2c) of |d0| + sum |w src|) or
        // in f64 and rounds once (u |ref|); our `as f32` adds u |ref|. Rows with no contribution
        // must be untouched: bound 0.
        let bound: Vec<f64> = (0..rows * cols)
            .map(|e| {
                let c = count[e / cols];
                if c == 0 { 0.0 } else { gamma(2 * c) * abs[e] + 2.0 * U32 * exact[e].abs() }
            })
            .collect();
        let what = format!("scatter_add_rows {rows}x{cols} idx {iv:?}");
        assert_close(&format!("{what}: reference vs definition"), &read_f32(r, &d_ref), &want, &bound);
        // Fast vs reference: each within `bound` of the true value.
        let bound2: Vec<f64> = bound.iter().map(|b| 2.0 * b).collect();
        let reference = read_f32(r, &d_ref);
        for (name, f) in fasts() {
            let mut d = upload(r, DType::F32, &[rows, cols], &dv);
            f.scatter_add_rows(&mut d, &idx, &src, &weights).unwrap_or_else(|e| panic!("fast {name} scatter_add_rows: {e}"));
            assert_close(&format!("{what}: fast {name} vs reference"), &read_f32(r, &d), &reference, &bound2);
        }
    }
}
