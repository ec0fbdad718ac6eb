//! The reference backend against the definitions of its ops, on small hand-made cases whose
//! expected values are derived by hand or from first principles in the comments.
//!
//! Tolerances: an f32 output of magnitude v, rounded once from an f64 result, is within
//! 2^-24 * |v| (~6e-8 |v|) of it; an f32 input like ln 3 is within 2^-24 relative of the real
//! number. The f64 arithmetic itself adds ~1e-15 relative. Where every value is a small dyadic
//! rational the result is exact and compared with `==`.

use std::f64::consts::{LN_2, PI};
use std::sync::Arc;

use memmap2::MmapMut;
use memwall_runtime::cpu::Reference;
use memwall_runtime::ops::sample_uniform;
use memwall_runtime::{
    Backend, DType, Error, HostStorage, HostTensor, KvCacheLayer, Linear, Llama3RopeScaling, Rope,
    SamplingParams, Tensor, WeightScale,
};

const B: Reference = Reference;
const LN_3: f64 = 1.098_612_288_668_109_8;

// ---------------------------------------------------------------------------------------------
// Helpers

fn f32_tensor(shape: &[usize], values: &[f32]) -> HostTensor {
    B.upload_f32(DType::F32, shape, values).unwrap()
}

fn typed(dtype: DType, shape: &[usize], values: &[f32]) -> HostTensor {
    B.upload_f32(dtype, shape, values).unwrap()
}

fn u32_tensor(shape: &[usize], values: &[u32]) -> HostTensor {
    B.upload_u32(shape, values).unwrap()
}

/// An f32 tensor filled with a NaN payload, to see whether an op wrote it.
const POISON: u32 = 0x7fc0_dead;
fn poisoned(shape: &[usize]) -> HostTensor {
    let n: usize = shape.iter().product();
    B.upload(DType::F32, shape, bytemuck::cast_slice(&vec![POISON; n])).unwrap()
}
fn assert_untouched(t: &HostTensor, what: &str) {
    let bits: &[u32] = t.as_slice();
    assert!(bits.iter().all(|&b| b == POISON), "{what} was written: {:?}", B.read_f32(t).unwrap());
}

/// A read-only mapped tensor holding `values` as `dtype` (like weights used in place).
fn read_only(dtype: DType, shape: &[usize], values: &[f32]) -> HostTensor {
    let bytes = memwall_runtime::dtype::encode_f32(dtype, values).unwrap();
    let mut map = MmapMut::map_anon(bytes.len()).unwrap();
    map.copy_from_slice(&bytes);
    let map = Arc::new(map.make_read_only().unwrap());
    let storage = HostStorage::mapped(map, 0, bytes.len(), dtype.size()).unwrap();
    let t = Tensor::new(storage, dtype, shape).unwrap();
    assert!(t.storage().is_read_only());
    t
}

fn read(t: &HostTensor) -> Vec<f32> {
    B.read_f32(t).unwrap()
}

/// Fails with the max abs error and the first mismatch unless `|got - want| <= tol` everywhere.
fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut max_err = 0.0f64;
    let mut first_bad = None;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(g) - w).abs();
        // NaN fails too.
        let ok = err <= tol;
        if !ok && first_bad.is_none() {
            first_bad = Some((i, g, w));
        }
        max_err = max_err.max(err);
    }
    if let Some((i, g, w)) = first_bad {
        panic!("{what}: max abs error {max_err:e} > {tol:e}; first mismatch at {i}: got {g}, want {w}");
    }
}

fn as_f64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

/// Deterministic uniform values in [-1, 1] (xorshift64*), never exactly 0 or 1 in practice.
struct Rng(u64);
impl Rng {
    fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
        (bits as f64 / (1u64 << 24) as f64 * 2.0 - 1.0) as f32
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }
}

// ---------------------------------------------------------------------------------------------
// linear and embedding

/// Dequantise-then-dot: `y[i][j] = sum_l x[i][l] * (w[j][l] * scale(j, l))`, from the
/// definition of the weight scales (a different association from the kernel's).
fn linear_by_definition(
    x: &[f64],
    w: &[f64],
    scale: impl Fn(usize, usize) -> f64,
    m: usize,
    n: usize,
    k: usize,
) -> Vec<f64> {
    let mut y = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            y[i * n + j] = (0..k).map(|l| x[i * k + l] * (w[j * k + l] * scale(j, l))).sum();
        }
    }
    y
}

/// n = 5, k = 7 with 2x3 blocks: a 3x3 scale grid whose last block row has one weight row and
/// whose last block column has one weight column. Integers and dyadic scales, so every product
/// and sum is exact in f64 and the results (below 2^10, multiples of 2^-5) are exact in f32.
#[test]
fn block_scale_with_non_multiple_shapes() {
    let (m, n, k) = (2, 5, 7);
    let w: Vec<f32> = (0..n * k).map(|e| (e % 5) as f32 - 2.0).collect();
    let x: Vec<f32> = (0..m * k).map(|e| ((e % k) as f32 + 1.0) * if e < k { 1.0 } else { -0.5 }).collect();
    let grid: [f32; 9] = [0.5, 2.0, 0.25, 1.5, -1.0, 4.0, 0.125, 3.0, 0.75];
    let scale = |j: usize, l: usize| f64::from(grid[(j / 2) * 3 + l / 3]);
    let want = linear_by_definition(&as_f64(&x), &as_f64(&w), scale, m, n, k);

    for (wdt, sdt) in [(DType::F32, DType::F32), (DType::BF16, DType::BF16), (DType::F16, DType::F32)] {
        let lin = Linear {
            weight: typed(wdt, &[n, k], &w),
            scale: WeightScale::Block { block_rows: 2, block_cols: 3, scales: typed(sdt, &[3, 3], &grid) },
        };
        let mut y = poisoned(&[m, n]);
        B.linear(&f32_tensor(&[m, k], &x), &lin, &mut y).unwrap();
        assert_eq!(as_f64(&read(&y)), want, "weight {wdt}, scales {sdt}");
    }
    // Row 4 (the lone row of block row 2), by hand: w[4][l] = ((28 + l) % 5) - 2
    // = [1, 2, -2, -1, 0, 1, 2], x[0] = [1..=7]; block sums: 1 + 4 - 6 = -1, -4 + 0 + 6 = 2,
    // 14; scaled by [0.125, 3, 0.75]: -0.125 + 6 + 10.5 = 16.375.
    assert_eq!(want[4], 16.375);
}

