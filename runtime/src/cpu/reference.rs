//! The reference CPU backend: obvious loops, f64 accumulation, no unsafe. The oracle.

use crate::ops::{
    AttnDims, GatherDims, KvCacheLayer, Linear, LinearDims, RopeDims, RowsDims, SamplingParams, TopKDims,
};
use crate::{Backend, Error, HostStorage, HostTensor, Result, Rope};

#[derive(Debug, Default)]
pub struct Reference;

fn todo(op: &'static str) -> Result<()> {
    Err(Error::Unsupported { backend: "cpu-ref", op, reason: "not written yet".into() })
}

impl Backend for Reference {
    type Storage = HostStorage;

    fn name(&self) -> &'static str {
        "cpu-ref"
    }
    fn exec_alloc(&self, bytes: usize) -> Result<HostStorage> {
        super::host_alloc(bytes)
    }
    fn exec_write(&self, dst: &mut HostStorage, bytes: &[u8]) -> Result<()> {
        super::host_write(dst, bytes)
    }
    fn exec_read(&self, src: &HostStorage, out: &mut [u8]) -> Result<()> {
        super::host_read(src, out)
    }
    fn exec_linear(
        &self,
        _d: LinearDims,
        _x: &HostTensor,
        _w: &Linear<HostStorage>,
        _y: &mut HostTensor,
    ) -> Result<()> {
        todo("linear")
    }
    fn exec_rms_norm(
        &self,
        _d: RowsDims,
        _x: &HostTensor,
        _weight: &HostTensor,
        _eps: f32,
        _y: &mut HostTensor,
    ) -> Result<()> {
        todo("rms_norm")
    }
    fn exec_rope(
        &self,
        _d: RopeDims,
        _x: &mut HostTensor,
        _positions: &HostTensor,
        _rope: &Rope,
    ) -> Result<()> {
        todo("rope")
    }
    fn exec_silu_mul(
        &self,
        _d: RowsDims,
        _gate: &HostTensor,
        _up: &HostTensor,
        _out: &mut HostTensor,
    ) -> Result<()> {
        todo("silu_mul")
    }
    fn exec_add_assign(&self, _d: RowsDims, _x: &mut HostTensor, _y: &HostTensor) -> Result<()> {
        todo("add_assign")
    }
    fn exec_embedding(
        &self,
        _d: GatherDims,
        _table: &Linear<HostStorage>,
        _ids: &HostTensor,
        _out: &mut HostTensor,
    ) -> Result<()> {
        todo("embedding")
    }
    fn exec_kv_store(
        &self,
        _d: AttnDims,
        _k: &HostTensor,
        _v: &HostTensor,
        _cache: &mut KvCacheLayer<HostStorage>,
        _slots: &HostTensor,
        _positions: &HostTensor,
    ) -> Result<()> {
        todo("kv_store")
    }
    fn exec_attention(
        &self,
        _d: AttnDims,
        _q: &HostTensor,
        _cache: &KvCacheLayer<HostStorage>,
        _slots: &HostTensor,
        _positions: &HostTensor,
        _scale: f32,
        _out: &mut HostTensor,
    ) -> Result<()> {
        todo("attention")
    }
    fn exec_router_topk(
        &self,
        _d: TopKDims,
        _logits: &HostTensor,
        _ids: &mut HostTensor,
        _weights: &mut HostTensor,
    ) -> Result<()> {
        todo("router_topk")
    }
    fn exec_argmax(&self, _d: RowsDims, _logits: &HostTensor, _out: &mut HostTensor) -> Result<()> {
        todo("argmax")
    }
    fn exec_sample(
        &self,
        _d: RowsDims,
        _logits: &HostTensor,
        _params: &SamplingParams,
        _seed: u64,
        _step: u64,
        _out: &mut HostTensor,
    ) -> Result<()> {
        todo("sample")
    }
    fn exec_gather_rows(
        &self,
        _d: GatherDims,
        _src: &HostTensor,
        _idx: &HostTensor,
        _out: &mut HostTensor,
    ) -> Result<()> {
        todo("gather_rows")
    }
    fn exec_scatter_add_rows(
        &self,
        _d: GatherDims,
        _dst: &mut HostTensor,
        _idx: &HostTensor,
        _src: &HostTensor,
        _weights: &HostTensor,
    ) -> Result<()> {
        todo("scatter_add_rows")
    }
}
