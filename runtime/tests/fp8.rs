//! Exhaustive tests of the float8 codecs (`fp8.rs`) and the `Float` impls of the fp8, bf16 and f16
//! element types, against tables built here from the formats' definitions.
//!
//! Nothing here reuses how `fp8.rs` computes: values are assembled from the bit fields with exact
//! powers of two built from f64 bit patterns, and the expected encoding of an f32 is found by a
//! brute-force search over every code, comparing distances exactly (through midpoints, which are
//! exact in f64) and breaking ties towards the code with an even mantissa.

use half::{bf16, f16};
use memwall_runtime::dtype::{decode_f32, encode_f32};
use memwall_runtime::{DType, F8E4M3Fn, F8E4M3Fnuz, F8E5M2, F8E5M2Fnuz, Float, fp8};

// ---------------------------------------------------------------------------------------------
// The formats, from their definitions

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Specials {
    /// OCP "fn": S.1111.111 is NaN, no infinities, +0 and -0.
    Fn,
    /// "fnuz": 0x80 is the only NaN, no infinities, one zero (0x00).
    Fnuz,
    /// IEEE-like: exponent all ones with mantissa 0 is ±inf, with mantissa != 0 NaN; ±0.
    Ieee,
}

#[derive(Clone, Copy, Debug)]
struct Def {
    name: &'static str,
    dtype: DType,
    exp_bits: u32,
    mant_bits: u32,
    bias: i32,
    specials: Specials,
    /// The largest finite value, as the formats' documents state it.
    max: f32,
    /// The smallest positive (subnormal) value, 2^(1 - bias - mant_bits).
    min_subnormal: f32,
    /// How many of the 256 codes are NaN.
    nan_count: usize,
    decode: fn(u8) -> f32,
    encode: fn(f32) -> u8,
    float_decode: fn(u8) -> f32,
    float_encode: fn(f32) -> u8,
}

const E4M3FN: Def = Def {
    name: "e4m3fn",
    dtype: DType::F8E4M3Fn,
    exp_bits: 4,
    mant_bits: 3,
    bias: 7,
    specials: Specials::Fn,
    max: 448.0,
    min_subnormal: 1.0 / 512.0,
    nan_count: 2,
    decode: fp8::e4m3fn_to_f32,
    encode: fp8::f32_to_e4m3fn,
    float_decode: |c| F8E4M3Fn(c).to_f32(),
    float_encode: |v| F8E4M3Fn::from_f32(v).0,
};

const E4M3FNUZ: Def = Def {
    name: "e4m3fnuz",
    dtype: DType::F8E4M3Fnuz,
    exp_bits: 4,
    mant_bits: 3,
    bias: 8,
    specials: Specials::Fnuz,
    max: 240.0,
    min_subnormal: 1.0 / 1024.0,
    nan_count: 1,
    decode: fp8::e4m3fnuz_to_f32,
    encode: fp8::f32_to_e4m3fnuz,
    float_decode: |c| F8E4M3Fnuz(c).to_f32(),
    float_encode: |v| F8E4M3Fnuz::from_f32(v).0,
};

const E5M2: Def = Def {
    name: "e5m2",
    dtype: DType::F8E5M2,
    exp_bits: 5,
    mant_bits: 2,
    bias: 15,
    specials: Specials::Ieee,
    max: 57344.0,
    min_subnormal: 1.0 / 65536.0,
    // Exponent 11111 with mantissa 01, 10, 11, for both signs.
    nan_count: 6,
    decode: fp8::e5m2_to_f32,
    encode: fp8::f32_to_e5m2,
    float_decode: |c| F8E5M2(c).to_f32(),
    float_encode: |v| F8E5M2::from_f32(v).0,
};

const E5M2FNUZ: Def = Def {
    name: "e5m2fnuz",
    dtype: DType::F8E5M2Fnuz,
    exp_bits: 5,
    mant_bits: 2,
    bias: 16,
    specials: Specials::Fnuz,
    max: 57344.0,
    min_subnormal: 1.0 / 131072.0,
    nan_count: 1,
    decode: fp8::e5m2fnuz_to_f32,
    encode: fp8::f32_to_e5m2fnuz,
    float_decode: |c| F8E5M2Fnuz(c).to_f32(),
    float_encode: |v| F8E5M2Fnuz::from_f32(v).0,
};

const FORMATS: [Def; 4] = [E4M3FN, E4M3FNUZ, E5M2, E5M2FNUZ];

