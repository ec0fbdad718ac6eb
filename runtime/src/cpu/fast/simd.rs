//! SIMD building blocks of the fast CPU backend.
//!
//! Two traits keep the kernels generic and the instruction sets apart:
//! - [`Vector`]: an f32 vector of `LANES` lanes and the few operations the kernels use (load,
//!   store, fused multiply-add, horizontal sum). Implemented by [`Avx512`] (16 lanes),
//!   [`Avx2`] (8 lanes, with FMA and F16C) and [`Portable`] (8 lanes of plain Rust, correct on
//!   every target).
//! - [`Elem`]: a stored float type; `Vector::load_elem` loads `LANES` of them and widens them to
//!   f32 in registers. The value loaded is the stored value divided by `Elem::POST`, a power of
//!   two the caller multiplies back after its reduction (exact: scaling by a power of two only moves the
//!   exponent). This lets the fp8 formats widen through f16 bit patterns:
//!   - bf16: the top half of an f32 (shift left 16).
//!   - f16: `vcvtph2ps`.
//!   - e5m2: the top byte of an f16 with the same bias, infinities and NaNs (shift left 8).
//!   - e4m3fn / e4m3fnuz: `S EEEE MMM` placed as `S 0EEEE MMM0000000`, an f16 whose value is the
//!     fp8 value times 2^-8 (fn, bias 7) or 2^-7 (fnuz, bias 8), subnormals included.
//!   - e5m2fnuz: `S EEEEE MM` placed as the f32 `S 000EEEEE MM0...`, times 2^111 in the loop (its
//!     exponent range does not fit f16; the product is exact).
//!
//!   These three have NaN codes (S.1111.111, resp. 0x80) that the vector loads widen to finite
//!   values (±1.875 * 2^-8, resp. -0): patching them per element cost a quarter of the fp8 loop.
//!   Instead `Elem::NAN_CODES` is set and a caller that reduces rows scans each row's codes once
//!   with `Elem::any_nan` (a byte fold the compiler vectorises) and makes that row's result NaN,
//!   which is what a NaN weight does to a dot product.
//!
//! fp8 weights have a second widening on CPUs with AVX-512 VBMI (Ice Lake, Sapphire Rapids,
//! Zen 4 and later): [`Fp8Bytes`] holds each format as two 128-byte tables and
//! [`Vbmi::widen64`] turns 64 codes into four f32 vectors, exactly, in a column order callers
//! match by permuting x ([`x64_column`]). It is its own level, `avx512vbmi`, so tests and benches
//! can hold it against `avx512` on the same CPU.
//!
//! The x86 token types can only be made after runtime feature detection, so their methods may
//! call the intrinsics: a token's existence proves the CPU has the features. A kernel is a
//! [`Kernel`] whose `#[inline(always)] run::<V>` is generic over the vector type; [`Simd::run`]
//! calls it inside a `#[target_feature]` wrapper, where LLVM inlines the intrinsics and emits the
//! wide instructions.
//!
//! `Elem::widen` is the exact per-element widening used by tails and elementwise ops; the fp8
//! formats widen through 256-entry tables built at compile time from the formats' definitions.

use half::{bf16, f16};

use crate::{F8E4M3Fn, F8E4M3Fnuz, F8E5M2, F8E5M2Fnuz, Float};

/// Largest `LANES` of any [`Vector`]; sizes the padded tail buffers.
pub(crate) const MAX_LANES: usize = 16;

// ---------------------------------------------------------------------------------------------
// Instruction set selection and dispatch

/// An instruction set the fast backend has kernels for, with the token that proves the CPU has
/// it. Made only by [`Simd::detect`] / [`Simd::from_name`], which check the CPU.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Simd {
    /// [`Simd::Avx512`] plus AVX-512 VBMI: the same vector kernels, except that the linear
    /// layers widen fp8 weights 64 at a time through byte tables ([`Vbmi::widen64`]).
    #[cfg(target_arch = "x86_64")]
    Avx512Vbmi(Avx512, Vbmi),
    /// AVX-512 F/BW/VL with AVX2, FMA and F16C: 16 f32 lanes.
    #[cfg(target_arch = "x86_64")]
    Avx512(Avx512),
    /// AVX2 with FMA and F16C: 8 f32 lanes.
    #[cfg(target_arch = "x86_64")]
    Avx2(Avx2),
    /// Plain Rust over 8-lane arrays; whatever the compiler vectorises for the base target.
    Portable,
}

/// Names of the instruction sets, best first.
pub(crate) const SIMD_NAMES: [&str; 4] = ["avx512vbmi", "avx512", "avx2", "portable"];

impl Simd {
    pub(crate) fn name(self) -> &'static str {
        match self {
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512Vbmi(..) => "avx512vbmi",
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512(_) => "avx512",
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2(_) => "avx2",
            Simd::Portable => "portable",
        }
    }

    /// The named instruction set, if this CPU has it.
    pub(crate) fn from_name(name: &str) -> Option<Simd> {
        match name {
            #[cfg(target_arch = "x86_64")]
            "avx512vbmi" => Vbmi::detect().map(|(v, b)| Simd::Avx512Vbmi(v, b)),
            #[cfg(target_arch = "x86_64")]
            "avx512" => Avx512::detect().map(Simd::Avx512),
            #[cfg(target_arch = "x86_64")]
            "avx2" => Avx2::detect().map(Simd::Avx2),
            "portable" => Some(Simd::Portable),
            _ => None,
        }
    }

    /// Every instruction set this CPU has, best first.
    pub(crate) fn available() -> Vec<Simd> {
        SIMD_NAMES.iter().filter_map(|n| Simd::from_name(n)).collect()
    }

    /// The best instruction set this CPU has.
    pub(crate) fn detect() -> Simd {
        SIMD_NAMES.iter().find_map(|n| Simd::from_name(n)).unwrap_or(Simd::Portable)
    }

    /// f32 lanes of a vector.
    pub(crate) fn lanes(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512Vbmi(..) | Simd::Avx512(_) => 16,
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2(_) => 8,
            Simd::Portable => 8,
        }
    }

    /// Runs `k` compiled for this instruction set.
    #[inline]
    pub(crate) fn run<K: Kernel>(self, k: K) -> K::Output {
        match self {
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512Vbmi(v, _) => {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
                fn go<K: Kernel>(v: Avx512, k: K) -> K::Output {
                    k.run(v)
                }
                // SAFETY: the `Avx512` and `Vbmi` tokens exist only if the CPU has every enabled
                // feature.
                unsafe { go(v, k) }
            }
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512(v) => {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
                fn go<K: Kernel>(v: Avx512, k: K) -> K::Output {
                    k.run(v)
                }
                // SAFETY: the `Avx512` token exists only if the CPU has every enabled feature.
                unsafe { go(v, k) }
            }
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2(v) => {
                #[target_feature(enable = "avx2,fma,f16c")]
                fn go<K: Kernel>(v: Avx2, k: K) -> K::Output {
                    k.run(v)
                }
                // SAFETY: the `Avx2` token exists only if the CPU has every enabled feature.
                unsafe { go(v, k) }
            }
            Simd::Portable => k.run(Portable),
        }
    }

    /// The tokens of [`Simd::Avx512Vbmi`], for [`run_vbmi`]; `None` at the other levels.
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn vbmi(self) -> Option<(Avx512, Vbmi)> {
        match self {
            Simd::Avx512Vbmi(v, b) => Some((v, b)),
            _ => None,
        }
    }
}

