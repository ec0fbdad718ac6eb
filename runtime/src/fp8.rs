//! float8 codecs, written from the formats' definitions.
//!
//! A code is `S EEEE MMM` (e4m3) or `S EEEEE MM` (e5m2). A normal code means
//! `(-1)^S * 2^(E - bias) * (1 + M / 2^m)`, a subnormal (E = 0) `(-1)^S * 2^(1 - bias) * (M / 2^m)`.
//! The flavours differ in bias and in which codes are special:
//!
//! | format   | bias | specials                                   | max finite |
//! |----------|------|--------------------------------------------|------------|
//! | e4m3fn   | 7    | NaN = S.1111.111; no infinities; +0 and -0 | 448        |
//! | e4m3fnuz | 8    | NaN = 0x80; no infinities; one zero        | 240        |
//! | e5m2     | 15   | E = 11111: M = 0 is ±inf, else NaN; ±0     | 57344      |
//! | e5m2fnuz | 16   | NaN = 0x80; no infinities; one zero        | 57344      |
//!
//! Encoding rounds to nearest, ties to even, and saturates: a finite value beyond the largest
//! finite code becomes that code with its sign (±448, ±240, ±57344). ±inf becomes ±inf in e5m2 and
//! the saturated maximum in the formats without infinities. NaN becomes the format's NaN. In the
//! fnuz formats a value that rounds to zero is +0 (0x00) whatever its sign.
//!
//! The same byte means different numbers in e4m3fn and e4m3fnuz: an e4m3fn code read as e4m3fnuz
//! is worth half as much (bias 8 instead of 7), except 0x80 (-0 in fn, NaN in fnuz), and the fn NaN
//! codes S.1111.111 read as the fnuz finite values ±240. See [`e4m3fn_to_e4m3fnuz`].

use crate::{HostStorage, Linear, WeightScale};

/// The parameters of one fp8 flavour.
#[derive(Clone, Copy, Debug)]
struct Format {
    mant_bits: u32,
    bias: i32,
    kind: Kind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// OCP "fn": no infinities, NaN = all exponent and mantissa bits set, two zeros.
    Fn,
    /// "fnuz": no infinities, no negative zero, NaN = 0x80.
    Fnuz,
    /// IEEE-like: top exponent holds ±inf (M = 0) and NaN.
    Ieee,
}

const E4M3FN: Format = Format { mant_bits: 3, bias: 7, kind: Kind::Fn };
const E4M3FNUZ: Format = Format { mant_bits: 3, bias: 8, kind: Kind::Fnuz };
const E5M2: Format = Format { mant_bits: 2, bias: 15, kind: Kind::Ieee };
const E5M2FNUZ: Format = Format { mant_bits: 2, bias: 16, kind: Kind::Fnuz };

impl Format {
    const fn exp_bits(self) -> u32 {
        7 - self.mant_bits
    }
    const fn exp_max(self) -> u32 {
        (1 << self.exp_bits()) - 1
    }
    const fn mant_mask(self) -> u8 {
        (1 << self.mant_bits) - 1
    }

    /// The positive NaN code of the format.
    const fn nan_code(self) -> u8 {
        match self.kind {
            Kind::Fn => 0x7f,
            Kind::Fnuz => 0x80,
            // Quiet NaN: top exponent, top mantissa bit.
            Kind::Ieee => ((self.exp_max() as u8) << self.mant_bits) | (1 << (self.mant_bits - 1)),
        }
    }

    /// The largest finite code (positive).
    const fn max_code(self) -> u8 {
        match self.kind {
            // Top exponent with mantissa all ones is NaN, so the max has mantissa 110.
            Kind::Fn => 0x7e,
            Kind::Fnuz => 0x7f,
            // The top exponent is reserved; max is the exponent below it with full mantissa.
            Kind::Ieee => (((self.exp_max() - 1) as u8) << self.mant_bits) | self.mant_mask(),
        }
    }

    fn is_nan(self, code: u8) -> bool {
        match self.kind {
            Kind::Fn => code & 0x7f == 0x7f,
            Kind::Fnuz => code == 0x80,
            Kind::Ieee => {
                (code >> self.mant_bits) & self.exp_max() as u8 == self.exp_max() as u8
                    && code & self.mant_mask() != 0
            }
        }
    }