/// Per-tensor, per-channel `[n]` and `[n, 1]` scales multiply the row's sum (exact values).
#[test]
fn per_channel_and_per_tensor_scales() {
    let (n, k) = (3, 4);
    let w = [1.0, 2.0, 3.0, 4.0, -1.0, 0.5, 2.0, -2.0, 0.25, 1.0, -3.0, 1.5];
    let x = f32_tensor(&[1, k], &[1.0, -1.0, 2.0, 0.5]);
    // Unscaled row sums: 1 - 2 + 6 + 2 = 7; -1 - 0.5 + 4 - 1 = 1.5; 0.25 - 1 - 6 + 0.75 = -6.
    let run = |scale: WeightScale<HostStorage>| {
        let mut y = poisoned(&[1, n]);
        B.linear(&x, &Linear { weight: f32_tensor(&[n, k], &w), scale }, &mut y).unwrap();
        read(&y)
    };
    assert_eq!(run(WeightScale::None), [7.0, 1.5, -6.0]);
    assert_eq!(run(WeightScale::PerTensor(0.25)), [1.75, 0.375, -1.5]);
    let per_row = [0.5, -2.0, 3.0];
    assert_eq!(run(WeightScale::PerChannel(f32_tensor(&[n], &per_row))), [3.5, -3.0, -18.0]);
    assert_eq!(run(WeightScale::PerChannel(typed(DType::BF16, &[n, 1], &per_row))), [3.5, -3.0, -18.0]);
}

/// fp8 weights given as raw codes, decoded by hand from `S EEEE MMM`:
/// e4m3fn (bias 7): 0x38 = 1, 0x40 = 2, 0x3c = 1.5, 0xb8 = -1, 0x01 = 2^-6 * 1/8 = 2^-9,
/// 0x7e = 2^8 * 1.75 = 448, 0x30 = 0.5, 0xc4 = -(2 * 1.5) = -3.
/// The same codes read as e4m3fnuz (bias 8) are worth half, so a doubled scale gives the same
/// products, exactly (scaling by 2 is exact).
#[test]
fn fp8_weights_fn_and_fnuz_agree_with_doubled_scale() {
    let codes = [0x38u8, 0x40, 0x3c, 0xb8, 0x01, 0x7e, 0x30, 0xc4];
    let x = f32_tensor(&[1, 4], &[1.0, 2.0, 4.0, 8.0]);
    // Row 0: 1 + 4 + 6 - 8 = 3, times 0.5 = 1.5.
    // Row 1: 2^-9 + 896 + 2 - 24 = 874 + 2^-9, times 0.25 = 218.5 + 2^-11 (exact in f32).
    let want = [1.5, 218.5 + 2f32.powi(-11)];
    let mut outputs = Vec::new();
    for (dtype, scales) in [(DType::F8E4M3Fn, [0.5, 0.25]), (DType::F8E4M3Fnuz, [1.0, 0.5])] {
        let lin = Linear {
            weight: B.upload(dtype, &[2, 4], &codes).unwrap(),
            scale: WeightScale::PerChannel(f32_tensor(&[2], &scales)),
        };
        let mut y = poisoned(&[1, 2]);
        B.linear(&x, &lin, &mut y).unwrap();
        let got = read(&y);
        assert_eq!(got, want, "{dtype}");
        outputs.push(got);
    }
    assert_eq!(outputs[0], outputs[1]);

    // Per-tensor: fn with scale 3 and fnuz with scale 6 both give 3 * 3 = 9 for row 0.
    let mut y0 = poisoned(&[1, 2]);
    let mut y1 = poisoned(&[1, 2]);
    let fn_w = Linear {
        weight: B.upload(DType::F8E4M3Fn, &[2, 4], &codes).unwrap(),
        scale: WeightScale::PerTensor(3.0),
    };
    let fnuz_w = Linear {
        weight: B.upload(DType::F8E4M3Fnuz, &[2, 4], &codes).unwrap(),
        scale: WeightScale::PerTensor(6.0),
    };
    B.linear(&x, &fn_w, &mut y0).unwrap();
    B.linear(&x, &fnuz_w, &mut y1).unwrap();
    assert_eq!(read(&y0)[0], 9.0);
    assert_eq!(read(&y0), read(&y1));
}

/// Outputs rounded once, to nearest even. bf16 keeps 8 significant bits (ulp at 1 is 2^-7):
/// 1 + 2^-8 + 2^-10 is above the midpoint 1 + 2^-8, so it rounds up to 1 + 2^-7; without the
/// 2^-10 it is a tie and rounds to the even 1. f16 keeps 11 bits (ulp 2^-10): the same with
/// 2^-11 and 2^-13.
#[test]
fn linear_rounds_output_once_to_nearest_even() {
    let w = Linear::plain(f32_tensor(&[2, 3], &[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]));
    for (dt, half_ulp, below) in
        [(DType::BF16, 2f32.powi(-8), 2f32.powi(-10)), (DType::F16, 2f32.powi(-11), 2f32.powi(-13))]
    {
        let x = typed(dt, &[1, 3], &[1.0, half_ulp, below]);
        let mut y = typed(dt, &[1, 2], &[f32::NAN; 2]);
        B.linear(&x, &w, &mut y).unwrap();
        assert_eq!(read(&y), [1.0 + 2.0 * half_ulp, 1.0], "{dt}");
    }
}

/// `scale(j, l)` of a weight, by its definition.
type ScaleFn<'a> = Box<dyn Fn(usize, usize) -> f64 + 'a>;

/// Every weight dtype and scale kind against dequantise-then-dot on random values. The two
/// differ only in the association of f64 sums (~k * 2^-53 relative) and both round to f32 once,
/// so they agree to within one f32 rounding of the largest partial magnitude.
#[test]
fn linear_matches_definition_for_every_dtype_and_scale() {
    let (m, n, k) = (3, 5, 7);
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let x = rng.vec(m * k);
    let w_f32 = rng.vec(n * k);
    let per_row: Vec<f32> = rng.vec(n).iter().map(|v| v + 2.0).collect();
    let grid: Vec<f32> = rng.vec(9).iter().map(|v| v + 2.0).collect();
    for dtype in DType::FLOATS {
        // The weight as stored, then widened back: the values the op must use.
        let stored = typed(dtype, &[n, k], &w_f32);
        let w = as_f64(&read(&stored));
        let cases: [(&str, WeightScale<HostStorage>, ScaleFn); 4] = [
            ("none", WeightScale::None, Box::new(|_, _| 1.0)),
            ("tensor", WeightScale::PerTensor(0.375), Box::new(|_, _| 0.375)),
            (
                "channel",
                WeightScale::PerChannel(f32_tensor(&[n], &per_row)),
                Box::new(|j, _| f64::from(per_row[j])),
            ),
            (
                "block",
                WeightScale::Block { block_rows: 2, block_cols: 3, scales: f32_tensor(&[3, 3], &grid) },
                Box::new(|j, l| f64::from(grid[(j / 2) * 3 + l / 3])),
            ),
        ];
        for (name, scale, scale_fn) in cases {
            let want = linear_by_definition(&as_f64(&x), &w, &scale_fn, m, n, k);
            let lin = Linear { weight: typed(dtype, &[n, k], &w_f32), scale };
            let mut y = poisoned(&[m, n]);
            B.linear(&f32_tensor(&[m, k], &x), &lin, &mut y).unwrap();
            // |x| <= 1, |w| <= 1 (fp8 saturates far above), scales <= 3: partial sums <= 3k.
            let tol = 3.0 * k as f64 * 2f64.powi(-24);
            assert_close(&format!("linear {dtype} {name}"), &read(&y), &want, tol);
        }
    }
}