/// Runs `k` compiled for AVX-512 with VBMI (the tokens prove the CPU has them).
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn run_vbmi<K: VbmiKernel>(v: Avx512, b: Vbmi, k: K) -> K::Output {
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
    fn go<K: VbmiKernel>(v: Avx512, b: Vbmi, k: K) -> K::Output {
        k.run(v, b)
    }
    // SAFETY: the `Avx512` and `Vbmi` tokens exist only if the CPU has every enabled feature.
    unsafe { go(v, b, k) }
}

/// A kernel generic over the vector type, run through [`Simd::run`]. `run` must be
/// `#[inline(always)]` so it is compiled inside the level's `#[target_feature]` wrapper.
pub(crate) trait Kernel {
    type Output;
    fn run<V: Vector>(self, v: V) -> Self::Output;
}

/// A kernel for AVX-512 with VBMI, run through [`run_vbmi`]; `run` must be
/// `#[inline(always)]`, as [`Kernel::run`].
#[cfg(target_arch = "x86_64")]
pub(crate) trait VbmiKernel {
    type Output;
    fn run(self, v: Avx512, b: Vbmi) -> Self::Output;
}

// ---------------------------------------------------------------------------------------------
// Traits

/// An f32 vector of `LANES` lanes. Methods take the (zero-sized) token by value.
pub(crate) trait Vector: Copy + Send + Sync + 'static {
    const LANES: usize;
    type F: Copy;

    fn zero(self) -> Self::F;
    fn splat(self, v: f32) -> Self::F;
    /// # Safety
    /// `p .. p + LANES` must be readable f32s.
    unsafe fn load(self, p: *const f32) -> Self::F;
    /// `LANES` stored elements widened to f32, divided by `W::POST`.
    /// # Safety
    /// `p .. p + LANES` must be readable elements.
    unsafe fn load_elem<W: Elem>(self, p: *const W) -> Self::F;
    /// # Safety
    /// `p .. p + LANES` must be writable f32s.
    unsafe fn store(self, p: *mut f32, v: Self::F);
    /// `a * b + c`, fused where the ISA has it.
    fn fma(self, a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    fn mul(self, a: Self::F, b: Self::F) -> Self::F;
    /// Sum of the lanes.
    fn hsum(self, a: Self::F) -> f32;
    /// The sums of the lanes of four vectors: a transposing reduction where the ISA has one
    /// (each sum is still a sum of all its vector's lanes, in another order).
    #[inline(always)]
    fn hsum4(self, a: [Self::F; 4]) -> [f32; 4] {
        [self.hsum(a[0]), self.hsum(a[1]), self.hsum(a[2]), self.hsum(a[3])]
    }
}

/// A stored float type: exact scalar widening, and the vector loads of each instruction set.
pub(crate) trait Elem: Float {
    /// A vector load gives the stored value divided by `POST` (a power of two, so exact; 1 for
    /// f32, bf16, f16 and e5m2). Callers multiply it back after their reduction.
    const POST: f32;
    /// The true value.
    fn widen(self) -> f32;
    /// The value divided by `POST` (exact).
    #[inline(always)]
    fn widen_raw(self) -> f32 {
        self.widen() * (1.0 / Self::POST)
    }
    /// Whether the vector loads may widen NaN codes to finite values; then callers must check
    /// [`Elem::any_nan`].
    const NAN_CODES: bool = false;
    /// Whether `codes` holds a NaN code (always false for types without `NAN_CODES`).
    #[inline(always)]
    fn any_nan(codes: &[Self]) -> bool {
        let _ = codes;
        false
    }
    /// The byte tables of an fp8 format, for [`Vbmi::widen64`]; `None` for the other types.
    const BYTES: Option<&'static Fp8Bytes> = None;
    /// 16 elements, divided by `POST`.
    /// # Safety
    /// `p .. p + 16` must be readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load_avx512(v: Avx512, p: *const Self) -> std::arch::x86_64::__m512;
    /// 8 elements, divided by `POST`.
    /// # Safety
    /// `p .. p + 8` must be readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load_avx2(v: Avx2, p: *const Self) -> std::arch::x86_64::__m256;
}

// ---------------------------------------------------------------------------------------------
// fp8 tables (f32 bit patterns), computed at compile time from the formats' definitions

#[derive(Clone, Copy)]
enum Fp8Kind {
    /// NaN = S.1111.111, no infinities.
    Fn,
    /// NaN = 0x80, no infinities, no negative zero.
    Fnuz,
    /// Top exponent: infinity (M = 0) or NaN.
    Ieee,
}

const F32_QNAN: u32 = 0x7fc0_0000;

