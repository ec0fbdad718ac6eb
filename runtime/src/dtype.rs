//! Element types: the `DType` tag carried by every tensor, and the Rust element types behind it.
//!
//! Float types widen to f32 exactly (every bf16, f16 and fp8 value is an f32 value) and narrow
//! from f32 with round-to-nearest-even. The fp8 flavours are distinct types because the same byte
//! means different numbers in each (see `fp8.rs`).

use std::fmt;

use bytemuck::{Pod, Zeroable};
use half::{bf16, f16};

use crate::fp8;

/// The element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// OCP float8 E4M3 "fn": bias 7, no infinities, NaN = S.1111.111, max 448.
    F8E4M3Fn,
    /// AMD/graphcore E4M3 "fnuz": bias 8, no infinities, no negative zero, NaN = 0x80, max 240.
    F8E4M3Fnuz,
    /// OCP float8 E5M2: bias 15, IEEE-like (infinities and NaNs), max 57344.
    F8E5M2,
    /// E5M2 "fnuz": bias 16, no infinities, no negative zero, NaN = 0x80, max 57344.
    F8E5M2Fnuz,
    /// Token ids, positions, slots, expert ids.
    U32,
}

impl DType {
    pub const ALL: [DType; 8] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F8E4M3Fn,
        DType::F8E4M3Fnuz,
        DType::F8E5M2,
        DType::F8E5M2Fnuz,
        DType::U32,
    ];
    /// Every float type, in the order tests enumerate them.
    pub const FLOATS: [DType; 7] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F8E4M3Fn,
        DType::F8E4M3Fnuz,
        DType::F8E5M2,
        DType::F8E5M2Fnuz,
    ];
    /// Types an activation tensor (the `x` and `y` of a linear layer) may have.
    pub const ACTIVATIONS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F8E4M3Fn | DType::F8E4M3Fnuz | DType::F8E5M2 | DType::F8E5M2Fnuz => 1,
        }
    }

    /// The name used in kernel symbols and on the command line (`bf16`, `e4m3fn`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F8E4M3Fn => "e4m3fn",
            DType::F8E4M3Fnuz => "e4m3fnuz",
            DType::F8E5M2 => "e5m2",
            DType::F8E5M2Fnuz => "e5m2fnuz",
            DType::U32 => "u32",
        }
    }

    /// The dtype string of the safetensors format, where it has one.
    pub const fn safetensors_name(self) -> Option<&'static str> {
        match self {
            DType::F32 => Some("F32"),
            DType::F16 => Some("F16"),
            DType::BF16 => Some("BF16"),
            DType::F8E4M3Fn => Some("F8_E4M3"),
            DType::F8E5M2 => Some("F8_E5M2"),
            DType::U32 => Some("U32"),
            DType::F8E4M3Fnuz | DType::F8E5M2Fnuz => None,
        }
    }

    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == name)
    }

    pub const fn is_float(self) -> bool {
        !matches!(self, DType::U32)
    }

    pub const fn is_fp8(self) -> bool {
        self.size() == 1
    }

    /// Largest finite value, for float types.
    pub fn max_finite(self) -> Option<f32> {
        match self {
            DType::F32 => Some(f32::MAX),
            DType::F16 => Some(f16::MAX.to_f32()),
            DType::BF16 => Some(bf16::MAX.to_f32()),
            DType::F8E4M3Fn => Some(448.0),
            DType::F8E4M3Fnuz => Some(240.0),
            DType::F8E5M2 | DType::F8E5M2Fnuz => Some(57344.0),
            DType::U32 => None,
        }
    }

    /// Unit roundoff of the type (half an ulp at 1.0, relative): the bound on the relative error
    /// of one rounding to nearest, used to derive test tolerances.
    pub fn unit_roundoff(self) -> Option<f64> {
        // A type with p significand bits (hidden bit included) rounds with relative error <= 2^-p.
        let p = match self {
            DType::F32 => 24,
            DType::F16 => 11,
            DType::BF16 => 8,
            DType::F8E4M3Fn | DType::F8E4M3Fnuz => 4,
            DType::F8E5M2 | DType::F8E5M2Fnuz => 3,
            DType::U32 => return None,
        };
        Some((-(p as f64)).exp2())
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A float element type stored in tensors. `to_f32` is exact; `from_f32` rounds to nearest even
/// and, for the fp8 types, saturates to the largest finite value (NaN stays NaN).
pub trait Float: Pod + Copy + Send + Sync + PartialEq + fmt::Debug + 'static {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self.to_f32() as f64
    }
}