/// A read-only output is `ReadOnly`, not a crash and not a silent no-op.
#[test]
fn linear_into_read_only_output() {
    let w = Linear::plain(f32_tensor(&[2, 2], &[1.0, 2.0, 3.0, 4.0]));
    let mut y = read_only(DType::F32, &[1, 2], &[7.0, 8.0]);
    let err = B.linear(&f32_tensor(&[1, 2], &[1.0, 1.0]), &w, &mut y).unwrap_err();
    assert_eq!(err, Error::ReadOnly { op: "linear", tensor: "y" });
    assert_eq!(read(&y), [7.0, 8.0]);
}

/// Shapes like the fast backend's tests use run quickly: 4097 outputs, k = 64, bf16 weights
/// with 128x32 blocks (neither dimension a multiple), spot-checked against the definition.
#[test]
fn linear_4097_rows() {
    let (n, k) = (4097, 64);
    let mut rng = Rng(42);
    let x = rng.vec(k);
    let w = rng.vec(n * k);
    let grid: Vec<f32> = rng.vec(33 * 2).iter().map(|v| v + 2.0).collect();
    let weight = typed(DType::BF16, &[n, k], &w);
    let wq = as_f64(&read(&weight));
    let lin = Linear {
        weight,
        scale: WeightScale::Block { block_rows: 128, block_cols: 32, scales: f32_tensor(&[33, 2], &grid) },
    };
    let mut y = poisoned(&[1, n]);
    let start = std::time::Instant::now();
    B.linear(&f32_tensor(&[1, k], &x), &lin, &mut y).unwrap();
    let elapsed = start.elapsed();
    let y = read(&y);
    for j in [0, 127, 128, 4095, 4096] {
        let want: f64 =
            (0..k).map(|l| f64::from(x[l]) * wq[j * k + l] * f64::from(grid[(j / 128) * 2 + l / 32])).sum();
        // Same derivation as above: |partials| <= 3k.
        assert_close(&format!("row {j}"), &y[j..j + 1], &[want], 3.0 * k as f64 * 2f64.powi(-24));
    }
    assert!(elapsed.as_secs_f64() < 2.0, "reference linear 4097x64 took {elapsed:?}");
}

/// Embedding rows are dequantised: per-channel scales are one per row (token); block scales are
/// indexed by (id / block_rows, c / block_cols).
#[test]
fn embedding_dequantises_rows() {
    let table: Vec<f32> = (0..4 * 3).map(|e| e as f32 - 5.0).collect();
    let ids = u32_tensor(&[3], &[2, 3, 2]);
    let lin = Linear {
        weight: f32_tensor(&[4, 3], &table),
        scale: WeightScale::PerChannel(f32_tensor(&[4], &[1.0, 2.0, 0.5, 4.0])),
    };
    let mut out = poisoned(&[3, 3]);
    B.embedding(&lin, &ids, &mut out).unwrap();
    // Row 2 = [1, 2, 3] * 0.5; row 3 = [4, 5, 6] * 4.
    assert_eq!(read(&out), [0.5, 1.0, 1.5, 16.0, 20.0, 24.0, 0.5, 1.0, 1.5]);

    // 5x7 table, 2x3 blocks: row 4 lies in block row 2; columns 0-2, 3-5, 6 in block cols 0-2.
    let table: Vec<f32> = (0..5 * 7).map(|e| (e % 5) as f32 - 2.0).collect();
    let grid = [0.5, 2.0, 0.25, 1.5, -1.0, 4.0, 0.125, 3.0, 0.75];
    let lin = Linear {
        weight: f32_tensor(&[5, 7], &table),
        scale: WeightScale::Block { block_rows: 2, block_cols: 3, scales: f32_tensor(&[3, 3], &grid) },
    };
    let mut out = poisoned(&[2, 7]);
    B.embedding(&lin, &u32_tensor(&[2], &[4, 1]), &mut out).unwrap();
    // Row 4 (elements 28..35): [1, 2, -2, -1, 0, 1, 2] * [0.125 x3, 3 x3, 0.75]; row 1 (block
    // row 0, elements 7..14): [0, 1, 2, -2, -1, 0, 1] * [0.5 x3, 2 x3, 0.25].
    assert_eq!(read(&out), [0.125, 0.25, -0.25, -3.0, 0.0, 3.0, 1.5, 0.0, 0.5, 1.0, -4.0, -2.0, 0.0, 0.25]);
}

#[test]
fn embedding_out_of_range_id_writes_nothing() {
    let lin = Linear::plain(f32_tensor(&[4, 2], &[1.0; 8]));
    let mut out = poisoned(&[2, 2]);
    let err = B.embedding(&lin, &u32_tensor(&[2], &[1, 4]), &mut out).unwrap_err();
    assert_eq!(err, Error::TokenOutOfRange { op: "embedding", row: 1, id: 4, vocab: 4 });
    assert_untouched(&out, "embedding out");
}

// ---------------------------------------------------------------------------------------------
// rms_norm, silu_mul, add_assign

#[test]
fn rms_norm_by_hand() {
    // Row 0: mean(9, 16) = 12.5, + eps 3.5 = 16, sqrt 4: [0.75, 1] * w = [1.5, -0.5] exactly.
    // Row 1: mean(1, 1) = 1, + 3.5 = 4.5: [1, -1] / sqrt(4.5) * [2, -0.5].
    let x = f32_tensor(&[2, 2], &[3.0, 4.0, 1.0, -1.0]);
    let w = typed(DType::BF16, &[2], &[2.0, -0.5]);
    let mut y = poisoned(&[2, 2]);
    B.rms_norm(&x, &w, 3.5, &mut y).unwrap();
    let r = 4.5f64.sqrt();
    assert_close("rms_norm", &read(&y), &[1.5, -0.5, 2.0 / r, 0.5 / r], 2.0 * 2f64.powi(-24));
    assert_eq!(read(&y)[..2], [1.5, -0.5]);
}

#[test]
fn silu_mul_and_add_assign_by_hand() {
    // silu(g) = g * sigmoid(g); sigmoid(ln 3) = 3/4, sigmoid(-ln 3) = 1/4, sigmoid(0) = 1/2.
    let g = f32_tensor(&[1, 4], &[LN_3 as f32, -LN_3 as f32, 0.0, 20.0]);
    let u = f32_tensor(&[1, 4], &[2.0, 2.0, 5.0, 1.0]);
    let mut out = poisoned(&[1, 4]);
    B.silu_mul(&g, &u, &mut out).unwrap();
    let want = [1.5 * LN_3, -0.5 * LN_3, 0.0, 20.0 / (1.0 + (-20f64).exp())];
    // ln 3 as f32 is off by <= 2^-24 relative, then one output rounding: 2 * 2^-24 * 20.
    assert_close("silu_mul", &read(&out), &want, 40.0 * 2f64.powi(-24));

    let mut x = f32_tensor(&[1, 2], &[1.5, -2.0]);
    B.add_assign(&mut x, &f32_tensor(&[1, 2], &[0.25, 3.0])).unwrap();
    assert_eq!(read(&x), [1.75, 1.0]);
}

// ---------------------------------------------------------------------------------------------
// rope

fn basis(len: usize, i: usize) -> Vec<f32> {
    let mut v = vec![0.0; len];
    v[i] = 1.0;
    v
}