const fn fp8_bits(code: u8, mant_bits: u32, bias: i32, kind: Fp8Kind) -> u32 {
    let c = code as u32;
    let sign = (c & 0x80) << 24;
    let exp_max = (1u32 << (7 - mant_bits)) - 1;
    let e = (c >> mant_bits) & exp_max;
    let m = c & ((1 << mant_bits) - 1);
    match kind {
        Fp8Kind::Fn if c & 0x7f == 0x7f => return F32_QNAN,
        Fp8Kind::Fnuz if c == 0x80 => return F32_QNAN,
        Fp8Kind::Ieee if e == exp_max => return if m == 0 { sign | 0x7f80_0000 } else { F32_QNAN },
        _ => {}
    }
    if e == 0 {
        if m == 0 {
            return sign;
        }
        // Subnormal: (m / 2^mant_bits) * 2^(1 - bias); normalise the significand.
        let mut mm = m;
        let mut ex = 1 - bias;
        while mm & (1 << mant_bits) == 0 {
            mm <<= 1;
            ex -= 1;
        }
        sign | (((ex + 127) as u32) << 23) | ((mm & ((1 << mant_bits) - 1)) << (23 - mant_bits))
    } else {
        sign | (((e as i32 - bias + 127) as u32) << 23) | (m << (23 - mant_bits))
    }
}

const fn fp8_table(mant_bits: u32, bias: i32, kind: Fp8Kind) -> [u32; 256] {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = fp8_bits(i as u8, mant_bits, bias, kind);
        i += 1;
    }
    t
}

static E4M3FN_BITS: [u32; 256] = fp8_table(3, 7, Fp8Kind::Fn);
static E4M3FNUZ_BITS: [u32; 256] = fp8_table(3, 8, Fp8Kind::Fnuz);
static E5M2_BITS: [u32; 256] = fp8_table(2, 15, Fp8Kind::Ieee);
static E5M2FNUZ_BITS: [u32; 256] = fp8_table(2, 16, Fp8Kind::Fnuz);

/// An fp8 format as two byte tables over the seven magnitude bits of a code. Every fp8 value is
/// an f32 whose low 16 bits are zero, so code `c`'s f32 is, from the top byte down,
/// `hi[c & 0x7f] | (c & 0x80)` (the sign and the top seven exponent bits), `lo[c & 0x7f]` (the
/// last exponent bit and the top seven mantissa bits), and two zero bytes. `vpermi2b` looks up
/// 64 codes in a 128-byte table in one instruction and ignores each index's top bit, which is
/// exactly the sign.
pub(crate) struct Fp8Bytes {
    pub(crate) hi: [u8; 128],
    pub(crate) lo: [u8; 128],
    /// Whether a code with the sign bit set can be NaN while its magnitude code is not (the fnuz
    /// formats' 0x80, widened to -0 by the tables): then callers must check [`Elem::any_nan`].
    /// For the other formats a negative code is exactly the negated magnitude, NaN included.
    pub(crate) nan_lost: bool,
}

const fn fp8_bytes(bits: [u32; 256]) -> Fp8Bytes {
    let mut b = Fp8Bytes { hi: [0; 128], lo: [0; 128], nan_lost: false };
    let mut c = 0;
    while c < 128 {
        let (pos, neg) = (bits[c], bits[c + 128]);
        assert!(pos & 0x8000_ffff == 0, "an fp8 value is a positive f32 with 16 zero low bits");
        b.hi[c] = (pos >> 24) as u8;
        b.lo[c] = (pos >> 16) as u8;
        let neg_nan = neg & 0x7fff_ffff > 0x7f80_0000;
        let pos_nan = pos > 0x7f80_0000;
        if neg != pos | 0x8000_0000 && !(neg_nan && pos_nan) {
            assert!(neg_nan, "only a NaN code may differ from its negated magnitude");
            b.nan_lost = true;
        }
        c += 1;
    }
    b
}

const E4M3FN_BYTES: Fp8Bytes = fp8_bytes(fp8_table(3, 7, Fp8Kind::Fn));
const E4M3FNUZ_BYTES: Fp8Bytes = fp8_bytes(fp8_table(3, 8, Fp8Kind::Fnuz));
const E5M2_BYTES: Fp8Bytes = fp8_bytes(fp8_table(2, 15, Fp8Kind::Ieee));
const E5M2FNUZ_BYTES: Fp8Bytes = fp8_bytes(fp8_table(2, 16, Fp8Kind::Fnuz));

// ---------------------------------------------------------------------------------------------
// Element types

macro_rules! elem_loads {
    ($t:ty) => {
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn load_avx512(v: Avx512, p: *const $t) -> std::arch::x86_64::__m512 {
            // SAFETY: forwarded contract: 16 readable elements at `p`.
            unsafe { x86::Load::<$t>::avx512(v, p) }
        }
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn load_avx2(v: Avx2, p: *const $t) -> std::arch::x86_64::__m256 {
            // SAFETY: forwarded contract: 8 readable elements at `p`.
            unsafe { x86::Load::<$t>::avx2(v, p) }
        }
    };
}

impl Elem for f32 {
    const POST: f32 = 1.0;
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
    elem_loads!(f32);
}

impl Elem for bf16 {
    const POST: f32 = 1.0;
    #[inline(always)]
    fn widen(self) -> f32 {
        // Exact: a bf16 is the top half of an f32.
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    elem_loads!(bf16);
}

impl Elem for f16 {
    const POST: f32 = 1.0;
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
    elem_loads!(f16);
}

macro_rules! fp8_elem {
    ($t:ty, $table:ident, $bytes:ident, $post:expr $(, nan: |$c:ident| $fold:expr)?) => {
        impl Elem for $t {
            const POST: f32 = $post;
            const BYTES: Option<&'static Fp8Bytes> = Some(&$bytes);
            #[inline(always)]
            fn widen(self) -> f32 {
                f32::from_bits($table[self.0 as usize])
            }
            $(
            const NAN_CODES: bool = true;
            #[inline(always)]
            fn any_nan(codes: &[Self]) -> bool {
                // A branch-free fold (no early exit), so it vectorises to byte ops.
                codes.iter().fold(0u8, |acc, code| {
                    let $c = code.0;
                    acc | $fold
                }) != 0
            }
            )?
            elem_loads!($t);
        }
    };
}
// NaN = S.1111.111: the low seven bits all set.
fp8_elem!(F8E4M3Fn, E4M3FN_BITS, E4M3FN_BYTES, 256.0, nan: |c| ((c & 0x7f) == 0x7f) as u8);
// NaN = 0x80 (the code negative zero would have).
fp8_elem!(F8E4M3Fnuz, E4M3FNUZ_BITS, E4M3FNUZ_BYTES, 128.0, nan: |c| (c == 0x80) as u8);
// Widened exactly, NaN and infinities included (the top byte of an f16).
fp8_elem!(F8E5M2, E5M2_BITS, E5M2_BYTES, 1.0);
fp8_elem!(F8E5M2Fnuz, E5M2FNUZ_BITS, E5M2FNUZ_BYTES, 1.0, nan: |c| (c == 0x80) as u8);

// ---------------------------------------------------------------------------------------------
// Portable

/// Plain Rust over 8-lane arrays.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Portable;

impl Vector for Portable {
    const LANES: usize = 8;
    type F = [f32; 8];