    fn decode(self, code: u8) -> f32 {
        if self.is_nan(code) {
            return f32::NAN;
        }
        let negative = code & 0x80 != 0;
        let e = ((code >> self.mant_bits) as u32) & self.exp_max();
        let m = (code & self.mant_mask()) as i32;
        let magnitude = if self.kind == Kind::Ieee && e == self.exp_max() {
            f64::INFINITY
        } else if e == 0 {
            // Subnormal: M / 2^m * 2^(1 - bias).
            m as f64 * pow2(1 - self.bias - self.mant_bits as i32)
        } else {
            ((1 << self.mant_bits) + m) as f64 * pow2(e as i32 - self.bias - self.mant_bits as i32)
        };
        // Every fp8 value is exactly representable in f32.
        let v = magnitude as f32;
        if negative { -v } else { v }
    }

    fn encode(self, v: f32) -> u8 {
        if v.is_nan() {
            return self.nan_code();
        }
        let sign: u8 = if v.is_sign_negative() { 0x80 } else { 0 };
        let a = (v as f64).abs();
        let max_code = self.max_code();
        if a.is_infinite() {
            return match self.kind {
                Kind::Ieee => sign | ((self.exp_max() as u8) << self.mant_bits),
                Kind::Fn | Kind::Fnuz => sign | max_code,
            };
        }
        let max = self.decode(max_code) as f64;
        // The spacing of representable values around `a`: 2^(1 - bias - m) below the smallest
        // normal, 2^(floor(log2 a) - m) above.
        let min_normal_exp = 1 - self.bias;
        let exp = if a == 0.0 { min_normal_exp } else { exponent_of(a).max(min_normal_exp) };
        let quantum = pow2(exp - self.mant_bits as i32);
        // `a / quantum` is exact (power-of-two divisor); round half to even.
        let q = round_half_even(a / quantum);
        let r = q * quantum;
        if r > max {
            return sign | max_code;
        }
        if r == 0.0 {
            return if self.kind == Kind::Fnuz { 0 } else { sign };
        }
        // `r` is representable: rebuild its code (rounding may have carried into the next binade).
        let r_exp = exponent_of(r);
        let code = if r_exp < min_normal_exp {
            (r / pow2(min_normal_exp - self.mant_bits as i32)) as u8
        } else {
            let e_field = (r_exp + self.bias) as u8;
            let m_field = (r / pow2(r_exp - self.mant_bits as i32)) as u32 - (1 << self.mant_bits);
            (e_field << self.mant_bits) | m_field as u8
        };
        sign | code
    }
}

fn pow2(e: i32) -> f64 {
    (e as f64).exp2()
}

/// floor(log2(a)) for a positive normal f64, read from its exponent field (exact).
fn exponent_of(a: f64) -> i32 {
    ((a.to_bits() >> 52) & 0x7ff) as i32 - 1023
}

fn round_half_even(x: f64) -> f64 {
    let r = x.round();
    if (r - x).abs() == 0.5 && r % 2.0 != 0.0 { r - x.signum() } else { r }
}

pub fn e4m3fn_to_f32(code: u8) -> f32 {
    E4M3FN.decode(code)
}
pub fn e4m3fnuz_to_f32(code: u8) -> f32 {
    E4M3FNUZ.decode(code)
}
pub fn e5m2_to_f32(code: u8) -> f32 {
    E5M2.decode(code)
}
pub fn e5m2fnuz_to_f32(code: u8) -> f32 {
    E5M2FNUZ.decode(code)
}
pub fn f32_to_e4m3fn(v: f32) -> u8 {
    E4M3FN.encode(v)
}
pub fn f32_to_e4m3fnuz(v: f32) -> u8 {
    E4M3FNUZ.encode(v)
}
pub fn f32_to_e5m2(v: f32) -> u8 {
    E5M2.encode(v)
}
pub fn f32_to_e5m2fnuz(v: f32) -> u8 {
    E5M2FNUZ.encode(v)
}

