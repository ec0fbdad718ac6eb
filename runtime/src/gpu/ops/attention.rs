//! `kv_store` and `attention` (causal prefill and flash-decoding), `kernels-cuda/attention.cu`.

use super::super::{Device, Gpu, GpuStorage};
use crate::ops::{AttnDims, KvCacheLayer};
use crate::{Backend, Result, Tensor};

type T<D> = Tensor<GpuStorage<<D as Device>::Buffer>>;

pub(crate) fn kv_store<D: Device>(
    g: &Gpu<D>,
    _d: AttnDims,
    _k: &T<D>,
    _v: &T<D>,
    _cache: &mut KvCacheLayer<GpuStorage<D::Buffer>>,
    _slots: &T<D>,
    _positions: &T<D>,
) -> Result<()> {
    Err(super::unsupported("kv_store", g.name()))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn attention<D: Device>(
    g: &Gpu<D>,
    _d: AttnDims,
    _q: &T<D>,
    _cache: &KvCacheLayer<GpuStorage<D::Buffer>>,
    _slots: &T<D>,
    _positions: &T<D>,
    _scale: f32,
    _out: &mut T<D>,
) -> Result<()> {
    Err(super::unsupported("attention", g.name()))
}