/// Hugging Face pairing: dimension i rotates with i + d/2 (not 2i with 2i + 1). With theta =
/// 10^4 and head_dim 8, inv_freq[i] = 10^4^(-2i/8) = 10^-i. Rotating e_i by a puts cos a at i and
/// sin a at i + d/2; rotating e_{i+d/2} puts -sin a at i and cos a at i + d/2.
#[test]
fn rope_pairs_i_with_i_plus_half() {
    let rope = Rope { head_dim: 8, theta: 10_000.0, scaling: None };
    // Row 0 at position 3: head 0 = e_1, head 1 = e_5 (angle 3 * 0.1 = 0.3).
    // Row 1 at position 7: head 0 = e_2 (angle 7 * 0.01 = 0.07), head 1 = e_0 (angle 7).
    let x: Vec<f32> = [basis(8, 1), basis(8, 5), basis(8, 2), basis(8, 0)].concat();
    let mut x = f32_tensor(&[2, 2, 8], &x);
    B.rope(&mut x, &u32_tensor(&[2], &[3, 7]), &rope).unwrap();
    let mut want = vec![0.0f64; 32];
    let (a, b, c) = (0.3f64, 0.07f64, 7.0f64);
    want[1] = a.cos();
    want[5] = a.sin();
    want[8 + 1] = -a.sin();
    want[8 + 5] = a.cos();
    want[16 + 2] = b.cos();
    want[16 + 6] = b.sin();
    want[24] = c.cos();
    want[24 + 4] = c.sin();
    // One f32 rounding of values <= 1, plus ~1e-16 from inv_freq: 2^-24.
    assert_close("rope", &read(&x), &want, 2f64.powi(-24));
}

/// Llama 3.1's rope_scaling: theta 500000, head_dim 128, factor 8, low 1, high 4, original 8192.
/// Wavelengths 2 pi / f_i with f_i = 500000^(-i/64): kept below 8192 / 4 = 2048, divided by 8
/// above 8192 / 1, blended in between. f_i > 2 pi / 2048 iff i < 64 ln(2048 / 2pi) / ln 500000
/// = 28.22, and f_i < 2 pi / 8192 iff i > 64 ln(8192 / 2pi) / ln 500000 = 34.98. So i <= 28 are
/// kept, 29..=34 blended, i >= 35 divided by 8. In the blend, with s = (8192 f / 2pi - 1) / 3,
/// the scaled frequency is (1 - s) f / 8 + s f = f (1/8 + 7s/8).
#[test]
fn llama3_scaling_regimes() {
    let rope = Rope {
        head_dim: 128,
        theta: 500_000.0,
        scaling: Some(Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }),
    };
    let inv = rope.inv_freq();
    assert_eq!(inv.len(), 64);
    let f = |i: usize| 500_000f64.powf(-(i as f64) / 64.0);
    let rel = |got: f64, want: f64| ((got - want) / want).abs();
    for i in [0, 1, 10, 28] {
        assert!(rel(inv[i], f(i)) < 1e-12, "kept i={i}: {} vs {}", inv[i], f(i));
    }
    for i in [35, 50, 63] {
        assert!(rel(inv[i], f(i) / 8.0) < 1e-12, "divided i={i}: {} vs {}", inv[i], f(i) / 8.0);
    }
    for i in [29, 31, 34] {
        let s = (8192.0 * f(i) / (2.0 * PI) - 1.0) / 3.0;
        assert!(s > 0.0 && s < 1.0, "i={i} is in the blend: s = {s}");
        let want = f(i) * (0.125 + 0.875 * s);
        assert!(rel(inv[i], want) < 1e-12, "blended i={i}: {} vs {want}", inv[i]);
        assert!(inv[i] > f(i) / 8.0 && inv[i] < f(i));
    }

    // The op uses these frequencies: e_50 at position 1000 rotates by 1000 f_50 / 8 into
    // dimensions 50 and 50 + 64.
    let mut x = f32_tensor(&[1, 1, 128], &basis(128, 50));
    B.rope(&mut x, &u32_tensor(&[1], &[1000]), &rope).unwrap();
    let a = 1000.0 * f(50) / 8.0;
    let mut want = vec![0.0; 128];
    want[50] = a.cos();
    want[114] = a.sin();
    assert_close("llama3 rope", &read(&x), &want, 2f64.powi(-24) + 1e-12);
}

// ---------------------------------------------------------------------------------------------
// kv cache and attention

fn cache(dtype: DType, shape: [usize; 4], k: &[f32], v: &[f32]) -> KvCacheLayer<HostStorage> {
    KvCacheLayer { k: typed(dtype, &shape, k), v: typed(dtype, &shape, v) }
}

/// The block table of the contiguous layout: slot s is block s (`[slots, 1]`).
fn contiguous(slots: usize) -> HostTensor {
    u32_tensor(&[slots, 1], &(0..slots as u32).collect::<Vec<_>>())
}

/// Query head h reads kv head h / (heads / kv_heads): heads 0, 1 -> kv 0; heads 2, 3 -> kv 1
/// (the wrong `h % kv_heads` would give 0, 1, 0, 1). V holds its own index, 1000 slot + 100 t +
/// 10 kv_head + e; K is 0, so every visible position weighs the same and the output is the mean
/// of V over t = 0..=pos: 1000 slot + 100 pos / 2 + 10 kv_head + e. Integers below 2^24, exact
/// in f32 (the f64 thirds are off by ~1e-13, far below half an f32 ulp).
#[test]
fn grouped_query_heads_read_their_kv_head() {
    let (slots, cap, kvh, hd, heads) = (2, 3, 2, 2, 4);
    let mut v = Vec::new();
    for s in 0..slots {
        for t in 0..cap {
            for g in 0..kvh {
                for e in 0..hd {
                    v.push((1000 * s + 100 * t + 10 * g + e) as f32);
                }
            }
        }
    }
    let c = cache(DType::F32, [slots, cap, kvh, hd], &vec![0.0; v.len()], &v);
    // Row 0: slot 1, pos 0. Row 1: slot 0, pos 0. Row 2: slot 1, pos 2.
    let (row_slot, row_pos) = ([1u32, 0, 1], [0u32, 0, 2]);
    let q = f32_tensor(&[3, heads, hd], &Rng(7).vec(3 * heads * hd));
    let mut out = poisoned(&[3, heads, hd]);
    B.attention(
        &q,
        &c,
        &contiguous(slots),
        &u32_tensor(&[3], &row_slot),
        &u32_tensor(&[3], &row_pos),
        0.5,
        &mut out,
    )
    .unwrap();
    let mut want = Vec::new();
    for r in 0..3 {
        for h in 0..heads {
            for e in 0..hd {
                let g = h / 2;
                want.push((1000 * row_slot[r] as usize + 50 * row_pos[r] as usize + 10 * g + e) as f32);
            }
        }
    }
    assert_eq!(read(&out), want);
}