/// 2^e exactly, built from the f64 bit pattern (|e| well inside the normal range here).
fn pow2(e: i32) -> f64 {
    assert!((-1022..=1023).contains(&e));
    f64::from_bits(((e + 1023) as u64) << 52)
}

/// What one code means.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Meaning {
    Nan,
    /// A finite value or ±inf, exact in f64 (and in f32).
    Value(f64),
}

impl Def {
    fn fields(&self, code: u8) -> (bool, u32, u32) {
        let sign = code & 0x80 != 0;
        let exp = (code as u32 >> self.mant_bits) & ((1 << self.exp_bits) - 1);
        let mant = code as u32 & ((1 << self.mant_bits) - 1);
        (sign, exp, mant)
    }

    /// The meaning of `code`, from the definition.
    fn meaning(&self, code: u8) -> Meaning {
        let (sign, exp, mant) = self.fields(code);
        let exp_all_ones = exp == (1 << self.exp_bits) - 1;
        let mant_all_ones = mant == (1 << self.mant_bits) - 1;
        match self.specials {
            Specials::Fn if exp_all_ones && mant_all_ones => return Meaning::Nan,
            Specials::Fnuz if code == 0x80 => return Meaning::Nan,
            Specials::Ieee if exp_all_ones && mant != 0 => return Meaning::Nan,
            Specials::Ieee if exp_all_ones => {
                return Meaning::Value(if sign { f64::NEG_INFINITY } else { f64::INFINITY });
            }
            _ => {}
        }
        let m = self.mant_bits as i32;
        let magnitude = if exp == 0 {
            // Subnormal: 0.M x 2^(1 - bias).
            mant as f64 * pow2(1 - self.bias - m)
        } else {
            // Normal: 1.M x 2^(E - bias).
            ((1u32 << self.mant_bits) + mant) as f64 * pow2(exp as i32 - self.bias - m)
        };
        Meaning::Value(if sign { -magnitude } else { magnitude })
    }

    fn is_nan_code(&self, code: u8) -> bool {
        self.meaning(code) == Meaning::Nan
    }

    /// The non-negative finite magnitudes: codes 0x00..=0x7f that are neither NaN nor inf, with
    /// their values (ascending, since the code order is the value order for positive codes).
    fn positive_finite(&self) -> Vec<(u8, f64)> {
        (0u8..=0x7f)
            .filter_map(|c| match self.meaning(c) {
                Meaning::Value(v) if v.is_finite() => Some((c, v)),
                _ => None,
            })
            .collect()
    }

    /// The expected code for `v` under round-to-nearest-even with saturation, by brute force.
    /// `None` means "any NaN code".
    fn expected_encode(&self, v: f32) -> Option<u8> {
        if v.is_nan() {
            return None;
        }
        let neg = v.is_sign_negative();
        let sign = if neg { 0x80 } else { 0 };
        if v.is_infinite() {
            return Some(match self.specials {
                // e5m2 keeps its infinities: exponent all ones, mantissa 0.
                Specials::Ieee => sign | (((1u8 << self.exp_bits) - 1) << self.mant_bits),
                // The formats without infinities saturate.
                Specials::Fn | Specials::Fnuz => {
                    let mag = self.positive_finite().last().expect("a finite code").0;
                    sign | mag
                }
            });
        }
        let a = (v as f64).abs();
        // Brute force over every non-negative finite code: `c` beats `best` when it is strictly
        // nearer, or as near with an even mantissa. For b != c, |a - c| < |a - b| is exactly
        // "a lies on c's side of the midpoint (b + c) / 2", and that midpoint is exact in f64
        // (two fp8 values span under 40 bits), so no distance is ever rounded.
        let mut best: Option<(u8, f64)> = None;
        for (c, cv) in self.positive_finite() {
            best = Some(match best {
                None => (c, cv),
                Some((b, bv)) => {
                    let mid = (bv + cv) / 2.0;
                    let nearer = if cv > bv { a > mid } else { a < mid };
                    let tie = a == mid;
                    let c_even = self.fields(c).2.is_multiple_of(2);
                    if nearer || (tie && c_even) { (c, cv) } else { (b, bv) }
                }
            });
        }
        let (mag, _) = best.expect("a finite code");
        if mag == 0 && self.specials == Specials::Fnuz {
            // One zero: whatever the sign, a value that rounds to zero is 0x00.
            return Some(0);
        }
        Some(sign | mag)
    }