impl Float for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Float for f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl Float for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        // Exact: a bf16 is the top half of an f32.
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

macro_rules! fp8_type {
    ($(#[$doc:meta])* $name:ident, $dtype:expr, $to:path, $from:path) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Default, Pod, Zeroable)]
        #[repr(transparent)]
        pub struct $name(pub u8);

        impl Float for $name {
            const DTYPE: DType = $dtype;
            #[inline(always)]
            fn to_f32(self) -> f32 {
                $to(self.0)
            }
            #[inline(always)]
            fn from_f32(v: f32) -> Self {
                $name($from(v))
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}(0x{:02x} = {})", stringify!($name), self.0, self.to_f32())
            }
        }
    };
}

fp8_type!(
    /// float8 e4m3fn, the OCP format NVIDIA Hopper accelerates.
    F8E4M3Fn,
    DType::F8E4M3Fn,
    fp8::e4m3fn_to_f32,
    fp8::f32_to_e4m3fn
);
fp8_type!(
    /// float8 e4m3fnuz, the format AMD MI300 accelerates.
    F8E4M3Fnuz,
    DType::F8E4M3Fnuz,
    fp8::e4m3fnuz_to_f32,
    fp8::f32_to_e4m3fnuz
);
fp8_type!(
    /// float8 e5m2 (OCP).
    F8E5M2,
    DType::F8E5M2,
    fp8::e5m2_to_f32,
    fp8::f32_to_e5m2
);
fp8_type!(
    /// float8 e5m2fnuz.
    F8E5M2Fnuz,
    DType::F8E5M2Fnuz,
    fp8::e5m2fnuz_to_f32,
    fp8::f32_to_e5m2fnuz
);

/// Runs `$body` with `$T` bound to the Rust element type of the float dtype `$dtype`.
/// Evaluates `$other` for `U32`.
#[macro_export]
macro_rules! with_float_type {
    ($dtype:expr, $T:ident => $body:expr, else => $other:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F16 => {
                type $T = $crate::half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $T = $crate::half::bf16;
                $body
            }
            $crate::DType::F8E4M3Fn => {
                type $T = $crate::F8E4M3Fn;
                $body
            }
            $crate::DType::F8E4M3Fnuz => {
                type $T = $crate::F8E4M3Fnuz;
                $body
            }
            $crate::DType::F8E5M2 => {
                type $T = $crate::F8E5M2;
                $body
            }
            $crate::DType::F8E5M2Fnuz => {
                type $T = $crate::F8E5M2Fnuz;
                $body
            }
            $crate::DType::U32 => $other,
        }
    };
}

/// Converts f32 values to the bytes of `dtype` (rounding to nearest even, fp8 saturating).
pub fn encode_f32(dtype: DType, values: &[f32]) -> Option<Vec<u8>> {
    with_float_type!(dtype, T => {
        let v: Vec<T> = values.iter().map(|&x| T::from_f32(x)).collect();
        Some(bytemuck::cast_slice(&v).to_vec())
    }, else => None)
}

/// Widens the bytes of a float `dtype` to f32 (exact). `None` for `U32` or a ragged length.
pub fn decode_f32(dtype: DType, bytes: &[u8]) -> Option<Vec<f32>> {
    if !bytes.len().is_multiple_of(dtype.size()) {
        return None;
    }
    with_float_type!(dtype, T => {
        // Copy through a Vec<T> so unaligned input is fine.
        let mut v = vec![T::zeroed(); bytes.len() / dtype.size()];
        bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(bytes);
        Some(v.into_iter().map(T::to_f32).collect())
    }, else => None)
}
