//! `linear`: GEMV (decode) and GEMM (prefill) kernels of `kernels-cuda/linear.cu`.

use super::super::{Device, Gpu, GpuStorage};
use crate::ops::{Linear, LinearDims};
use crate::{Backend, Result, Tensor};

type T<D> = Tensor<GpuStorage<<D as Device>::Buffer>>;

pub(crate) fn linear<D: Device>(
    g: &Gpu<D>,
    _d: LinearDims,
    _x: &T<D>,
    _w: &Linear<GpuStorage<D::Buffer>>,
    _y: &mut T<D>,
) -> Result<()> {
    Err(super::unsupported("linear", g.name()))
}
