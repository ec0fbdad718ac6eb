#![allow(dead_code)]

//! The fnuz kit: random e4m3fn test weights and their conversion for an e4m3fnuz device, as the
//! model loader converts them (`fp8::linear_to_fnuz`). Used by `runtime/tests/fnuz.rs` (the
//! reference backend) and the root crate's `tests/gpu_fnuz.rs` (the GPU kernels on the emulator);
//! each suite draws from its own generator through [`Draw`].

use memwall_runtime::cpu::Reference;
use memwall_runtime::{Backend, DType, HostStorage, HostTensor, Linear, WeightScale, fp8};

/// How a test weight is scaled.
#[derive(Clone, Copy, Debug)]
pub enum Scheme {
    None,
    PerTensor,
    PerChannel(DType),
    /// Scales of a dtype, per `rows x cols` block.
    Block(DType, usize, usize),
}

/// A suite's random numbers.
pub trait Draw {
    /// 64 random bits.
    fn bits(&mut self) -> u64;
    /// `n` random scale values in [-1, 1], to be stored as `dtype`.
    fn values(&mut self, dtype: DType, n: usize) -> Vec<f32>;
}

/// A random e4m3fn code that is not NaN: every other code can occur, and the NaN codes become
/// 0x80, fn's -0, so that occurs often.
pub fn code(rng: &mut impl Draw) -> u8 {
    let c = (rng.bits() >> 56) as u8;
    if c & 0x7f == 0x7f { 0x80 } else { c }
}

/// A random e4m3fn weight `[n, k]` on the host with a random scale of `scheme`.
pub fn fn_weight(rng: &mut impl Draw, n: usize, k: usize, scheme: Scheme) -> Linear<HostStorage> {
    let codes: Vec<u8> = (0..n * k).map(|_| code(rng)).collect();
    let weight = Reference.upload(DType::F8E4M3Fn, &[n, k], &codes).expect("e4m3fn weight");
    let scale = match scheme {
        Scheme::None => WeightScale::None,
        Scheme::PerTensor => WeightScale::PerTensor(rng.values(DType::F32, 1)[0]),
        Scheme::PerChannel(d) => WeightScale::PerChannel(scales(rng, d, [n, 1])),
        Scheme::Block(d, r, c) => {
            let scales = scales(rng, d, [n.div_ceil(r), k.div_ceil(c)]);
            WeightScale::Block { block_rows: r, block_cols: c, scales }
        }
    };
    Linear { weight, scale }
}

/// Random scales of `dtype`, `shape`, on the host.
fn scales(rng: &mut impl Draw, dtype: DType, shape: [usize; 2]) -> HostTensor {
    let values = rng.values(dtype, shape[0] * shape[1]);
    Reference.upload_f32(dtype, &shape, &values).expect("scales")
}

/// `w` as the loader converts it for an e4m3fnuz device: `fp8::linear_to_fnuz` on a host copy,
/// every code byte rewritten.
pub fn to_fnuz(w: &Linear<HostStorage>) -> Linear<HostStorage> {
    let mut u = w.upload_to(&Reference).expect("host copy");
    let converted = fp8::linear_to_fnuz(&mut u).expect("an e4m3fn weight without NaN codes");
    assert_eq!(converted.code_bytes, w.weight.nbytes());
    u
}

/// Bit for bit equal f32 values, except that an exact zero may have either sign (fnuz has no -0).
pub fn same_bits(a: &[u32], b: &[u32]) -> Result<(), String> {
    match a
        .iter()
        .zip(b)
        .position(|(&x, &y)| x != y && !(f32::from_bits(x) == 0.0 && f32::from_bits(y) == 0.0))
    {
        _ if a.len() != b.len() => Err(format!("{} vs {} elements", a.len(), b.len())),
        Some(i) => Err(format!(
            "element {i}: {:e} ({:#010x}) vs {:e} ({:#010x}) of {}",
            f32::from_bits(a[i]),
            a[i],
            f32::from_bits(b[i]),
            b[i],
            a.len()
        )),
        None => Ok(()),
    }
}
