//! e4m3fn weights converted for an e4m3fnuz device by `fp8::linear_to_fnuz` (the function the
//! model loader converts with: codes mapped, scale doubled) give the same products on the reference
//! backend as the weights they came from, bit for bit; and the function's own contract (what it
//! rewrites, what it counts, what it refuses).
//!
//! Why bit for bit, not within a tolerance: the reference widens every value to f64. A converted
//! code is worth exactly half the original (fp8 -> f64 is exact), so each product `x * w` (24 + 4
//! significant bits, exact in f64) halves exactly, and so does every partial sum of them (halving
//! every term of a sum halves each rounded partial sum exactly: a power-of-two factor commutes with
//! rounding, and no term comes near f64's subnormal range; |x * w| >= 2^-24 * 2^-10). The doubled
//! scale is exact too, so `(2 s) * (sum / 2)` is the same real number as `s * sum` and rounds to
//! the same f64; with no scale the converted weight gets `2.0 * (sum / 2) = sum`. The same holds
//! for each block's partial sum and for the embedding's dequantised `w * s`. Equal f64 results
//! round to equal f32 outputs. The one difference is the sign of an exact zero: fnuz has no -0,
//! so fn's -0 (0x80) becomes +0 and a result that is exactly zero may lose its sign
//! ([`fnuz_kit::same_bits`]).

#[path = "fnuz_kit/mod.rs"]
mod fnuz_kit;

use fnuz_kit::{Draw, Scheme, fn_weight, same_bits, to_fnuz};
use memwall_runtime::cpu::Reference;
use memwall_runtime::{Backend, DType, HostStorage, HostTensor, Linear, WeightScale, fp8};
use proptest::prelude::*;

const B: Reference = Reference;

/// Deterministic xorshift stream.
struct Rng(u64);
impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

impl Draw for Rng {
    fn bits(&mut self) -> u64 {
        self.next()
    }
    fn values(&mut self, _: DType, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }
}

fn schemes() -> Vec<Scheme> {
    let mut s = vec![Scheme::None, Scheme::PerTensor];
    for d in [DType::F32, DType::BF16] {
        s.push(Scheme::PerChannel(d));
        for (r, c) in [(128, 128), (3, 5), (1, 7), (16, 4097)] {
            s.push(Scheme::Block(d, r, c));
        }
    }
    s
}

fn bytes(t: &HostTensor) -> Vec<u8> {
    t.storage().bytes()[..t.nbytes()].to_vec()
}

/// An f32 tensor filled with a NaN payload, so an unwritten element fails the comparison.
fn poisoned(shape: &[usize]) -> HostTensor {
    let n: usize = shape.iter().product();
    B.upload(DType::F32, shape, bytemuck::cast_slice(&vec![0x7fc0_deadu32; n])).unwrap()
}

fn linear_bits(x: &HostTensor, w: &Linear<HostStorage>, m: usize, n: usize) -> Vec<u32> {
    let mut y = poisoned(&[m, n]);
    B.linear(x, w, &mut y).unwrap();
    y.as_slice::<u32>().to_vec()
}

fn embedding_bits(w: &Linear<HostStorage>, ids: &HostTensor, k: usize) -> Vec<u32> {
    let mut out = poisoned(&[ids.numel(), k]);
    B.embedding(w, ids, &mut out).unwrap();
    out.as_slice::<u32>().to_vec()
}

const SHAPES: [(usize, usize); 5] = [(1, 1), (3, 17), (17, 4097), (130, 257), (1, 4097)];

