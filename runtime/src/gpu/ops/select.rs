//! Selection over rows of logits: `router_topk`, `argmax`, `sample` (`kernels-cuda/select.cu`).

use super::super::{Device, Gpu, GpuStorage};
use crate::ops::{RowsDims, SamplingParams, TopKDims};
use crate::{Backend, Result, Tensor};

type T<D> = Tensor<GpuStorage<<D as Device>::Buffer>>;

pub(crate) fn router_topk<D: Device>(
    g: &Gpu<D>,
    _d: TopKDims,
    _logits: &T<D>,
    _ids: &mut T<D>,
    _weights: &mut T<D>,
) -> Result<()> {
    Err(super::unsupported("router_topk", g.name()))
}

pub(crate) fn argmax<D: Device>(g: &Gpu<D>, _d: RowsDims, _logits: &T<D>, _out: &mut T<D>) -> Result<()> {
    Err(super::unsupported("argmax", g.name()))
}

pub(crate) fn sample<D: Device>(
    g: &Gpu<D>,
    _d: RowsDims,
    _logits: &T<D>,
    _params: &SamplingParams,
    _seeds: &T<D>,
    _steps: &T<D>,
    _out: &mut T<D>,
) -> Result<()> {
    Err(super::unsupported("sample", g.name()))
}