    #[inline(always)]
    fn zero(self) -> [f32; 8] {
        [0.0; 8]
    }
    #[inline(always)]
    fn splat(self, v: f32) -> [f32; 8] {
        [v; 8]
    }
    #[inline(always)]
    unsafe fn load(self, p: *const f32) -> [f32; 8] {
        // SAFETY: the caller guarantees 8 readable f32s at `p`; unaligned reads are allowed.
        unsafe { p.cast::<[f32; 8]>().read_unaligned() }
    }
    #[inline(always)]
    unsafe fn load_elem<W: Elem>(self, p: *const W) -> [f32; 8] {
        // SAFETY: the caller guarantees 8 readable elements at `p`.
        let a = unsafe { p.cast::<[W; 8]>().read_unaligned() };
        a.map(W::widen_raw)
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32, v: [f32; 8]) {
        // SAFETY: the caller guarantees 8 writable f32s at `p`.
        unsafe { p.cast::<[f32; 8]>().write_unaligned(v) }
    }
    #[inline(always)]
    fn fma(self, a: [f32; 8], b: [f32; 8], c: [f32; 8]) -> [f32; 8] {
        // Not fused: `mul_add` without hardware FMA is a slow library call.
        std::array::from_fn(|i| a[i] * b[i] + c[i])
    }
    #[inline(always)]
    fn mul(self, a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|i| a[i] * b[i])
    }
    #[inline(always)]
    fn hsum(self, a: [f32; 8]) -> f32 {
        ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))
    }
}

// ---------------------------------------------------------------------------------------------
// x86-64

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{Avx2, Avx512, Fp8Regs, Vbmi};