/// softmax(scale * q.k): with q = [2, 0], k_0 = [0, 1], k_1 = [ln 3, 1] and scale 1/2 the scores
/// are 0 and ln 3, so p = [1/4, 3/4] and out = v_0 / 4 + 3 v_1 / 4. With scale 1/4 the scores
/// are 0 and ln 3 / 2, so p_1 = sqrt 3 / (1 + sqrt 3). q = [2, 2000] adds the same 1000 (or
/// 500) to both scores, which softmax ignores (exp(1000) itself overflows f64: the maximum must
/// be subtracted first).
#[test]
fn attention_softmax_scale() {
    let k = [0.0, 1.0, LN_3 as f32, 1.0];
    let v = [1.0, -1.0, -2.0, 4.0];
    let c = cache(DType::F32, [1, 2, 1, 2], &k, &v);
    let cases = [(0.5f32, 0.75f64), (0.25, 3f64.sqrt() / (1.0 + 3f64.sqrt()))];
    for ((scale, p1), q_values) in cases.into_iter().flat_map(|c| [(c, [2.0, 0.0]), (c, [2.0, 2000.0])]) {
        let q = f32_tensor(&[1, 1, 2], &q_values);
        let mut out = poisoned(&[1, 1, 2]);
        B.attention(
            &q,
            &c,
            &contiguous(1),
            &u32_tensor(&[1], &[0]),
            &u32_tensor(&[1], &[1]),
            scale,
            &mut out,
        )
        .unwrap();
        let p0 = 1.0 - p1;
        // v_0 = [1, -1], v_1 = [-2, 4].
        let want = [p0 - 2.0 * p1, -p0 + 4.0 * p1];
        // ln 3 in f32 moves the score by <= 2^-24 ln 3, p by less, out (|v| <= 4) by < 4 * 2^-24;
        // plus one output rounding 4 * 2^-24.
        assert_close(&format!("scale {scale}, q {q_values:?}"), &read(&out), &want, 8.0 * 2f64.powi(-24));
    }
}

/// Causal mask: entries after pos never matter; the entry at pos does.
#[test]
fn attention_ignores_positions_after_pos() {
    let (cap, heads, hd) = (6, 2, 4);
    let mut rng = Rng(99);
    let mut c = cache(DType::BF16, [1, cap, 1, hd], &rng.vec(cap * hd), &rng.vec(cap * hd));
    let q = f32_tensor(&[1, heads, hd], &rng.vec(heads * hd));
    let (slot, pos) = (u32_tensor(&[1], &[0]), u32_tensor(&[1], &[2]));
    let attend = |c: &KvCacheLayer<HostStorage>| {
        let mut out = poisoned(&[1, heads, hd]);
        B.attention(&q, c, &contiguous(1), &slot, &pos, 0.5, &mut out).unwrap();
        read(&out)
    };
    let before = attend(&c);

    let big = f32_tensor(&[3, 1, hd], &[50.0; 12]);
    B.kv_store(&big, &big, &mut c, &contiguous(1), &u32_tensor(&[3], &[0; 3]), &u32_tensor(&[3], &[3, 4, 5]))
        .unwrap();
    assert_eq!(attend(&c), before, "positions 3..6 leaked into the output");

    let one = f32_tensor(&[1, 1, hd], &[50.0; 4]);
    B.kv_store(&one, &one, &mut c, &contiguous(1), &u32_tensor(&[1], &[0]), &u32_tensor(&[1], &[2])).unwrap();
    assert_ne!(attend(&c), before, "position pos itself must be attended");
}

/// kv_store writes row r at (slots[r], positions[r]), converted to the cache dtype (bf16: to
/// nearest even; 1 + 2^-8 is a tie and goes to the even 1, 1 + 3 * 2^-8 to the even 1 + 2^-6).
#[test]
fn kv_store_layout_and_conversion() {
    let (slots, cap, kvh, hd) = (2, 3, 1, 2);
    let n = slots * cap * kvh * hd;
    let mut c = KvCacheLayer {
        k: typed(DType::BF16, &[slots, cap, kvh, hd], &vec![0.0; n]),
        v: f32_tensor(&[slots, cap, kvh, hd], &vec![0.0; n]),
    };
    let k = f32_tensor(&[2, 1, 2], &[1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), 5.0, 6.0]);
    let v = f32_tensor(&[2, 1, 2], &[1.0 + 2f32.powi(-8), 2.0, 7.0, 8.0]);
    B.kv_store(&k, &v, &mut c, &contiguous(slots), &u32_tensor(&[2], &[1, 0]), &u32_tensor(&[2], &[2, 1]))
        .unwrap();
    // Row 0 -> slot 1, position 2: element offset (1 * 3 + 2) * 2 = 10. Row 1 -> offset 2.
    let mut want_k = vec![0.0; n];
    let mut want_v = vec![0.0; n];
    want_k[10..12].copy_from_slice(&[1.0, 1.0 + 2f32.powi(-6)]);
    want_v[10..12].copy_from_slice(&[1.0 + 2f32.powi(-8), 2.0]);
    want_k[2..4].copy_from_slice(&[5.0, 6.0]);
    want_v[2..4].copy_from_slice(&[7.0, 8.0]);
    assert_eq!(read(&c.k), want_k);
    assert_eq!(read(&c.v), want_v);
}

#[test]
fn kv_store_and_attention_reject_bad_slots_and_positions_before_writing() {
    let shape = [2, 3, 1, 2];
    let mut c = KvCacheLayer { k: poisoned(&shape), v: poisoned(&shape) };
    let kv = f32_tensor(&[2, 1, 2], &[1.0; 4]);
    let q = f32_tensor(&[2, 1, 2], &[1.0; 4]);
    let cases = [
        ([0u32, 2], [0u32, 0], Error::SlotOutOfRange { op: "kv_store", row: 1, slot: 2, slots: 2 }),
        ([0, 1], [0, 3], Error::ContextOverflow { op: "kv_store", row: 1, pos: 3, capacity: 3 }),
    ];
    for (slots, positions, err) in cases {
        let (s, p) = (u32_tensor(&[2], &slots), u32_tensor(&[2], &positions));
        assert_eq!(B.kv_store(&kv, &kv, &mut c, &contiguous(2), &s, &p).unwrap_err(), err);
        assert_untouched(&c.k, "k cache");
        assert_untouched(&c.v, "v cache");

        let mut out = poisoned(&[2, 1, 2]);
        let attn_err = match err {
            Error::SlotOutOfRange { row, slot, slots, .. } => {
                Error::SlotOutOfRange { op: "attention", row, slot, slots }
            }
            Error::ContextOverflow { row, pos, capacity, .. } => {
                Error::ContextOverflow { op: "attention", row, pos, capacity }
            }
            other => other,
        };
        assert_eq!(B.attention(&q, &c, &contiguous(2), &s, &p, 1.0, &mut out).unwrap_err(), attn_err);
        assert_untouched(&out, "attention out");
    }

    // A read-only v cache fails before the k cache is written.
    let mut c = KvCacheLayer { k: poisoned(&shape), v: read_only(DType::F32, &shape, &[0.0; 12]) };
    let (s, p) = (u32_tensor(&[2], &[0, 1]), u32_tensor(&[2], &[0, 2]));
    assert_eq!(
        B.kv_store(&kv, &kv, &mut c, &contiguous(2), &s, &p).unwrap_err(),
        Error::ReadOnly { op: "kv_store", tensor: "v_cache" }
    );
    assert_untouched(&c.k, "k cache");
}

