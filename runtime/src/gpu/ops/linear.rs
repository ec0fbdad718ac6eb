//! `linear`: GEMV (decode, a few rows) of `kernels-cuda/gemv.cu`; the other shapes go to
//! [`super::gemm`].

use super::super::{Device, Gpu, GpuStorage};
use crate::ops::{Linear, LinearDims};
use crate::{Backend, Result, Tensor};

type T<D> = Tensor<GpuStorage<<D as Device>::Buffer>>;

/// The most rows (tokens) one GEMV launch takes; more go to GEMM.
pub const GEMV_MAX_ROWS: usize = 16;

pub(crate) fn linear<D: Device>(
    g: &Gpu<D>,
    d: LinearDims,
    x: &T<D>,
    w: &Linear<GpuStorage<D::Buffer>>,
    y: &mut T<D>,
) -> Result<()> {
    if d.m > GEMV_MAX_ROWS {
        return super::gemm::gemm(g, d, x, w, y);
    }
    Err(super::unsupported("linear (gemv)", g.name()))
}