    /// Checks every encoder against the brute-force expectation for `v`.
    fn check_encode(&self, v: f32, what: &str) {
        let want = self.expected_encode(v);
        for (path, enc) in [("fp8", self.encode), ("Float", self.float_encode)] {
            let got = enc(v);
            match want {
                None => assert!(
                    self.is_nan_code(got),
                    "{} {path} encode of NaN {v:?} ({what}) gave the non-NaN code 0x{got:02x}",
                    self.name
                ),
                Some(w) => assert_eq!(
                    got,
                    w,
                    "{} {path} encode of {v:e} (bits 0x{:08x}, {what}): got 0x{got:02x} = {:?}, want \
                     0x{w:02x} = {:?}",
                    self.name,
                    v.to_bits(),
                    self.meaning(got),
                    self.meaning(w)
                ),
            }
        }
    }
}

/// splitmix64: a small seeded generator so every run checks the same values.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [lo, hi).
    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next_u64() >> 11) as f64 * pow2(-53))
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding

#[test]
fn definition_tables_have_the_documented_landmarks() {
    // Guards the tables themselves, so a slip here cannot make both sides agree on nonsense.
    for f in FORMATS {
        let nans = (0..=255u8).filter(|&c| f.is_nan_code(c)).count();
        assert_eq!(nans, f.nan_count, "{}: NaN codes", f.name);
        let pos = f.positive_finite();
        assert_eq!(pos.last().map(|p| p.1), Some(f.max as f64), "{}: max finite", f.name);
        assert_eq!(pos[1].1, f.min_subnormal as f64, "{}: min subnormal", f.name);
        assert_eq!(f.dtype.max_finite(), Some(f.max), "{}: DType::max_finite", f.name);
        // Ascending and distinct.
        assert!(pos.windows(2).all(|w| w[0].1 < w[1].1), "{}: positive codes ascend", f.name);
        let zeros = (0..=255u8).filter(|&c| f.meaning(c) == Meaning::Value(0.0)).count();
        let want_zeros = if f.specials == Specials::Fnuz { 1 } else { 2 };
        assert_eq!(zeros, want_zeros, "{}: zero codes", f.name);
        let infs =
            (0..=255u8).filter(|&c| matches!(f.meaning(c), Meaning::Value(v) if v.is_infinite())).count();
        assert_eq!(infs, if f.specials == Specials::Ieee { 2 } else { 0 }, "{}: infinities", f.name);
    }
    // A few codes by hand.
    assert_eq!(E4M3FN.meaning(0x7e), Meaning::Value(448.0));
    assert_eq!(E4M3FN.meaning(0x7f), Meaning::Nan);
    assert_eq!(E4M3FN.meaning(0xff), Meaning::Nan);
    assert_eq!(E4M3FN.meaning(0x38), Meaning::Value(1.0));
    assert_eq!(E4M3FN.meaning(0x01), Meaning::Value(1.0 / 512.0));
    assert_eq!(E4M3FN.meaning(0x08), Meaning::Value(1.0 / 64.0));
    assert_eq!(E4M3FNUZ.meaning(0x7f), Meaning::Value(240.0));
    assert_eq!(E4M3FNUZ.meaning(0x40), Meaning::Value(1.0));
    assert_eq!(E4M3FNUZ.meaning(0xff), Meaning::Value(-240.0));
    assert_eq!(E5M2.meaning(0x7c), Meaning::Value(f64::INFINITY));
    assert_eq!(E5M2.meaning(0xfc), Meaning::Value(f64::NEG_INFINITY));
    assert_eq!(E5M2.meaning(0x7b), Meaning::Value(57344.0));
    assert_eq!(E5M2.meaning(0x3c), Meaning::Value(1.0));
    assert_eq!(E5M2FNUZ.meaning(0x7f), Meaning::Value(57344.0));
    assert_eq!(E5M2FNUZ.meaning(0x40), Meaning::Value(1.0));
}

#[test]
fn decode_matches_definition_for_all_256_codes() {
    for f in FORMATS {
        let bytes: Vec<u8> = (0..=255u8).collect();
        let bulk = decode_f32(f.dtype, &bytes).expect("fp8 is a float type");
        for code in 0..=255u8 {
            let want = f.meaning(code);
            let got = [
                ("fp8", (f.decode)(code)),
                ("Float", (f.float_decode)(code)),
                ("decode_f32", bulk[code as usize]),
            ];
            for (path, g) in got {
                match want {
                    Meaning::Nan => {
                        assert!(g.is_nan(), "{} {path}: code 0x{code:02x} must be NaN, got {g:?}", f.name)
                    }
                    // Bit equality: tells +0 from -0.
                    Meaning::Value(v) => assert_eq!(
                        g.to_bits(),
                        (v as f32).to_bits(),
                        "{} {path}: code 0x{code:02x} decodes to {g:e}, want {v:e}",
                        f.name
                    ),
                }
            }
        }
    }
}