/// Paged layout: blocks of 2 positions, slot 0 in blocks [3, 0], slot 1 in [4, 1] (block 2
/// unused). kv_store of index-revealing rows (row r holds 10 r + e) lands at element
/// `((table[s][p / 2] * 2 + p % 2) * kv_heads + g) * head_dim + e`; attention with K = 0 (equal
/// weights) gives the mean of V over 0..=pos read through the same table.
#[test]
fn paged_layout_through_the_block_table() {
    let (blocks, bs, kvh, hd) = (5, 2, 1, 2);
    let n = blocks * bs * kvh * hd;
    let table = u32_tensor(&[2, 2], &[3, 0, 4, 1]);
    let mut c = KvCacheLayer {
        k: f32_tensor(&[blocks, bs, kvh, hd], &vec![0.0; n]),
        v: poisoned(&[blocks, bs, kvh, hd]),
    };
    // Every position of both slots: (slot, pos) for rows 0..8.
    let entries: Vec<(u32, u32)> = (0..2).flat_map(|s| (0..4).map(move |p| (s, p))).collect();
    let vals: Vec<f32> = (0..8).flat_map(|r| (0..hd).map(move |e| (10 * r + e) as f32)).collect();
    let slots: Vec<u32> = entries.iter().map(|e| e.0).collect();
    let positions: Vec<u32> = entries.iter().map(|e| e.1).collect();
    let (s, p) = (u32_tensor(&[8], &slots), u32_tensor(&[8], &positions));
    let zeros = f32_tensor(&[8, kvh, hd], &[0.0; 16]);
    B.kv_store(&zeros, &f32_tensor(&[8, kvh, hd], &vals), &mut c, &table, &s, &p).unwrap();
    let tab = [[3usize, 0], [4, 1]];
    let got = read(&c.v);
    for (r, &(slot, pos)) in entries.iter().enumerate() {
        let at = ((tab[slot as usize][pos as usize / bs] * bs + pos as usize % bs) * kvh) * hd;
        assert_eq!(&got[at..at + hd], &vals[r * hd..(r + 1) * hd], "row {r} (slot {slot}, pos {pos})");
    }
    // Block 2 was never named: still poisoned.
    assert!(got[2 * bs * hd..3 * bs * hd].iter().all(|v| v.is_nan()), "block 2 written");
    // Attention: row (slot 1, pos 2) averages rows 4, 5, 6 of the store.
    let q = f32_tensor(&[2, 1, hd], &[0.5, -0.25, 0.75, 0.125]);
    let mut out = poisoned(&[2, 1, hd]);
    B.attention(&q, &c, &table, &u32_tensor(&[2], &[1, 0]), &u32_tensor(&[2], &[2, 3]), 0.5, &mut out)
        .unwrap();
    // Means of 10 r + e: slot 1 rows 4..=6 -> 50 + e; slot 0 rows 0..=3 -> 15 + e.
    assert_eq!(read(&out), [50.0, 51.0, 15.0, 16.0]);
}

/// A table entry a row needs that names no block is `BlockOutOfRange`, before anything is
/// written; entries no row reads may hold anything.
#[test]
fn bad_block_table_entries_are_refused_before_writing() {
    let shape = [3, 2, 1, 2];
    let mut c = KvCacheLayer { k: poisoned(&shape), v: poisoned(&shape) };
    // Slot 0: blocks [1, 3 (bad)]; slot 1: [u32::MAX (bad), 0].
    let table = u32_tensor(&[2, 2], &[1, 3, u32::MAX, 0]);
    let kv = f32_tensor(&[2, 1, 2], &[1.0; 4]);
    let q = f32_tensor(&[2, 1, 2], &[1.0; 4]);
    let blk = |op, row, block| Error::BlockOutOfRange { op, row, block, blocks: 3 };
    // (slots, positions, kv_store's error, attention's error).
    let cases = [
        // Slot 0 position 2 is in the bad second block.
        ([0u32, 0], [1u32, 2], Some(blk("kv_store", 1, 3)), blk("attention", 1, 3)),
        // Slot 1 position 2 is in its good second block, but attention reads 0..=2, the bad
        // first block too.
        ([0, 1], [0, 2], None, blk("attention", 1, u32::MAX)),
    ];
    for (slots, positions, store_err, attn_err) in cases {
        let (s, p) = (u32_tensor(&[2], &slots), u32_tensor(&[2], &positions));
        let r = B.kv_store(&kv, &kv, &mut c, &table, &s, &p);
        match store_err {
            // kv_store needs only the entry of each row's own position.
            None => r.unwrap(),
            Some(want) => {
                assert_eq!(r.unwrap_err(), want);
                assert_untouched(&c.k, "k cache");
                assert_untouched(&c.v, "v cache");
            }
        }
        let mut out = poisoned(&[2, 1, 2]);
        assert_eq!(B.attention(&q, &c, &table, &s, &p, 1.0, &mut out).unwrap_err(), attn_err);
        assert_untouched(&out, "attention out");
    }
}

// ---------------------------------------------------------------------------------------------
// router, argmax, sampling

/// logits ln [1, 2, 3, 4] give softmax [0.1, 0.2, 0.3, 0.4]; the top 2 are experts 3 and 2 with
/// weights 0.4 / 0.7 = 4/7 and 3/7. Logits [0, 2, 2, 1], top 3: the tie between 1 and 2 goes to
/// the lower index first, weights e^2, e^2, e over 2e^2 + e.
#[test]
fn router_topk_renormalises_over_the_chosen() {
    let row0: Vec<f32> = [1.0f64, 2.0, 3.0, 4.0].iter().map(|v| v.ln() as f32).collect();
    let logits = f32_tensor(&[3, 4], &[row0, vec![0.0, 2.0, 2.0, 1.0], vec![0.5; 4]].concat());
    for k in [2, 3] {
        let mut ids = u32_tensor(&[3, k], &vec![99; 3 * k]);
        let mut w = poisoned(&[3, k]);
        B.router_topk(&logits, k, &mut ids, &mut w).unwrap();
        let ids = B.read_u32(&ids).unwrap();
        let w = read(&w);
        let e = 1f64.exp();
        let (want_ids, want_w): (Vec<u32>, Vec<f64>) = if k == 2 {
            (vec![3, 2, 1, 2, 0, 1], vec![4.0 / 7.0, 3.0 / 7.0, 0.5, 0.5, 0.5, 0.5])
        } else {
            let d = 2.0 * e * e + e;
            let third = 1.0 / 3.0;
            (
                vec![3, 2, 1, 1, 2, 3, 0, 1, 2],
                vec![4.0 / 9.0, 3.0 / 9.0, 2.0 / 9.0, e * e / d, e * e / d, e / d, third, third, third],
            )
        };
        assert_eq!(ids, want_ids, "k = {k}");
        // Each f32 logit ln x is off by <= 2^-24 ln 4 < 1.4 * 2^-24, so a weight
        // e^l_i / sum_chosen e^l_j moves by <= 2.8 * 2^-24 relative; plus one f32 rounding
        // (<= 2^-24 relative); weights <= 1.
        assert_close(&format!("router weights k = {k}"), &w, &want_w, 4.0 * 2f64.powi(-24));
        for r in 0..3 {
            let sum: f64 = w[r * k..(r + 1) * k].iter().map(|&x| f64::from(x)).sum();
            assert!((sum - 1.0).abs() <= k as f64 * 2f64.powi(-24), "row {r} sums to {sum}");
        }
    }
}