/// The x column (within a block of 64) that lane `i % 16` of vector `i / 16` of
/// [`Vbmi::widen64`] holds: the unpacks interleave bytes within 128-bit lanes and each 32-bit
/// lane holds two words, the odd column in its top half. Callers permute x the same way once, so
/// the weights never move.
#[cfg(target_arch = "x86_64")]
pub(crate) const fn x64_column(i: usize) -> usize {
    let (v, t) = (i / 16, i % 16);
    let (lane, pair) = (t / 4, t % 4);
    // Vectors 0 and 1: the unpack of bytes 0..8 of each 128-bit lane; 2 and 3: bytes 8..16.
    // Vectors 0 and 2: the top word of each pair (odd column); 1 and 3: the bottom word.
    16 * lane + 8 * (v / 2) + 2 * pair + (1 - v % 2)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::marker::PhantomData;

    use half::{bf16, f16};

    use super::{Elem, Fp8Bytes, Vector};
    use crate::{F8E4M3Fn, F8E4M3Fnuz, F8E5M2, F8E5M2Fnuz};

    /// AVX-512 F/BW/VL + AVX2 + FMA + F16C. Only made by [`Avx512::detect`].
    #[derive(Clone, Copy, Debug)]
    pub(crate) struct Avx512(());

    /// AVX2 + FMA + F16C. Only made by [`Avx2::detect`].
    #[derive(Clone, Copy, Debug)]
    pub(crate) struct Avx2(());

    /// AVX-512 VBMI (`vpermi2b`), on a CPU that also has everything [`Avx512`] needs. Only made
    /// by [`Vbmi::detect`].
    #[derive(Clone, Copy, Debug)]
    pub(crate) struct Vbmi(());

    impl Vbmi {
        pub(crate) fn detect() -> Option<(Avx512, Vbmi)> {
            let v = Avx512::detect()?;
            is_x86_feature_detected!("avx512vbmi").then_some((v, Vbmi(())))
        }
    }

    /// An fp8 format's byte tables and masks, in registers for [`Vbmi::widen64`].
    #[derive(Clone, Copy)]
    pub(crate) struct Fp8Regs {
        hi: [__m512i; 2],
        lo: [__m512i; 2],
    }

    impl Vbmi {
        #[inline(always)]
        pub(crate) fn regs(self, t: &Fp8Bytes) -> Fp8Regs {
            // SAFETY: the token proves AVX-512F; each table is 128 bytes, read as two 64-byte
            // halves. (No closure: it would not be compiled with the caller's features.)
            unsafe {
                let (hi, lo) = (t.hi.as_ptr(), t.lo.as_ptr());
                Fp8Regs {
                    hi: [_mm512_loadu_si512(hi.cast()), _mm512_loadu_si512(hi.add(64).cast())],
                    lo: [_mm512_loadu_si512(lo.cast()), _mm512_loadu_si512(lo.add(64).cast())],
                }
            }
        }

        /// The 64 fp8 codes at `p`, exactly, as four vectors of 16 f32; lane `i % 16` of
        /// vector `i / 16` holds column [`super::x64_column`]`(i)` (NaN codes as
        /// [`Fp8Bytes::nan_lost`] says). Two table lookups give each code's top two bytes, the sign
        /// is or-ed in, the byte unpacks pair them into words, and a mask and a shift make each
        /// 32-bit lane's two words two f32: 9 instructions for 64 codes, no conversions.
        ///
        /// # Safety
        /// `p .. p + 64` must be readable.
        #[inline(always)]
        pub(crate) unsafe fn widen64(self, r: &Fp8Regs, p: *const u8) -> [__m512; 4] {
            // SAFETY: the token proves AVX-512F/BW/VBMI; the caller guarantees 64 readable bytes.
            unsafe {
                let c = _mm512_loadu_si512(p.cast());
                let hi = _mm512_permutex2var_epi8(r.hi[0], c, r.hi[1]);
                // hi | (c & 0x80): ternary-logic truth table A | (B & C).
                let hi = _mm512_ternarylogic_epi32::<0xf8>(hi, c, _mm512_set1_epi8(0x80u8 as i8));
                let lo = _mm512_permutex2var_epi8(r.lo[0], c, r.lo[1]);
                let w0 = _mm512_unpacklo_epi8(lo, hi);
                let w1 = _mm512_unpackhi_epi8(lo, hi);
                let top = _mm512_set1_epi32(0xffff_0000u32 as i32);
                [
                    _mm512_castsi512_ps(_mm512_and_si512(w0, top)),
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w0)),
                    _mm512_castsi512_ps(_mm512_and_si512(w1, top)),
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w1)),
                ]
            }
        }
    }

    impl Avx512 {
        pub(crate) fn detect() -> Option<Avx512> {
            let ok = is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            ok.then_some(Avx512(()))
        }
    }

    impl Avx2 {
        pub(crate) fn detect() -> Option<Avx2> {
            let ok = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            ok.then_some(Avx2(()))
        }
    }

    // The `unsafe` blocks below that only call register intrinsics share one justification:
    // the token (`Avx512` / `Avx2`) exists only after `detect` saw the features at run time.

    impl Vector for Avx512 {
        const LANES: usize = 16;
        type F = __m512;

        #[inline(always)]
        fn zero(self) -> __m512 {
            // SAFETY: the token proves AVX-512F.
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        fn splat(self, v: f32) -> __m512 {
            // SAFETY: the token proves AVX-512F.
            unsafe { _mm512_set1_ps(v) }
        }
        #[inline(always)]
        unsafe fn load(self, p: *const f32) -> __m512 {
            // SAFETY: the token proves AVX-512F; the caller guarantees 16 readable f32s at `p`.
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn load_elem<W: Elem>(self, p: *const W) -> __m512 {
            // SAFETY: forwarded contract: 16 readable elements at `p`.
            unsafe { W::load_avx512(self, p) }
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32, v: __m512) {
            // SAFETY: the token proves AVX-512F; the caller guarantees 16 writable f32s at `p`.
            unsafe { _mm512_storeu_ps(p, v) }
        }
        #[inline(always)]
        fn fma(self, a: __m512, b: __m512, c: __m512) -> __m512 {
            // SAFETY: the token proves AVX-512F.
            unsafe { _mm512_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        fn mul(self, a: __m512, b: __m512) -> __m512 {
            // SAFETY: the token proves AVX-512F.
            unsafe { _mm512_mul_ps(a, b) }
        }
        #[inline(always)]
        fn hsum(self, a: __m512) -> f32 {
            // SAFETY: the token proves AVX-512F.
            unsafe { _mm512_reduce_add_ps(a) }
        }
        /// 128-bit quarters of pairs added (each of a0, a1 to 2 quarters, then each of a0..a3
        /// to one), then the four lanes of each quarter: 9 shuffles and 5 adds for 4 sums.
        #[inline(always)]
        fn hsum4(self, a: [__m512; 4]) -> [f32; 4] {
            // SAFETY: the token proves AVX-512F; `out` holds 4 f32s.
            unsafe {
                // Quarters 0-1 of t01: a0's quarters 0-1 plus 2-3; quarters 2-3: a1's. So t23.
                const LOW: i32 = 0b01_00_01_00;
                const HIGH: i32 = 0b11_10_11_10;
                let t01 = _mm512_add_ps(
                    _mm512_shuffle_f32x4::<LOW>(a[0], a[1]),
                    _mm512_shuffle_f32x4::<HIGH>(a[0], a[1]),
                );
                let t23 = _mm512_add_ps(
                    _mm512_shuffle_f32x4::<LOW>(a[2], a[3]),
                    _mm512_shuffle_f32x4::<HIGH>(a[2], a[3]),
                );
                // Quarter i holds a_i's four partial sums.
                let q = _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0b10_00_10_00>(t01, t23),
                    _mm512_shuffle_f32x4::<0b11_01_11_01>(t01, t23),
                );
                // Within each quarter: (0+1, 1+0, 2+3, 3+2), then every lane the quarter's sum.
                let q = _mm512_add_ps(q, _mm512_permute_ps::<0b10_11_00_01>(q));
                let q = _mm512_add_ps(q, _mm512_permute_ps::<0b01_00_11_10>(q));
                let sums = _mm512_permutexvar_ps(
                    _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
                    q,
                );
                let mut out = [0f32; 4];
                _mm_storeu_ps(out.as_mut_ptr(), _mm512_castps512_ps128(sums));
                out
            }
        }
    }

    impl Vector for Avx2 {
        const LANES: usize = 8;
        type F = __m256;

        #[inline(always)]
        fn zero(self) -> __m256 {
            // SAFETY: the token proves AVX2.
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        fn splat(self, v: f32) -> __m256 {
            // SAFETY: the token proves AVX2.
            unsafe { _mm256_set1_ps(v) }
        }
        #[inline(always)]
        unsafe fn load(self, p: *const f32) -> __m256 {
            // SAFETY: the token proves AVX2; the caller guarantees 8 readable f32s at `p`.
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn load_elem<W: Elem>(self, p: *const W) -> __m256 {
            // SAFETY: forwarded contract: 8 readable elements at `p`.
            unsafe { W::load_avx2(self, p) }
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32, v: __m256) {
            // SAFETY: the token proves AVX2; the caller guarantees 8 writable f32s at `p`.
            unsafe { _mm256_storeu_ps(p, v) }
        }
        #[inline(always)]
        fn fma(self, a: __m256, b: __m256, c: __m256) -> __m256 {
            // SAFETY: the token proves FMA.
            unsafe { _mm256_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        fn mul(self, a: __m256, b: __m256) -> __m256 {
            // SAFETY: the token proves AVX2.
            unsafe { _mm256_mul_ps(a, b) }
        }
        #[inline(always)]
        fn hsum(self, a: __m256) -> f32 {
            // SAFETY: the token proves AVX2.
            unsafe {
                let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                let s = _mm_add_ss(s, _mm_movehdup_ps(s));
                _mm_cvtss_f32(s)
            }
        }
        /// Pairs added within 128-bit halves (two levels of `hadd`), then the halves: 6
        /// shuffles and 4 adds for 4 sums.
        #[inline(always)]
        fn hsum4(self, a: [__m256; 4]) -> [f32; 4] {
            // SAFETY: the token proves AVX2; `out` holds 4 f32s.
            unsafe {
                let t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
                let s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps::<1>(t));
                let mut out = [0f32; 4];
                _mm_storeu_ps(out.as_mut_ptr(), s);
                out
            }
        }
    }

    /// The widening loads of element type `T` (namespaced so each type's pair reads together).
    pub(super) struct Load<T>(PhantomData<T>);

    /// Clears bit 14, the second copy of the sign the sign-extending widen leaves.
    const CLEAR_BIT14: i16 = 0xbfffu16 as i16;
    /// 2^111: an e5m2fnuz code placed in the low exponent bits of an f32 is 2^-111 of itself.
    const E5M2FNUZ_FOLD: f32 = f32::from_bits((127 + 111) << 23);
    /// Keeps S and EEEEE MM of a sign-extended code shifted left by 21.
    const E5M2FNUZ_MASK: i32 = 0x8fe0_0000u32 as i32;

    impl Load<f32> {
        #[inline(always)]
        pub(super) unsafe fn avx512(v: Avx512, p: *const f32) -> __m512 {
            // SAFETY: forwarded contract.
            unsafe { v.load(p) }
        }
        #[inline(always)]
        pub(super) unsafe fn avx2(v: Avx2, p: *const f32) -> __m256 {
            // SAFETY: forwarded contract.
            unsafe { v.load(p) }
        }
    }

    impl Load<bf16> {
        #[inline(always)]
        pub(super) unsafe fn avx512(_: Avx512, p: *const bf16) -> __m512 {
            // SAFETY: the token proves AVX-512F/AVX2; the caller guarantees 32 readable bytes.
            unsafe {
                let h = _mm256_loadu_si256(p.cast());
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
        }
        #[inline(always)]
        pub(super) unsafe fn avx2(_: Avx2, p: *const bf16) -> __m256 {
            // SAFETY: the token proves AVX2; the caller guarantees 16 readable bytes.
            unsafe {
                let h = _mm_loadu_si128(p.cast());
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            }
        }
    }

    impl Load<f16> {
        #[inline(always)]
        pub(super) unsafe fn avx512(_: Avx512, p: *const f16) -> __m512 {
            // SAFETY: the token proves AVX-512F; the caller guarantees 32 readable bytes.
            unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
        }
        #[inline(always)]
        pub(super) unsafe fn avx2(_: Avx2, p: *const f16) -> __m256 {
            // SAFETY: the token proves F16C; the caller guarantees 16 readable bytes.
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
        }
    }

    /// f16 bits `S 0EEEE MMM0000000` of 16 e4m3 codes: the fp8 value times 2^-8 (bias 7) or
    /// 2^-7 (bias 8). The sign-extending widen puts S in bits 15 and 14; bit 14 is cleared.
    #[inline(always)]
    fn e4m3_f16_bits_x16(_: Avx512, b: __m128i) -> __m256i {
        // SAFETY: the token proves AVX2.
        unsafe {
            let s = _mm256_cvtepi8_epi16(b);
            _mm256_and_si256(_mm256_slli_epi16::<7>(s), _mm256_set1_epi16(CLEAR_BIT14))
        }
    }

    /// As [`e4m3_f16_bits_x16`], for the 8 codes in the low half of `b`.
    #[inline(always)]
    fn e4m3_f16_bits_x8(_: Avx2, b: __m128i) -> __m128i {
        // SAFETY: the token proves AVX2 (SSE4.1 included).
        unsafe {
            let s = _mm_cvtepi8_epi16(b);
            _mm_and_si128(_mm_slli_epi16::<7>(s), _mm_set1_epi16(CLEAR_BIT14))
        }
    }

    impl Load<F8E4M3Fn> {
        #[inline(always)]
        pub(super) unsafe fn avx512(v: Avx512, p: *const F8E4M3Fn) -> __m512 {
            // SAFETY: the token proves AVX-512F/AVX2; the caller guarantees 16 readable bytes.
            unsafe { _mm512_cvtph_ps(e4m3_f16_bits_x16(v, _mm_loadu_si128(p.cast()))) }
        }
        #[inline(always)]
        pub(super) unsafe fn avx2(v: Avx2, p: *const F8E4M3Fn) -> __m256 {
            // SAFETY: the token proves AVX2/F16C; the caller guarantees 8 readable bytes.
            unsafe { _mm256_cvtph_ps(e4m3_f16_bits_x8(v, _mm_loadl_epi64(p.cast()))) }
        }
    }

    impl Load<F8E4M3Fnuz> {
        #[inline(always)]
        pub(super) unsafe fn avx512(v: Avx512, p: *const F8E4M3Fnuz) -> __m512 {
            // SAFETY: the token proves AVX-512F/AVX2; the caller guarantees 16 readable bytes.
            unsafe { _mm512_cvtph_ps(e4m3_f16_bits_x16(v, _mm_loadu_si128(p.cast()))) }
        }
        #[inline(always)]
        pub(super) unsafe fn avx2(v: Avx2, p: *const F8E4M3Fnuz) -> __m256 {
            // SAFETY: the token proves AVX2/F16C; the caller guarantees 8 readable bytes.
            unsafe { _mm256_cvtph_ps(e4m3_f16_bits_x8(v, _mm_loadl_epi64(p.cast()))) }
        }
    }

    impl Load<F8E5M2> {
        #[inline(always)]
        pub(super) unsafe fn avx512(_: Avx512, p: *const F8E5M2) -> __m512 {
            // SAFETY: the token proves AVX-512F/AVX2; the caller guarantees 16 readable bytes.
            unsafe {
                let b = _mm_loadu_si128(p.cast());
                _mm512_cvtph_ps(_mm256_slli_epi16::<8>(_mm256_cvtepu8_epi16(b)))
            }
        }
        #[inline(always)]
        pub(super) unsafe fn avx2(_: Avx2, p: *const F8E5M2) -> __m256 {
            // SAFETY: the token proves AVX2/F16C; the caller guarantees 8 readable bytes.
            unsafe {
                let b = _mm_loadl_epi64(p.cast());
                _mm256_cvtph_ps(_mm_slli_epi16::<8>(_mm_cvtepu8_epi16(b)))
            }
        }
    }

    impl Load<F8E5M2Fnuz> {
        #[inline(always)]
        pub(super) unsafe fn avx512(_: Avx512, p: *const F8E5M2Fnuz) -> __m512 {
            // SAFETY: the token proves AVX-512F; the caller guarantees 16 readable bytes.
            unsafe {
                let i = _mm512_slli_epi32::<21>(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast())));
                let f = _mm512_castsi512_ps(_mm512_and_si512(i, _mm512_set1_epi32(E5M2FNUZ_MASK)));
                _mm512_mul_ps(f, _mm512_set1_ps(E5M2FNUZ_FOLD))
            }
        }
        #[inline(always)]
        pub(super) unsafe fn avx2(_: Avx2, p: *const F8E5M2Fnuz) -> __m256 {
            // SAFETY: the token proves AVX2; the caller guarantees 8 readable bytes.
            unsafe {
                let i = _mm256_slli_epi32::<21>(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())));
                let f = _mm256_castsi256_ps(_mm256_and_si256(i, _mm256_set1_epi32(E5M2FNUZ_MASK)));
                _mm256_mul_ps(f, _mm256_set1_ps(E5M2FNUZ_FOLD))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fp8;

    /// Widens `src` with the vector loads of the instruction set, `LANES` at a time.
    struct WidenAll<'a, W> {
        src: &'a [W],
        dst: &'a mut [f32],
    }

    impl<W: Elem> Kernel for WidenAll<'_, W> {
        type Output = ();
        #[inline(always)]
        fn run<V: Vector>(self, v: V) {
            assert_eq!(self.src.len() % V::LANES, 0);
            for (s, d) in self.src.chunks_exact(V::LANES).zip(self.dst.chunks_exact_mut(V::LANES)) {
                // SAFETY: both chunks hold LANES elements.
                unsafe { v.store(d.as_mut_ptr(), v.load_elem(s.as_ptr())) };
            }
        }
    }

    fn same(a: f32, b: f32) -> bool {
        (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits()
    }

    /// Every vector load of `codes` equals the exact widening divided by POST, bit for bit;
    /// except that a NaN code of a `NAN_CODES` type may load as anything, and then `any_nan` must
    /// see it.
    fn check_vector_widening<W: Elem>(codes: &[W]) {
        for simd in Simd::available() {
            let mut out = vec![0.0f32; codes.len()];
            simd.run(WidenAll { src: codes, dst: &mut out });
            for (c, &o) in codes.iter().zip(&out) {
                let want = c.widen() / W::POST;
                if W::NAN_CODES && want.is_nan() {
                    assert!(W::any_nan(std::slice::from_ref(c)), "{c:?} is NaN but any_nan misses it");
                    continue;
                }
                assert!(same(o, want), "{} {:?}: vector {o} vs scalar {want}", simd.name(), c);
            }
        }
    }

    #[test]
    fn any_nan_finds_exactly_the_nan_codes() {
        fn each<W: Elem>(make: fn(u8) -> W) {
            for c in 0..=255u8 {
                let w = make(c);
                assert_eq!(W::any_nan(&[w]), W::NAN_CODES && w.widen().is_nan(), "{w:?}");
                // In a long run, at every position (the vectorised fold and its tail).
                let mut run = vec![make(0x11); 131];
                for at in [0, 63, 64, 130] {
                    run[at] = w;
                    assert_eq!(W::any_nan(&run), W::NAN_CODES && w.widen().is_nan(), "{w:?} at {at}");
                    run[at] = make(0x11);
                }
            }
        }
        each(F8E4M3Fn);
        each(F8E4M3Fnuz);
        each(F8E5M2);
        each(F8E5M2Fnuz);
        assert!(!f32::any_nan(&[f32::NAN]) && !f32::NAN_CODES, "f32 loads carry their own NaN");
    }

    #[test]
    fn fp8_tables_match_the_codecs() {
        type Decode = fn(u8) -> f32;
        let decoders: [(&str, Decode, Decode); 4] = [
            ("e4m3fn", fp8::e4m3fn_to_f32, |c| F8E4M3Fn(c).widen()),
            ("e4m3fnuz", fp8::e4m3fnuz_to_f32, |c| F8E4M3Fnuz(c).widen()),
            ("e5m2", fp8::e5m2_to_f32, |c| F8E5M2(c).widen()),
            ("e5m2fnuz", fp8::e5m2fnuz_to_f32, |c| F8E5M2Fnuz(c).widen()),
        ];
        for (name, reference, table) in decoders {
            for c in 0..=255u8 {
                let (r, t) = (reference(c), table(c));
                assert!(same(r, t), "{name} code {c:#04x}: table {t} vs codec {r}");
            }
        }
        // Spot checks from the formats' definitions.
        assert_eq!(F8E4M3Fn(0x7e).widen(), 448.0);
        assert_eq!(F8E4M3Fn(0x01).widen(), 2f32.powi(-9));
        assert_eq!(F8E4M3Fn(0x80).widen().to_bits(), (-0.0f32).to_bits());
        assert_eq!(F8E4M3Fnuz(0x7f).widen(), 240.0);
        assert!(F8E4M3Fnuz(0x80).widen().is_nan());
        assert_eq!(F8E5M2(0x7c).widen(), f32::INFINITY);
        assert_eq!(F8E5M2Fnuz(0x7f).widen(), 57344.0);
        assert_eq!(F8E5M2Fnuz(0x01).widen(), 2f32.powi(-17));
    }

    #[test]
    fn fp8_vector_widening_all_codes() {
        let codes: Vec<u8> = (0..=255).collect();
        check_vector_widening(&codes.iter().map(|&c| F8E4M3Fn(c)).collect::<Vec<_>>());
        check_vector_widening(&codes.iter().map(|&c| F8E4M3Fnuz(c)).collect::<Vec<_>>());
        check_vector_widening(&codes.iter().map(|&c| F8E5M2(c)).collect::<Vec<_>>());
        check_vector_widening(&codes.iter().map(|&c| F8E5M2Fnuz(c)).collect::<Vec<_>>());
    }

    /// `widen64` over all 256 codes of each format, as four blocks of 64: every lane holds the
    /// exact value of the column `x64_column` names, bit for bit, but the NaN codes the tables
    /// lose (`nan_lost`), which `any_nan` must see.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn fp8_byte_tables_all_codes() {
        struct Widen<'a> {
            codes: &'a [u8; 256],
            bytes: &'a Fp8Bytes,
            out: &'a mut [f32; 256],
        }
        impl VbmiKernel for Widen<'_> {
            type Output = ();
            #[inline(always)]
            fn run(self, v: Avx512, b: Vbmi) {
                let regs = b.regs(self.bytes);
                for (c, o) in self.codes.chunks_exact(64).zip(self.out.chunks_exact_mut(64)) {
                    // SAFETY: 64 codes in, 4 x 16 f32 out.
                    let f = unsafe { b.widen64(&regs, c.as_ptr()) };
                    for (i, f) in f.into_iter().enumerate() {
                        // SAFETY: o holds 64 f32s.
                        unsafe { v.store(o[16 * i..].as_mut_ptr(), f) };
                    }
                }
            }
        }
        fn each<W: Elem>(make: fn(u8) -> W, nan_lost: bool) {
            let bytes = W::BYTES.expect("an fp8 format has byte tables");
            assert_eq!(bytes.nan_lost, nan_lost);
            let Some((v, b)) = Simd::from_name("avx512vbmi").and_then(Simd::vbmi) else {
                return eprintln!("no AVX-512 VBMI on this CPU: only the tables were checked");
            };
            // Codes in a scrambled order, so a lane that read the wrong column shows.
            let codes: [u8; 256] = std::array::from_fn(|i| (i as u8).wrapping_mul(167).wrapping_add(13));
            let mut out = [f32::NAN; 256];
            run_vbmi(v, b, Widen { codes: &codes, bytes, out: &mut out });
            for (i, &o) in out.iter().enumerate() {
                let c = make(codes[i / 64 * 64 + x64_column(i % 64)]);
                let want = c.widen();
                if want.is_nan() && bytes.nan_lost && !o.is_nan() {
                    assert!(
                        W::any_nan(std::slice::from_ref(&c)),
                        "{c:?} widens to {o} and any_nan misses it"
                    );
                    continue;
                }
                assert!(same(o, want), "{c:?} at lane {i}: {o} vs {want}");
            }
        }
        each(F8E4M3Fn, false);
        each(F8E4M3Fnuz, true);
        each(F8E5M2, false);
        each(F8E5M2Fnuz, true);
        let mut seen = [false; 64];
        for i in 0..64 {
            seen[x64_column(i)] = true;
        }
        assert!(seen.iter().all(|&s| s), "x64_column is a permutation of 0..64");
    }

    #[test]
    fn half_vector_widening_all_codes() {
        let bf: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        let h: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        check_vector_widening(&bf);
        check_vector_widening(&h);
        for (b, h) in bf.iter().zip(&h) {
            assert!(same(b.widen(), b.to_f32()));
            assert!(same(h.widen(), h.to_f32()));
        }
    }

    #[test]
    fn f32_vector_load_is_identity() {
        let v: Vec<f32> = (0..4094u32)
            .map(|i| f32::from_bits(i.wrapping_mul(0x9e37_79b9)))
            .chain([f32::NAN, -0.0])
            .collect();
        check_vector_widening(&v);
    }

    #[test]
    fn post_is_a_power_of_two() {
        for p in [F8E4M3Fn::POST, F8E4M3Fnuz::POST, F8E5M2::POST, F8E5M2Fnuz::POST, bf16::POST, f16::POST] {
            assert_eq!(p.to_bits() & 0x007f_ffff, 0, "{p}");
        }
    }

    /// Horizontal sums and FMAs agree with scalar arithmetic on exactly representable data.
    struct Arith<'a> {
        out: &'a mut Vec<f32>,
    }

    impl Kernel for Arith<'_> {
        type Output = ();
        #[inline(always)]
        fn run<V: Vector>(self, v: V) {
            let a: Vec<f32> = (0..V::LANES).map(|i| i as f32 + 1.0).collect();
            let b: Vec<f32> = (0..V::LANES).map(|i| 0.5 * i as f32).collect();
            // SAFETY: both hold LANES elements.
            let (x, y) = unsafe { (v.load(a.as_ptr()), v.load(b.as_ptr())) };
            let r = v.fma(x, y, v.splat(2.0));
            self.out.push(v.hsum(r));
            self.out.push(v.hsum(v.mul(x, y)));
            self.out.push(v.hsum(v.zero()));
            self.out.push(V::LANES as f32);
        }
    }

    #[test]
    fn vector_arithmetic() {
        for simd in Simd::available() {
            let mut out = Vec::new();
            simd.run(Arith { out: &mut out });
            let n = out[3] as usize;
            let a = |i: usize| i as f32 + 1.0;
            let b = |i: usize| 0.5 * i as f32;
            let fma: f32 = (0..n).map(|i| a(i) * b(i) + 2.0).sum();
            let mul: f32 = (0..n).map(|i| a(i) * b(i)).sum();
            assert_eq!(&out[..3], &[fma, mul, 0.0], "{}", simd.name());
            assert_eq!(n, simd.lanes());
        }
    }

    /// `hsum4` of vectors whose lanes are `(i + 1) 2^l`: every sum is exact in any order, and a
    /// lane taken twice, left out or taken from another vector changes it.
    struct Hsum4<'a> {
        out: &'a mut Vec<f32>,
    }

    impl Kernel for Hsum4<'_> {
        type Output = ();
        #[inline(always)]
        fn run<V: Vector>(self, v: V) {
            let lanes: Vec<Vec<f32>> = (0..4)
                .map(|i| (0..V::LANES).map(|l| (i + 1) as f32 * (1u32 << l) as f32).collect())
                .collect();
            // SAFETY: each holds LANES elements.
            let a = unsafe { [0, 1, 2, 3].map(|i| v.load(lanes[i].as_ptr())) };
            self.out.extend(v.hsum4(a));
        }
    }

    #[test]
    fn hsum4_sums_each_vector() {
        for simd in Simd::available() {
            let mut out = Vec::new();
            simd.run(Hsum4 { out: &mut out });
            let all = ((1u32 << simd.lanes()) - 1) as f32;
            assert_eq!(out, [all, 2.0 * all, 3.0 * all, 4.0 * all], "{}", simd.name());
        }
    }
}