#[test]
fn fp8_debug_names_code_and_value() {
    assert_eq!(format!("{:?}", F8E4M3Fn(0x38)), "F8E4M3Fn(0x38 = 1)");
}

// ---------------------------------------------------------------------------------------------
// Encoding

#[test]
fn encode_of_decode_is_identity_for_every_non_nan_code() {
    for f in FORMATS {
        for code in 0..=255u8 {
            if let Meaning::Value(v) = f.meaning(code) {
                let v = v as f32;
                assert_eq!(
                    (f.encode)(v),
                    code,
                    "{}: fp8 encode(decode(0x{code:02x})) = encode({v:e})",
                    f.name
                );
                assert_eq!((f.float_encode)(v), code, "{}: Float round trip of 0x{code:02x}", f.name);
            }
        }
        // The zero rules: -0.0 is 0x80 in fn and e5m2, 0x00 (the only zero) in fnuz.
        let neg_zero = if f.specials == Specials::Fnuz { 0x00 } else { 0x80 };
        assert_eq!((f.encode)(-0.0), neg_zero, "{}: encode(-0.0)", f.name);
        assert_eq!((f.encode)(0.0), 0x00, "{}: encode(+0.0)", f.name);
        // And in bulk through `encode_f32`.
        let values: Vec<f32> = (0..=255u8)
            .filter_map(|c| match f.meaning(c) {
                Meaning::Value(v) => Some(v as f32),
                Meaning::Nan => None,
            })
            .collect();
        let codes: Vec<u8> = (0..=255u8).filter(|&c| !f.is_nan_code(c)).collect();
        assert_eq!(
            encode_f32(f.dtype, &values).expect("fp8 is a float type"),
            codes,
            "{}: encode_f32",
            f.name
        );
    }
}

/// Every midpoint between neighbouring values (zero and the smallest subnormal, across binades,
/// the top value and the next value the format would have), and the f32 values just below and
/// just above each, with both signs.
fn midpoint_cases(f: &Def) -> Vec<f32> {
    let pos = f.positive_finite();
    let mut mids: Vec<f64> = pos.windows(2).map(|w| (w[0].1 + w[1].1) / 2.0).collect();
    // Beyond the top: the midpoint to the next value of the same spacing, and farther.
    let n = pos.len();
    let step = pos[n - 1].1 - pos[n - 2].1;
    mids.push(pos[n - 1].1 + step / 2.0);
    mids.push(pos[n - 1].1 + step);
    mids.push(pos[n - 1].1 * 2.0);
    let mut out = Vec::new();
    for m in mids {
        let exact = m;
        let m = m as f32;
        assert_eq!(m as f64, exact, "midpoints are exact in f32");
        for v in [m, m.next_up(), m.next_down()] {
            out.push(v);
            out.push(-v);
        }
    }
    out
}

#[test]
fn encode_rounds_midpoints_to_even_and_neighbours_to_nearest() {
    for f in FORMATS {
        for v in midpoint_cases(&f) {
            f.check_encode(v, "midpoint or its neighbour");
        }
    }
}

#[test]
fn encode_of_every_value_and_its_f32_neighbours() {
    for f in FORMATS {
        for (_, v) in f.positive_finite() {
            let v = v as f32;
            for w in [v, v.next_up(), v.next_down()] {
                f.check_encode(w, "value or its neighbour");
                f.check_encode(-w, "value or its neighbour");
            }
        }
    }
}

