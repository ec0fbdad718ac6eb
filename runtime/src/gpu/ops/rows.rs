//! Row gathers and scatters: `embedding`, `gather_rows`, `scatter_add_rows` (`kernels-cuda/rows.cu`).

use super::super::{Device, Gpu, GpuStorage};
use crate::ops::{GatherDims, Linear};
use crate::{Backend, Result, Tensor};

type T<D> = Tensor<GpuStorage<<D as Device>::Buffer>>;

pub(crate) fn embedding<D: Device>(
    g: &Gpu<D>,
    _d: GatherDims,
    _table: &Linear<GpuStorage<D::Buffer>>,
    _ids: &T<D>,
    _out: &mut T<D>,
) -> Result<()> {
    Err(super::unsupported("embedding", g.name()))
}

pub(crate) fn gather_rows<D: Device>(
    g: &Gpu<D>,
    _d: GatherDims,
    _src: &T<D>,
    _idx: &T<D>,
    _out: &mut T<D>,
) -> Result<()> {
    Err(super::unsupported("gather_rows", g.name()))
}

pub(crate) fn scatter_add_rows<D: Device>(
    g: &Gpu<D>,
    _d: GatherDims,
    _dst: &mut T<D>,
    _idx: &T<D>,
    _src: &T<D>,
    _weights: &T<D>,
) -> Result<()> {
    Err(super::unsupported("scatter_add_rows", g.name()))
}