proptest! {
    // Each case runs every shape and scheme (5 x 12 pairs of linears), so a few cases suffice.
    #![proptest_config(ProptestConfig::with_cases(6))]

    #[test]
    fn converted_weights_give_the_same_products(seed in any::<u64>(), m in 1usize..=4) {
        let mut rng = Rng::new(seed);
        for (n, k) in SHAPES {
            for scheme in schemes() {
                let w = fn_weight(&mut rng, n, k, scheme);
                let u = to_fnuz(&w);
                prop_assert_eq!(u.weight.dtype(), DType::F8E4M3Fnuz);
                let x_values: Vec<f32> = (0..m * k).map(|_| rng.uniform()).collect();
                let x = B.upload_f32(DType::F32, &[m, k], &x_values).unwrap();
                let (a, b) = (linear_bits(&x, &w, m, n), linear_bits(&x, &u, m, n));
                prop_assert!(a.iter().all(|&v| f32::from_bits(v).is_finite()), "{n}x{k} {scheme:?}: unwritten");
                let same = same_bits(&a, &b);
                prop_assert!(same.is_ok(), "linear {m}x{n}x{k} {scheme:?}: {same:?}");

                let ids: Vec<u32> = (0..m).map(|_| (rng.next() % n as u64) as u32).collect();
                let ids = B.upload_u32(&[m], &ids).unwrap();
                let (a, b) = (embedding_bits(&w, &ids, k), embedding_bits(&u, &ids, k));
                prop_assert!(a.iter().all(|&v| f32::from_bits(v).is_finite()), "{n}x{k} {scheme:?}: unwritten");
                let same = same_bits(&a, &b);
                prop_assert!(same.is_ok(), "embedding {n}x{k} {scheme:?}: {same:?}");
            }
        }
    }
}

#[test]
fn converted_zero_codes_are_the_fnuz_zero() {
    // fn's -0 (0x80) must not reach the device as 0x80, the fnuz NaN: a row of -0 gives 0.
    let w = Linear {
        weight: B.upload(DType::F8E4M3Fn, &[1, 3], &[0x80, 0x00, 0x80]).unwrap(),
        scale: WeightScale::PerTensor(0.5),
    };
    let u = to_fnuz(&w);
    assert_eq!(bytes(&u.weight), [0, 0, 0]);
    let x = B.upload_f32(DType::F32, &[1, 3], &[0.25, -0.5, 0.75]).unwrap();
    let y = linear_bits(&x, &u, 1, 1);
    assert_eq!(f32::from_bits(y[0]), 0.0);
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|&x| memwall_runtime::half::bf16::from_f32(x).to_le_bytes()).collect()
}

/// A `[2, 3]` e4m3fn weight (fn's -0 among its codes) with `scale`.
fn small(scale: WeightScale<HostStorage>) -> Linear<HostStorage> {
    Linear {
        weight: B.upload(DType::F8E4M3Fn, &[2, 3], &[0x80, 0x01, 0x38, 0xb8, 0x7e, 0xfe]).unwrap(),
        scale,
    }
}

#[test]
fn linear_to_fnuz_rewrites_codes_and_scales_in_place() {
    let fnuz_codes = [0x00, 0x01, 0x38, 0xb8, 0x7e, 0xfe];
    // Scale values: normal, subnormal (f32), large; each doubled exactly. The bf16 ones are
    // rounded to bf16 first, as stored.
    let f32_scale = [0.3, -1.5e-40];
    let bf16_scale: Vec<f32> = [0.3f32, 7.0, -1e30, 2.5]
        .iter()
        .map(|&v| memwall_runtime::half::bf16::from_f32(v).to_f32())
        .collect();
    let twice = |v: &[f32]| -> Vec<f32> { v.iter().map(|x| 2.0 * x).collect() };
    let cases: Vec<(WeightScale<HostStorage>, Option<Vec<u8>>, usize)> = vec![
        (WeightScale::None, None, 0),
        (WeightScale::PerTensor(-0.375), None, 0),
        (
            WeightScale::PerChannel(B.upload(DType::F32, &[2, 1], &f32_bytes(&f32_scale)).unwrap()),
            Some(f32_bytes(&twice(&f32_scale))),
            8,
        ),
        (
            WeightScale::Block {
                block_rows: 1,
                block_cols: 2,
                scales: B.upload(DType::BF16, &[2, 2], &bf16_bytes(&bf16_scale)).unwrap(),
            },
            Some(bf16_bytes(&twice(&bf16_scale))),
            8,
        ),
    ];
    for (scale, doubled, scale_bytes) in cases {
        let what = format!("{scale:?}");
        let mut w = small(scale);
        let stats = fp8::linear_to_fnuz(&mut w).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(stats, fp8::FnuzConversion { code_bytes: 6, scale_bytes }, "{what}");
        assert_eq!(w.weight.dtype(), DType::F8E4M3Fnuz, "{what}");
        assert_eq!(bytes(&w.weight), fnuz_codes, "{what}");
        match (&w.scale, doubled) {
            // The per-tensor values are checked below.
            (WeightScale::PerTensor(_), None) => {}
            (WeightScale::PerChannel(t) | WeightScale::Block { scales: t, .. }, Some(d)) => {
                assert_eq!(bytes(t), d, "{what}")
            }
            (s, d) => panic!("{what}: became {s:?}, expected {d:?}"),
        }
    }
    // No scale becomes 2; a per-tensor one is doubled.
    let mut w = small(WeightScale::None);
    fp8::linear_to_fnuz(&mut w).unwrap();
    assert!(matches!(w.scale, WeightScale::PerTensor(2.0)), "{:?}", w.scale);
    let mut w = small(WeightScale::PerTensor(-0.375));
    fp8::linear_to_fnuz(&mut w).unwrap();
    assert!(matches!(w.scale, WeightScale::PerTensor(-0.75)), "{:?}", w.scale);
}