#[test]
fn encode_hand_cases() {
    // Ties to even, by hand: 1 + 1/16 lies halfway between 1.0 (0x38, mantissa 000) and 1.125
    // (0x39, mantissa 001) in e4m3fn.
    assert_eq!(fp8::f32_to_e4m3fn(1.0625), 0x38);
    // 1.1875 lies halfway between 1.125 (001) and 1.25 (0x3a, 010): to 010.
    assert_eq!(fp8::f32_to_e4m3fn(1.1875), 0x3a);
    // Saturation on the way in.
    assert_eq!(fp8::f32_to_e4m3fn(1e6), 0x7e);
    assert_eq!(fp8::f32_to_e4m3fn(-1e6), 0xfe);
    assert_eq!(fp8::f32_to_e4m3fn(464.0), 0x7e);
    assert_eq!(fp8::f32_to_e4m3fnuz(1e6), 0x7f);
    assert_eq!(fp8::f32_to_e4m3fnuz(-1e6), 0xff);
    assert_eq!(fp8::f32_to_e5m2(1e6), 0x7b);
    assert_eq!(fp8::f32_to_e5m2(-1e6), 0xfb);
    assert_eq!(fp8::f32_to_e5m2fnuz(1e6), 0x7f);
    assert_eq!(fp8::f32_to_e5m2fnuz(-1e6), 0xff);
    // Infinities.
    assert_eq!(fp8::f32_to_e5m2(f32::INFINITY), 0x7c);
    assert_eq!(fp8::f32_to_e5m2(f32::NEG_INFINITY), 0xfc);
    assert_eq!(fp8::f32_to_e4m3fn(f32::INFINITY), 0x7e);
    assert_eq!(fp8::f32_to_e4m3fn(f32::NEG_INFINITY), 0xfe);
    assert_eq!(fp8::f32_to_e4m3fnuz(f32::NEG_INFINITY), 0xff);
    assert_eq!(fp8::f32_to_e5m2fnuz(f32::INFINITY), 0x7f);
    // NaN to the format's NaN.
    assert_eq!(fp8::f32_to_e4m3fnuz(f32::NAN), 0x80);
    assert_eq!(fp8::f32_to_e5m2fnuz(-f32::NAN), 0x80);
    assert!(E4M3FN.is_nan_code(fp8::f32_to_e4m3fn(f32::NAN)));
    assert!(E5M2.is_nan_code(fp8::f32_to_e5m2(f32::NAN)));
    // Tiny negatives round to the one zero of fnuz, to -0 elsewhere.
    assert_eq!(fp8::f32_to_e4m3fnuz(-1e-30), 0x00);
    assert_eq!(fp8::f32_to_e5m2fnuz(-1e-30), 0x00);
    assert_eq!(fp8::f32_to_e4m3fnuz(-f32::from_bits(1)), 0x00);
    assert_eq!(fp8::f32_to_e4m3fn(-1e-30), 0x80);
    assert_eq!(fp8::f32_to_e5m2(-1e-30), 0x80);
    // Half the smallest subnormal is a tie between 0 and it: to 0 (even).
    assert_eq!(fp8::f32_to_e4m3fn(1.0 / 1024.0), 0x00);
    assert_eq!(fp8::f32_to_e4m3fnuz(-1.0 / 2048.0), 0x00);
    // Just above it rounds up to the smallest subnormal.
    assert_eq!(fp8::f32_to_e4m3fn((1.0f32 / 1024.0).next_up()), 0x01);
    // Three halves of the smallest subnormal: between 1 (odd) and 2 (even) units: to 2.
    assert_eq!(fp8::f32_to_e4m3fn(3.0 / 1024.0), 0x02);
}

#[test]
fn encode_of_special_and_extreme_f32() {
    let mut cases = vec![
        0.0f32,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001), // signalling NaN
        f32::from_bits(0xffc1_2345), // negative NaN with payload
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE,
        -f32::MIN_POSITIVE,
        f32::from_bits(1), // smallest subnormal
        -f32::from_bits(1),
        f32::EPSILON,
    ];
    for f in FORMATS {
        cases.extend([f.max, -f.max, f.max.next_up(), -f.max.next_up(), f.max * 1.5, -f.max * 1.5]);
        let s = f.min_subnormal;
        cases.extend([s / 2.0, -s / 2.0, (s / 2.0).next_up(), -(s / 2.0).next_down(), s / 4.0, -s / 4.0]);
    }
    for f in FORMATS {
        for &v in &cases {
            f.check_encode(v, "special or extreme");
        }
    }
}