#[test]
fn argmax_ties_and_nan() {
    let nan = f32::NAN;
    let inf = f32::INFINITY;
    let rows = [
        ([1.0, 3.0, 3.0, 2.0], 1),     // tie: lowest index
        ([nan, 1.0, nan, 1.0], 1),     // NaN never wins
        ([nan, nan, nan, nan], 0),     // all NaN: 0
        ([nan, -inf, nan, -inf], 1),   // -inf is still a number
        ([-1.0, -0.5, inf, nan], 2),   // +inf wins
        ([-2.0, -1.0, -1.5, -3.0], 1), // negatives
    ];
    let flat: Vec<f32> = rows.iter().flat_map(|(r, _)| *r).collect();
    let mut out = u32_tensor(&[rows.len()], &vec![99; rows.len()]);
    B.argmax(&f32_tensor(&[rows.len(), 4], &flat), &mut out).unwrap();
    let want: Vec<u32> = rows.iter().map(|&(_, i)| i).collect();
    assert_eq!(B.read_u32(&out).unwrap(), want);
    for (row, i) in rows {
        assert_eq!(Reference::argmax_row(&row), i);
    }
}

/// The distribution p = [0.05, 0.1, 0.15, 0.2, 0.5] as logits ln p.
fn five_token_logits() -> Vec<f32> {
    [0.05f64, 0.1, 0.15, 0.2, 0.5].iter().map(|p| p.ln() as f32).collect()
}

fn params(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
    SamplingParams { temperature, top_k, top_p }
}

/// Draws `steps * rows` tokens with the op (every row holds `logits`) and counts them.
fn draw_counts(logits: &[f32], p: &SamplingParams, steps: u64, rows: usize) -> Vec<usize> {
    let t = f32_tensor(&[rows, logits.len()], &logits.repeat(rows));
    let mut counts = vec![0; logits.len()];
    let mut out = u32_tensor(&[rows], &vec![0; rows]);
    // Each row its own stream (seed 0x5eed + row), all at the same step.
    let seeds = u32_tensor(&[rows], &(0..rows as u32).map(|r| 0x5eed + r).collect::<Vec<_>>());
    for step in 0..steps {
        let step_t = u32_tensor(&[rows], &vec![step as u32; rows]);
        B.sample(&t, p, &seeds, &step_t, &mut out).unwrap();
        for id in B.read_u32(&out).unwrap() {
            counts[id as usize] += 1;
        }
    }
    counts
}

/// Each count within 5 standard deviations sqrt(N p (1 - p)) of N p; tokens of probability 0
/// never drawn.
fn assert_frequencies(what: &str, counts: &[usize], probs: &[f64]) {
    let n: usize = counts.iter().sum();
    for (i, (&c, &p)) in counts.iter().zip(probs).enumerate() {
        if p == 0.0 {
            assert_eq!(c, 0, "{what}: token {i} has probability 0 but was drawn {c} times");
            continue;
        }
        let mean = n as f64 * p;
        let sd = (n as f64 * p * (1.0 - p)).sqrt();
        assert!(
            (c as f64 - mean).abs() <= 5.0 * sd,
            "{what}: token {i} drawn {c} times, expected {mean:.0} +- {:.0}",
            5.0 * sd
        );
    }
}

#[test]
fn greedy_at_temperature_zero_and_top_k_one() {
    let mut rng = Rng(3);
    let logits = rng.vec(4 * 50);
    let t = f32_tensor(&[4, 50], &logits);
    let mut want = u32_tensor(&[4], &[0; 4]);
    B.argmax(&t, &mut want).unwrap();
    let want = B.read_u32(&want).unwrap();
    for (step, p) in [params(0.0, 0, 1.0), params(0.0, 7, 0.3), params(1.0, 1, 1.0), params(5.0, 1, 0.9)]
        .into_iter()
        .enumerate()
    {
        for seed in 0..20 {
            let mut out = u32_tensor(&[4], &[99; 4]);
            let (seeds, steps) = (u32_tensor(&[4], &[seed; 4]), u32_tensor(&[4], &[step as u32; 4]));
            B.sample(&t, &p, &seeds, &steps, &mut out).unwrap();
            assert_eq!(B.read_u32(&out).unwrap(), want, "{p:?} seed {seed}");
        }
    }
}

/// 20000 draws (1000 steps x 20 rows) from p = [0.05, 0.1, 0.15, 0.2, 0.5].
#[test]
fn sampling_frequencies_match_softmax() {
    let logits = five_token_logits();
    let probs = [0.05, 0.1, 0.15, 0.2, 0.5];
    let dist = Reference::sample_distribution(&logits, &params(1.0, 0, 1.0));
    let ids: Vec<u32> = dist.iter().map(|&(i, _)| i).collect();
    assert_eq!(ids, [4, 3, 2, 1, 0]);
    for &(i, p) in &dist {
        assert!((p - probs[i as usize]).abs() < 1e-6, "p[{i}] = {p}");
    }
    assert_frequencies("t=1", &draw_counts(&logits, &params(1.0, 0, 1.0), 1000, 20), &probs);

    // Temperature divides the logits: 2 ln p at temperature 2 is p again; at temperature 1 it is
    // p^2 / sum p^2 = [0.0025, 0.01, 0.0225, 0.04, 0.25] / 0.325.
    let doubled: Vec<f32> = logits.iter().map(|l| 2.0 * l).collect();
    let squared: Vec<f64> = probs.iter().map(|p| p * p / 0.325).collect();
    for (t, want) in [(2.0, probs.to_vec()), (1.0, squared.clone())] {
        for (i, p) in Reference::sample_distribution(&doubled, &params(t, 0, 1.0)) {
            assert!((p - want[i as usize]).abs() < 1e-6, "t={t}: p[{i}] = {p}");
        }
    }
    assert_frequencies("2 ln p at t=1", &draw_counts(&doubled, &params(1.0, 0, 1.0), 1000, 20), &squared);
}

