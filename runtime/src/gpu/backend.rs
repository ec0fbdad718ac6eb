//! `Backend` for [`Gpu`]: memory through the device, each op through its family's launcher in
//! `ops/`.

use super::{Device, Gpu, GpuGraph, GpuStorage, ops};
use crate::ops::{
    AttnDims, Expert, ExpertsDims, ExpertsScratch, GatherDims, KvCacheLayer, Linear, LinearDims, RopeDims,
    RowsDims, SamplingParams, TopKDims,
};
use crate::{Backend, DType, Error, Result, Rope, Tensor};

type T<D> = Tensor<GpuStorage<<D as Device>::Buffer>>;
type L<D> = Linear<GpuStorage<<D as Device>::Buffer>>;

impl<D: Device> Backend for Gpu<D> {
    type Storage = GpuStorage<D::Buffer>;
    type Graph = GpuGraph<D::Graph>;

    fn name(&self) -> &'static str {
        self.device.name()
    }

    fn exec_alloc(&self, bytes: usize) -> Result<Self::Storage> {
        self.not_recording("allocating")?;
        Ok(GpuStorage { buf: self.device.alloc(bytes.max(1))?, len: bytes })
    }

    fn exec_write(&self, dst: &mut Self::Storage, bytes: &[u8]) -> Result<()> {
        self.not_recording("copying to the device")?;
        if bytes.len() > dst.len {
            return Err(Error::OutOfBounds {
                what: "write".into(),
                offset: 0,
                len: bytes.len(),
                size: dst.len,
            });
        }
        self.device.write(&mut dst.buf, 0, bytes)
    }

    fn exec_zero(&self, dst: &mut Self::Storage, bytes: usize) -> Result<()> {
        self.not_recording("zero-filling")?;
        if bytes > dst.len {
            return Err(Error::OutOfBounds { what: "zero".into(), offset: 0, len: bytes, size: dst.len });
        }
        self.device.zero(&mut dst.buf, 0, bytes)
    }

    /// Reads after all queued work, then reports the first data-dependent error a kernel
    /// recorded since the last check (the bytes read may then be partly stale).
    fn exec_read(&self, src: &Self::Storage, out: &mut [u8]) -> Result<()> {
        self.not_recording("copying to the host")?;
        if out.len() > src.len {
            return Err(Error::OutOfBounds { what: "read".into(), offset: 0, len: out.len(), size: src.len });
        }
        self.device.read(&src.buf, 0, out)?;
        self.check_status()
    }

    fn synchronize(&self) -> Result<()> {
        self.not_recording("synchronising")?;
        self.device.synchronize()?;
        self.check_status()
    }

    fn native_e4m3(&self) -> DType {
        self.device.info().native_e4m3()
    }

    fn capture(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<Option<Self::Graph>> {
        Gpu::capture(self, f).map(Some)
    }

    fn replay(&self, graph: &Self::Graph) -> Result<bool> {
        Gpu::replay(self, graph)
    }

    fn exec_linear(&self, d: LinearDims, x: &T<D>, w: &L<D>, y: &mut T<D>) -> Result<()> {
        ops::linear::linear(self, d, x, w, y)
    }

    fn exec_rms_norm(&self, d: RowsDims, x: &T<D>, weight: &T<D>, eps: f32, y: &mut T<D>) -> Result<()> {
        ops::elementwise::rms_norm(self, d, x, weight, eps, y)
    }

    fn exec_rope(&self, d: RopeDims, x: &mut T<D>, positions: &T<D>, rope: &Rope) -> Result<()> {
        ops::elementwise::rope(self, d, x, positions, rope)
    }

    fn exec_silu_mul(&self, d: RowsDims, gate: &T<D>, up: &T<D>, out: &mut T<D>) -> Result<()> {
        ops::elementwise::silu_mul(self, d, gate, up, out)
    }

    fn exec_gate_up_silu(
        &self,
        d: LinearDims,
        x: &T<D>,
        w_gate: &L<D>,
        w_up: &L<D>,
        scratch: (&mut T<D>, &mut T<D>),
        out: &mut T<D>,
    ) -> Result<()> {
        ops::linear::gate_up_silu(self, d, x, w_gate, w_up, scratch, out)
    }

    fn exec_qkv(&self, d: [LinearDims; 3], x: &T<D>, w: [&L<D>; 3], y: [&mut T<D>; 3]) -> Result<()> {
        ops::linear::qkv(self, d, x, w, y)
    }

    fn exec_add_assign(&self, d: RowsDims, x: &mut T<D>, y: &T<D>) -> Result<()> {
        ops::elementwise::add_assign(self, d, x, y)
    }

    fn exec_embedding(&self, d: GatherDims, table: &L<D>, ids: &T<D>, out: &mut T<D>) -> Result<()> {
        ops::rows::embedding(self, d, table, ids, out)
    }

    fn exec_kv_store(
        &self,
        d: AttnDims,
        k: &T<D>,
        v: &T<D>,
        cache: &mut KvCacheLayer<Self::Storage>,
        table: &T<D>,
        slots: &T<D>,
        positions: &T<D>,
    ) -> Result<()> {
        ops::attention::kv_store(self, d, k, v, cache, table, slots, positions)
    }

    fn exec_attention(
        &self,
        d: AttnDims,
        q: &T<D>,
        cache: &KvCacheLayer<Self::Storage>,
        table: &T<D>,
        slots: &T<D>,
        positions: &T<D>,
        scale: f32,
        out: &mut T<D>,
    ) -> Result<()> {
        ops::attention::attention(self, d, q, cache, table, slots, positions, scale, out)
    }

    fn exec_router_topk(&self, d: TopKDims, logits: &T<D>, ids: &mut T<D>, weights: &mut T<D>) -> Result<()> {
        ops::select::router_topk(self, d, logits, ids, weights)
    }

    fn exec_argmax(&self, d: RowsDims, logits: &T<D>, out: &mut T<D>) -> Result<()> {
        ops::select::argmax(self, d, logits, out)
    }

    fn exec_sample(
        &self,
        d: RowsDims,
        logits: &T<D>,
        params: &SamplingParams,
        seeds: &T<D>,
        steps: &T<D>,
        out: &mut T<D>,
    ) -> Result<()> {
        ops::select::sample(self, d, logits, params, seeds, steps, out)
    }

    fn exec_gather_rows(&self, d: GatherDims, src: &T<D>, idx: &T<D>, out: &mut T<D>) -> Result<()> {
        ops::rows::gather_rows(self, d, src, idx, out)
    }

    fn exec_scatter_add_rows(
        &self,
        d: GatherDims,
        dst: &mut T<D>,
        idx: &T<D>,
        src: &T<D>,
        weights: &T<D>,
    ) -> Result<()> {
        ops::rows::scatter_add_rows(self, d, dst, idx, src, weights)
    }

    fn exec_experts(
        &self,
        d: ExpertsDims,
        x: &T<D>,
        ids: &T<D>,
        weights: &T<D>,
        experts: &[Expert<'_, Self::Storage>],
        scratch: &mut ExpertsScratch<Self::Storage>,
        out: &mut T<D>,
    ) -> Result<()> {
        ops::experts::experts(self, d, x, ids, weights, experts, scratch, out)
    }

    fn experts_on_device(&self, d: ExpertsDims, experts: &[Expert<'_, Self::Storage>]) -> bool {
        ops::experts::on_device::<D>(d, experts, self.device().info())
    }

    fn experts_scratch_rows(&self, d: ExpertsDims) -> usize {
        ops::experts::scratch_rows(d)
    }
}
