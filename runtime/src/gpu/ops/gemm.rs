//! `gemm`: the tiled matrix products of `kernels-cuda/gemm.cu` for prefill and large batches
//! (tensor cores where the dtypes allow). `linear::linear` hands it the shapes GEMV does not take.

use super::super::{Device, Gpu, GpuStorage};
use crate::ops::{Linear, LinearDims};
use crate::{Backend, Result, Tensor};

type T<D> = Tensor<GpuStorage<<D as Device>::Buffer>>;

pub(crate) fn gemm<D: Device>(
    g: &Gpu<D>,
    _d: LinearDims,
    _x: &T<D>,
    _w: &Linear<GpuStorage<D::Buffer>>,
    _y: &mut T<D>,
) -> Result<()> {
    Err(super::unsupported("linear (gemm)", g.name()))
}
