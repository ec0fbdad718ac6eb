//! The launchers, one module per kernel family of `kernels-cuda/`: each holds the `#[repr(C)]`
//! mirror of its params structs (`kernels-cuda/params/<family>.h`), the launch heuristics as pure
//! functions of (dims, dtypes, device info), and the typed launcher with the one `unsafe` call.

pub mod attention;
pub mod elementwise;
pub mod linear;
pub mod rows;
pub mod select;

use super::{Device, GpuStorage};
use crate::{Error, Tensor};

/// The device address of a tensor's first element.
pub(crate) fn addr<D: Device>(t: &Tensor<GpuStorage<D::Buffer>>) -> u64 {
    D::address(&t.storage().buf)
}

/// `Unsupported` for an op this device does not run yet.
pub(crate) fn unsupported(op: &'static str, backend: &'static str) -> Error {
    Error::Unsupported { backend, op, reason: "no kernel for this op yet".into() }
}