#[test]
fn linear_to_fnuz_refuses_with_typed_errors() {
    use fp8::ConvertError;
    // An fn NaN code names its byte.
    let mut w = small(WeightScale::PerTensor(1.0));
    B.write(&mut w.weight, &[0x00, 0x01, 0x38, 0xb8, 0xff, 0x7f]).unwrap();
    assert_eq!(fp8::linear_to_fnuz(&mut w), Err(ConvertError::NanCode { offset: 4, code: 0xff }));
    // A scale that overflows when doubled names its element and dtype.
    let mut w = small(WeightScale::PerTensor(f32::MAX));
    assert_eq!(
        fp8::linear_to_fnuz(&mut w),
        Err(ConvertError::ScaleOverflow { index: 0, value: f32::MAX, dtype: DType::F32 })
    );
    let big = memwall_runtime::half::bf16::MAX.to_f32();
    let scale = B.upload(DType::BF16, &[2, 1], &bf16_bytes(&[1.0, big])).unwrap();
    let mut w = small(WeightScale::PerChannel(scale));
    assert_eq!(
        fp8::linear_to_fnuz(&mut w),
        Err(ConvertError::ScaleOverflow { index: 1, value: big, dtype: DType::BF16 })
    );
    // Only e4m3fn weights convert; nothing is written.
    let mut w = Linear::plain(B.upload(DType::F8E4M3Fnuz, &[1, 2], &[0x80, 0x01]).unwrap());
    assert_eq!(fp8::linear_to_fnuz(&mut w), Err(ConvertError::NotE4m3fn { dtype: DType::F8E4M3Fnuz }));
    assert_eq!(bytes(&w.weight), [0x80, 0x01]);
    assert!(matches!(w.scale, WeightScale::None));
    // A weight or scale in a read-only mapping is refused before anything is written.
    let path = std::env::temp_dir().join(format!("memwall-fnuz-{}.bin", std::process::id()));
    std::fs::write(&path, [0x80u8, 0x01, 0, 0, 0, 0, 0, 0, 0, 0, 0x80, 0x3f, 0, 0, 0x80, 0x3f]).unwrap();
    // SAFETY: the file is this test's own and is not written while mapped.
    let map =
        std::sync::Arc::new(unsafe { memmap2::Mmap::map(&std::fs::File::open(&path).unwrap()) }.unwrap());
    std::fs::remove_file(&path).unwrap();
    let mapped = |offset, dtype: DType, shape: &[usize]| {
        let len = shape.iter().product::<usize>() * dtype.size();
        let storage = HostStorage::mapped(map.clone(), offset, len, dtype.size()).unwrap();
        memwall_runtime::Tensor::new(storage, dtype, shape).unwrap()
    };
    let mut w = Linear::plain(mapped(0, DType::F8E4M3Fn, &[1, 2]));
    assert_eq!(fp8::linear_to_fnuz(&mut w), Err(ConvertError::ReadOnly { tensor: "weight" }));
    let weight = B.upload(DType::F8E4M3Fn, &[2, 1], &[0x80, 0x01]).unwrap();
    let mut w = Linear { weight, scale: WeightScale::PerChannel(mapped(8, DType::F32, &[2, 1])) };
    assert_eq!(fp8::linear_to_fnuz(&mut w), Err(ConvertError::ReadOnly { tensor: "scale" }));
    assert_eq!(bytes(&w.weight), [0x80, 0x01], "nothing written before the refusal");
    assert_eq!(w.weight.dtype(), DType::F8E4M3Fn);
}