/// top-k 2 keeps tokens 4 and 3 (0.5 / 0.7, 0.2 / 0.7). top-p 0.8: cumulative 0.5, 0.7, 0.85,
/// so tokens 4, 3, 2 (over 0.85). top-k 3 then top-p 0.8: the survivors renormalised are 0.5,
/// 0.2, 0.15 over 0.85 with cumulative 0.588, 0.824, so only tokens 4 and 3 (without the
/// renormalisation it would take three).
#[test]
fn sampling_never_draws_outside_top_k_and_top_p() {
    let logits = five_token_logits();
    let cases = [
        ("top-k 2", params(1.0, 2, 1.0), vec![0.0, 0.0, 0.0, 0.2 / 0.7, 0.5 / 0.7]),
        ("top-p 0.8", params(1.0, 0, 0.8), vec![0.0, 0.0, 0.15 / 0.85, 0.2 / 0.85, 0.5 / 0.85]),
        ("top-k 3, top-p 0.8", params(1.0, 3, 0.8), vec![0.0, 0.0, 0.0, 0.2 / 0.7, 0.5 / 0.7]),
        ("top-p 0.6", params(1.0, 0, 0.6), vec![0.0, 0.0, 0.0, 0.2 / 0.7, 0.5 / 0.7]),
        ("top-k 4 of 5", params(1.0, 4, 1.0), vec![0.0, 0.1 / 0.95, 0.15 / 0.95, 0.2 / 0.95, 0.5 / 0.95]),
    ];
    for (what, p, want) in cases {
        let dist = Reference::sample_distribution(&logits, &p);
        assert_eq!(dist.len(), want.iter().filter(|&&q| q > 0.0).count(), "{what}: {dist:?}");
        for (i, q) in dist {
            assert!((q - want[i as usize]).abs() < 1e-6, "{what}: p[{i}] = {q}");
        }
        assert_frequencies(what, &draw_counts(&logits, &p, 500, 20), &want);
    }
}

/// NaN and -inf logits have probability 0.
#[test]
fn sampling_skips_nan_and_negative_infinity() {
    let logits = [f32::NAN, 0.0, f32::NEG_INFINITY, 0.0];
    assert_eq!(Reference::sample_distribution(&logits, &params(0.7, 0, 1.0)), [(1, 0.5), (3, 0.5)]);
    let counts = draw_counts(&logits, &params(0.7, 0, 1.0), 250, 8);
    assert_frequencies("nan/-inf", &counts, &[0.0, 0.5, 0.0, 0.5]);
}

/// The draw is the inverse CDF at u over the ranked candidates [4, 3, 2, 1, 0] with cumulative
/// [0.5, 0.7, 0.85, 0.95, 1]: the first whose cumulative probability exceeds u.
#[test]
fn sample_row_inverts_the_cdf() {
    let logits = five_token_logits();
    let p = params(1.0, 0, 1.0);
    for (u, want) in [
        (0.0, 4),
        (0.49, 4),
        (0.51, 3),
        (0.69, 3),
        (0.71, 2),
        (0.84, 2),
        (0.86, 1),
        (0.96, 0),
        (0.999_999, 0),
    ] {
        assert_eq!(Reference::sample_row(&logits, &p, u), want, "u = {u}");
    }
    // Row r of the op draws u = sample_uniform(seeds[r], steps[r], 0): its own stream, whatever
    // its place in the batch.
    let t = f32_tensor(&[3, 5], &logits.repeat(3));
    let mut out = u32_tensor(&[3], &[99; 3]);
    let (seeds, steps) = ([11u32, 11, 12], [5u32, 6, 5]);
    B.sample(&t, &p, &u32_tensor(&[3], &seeds), &u32_tensor(&[3], &steps), &mut out).unwrap();
    let want: Vec<u32> = (0..3)
        .map(|r| {
            Reference::sample_row(&logits, &p, sample_uniform(u64::from(seeds[r]), u64::from(steps[r]), 0))
        })
        .collect();
    assert_eq!(B.read_u32(&out).unwrap(), want);
    // The same row alone draws the same token.
    for r in 0..3 {
        let mut one = u32_tensor(&[1], &[99]);
        let t1 = f32_tensor(&[1, 5], &logits);
        B.sample(&t1, &p, &u32_tensor(&[1], &seeds[r..=r]), &u32_tensor(&[1], &steps[r..=r]), &mut one)
            .unwrap();
        assert_eq!(B.read_u32(&one).unwrap(), [want[r]], "row {r} alone");
    }
}

// ---------------------------------------------------------------------------------------------
// gather / scatter

#[test]
fn gather_and_scatter_with_repeated_indices() {
    let src = f32_tensor(&[3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let mut out = poisoned(&[3, 2]);
    B.gather_rows(&src, &u32_tensor(&[3], &[2, 0, 2]), &mut out).unwrap();
    assert_eq!(read(&out), [5.0, 6.0, 1.0, 2.0, 5.0, 6.0]);

    // dst[1] += 0.5 [1, 2] + 2 [3, 4] = [30 + 6.5, 40 + 9]; dst[0] += -1 [5, 6]; dst[2] kept.
    let mut dst = f32_tensor(&[3, 2], &[10.0, 20.0, 30.0, 40.0, 50.0, 60.0]);
    let w = f32_tensor(&[3], &[0.5, 2.0, -1.0]);
    B.scatter_add_rows(&mut dst, &u32_tensor(&[3], &[1, 1, 0]), &src, &w).unwrap();
    assert_eq!(read(&dst), [5.0, 14.0, 36.5, 49.0, 50.0, 60.0]);

    // Contributions accumulate in f64 and round once: 1 + 2^-24 + 2^-24 = 1 + 2^-23 exactly,
    // where adding in f32 one at a time would tie back to 1 twice.
    let mut dst = f32_tensor(&[1, 1], &[1.0]);
    let tiny = f32_tensor(&[2, 1], &[2f32.powi(-24); 2]);
    B.scatter_add_rows(&mut dst, &u32_tensor(&[2], &[0, 0]), &tiny, &f32_tensor(&[2], &[1.0, 1.0])).unwrap();
    assert_eq!(read(&dst), [1.0 + 2f32.powi(-23)]);
}

#[test]
fn gather_and_scatter_reject_bad_indices_before_writing() {
    let src = f32_tensor(&[3, 2], &[1.0; 6]);
    let idx = u32_tensor(&[2], &[0, 3]);
    let mut out = poisoned(&[2, 2]);
    assert_eq!(
        B.gather_rows(&src, &idx, &mut out).unwrap_err(),
        Error::IndexOutOfRange { op: "gather_rows", row: 1, index: 3, len: 3 }
    );
    assert_untouched(&out, "gather out");

    let mut dst = poisoned(&[3, 2]);
    let part = f32_tensor(&[2, 2], &[1.0; 4]);
    assert_eq!(
        B.scatter_add_rows(&mut dst, &idx, &part, &f32_tensor(&[2], &[1.0; 2])).unwrap_err(),
        Error::IndexOutOfRange { op: "scatter_add_rows", row: 1, index: 3, len: 3 }
    );
    assert_untouched(&dst, "scatter dst");
}

/// Both router outputs are claimed before either is written.
#[test]
fn router_with_read_only_weights_writes_nothing() {
    let logits = f32_tensor(&[1, 3], &[0.1, 0.2, LN_2 as f32]);
    let mut ids = u32_tensor(&[1, 2], &[99, 99]);
    let mut w = read_only(DType::F32, &[1, 2], &[0.0, 0.0]);
    assert_eq!(
        B.router_topk(&logits, 2, &mut ids, &mut w).unwrap_err(),
        Error::ReadOnly { op: "router_topk", tensor: "weights" }
    );
    assert_eq!(B.read_u32(&ids).unwrap(), [99, 99]);
}