/// Reinterprets an e4m3fn code for a device that reads e4m3fnuz: returns the fnuz code whose
/// value is exactly half the fn value (so the tensor's scale must be doubled), with the fn zero
/// codes 0x00 and 0x80 both mapped to the fnuz zero 0x00. Returns `None` for the fn NaN codes,
/// which have no counterpart: a checkpoint holding them is corrupt.
pub fn e4m3fn_to_e4m3fnuz(code: u8) -> Option<u8> {
    if E4M3FN.is_nan(code) {
        None
    } else if code == 0x80 {
        Some(0)
    } else {
        Some(code)
    }
}

/// Why a buffer could not be converted for an e4m3fnuz device.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ConvertError {
    #[error("byte {offset} holds the e4m3fn NaN code {code:#04x}, which has no e4m3fnuz counterpart")]
    NanCode { offset: usize, code: u8 },
    #[error("scale element {index} = {value:e} overflows {dtype} when doubled")]
    ScaleOverflow { index: usize, value: f32, dtype: crate::DType },
    #[error("{len} bytes are not whole {dtype} scales (scales are f32 or bf16)")]
    ScaleBytes { len: usize, dtype: crate::DType },
    #[error("the weight is {dtype}, not e4m3fn: only e4m3fn weights are converted to e4m3fnuz")]
    NotE4m3fn { dtype: crate::DType },
    #[error("the {tensor} is a read-only mapping: convert an owned copy")]
    ReadOnly { tensor: &'static str },
}

/// Bytes per parallel task of the in-place conversions: large enough that rayon's per-task cost
/// vanishes, small enough that a multi-GB checkpoint spreads over every core.
const CHUNK: usize = 1 << 20;

/// Converts a buffer of e4m3fn codes to e4m3fnuz in place ([`e4m3fn_to_e4m3fnuz`] on each byte,
/// in parallel): each byte is then worth exactly half what it was, so the tensor's scale must be
/// doubled ([`double_scales_in_place`]). An fn NaN code is an error naming the first such byte;
/// the buffer is then partly converted and must be discarded.
pub fn e4m3fn_to_e4m3fnuz_in_place(codes: &mut [u8]) -> Result<(), ConvertError> {
    use rayon::prelude::*;
    let first_nan = codes
        .par_chunks_mut(CHUNK)
        .enumerate()
        .filter_map(|(c, chunk)| {
            let mut bad = None;
            for (i, b) in chunk.iter_mut().enumerate() {
                match e4m3fn_to_e4m3fnuz(*b) {
                    Some(v) => *b = v,
                    None => {
                        bad = Some((c * CHUNK + i, *b));
                        break;
                    }
                }
            }
            bad
        })
        .min();
    match first_nan {
        Some((offset, code)) => Err(ConvertError::NanCode { offset, code }),
        None => Ok(()),
    }
}

/// `2 * s`, exactly (a power-of-two factor only raises the exponent), or an error where a finite
/// `s` overflows to infinity. Non-finite values stay what they are.
pub fn double_scale(s: f32) -> Result<f32, ConvertError> {
    let d = 2.0 * s;
    if s.is_finite() && !d.is_finite() {
        return Err(ConvertError::ScaleOverflow { index: 0, value: s, dtype: crate::DType::F32 });
    }
    Ok(d)
}

/// Doubles the f32 or bf16 scales in `bytes` (little-endian) in place, exactly: the companion of
/// [`e4m3fn_to_e4m3fnuz_in_place`]. A finite value whose double overflows is an error naming the
/// first such element (the buffer is then partly doubled and must be discarded).
pub fn double_scales_in_place(dtype: crate::DType, bytes: &mut [u8]) -> Result<(), ConvertError> {
    use crate::DType;
    let size = match dtype {
        DType::F32 => 4,
        DType::BF16 => 2,
        _ => return Err(ConvertError::ScaleBytes { len: bytes.len(), dtype }),
    };
    if !bytes.len().is_multiple_of(size) {
        return Err(ConvertError::ScaleBytes { len: bytes.len(), dtype });
    }
    for (index, e) in bytes.chunks_exact_mut(size).enumerate() {
        let overflow = |value: f32| ConvertError::ScaleOverflow { index, value, dtype };
        if size == 4 {
            let s = f32::from_le_bytes([e[0], e[1], e[2], e[3]]);
            let d = double_scale(s).map_err(|_| overflow(s))?;
            e.copy_from_slice(&d.to_le_bytes());
        } else {
            // bf16 -> f32 is exact, the doubling is exact, and the double has bf16's 8 significant
            // bits, so the narrowing back is exact too (f32 and bf16 share their exponent range).
            let s = half::bf16::from_le_bytes([e[0], e[1]]).to_f32();
            let d = double_scale(s).map_err(|_| overflow(s))?;
            e.copy_from_slice(&half::bf16::from_f32(d).to_le_bytes());
        }
    }
    Ok(())
}

