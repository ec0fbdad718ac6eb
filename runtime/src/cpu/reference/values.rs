//! Reading tensors as f64 values and writing f64 values back, for every float dtype.

use crate::{DType, Error, Float, HostTensor, Result, with_float_type};

fn not_float(op: &'static str, name: &'static str, t: &HostTensor) -> Error {
    Error::DType { op, tensor: name, got: t.dtype(), allowed: DType::FLOATS.to_vec() }
}

/// A float tensor read one element at a time, each widened exactly to f64. For tensors too large
/// to copy (weights, KV caches).
pub(super) struct Floats<'a> {
    read: Box<dyn Fn(usize) -> f64 + 'a>,
}

impl Floats<'_> {
    /// Element `i` (row-major).
    pub(super) fn at(&self, i: usize) -> f64 {
        (self.read)(i)
    }
}

pub(super) fn floats<'a>(op: &'static str, name: &'static str, t: &'a HostTensor) -> Result<Floats<'a>> {
    with_float_type!(t.dtype(), T => {
        let elems = t.as_slice::<T>();
        Ok(Floats { read: Box::new(move |i| elems[i].to_f64()) })
    }, else => Err(not_float(op, name, t)))
}

/// Every element of a float tensor, widened exactly to f64.
pub(super) fn widen(op: &'static str, name: &'static str, t: &HostTensor) -> Result<Vec<f64>> {
    with_float_type!(t.dtype(), T => {
        Ok(t.as_slice::<T>().iter().map(|v| v.to_f64()).collect())
    }, else => Err(not_float(op, name, t)))
}

/// The elements of a u32 tensor (ids, positions, slots, indices).
pub(super) fn indices<'a>(op: &'static str, name: &'static str, t: &'a HostTensor) -> Result<&'a [u32]> {
    crate::ops::expect_dtype(op, name, t.dtype(), &[DType::U32])?;
    Ok(t.as_slice::<u32>())
}

/// Writes `values` into elements `offset..offset + values.len()` of a float tensor, each rounded
/// once to the tensor's dtype through f32 (see the module docs for the double rounding).
pub(super) fn store_at(
    op: &'static str,
    name: &'static str,
    t: &mut HostTensor,
    offset: usize,
    values: &[f64],
) -> Result<()> {
    let len = t.numel();
    let out_of_bounds = || Error::OutOfBounds {
        what: format!("{op}: elements of `{name}`"),
        offset,
        len: values.len(),
        size: len,
    };
    let end = offset.checked_add(values.len()).ok_or_else(out_of_bounds)?;
    with_float_type!(t.dtype(), T => {
        let dst = t.as_mut_slice::<T>(op, name)?.get_mut(offset..end).ok_or_else(out_of_bounds)?;
        for (d, &v) in dst.iter_mut().zip(values) {
            *d = T::from_f32(v as f32);
        }
        Ok(())
    }, else => Err(not_float(op, name, t)))
}

/// Overwrites a whole float tensor with `values`.
pub(super) fn store(op: &'static str, name: &'static str, t: &mut HostTensor, values: &[f64]) -> Result<()> {
    if values.len() != t.numel() {
        return Err(Error::OutOfBounds {
            what: format!("{op}: elements of `{name}`"),
            offset: 0,
            len: values.len(),
            size: t.numel(),
        });
    }
    store_at(op, name, t, 0, values)
}

/// `ReadOnly` for a read-only mapped tensor, so an op writing several outputs fails before it
/// writes any of them.
pub(super) fn ensure_writable(op: &'static str, name: &'static str, t: &HostTensor) -> Result<()> {
    if t.storage().is_read_only() { Err(Error::ReadOnly { op, tensor: name }) } else { Ok(()) }
}