#[test]
fn encode_matches_brute_force_on_random_values() {
    let mut rng = Rng(0x6d65_6d77_616c_6c38);
    for f in FORMATS {
        let max = f.max as f64;
        let min_normal = f.min_subnormal as f64 * (1u64 << f.mant_bits) as f64;
        for i in 0..60_000 {
            let v = match i % 4 {
                // Over the whole range and twice beyond it (saturation).
                0 => rng.uniform(-2.0 * max, 2.0 * max) as f32,
                // Log-uniform magnitudes, so every binade gets as many cases.
                1 => {
                    let lo = (f.min_subnormal as f64 / 4.0).log2();
                    let hi = (4.0 * max).log2();
                    let mag = rng.uniform(lo, hi).exp2() as f32;
                    if rng.next_u64() & 1 == 0 { mag } else { -mag }
                }
                // The subnormal range and just above it.
                2 => rng.uniform(-2.0 * min_normal, 2.0 * min_normal) as f32,
                // Any f32 bit pattern at all (NaNs, infinities, f32 subnormals included).
                _ => f32::from_bits(rng.next_u64() as u32),
            };
            f.check_encode(v, "random");
        }
    }
}

#[test]
fn encode_matches_brute_force_on_a_strided_sweep_of_all_f32() {
    // Every 65521st bit pattern (a prime stride, so all low bits vary): ~65k values over every
    // exponent and sign.
    for f in FORMATS {
        let mut bits = 0u32;
        loop {
            f.check_encode(f32::from_bits(bits), "strided sweep");
            match bits.checked_add(65_521) {
                Some(b) => bits = b,
                None => break,
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// e4m3fn read as e4m3fnuz

#[test]
fn e4m3fn_to_e4m3fnuz_halves_every_value() {
    for code in 0..=255u8 {
        let got = fp8::e4m3fn_to_e4m3fnuz(code);
        match E4M3FN.meaning(code) {
            Meaning::Nan => assert_eq!(got, None, "fn NaN code 0x{code:02x} has no fnuz counterpart"),
            Meaning::Value(v) => {
                let fnuz = got.unwrap_or_else(|| panic!("fn code 0x{code:02x} = {v} must convert"));
                if code == 0x80 {
                    assert_eq!(fnuz, 0x00, "fn -0 (0x80) is the fnuz zero, not the fnuz NaN");
                }
                match E4M3FNUZ.meaning(fnuz) {
                    Meaning::Nan => panic!("fn code 0x{code:02x} = {v} became the fnuz NaN"),
                    Meaning::Value(h) => assert_eq!(
                        h * 2.0,
                        v,
                        "fn 0x{code:02x} = {v} -> fnuz 0x{fnuz:02x} = {h}: the fnuz value must be half"
                    ),
                }
            }
        }
    }
}

#[test]
fn in_place_conversion_of_all_256_codes_halves_through_the_codecs() {
    // Every non-NaN code in one buffer: decoded by the library's codecs, fnuz after is half of fn
    // before, exactly (the sign of zero aside: fnuz has one zero).
    let codes: Vec<u8> = (0..=255u8).filter(|&c| !fp8::e4m3fn_to_f32(c).is_nan()).collect();
    assert_eq!(codes.len(), 254, "e4m3fn has exactly two NaN codes, 0x7f and 0xff");
    let mut conv = codes.clone();
    fp8::e4m3fn_to_e4m3fnuz_in_place(&mut conv).expect("no NaN code");
    for (&c, &u) in codes.iter().zip(&conv) {
        let (v, h) = (fp8::e4m3fn_to_f32(c), fp8::e4m3fnuz_to_f32(u));
        assert!(!h.is_nan(), "fn 0x{c:02x} became the fnuz NaN 0x{u:02x}");
        assert_eq!(h * 2.0, v, "fn 0x{c:02x} = {v} -> fnuz 0x{u:02x} = {h}");
        assert_eq!(u, fp8::e4m3fn_to_e4m3fnuz(c).unwrap(), "in place = per code");
    }
    // Each NaN code, alone or after valid codes, is an error naming its byte.
    for nan in [0x7fu8, 0xff] {
        let mut one = [nan];
        assert_eq!(
            fp8::e4m3fn_to_e4m3fnuz_in_place(&mut one),
            Err(fp8::ConvertError::NanCode { offset: 0, code: nan })
        );
    }
}

#[test]
fn in_place_conversion_reports_the_first_nan_across_parallel_chunks() {
    // 3.5 MiB: several of the conversion's 1 MiB parallel chunks. NaNs in the third and second
    // chunks; the first in memory order is reported whichever task finds its NaN first.
    let len = 3 * (1 << 20) + (1 << 19);
    let mut codes: Vec<u8> = (0..len).map(|i| ((i * 37 + 11) % 256) as u8 & 0x7e).collect();
    let (a, b) = ((1 << 20) + 12_345, 2 * (1 << 20) + 7);
    codes[b] = 0x7f;
    codes[a] = 0xff;
    let err = fp8::e4m3fn_to_e4m3fnuz_in_place(&mut codes.clone());
    assert_eq!(err, Err(fp8::ConvertError::NanCode { offset: a, code: 0xff }));
    // Without the NaNs, every byte converts like the per-code function.
    codes[a] = 0x12;
    codes[b] = 0x92;
    let mut conv = codes.clone();
    fp8::e4m3fn_to_e4m3fnuz_in_place(&mut conv).expect("no NaN code");
    assert!(codes.iter().zip(&conv).all(|(&c, &u)| fp8::e4m3fn_to_e4m3fnuz(c) == Some(u)));
    assert!(fp8::e4m3fn_to_e4m3fnuz_in_place(&mut []).is_ok());
}

#[test]
fn doubling_scales_is_exact_and_overflow_is_an_error() {
    // f32: every value (normals, subnormals, tiny and large) doubles exactly: 2s / 2 == s.
    let f32s = [1.0f32, 3.0e-3, 1.0 / 448.0, f32::MIN_POSITIVE, f32::from_bits(1), 1.5e38, 0.1];
    let mut bytes: Vec<u8> = f32s.iter().flat_map(|v| v.to_le_bytes()).collect();
    fp8::double_scales_in_place(DType::F32, &mut bytes).expect("no overflow");
    for (v, d) in f32s.iter().zip(bytes.chunks_exact(4)) {
        let d = f32::from_le_bytes([d[0], d[1], d[2], d[3]]);
        assert_eq!(d.to_bits(), (v * 2.0).to_bits());
        assert_eq!(d / 2.0, *v, "{v:e}: doubling must be exact");
        assert_eq!(fp8::double_scale(*v), Ok(d));
    }
    // bf16: every finite positive code below the top binade doubles to the code one exponent up
    // (exponent field + 1, same mantissa); the top binade overflows.
    for bits in 0x0001u16..0x7f80 {
        let mut b = bits.to_le_bytes();
        let r = fp8::double_scales_in_place(DType::BF16, &mut b);
        let v = bf16::from_bits(bits).to_f32();
        if bits >= 0x7f00 {
            assert_eq!(r, Err(fp8::ConvertError::ScaleOverflow { index: 0, value: v, dtype: DType::BF16 }));
            continue;
        }
        r.unwrap_or_else(|e| panic!("bf16 {bits:#06x}: {e}"));
        let got = bf16::from_le_bytes(b).to_f32();
        assert_eq!(got, 2.0 * v, "bf16 {bits:#06x} = {v:e}");
        if bits >= 0x0080 {
            assert_eq!(u16::from_le_bytes(b), bits + 0x0080, "a normal bf16 doubles by exponent + 1");
        }
    }
    // The first element that overflows is named.
    let mut big: Vec<u8> = [1.0f32, 2.0, f32::MAX, f32::MAX].iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(
        fp8::double_scales_in_place(DType::F32, &mut big),
        Err(fp8::ConvertError::ScaleOverflow { index: 2, value: f32::MAX, dtype: DType::F32 })
    );
    assert!(fp8::double_scale(f32::MAX).is_err());
    // Only f32 and bf16 scales, in whole elements.
    assert!(matches!(
        fp8::double_scales_in_place(DType::F16, &mut [0, 0]),
        Err(fp8::ConvertError::ScaleBytes { .. })
    ));
    assert!(matches!(
        fp8::double_scales_in_place(DType::F32, &mut [0, 0, 0]),
        Err(fp8::ConvertError::ScaleBytes { .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// bf16 and f16

/// f16 value of `bits` from the definition: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
fn f16_meaning(bits: u16) -> Meaning {
    let sign = bits & 0x8000 != 0;
    let exp = ((bits >> 10) & 0x1f) as i32;
    let mant = (bits & 0x3ff) as f64;
    let mag = match exp {
        0x1f if mant != 0.0 => return Meaning::Nan,
        0x1f => f64::INFINITY,
        0 => mant * pow2(-24),
        e => (1024.0 + mant) * pow2(e - 25),
    };
    Meaning::Value(if sign { -mag } else { mag })
}

#[test]
fn f16_decode_matches_definition_and_round_trips() {
    for bits in 0..=u16::MAX {
        let h = f16::from_bits(bits);
        let got = <f16 as Float>::to_f32(h);
        match f16_meaning(bits) {
            Meaning::Nan => {
                assert!(got.is_nan(), "f16 0x{bits:04x} must be NaN");
                assert!(<f16 as Float>::from_f32(got).is_nan(), "f16 NaN stays NaN");
            }
            Meaning::Value(v) => {
                assert_eq!(got.to_bits(), (v as f32).to_bits(), "f16 0x{bits:04x} decodes to {v}");
                assert_eq!(<f16 as Float>::from_f32(got).to_bits(), bits, "f16 0x{bits:04x} round trip");
            }
        }
    }
}

#[test]
fn bf16_decode_is_the_top_half_of_f32_and_round_trips() {
    for bits in 0..=u16::MAX {
        let b = bf16::from_bits(bits);
        let got = <bf16 as Float>::to_f32(b);
        let want = f32::from_bits((bits as u32) << 16);
        if want.is_nan() {
            assert!(got.is_nan(), "bf16 0x{bits:04x} must be NaN");
            assert!(<bf16 as Float>::from_f32(got).is_nan(), "bf16 NaN stays NaN");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "bf16 0x{bits:04x}");
            assert_eq!(<bf16 as Float>::from_f32(got).to_bits(), bits, "bf16 0x{bits:04x} round trip");
        }
    }
}

/// For every pair of neighbouring finite positive values of a 16-bit type (bits `b`, `b + 1`),
/// the midpoint must round to the even one and its f32 neighbours to the nearer one.
fn check_16bit_midpoints(name: &str, to: fn(u16) -> f32, from: fn(f32) -> u16, max_bits: u16) {
    for b in 0..max_bits {
        let (lo, hi) = (to(b) as f64, to(b + 1) as f64);
        let mid = ((lo + hi) / 2.0) as f32;
        assert_eq!(mid as f64, (lo + hi) / 2.0, "{name}: midpoint exact in f32");
        let even = if b.is_multiple_of(2) { b } else { b + 1 };
        assert_eq!(from(mid), even, "{name}: midpoint of 0x{b:04x} and its successor ties to even");
        assert_eq!(from(mid.next_down()), b, "{name}: just below the midpoint above 0x{b:04x}");
        assert_eq!(from(mid.next_up()), b + 1, "{name}: just above the midpoint above 0x{b:04x}");
        assert_eq!(from(-mid), even | 0x8000, "{name}: negative midpoint above 0x{b:04x}");
    }
}

#[test]
fn f16_and_bf16_round_to_nearest_even() {
    let f16_to = |b: u16| <f16 as Float>::to_f32(f16::from_bits(b));
    let f16_from = |v: f32| <f16 as Float>::from_f32(v).to_bits();
    let bf16_to = |b: u16| <bf16 as Float>::to_f32(bf16::from_bits(b));
    let bf16_from = |v: f32| <bf16 as Float>::from_f32(v).to_bits();
    // 0x7bff is the largest finite f16, 0x7f7f the largest finite bf16.
    check_16bit_midpoints("f16", f16_to, f16_from, 0x7bff);
    check_16bit_midpoints("bf16", bf16_to, bf16_from, 0x7f7f);

    // Hand cases. bf16 has 8 significand bits: 1 + 2^-8 is halfway between 1 and 1 + 2^-7.
    assert_eq!(bf16_from(1.0 + 1.0 / 256.0), 0x3f80);
    assert_eq!(bf16_from(1.0 + 3.0 / 256.0), 0x3f82);
    assert_eq!(bf16_from((1.0f32 + 1.0 / 256.0).next_up()), 0x3f81);
    assert_eq!(bf16_from(-1.5), 0xbfc0);
    // Above the top midpoint RNE overflows to infinity (no saturation for bf16 / f16).
    assert_eq!(bf16_from(f32::MAX), 0x7f80);
    // f16 has 11: 1 + 2^-11 ties to 1, 1 + 3 * 2^-11 to 1 + 2^-9.
    assert_eq!(f16_from(1.0 + 1.0 / 2048.0), 0x3c00);
    assert_eq!(f16_from(1.0 + 3.0 / 2048.0), 0x3c02);
    assert_eq!(f16_from(65504.0), 0x7bff);
    assert_eq!(f16_from(65519.0), 0x7bff);
    assert_eq!(f16_from(65520.0), 0x7c00);
    // Smallest f16 subnormal 2^-24; half of it ties to 0.
    assert_eq!(f16_from(2f32.powi(-24)), 0x0001);
    assert_eq!(f16_from(2f32.powi(-25)), 0x0000);
    assert_eq!(f16_from(2f32.powi(-25).next_up()), 0x0001);
}