/// What [`linear_to_fnuz`] rewrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FnuzConversion {
    /// Bytes of e4m3fn codes converted: the weight's.
    pub code_bytes: usize,
    /// Bytes of scale tensor doubled: 0 for no scale or a per-tensor scale.
    pub scale_bytes: usize,
}

/// Converts an e4m3fn weight for a device whose fp8 hardware reads e4m3fnuz, in place: the codes
/// through [`e4m3fn_to_e4m3fnuz_in_place`] (each worth half as much afterwards; 0x80, fn's -0,
/// becomes 0x00) and the weight retagged `F8E4M3Fnuz`; the scale doubled to make up for it, exactly
/// (no scale becomes `PerTensor(2)`, a per-tensor scale `2 s`, per-channel and block scale tensors
/// [`double_scales_in_place`]). The real weights, and every product with them, stay what they were.
/// The model loader converts with this, and the tests of the conversion call it too.
///
/// A weight that is not e4m3fn, or a tensor in a read-only mapping, is refused before anything is
/// written. An fn NaN code (looked for first) or a scale that overflows when doubled is an error
/// after part of the buffers has been rewritten: the weight must then be discarded.
pub fn linear_to_fnuz(w: &mut Linear<HostStorage>) -> Result<FnuzConversion, ConvertError> {
    use crate::DType;
    if w.weight.dtype() != DType::F8E4M3Fn {
        return Err(ConvertError::NotE4m3fn { dtype: w.weight.dtype() });
    }
    let scale_tensor = match &mut w.scale {
        WeightScale::None | WeightScale::PerTensor(_) => None,
        WeightScale::PerChannel(t) | WeightScale::Block { scales: t, .. } => Some(t),
    };
    let read_only = |t: &crate::HostTensor| t.storage().is_read_only();
    if read_only(&w.weight) {
        return Err(ConvertError::ReadOnly { tensor: "weight" });
    }
    if scale_tensor.as_deref().is_some_and(read_only) {
        return Err(ConvertError::ReadOnly { tensor: "scale" });
    }
    let code_bytes = w.weight.nbytes();
    let codes = w.weight.storage_mut().bytes_mut().ok_or(ConvertError::ReadOnly { tensor: "weight" })?;
    e4m3fn_to_e4m3fnuz_in_place(&mut codes[..code_bytes])?;
    w.weight.set_dtype(DType::F8E4M3Fnuz);
    let mut scale_bytes = 0;
    if let Some(t) = scale_tensor {
        let (dtype, len) = (t.dtype(), t.nbytes());
        let bytes = t.storage_mut().bytes_mut().ok_or(ConvertError::ReadOnly { tensor: "scale" })?;
        double_scales_in_place(dtype, &mut bytes[..len])?;
        scale_bytes = len;
    }
    match &mut w.scale {
        WeightScale::None => w.scale = WeightScale::PerTensor(2.0),
        WeightScale::PerTensor(s) => *s = double_scale(*s)?,
        WeightScale::PerChannel(_) | WeightScale::Block { .. } => {}
    }
    Ok(FnuzConversion { code_bytes, scale_bytes })
}

/// Table of the 256 f32 values of an fp8 flavour, indexed by code.
pub fn decode_table(to_f32: fn(u8) -> f32) -> [f32; 256] {
    std::array::from_fn(|i| to_f32(i as u8))
}
