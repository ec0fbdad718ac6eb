//! The `Backend` trait: memory and the ops of the Llama 3.1 / Mixtral graphs.
//!
//! Each op is a provided method that runs the op's check (`ops::check_*`) and then hands the
//! checked dims to the backend's `exec_*` kernel. Data-dependent checks (token ids below the
//! vocabulary, slots and positions inside the cache, gather indices) are the kernel's: the CPU
//! backends make them before writing anything and return the typed error.

use crate::ops::{
    self, AttnDims, Expert, ExpertsDims, ExpertsScratch, GatherDims, KvCacheLayer, Linear, LinearDims,
    RopeDims, RowsDims, SamplingParams, TopKDims,
};
use crate::{DType, Error, Result, Rope, Storage, Tensor, tensor};

/// A device that can hold tensors and run the graph's ops.
///
/// Two layers: the kernel layer (memory, `synchronize`, `native_e4m3` and the `exec_*` ops, which
/// a backend implements) and the checked layer after it (`alloc`, `upload`, `linear`, ...,
/// provided here, which no backend overrides). A backend that wraps another is [`Wrapped`], which
/// forwards every kernel-layer method, default-implemented ones included: a new kernel-layer
/// method must be forwarded there too, or a wrapper would run the default over itself and bypass
/// the inner backend's own implementation (`backend::tests` fails until it is).
pub trait Backend: Send + Sync {
    /// Memory of this device.
    type Storage: Storage;
    /// A recorded sequence of this backend's kernel launches ([`Backend::capture`]): a CUDA or
    /// HIP graph on the GPU backends, uninhabited where nothing is recorded (the CPU).
    type Graph: Recorded;

    /// Short name (`cpu`, `cpu-ref`, `cuda`, ...).
    fn name(&self) -> &'static str;

    // ---- memory (kernels) -------------------------------------------------------------------

    /// A zero-filled buffer of `bytes` bytes.
    fn exec_alloc(&self, bytes: usize) -> Result<Self::Storage>;
    /// Copies host `bytes` into the first `bytes.len()` bytes of `dst` (a tensor's current shape
    /// may use only the start of its storage, see `Tensor::set_rows`); more bytes than `dst`
    /// holds is an error.
    fn exec_write(&self, dst: &mut Self::Storage, bytes: &[u8]) -> Result<()>;
    /// Copies the first `out.len()` bytes of `src` into host `out`; more than `src` holds is an
    /// error.
    fn exec_read(&self, src: &Self::Storage, out: &mut [u8]) -> Result<()>;
    /// Sets the first `bytes` bytes of `dst` to zero (ordered after queued work); more than
    /// `dst` holds is an error. The default writes a host buffer of zeros; a backend with a fill
    /// of its own (a device memset) overrides it.
    fn exec_zero(&self, dst: &mut Self::Storage, bytes: usize) -> Result<()> {
        self.exec_write(dst, &vec![0u8; bytes])
    }
    /// Waits until all queued work is done.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// The e4m3 flavour this device's fp8 hardware reads: `F8E4M3Fnuz` on AMD CDNA3 (MI300X),
    /// `F8E4M3Fn` elsewhere (the default: the CPU backends and NVIDIA). The kernels of every
    /// backend take both flavours; this says which one weights should reach the device in, so
    /// the loader (`memwall_model::weights::load`) converts e4m3fn checkpoints to e4m3fnuz (codes
    /// mapped, scales doubled: the same real weights) when it is `F8E4M3Fnuz`.
    fn native_e4m3(&self) -> DType {
        DType::F8E4M3Fn
    }

    // ---- recording (graphs) -----------------------------------------------------------------

    /// Records the kernel launches `f` queues as a graph instead of running them, for
    /// [`Backend::replay`]: the decode step, whose launches are the same from step to step (its
    /// varying inputs, token ids and positions, live in device buffers the caller writes before
    /// each replay). `Ok(None)` without calling `f` where the backend records nothing (the
    /// default, the CPU backends): the caller then runs the work itself.
    ///
    /// While recording, `f` may only launch kernels: allocating, copying to or from the host and
    /// synchronising are errors (and so is a launcher growing its scratch: run the same work once
    /// unrecorded first). Nothing `f` queues runs until the graph is replayed. An error from `f`
    /// or from the device ends the recording and discards it.
    fn capture(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<Option<Self::Graph>> {
        let _ = f;
        Ok(None)
    }

    /// Queues the launches of `graph` (recorded by this backend) again, each with the arguments
    /// it was recorded with: the same buffers, read and written at their current contents.
    /// `Ok(false)` with nothing queued when the graph is stale (a launcher's scratch moved since
    /// it was recorded): record it again. The default, for backends that record nothing, is an
    /// `Unsupported` error.
    fn replay(&self, graph: &Self::Graph) -> Result<bool> {
        let _ = graph;
        Err(Error::Unsupported { backend: self.name(), op: "replay", reason: "it records no graphs".into() })
    }

    // ---- op kernels: called with checked dims -----------------------------------------------

    fn exec_linear(
        &self,
        d: LinearDims,
        x: &Tensor<Self::Storage>,
        w: &Linear<Self::Storage>,
        y: &mut Tensor<Self::Storage>,
    ) -> Result<()>;
    fn exec_rms_norm(
        &self,
        d: RowsDims,
        x: &Tensor<Self::Storage>,
        weight: &Tensor<Self::Storage>,
        eps: f32,
        y: &mut Tensor<Self::Storage>,
    ) -> Result<()>;
    fn exec_rope(
        &self,
        d: RopeDims,
        x: &mut Tensor<Self::Storage>,
        positions: &Tensor<Self::Storage>,
        rope: &Rope,
    ) -> Result<()>;
    fn exec_silu_mul(
        &self,
        d: RowsDims,
        gate: &Tensor<Self::Storage>,
        up: &Tensor<Self::Storage>,
        out: &mut Tensor<Self::Storage>,
    ) -> Result<()>;
    /// `gate_up_silu` (see [`Backend::gate_up_silu`]); by default [`gate_up_silu_composed`]:
    /// two `exec_linear` into the scratch, then `exec_silu_mul`.
    fn exec_gate_up_silu(
        &self,
        d: LinearDims,
        x: &Tensor<Self::Storage>,
        w_gate: &Linear<Self::Storage>,
        w_up: &Linear<Self::Storage>,
        scratch: (&mut Tensor<Self::Storage>, &mut Tensor<Self::Storage>),
        out: &mut Tensor<Self::Storage>,
    ) -> Result<()> {
        gate_up_silu_composed(self, d, x, w_gate, w_up, scratch, out)
    }
    /// `qkv` (see [`Backend::qkv`]) with the dims of each product; by default three
    /// `exec_linear`.
    fn exec_qkv(
        &self,
        d: [LinearDims; 3],
        x: &Tensor<Self::Storage>,
        w: [&Linear<Self::Storage>; 3],
        y: [&mut Tensor<Self::Storage>; 3],
    ) -> Result<()> {
        let [q, k, v] = y;
        self.exec_linear(d[0], x, w[0], q)?;
        self.exec_linear(d[1], x, w[1], k)?;
        self.exec_linear(d[2], x, w[2], v)
    }
    fn exec_add_assign(
        &self,
        d: RowsDims,
        x: &mut Tensor<Self::Storage>,
        y: &Tensor<Self::Storage>,
    ) -> Result<()>;
    fn exec_embedding(
        &self,
        d: GatherDims,
        table: &Linear<Self::Storage>,
        ids: &Tensor<Self::Storage>,
        out: &mut Tensor<Self::Storage>,
    ) -> Result<()>;
    #[allow(clippy::too_many_arguments)]
    fn exec_kv_store(
        &self,
        d: AttnDims,
        k: &Tensor<Self::Storage>,
        v: &Tensor<Self::Storage>,
        cache: &mut KvCacheLayer<Self::Storage>,
        table: &Tensor<Self::Storage>,
        slots: &Tensor<Self::Storage>,
        positions: &Tensor<Self::Storage>,
    ) -> Result<()>;
    #[allow(clippy::too_many_arguments)]
    fn exec_attention(
        &self,
        d: AttnDims,
        q: &Tensor<Self::Storage>,
        cache: &KvCacheLayer<Self::Storage>,
        table: &Tensor<Self::Storage>,
        slots: &Tensor<Self::Storage>,
        positions: &Tensor<Self::Storage>,
        scale: f32,
        out: &mut Tensor<Self::Storage>,
    ) -> Result<()>;
    fn exec_router_topk(
        &self,
        d: TopKDims,
        logits: &Tensor<Self::Storage>,
        ids: &mut Tensor<Self::Storage>,
        weights: &mut Tensor<Self::Storage>,
    ) -> Result<()>;
    fn exec_argmax(
        &self,
        d: RowsDims,
        logits: &Tensor<Self::Storage>,
        out: &mut Tensor<Self::Storage>,
    ) -> Result<()>;
    fn exec_sample(
        &self,
        d: RowsDims,
        logits: &Tensor<Self::Storage>,
        params: &SamplingParams,
        seeds: &Tensor<Self::Storage>,
        steps: &Tensor<Self::Storage>,
        out: &mut Tensor<Self::Storage>,
    ) -> Result<()>;
    fn exec_gather_rows(
        &self,
        d: GatherDims,
        src: &Tensor<Self::Storage>,
        idx: &Tensor<Self::Storage>,
        out: &mut Tensor<Self::Storage>,
    ) -> Result<()>;
    fn exec_scatter_add_rows(
        &self,
        d: GatherDims,
        dst: &mut Tensor<Self::Storage>,
        idx: &Tensor<Self::Storage>,
        src: &Tensor<Self::Storage>,
        weights: &Tensor<Self::Storage>,
    ) -> Result<()>;
    /// `experts` (see [`Backend::experts`]); by default [`experts_composed`], routed on the host.
    #[allow(clippy::too_many_arguments)]
    fn exec_experts(
        &self,
        d: ExpertsDims,
        x: &Tensor<Self::Storage>,
        ids: &Tensor<Self::Storage>,
        weights: &Tensor<Self::Storage>,
        experts: &[Expert<'_, Self::Storage>],
        scratch: &mut ExpertsScratch<Self::Storage>,
        out: &mut Tensor<Self::Storage>,
    ) -> Result<()> {
        experts_composed(self, d, x, ids, weights, experts, scratch, out)
    }
    /// Whether `exec_experts` at `d` routes on the device: it reads nothing back and queues only
    /// kernel launches, so a step holding it can be recorded as a graph ([`Backend::capture`]).
    /// False by default (the host-routed [`experts_composed`] reads the picks back).
    fn experts_on_device(&self, d: ExpertsDims, experts: &[Expert<'_, Self::Storage>]) -> bool {
        let _ = (d, experts);
        false
    }
    /// Rows of the per-row buffers (`x`, `gate`, `up`, `act`, `out`) of an [`ExpertsScratch`]
    /// for steps of at most `d.rows` rows of `d.k` picks among `d.experts`: `d.rows` for the
    /// host-routed [`experts_composed`] (one expert's rows at a time); a backend whose
    /// `exec_experts` works on every pick's row at once asks for `d.rows * d.k`, and then uses the
    /// session's scratch instead of holding its own.
    fn experts_scratch_rows(&self, d: ExpertsDims) -> usize {
        d.rows
    }

    // ---- memory (checked) -------------------------------------------------------------------

    /// A zero-filled tensor. A workspace allocated at its largest shape can then run at fewer
    /// rows with `Tensor::set_rows`, without allocating again.
    fn alloc(&self, dtype: DType, shape: &[usize]) -> Result<Tensor<Self::Storage>> {
        let bytes = tensor::nbytes(dtype, shape)?;
        Tensor::new(self.exec_alloc(bytes)?, dtype, shape)
    }

    /// A tensor holding `bytes` (the little-endian elements of `dtype`, row-major).
    fn upload(&self, dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Tensor<Self::Storage>> {
        let mut t = self.alloc(dtype, shape)?;
        self.write(&mut t, bytes)?;
        Ok(t)
    }

    /// f32 values stored as `dtype` (rounded to nearest even; fp8 saturating).
    fn upload_f32(&self, dtype: DType, shape: &[usize], values: &[f32]) -> Result<Tensor<Self::Storage>> {
        let bytes = crate::dtype::encode_f32(dtype, values)
            .ok_or_else(|| ops::arg("upload_f32", format!("{dtype} is not a float type")))?;
        self.upload(dtype, shape, &bytes)
    }

    fn upload_u32(&self, shape: &[usize], values: &[u32]) -> Result<Tensor<Self::Storage>> {
        self.upload(DType::U32, shape, bytemuck::cast_slice(values))
    }

    /// Overwrites a tensor's bytes.
    fn write(&self, dst: &mut Tensor<Self::Storage>, bytes: &[u8]) -> Result<()> {
        if bytes.len() != dst.nbytes() {
            return Err(Error::ByteLength {
                dtype: dst.dtype(),
                shape: dst.shape().to_vec(),
                expected: dst.nbytes(),
                got: bytes.len(),
            });
        }
        self.exec_write(dst.storage_mut(), bytes)
    }

    /// Sets every element of the tensor (its current shape) to zero, without a host buffer of
    /// its size where the backend can fill memory itself.
    fn zero(&self, dst: &mut Tensor<Self::Storage>) -> Result<()> {
        let bytes = dst.nbytes();
        self.exec_zero(dst.storage_mut(), bytes)
    }

    /// The tensor's bytes.
    fn read(&self, src: &Tensor<Self::Storage>) -> Result<Vec<u8>> {
        let mut out = vec![0u8; src.nbytes()];
        self.exec_read(src.storage(), &mut out)?;
        Ok(out)
    }

    /// A float tensor widened to f32.
    fn read_f32(&self, src: &Tensor<Self::Storage>) -> Result<Vec<f32>> {
        let bytes = self.read(src)?;
        crate::dtype::decode_f32(src.dtype(), &bytes)
            .ok_or_else(|| ops::arg("read_f32", format!("{} is not a float type", src.dtype())))
    }

    fn read_u32(&self, src: &Tensor<Self::Storage>) -> Result<Vec<u32>> {
        ops::expect_dtype("read_u32", "src", src.dtype(), &[DType::U32])?;
        Ok(self.read(src)?.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    // ---- ops (checked) ----------------------------------------------------------------------

    /// `y[m, n] = x[m, k] . W[n, k]^T` (GEMV for m = 1, GEMM above), W dequantised by its scale.
    fn linear(
        &self,
        x: &Tensor<Self::Storage>,
        w: &Linear<Self::Storage>,
        y: &mut Tensor<Self::Storage>,
    ) -> Result<()> {
        let d = ops::check_linear(x, w, y)?;
        self.exec_linear(d, x, w, y)
    }

    /// RMSNorm of each row, times `weight`.
    fn rms_norm(
        &self,
        x: &Tensor<Self::Storage>,
        weight: &Tensor<Self::Storage>,
        eps: f32,
        y: &mut Tensor<Self::Storage>,
    ) -> Result<()> {
        let d = ops::check_rms_norm(x, weight, eps, y)?;
        self.exec_rms_norm(d, x, weight, eps, y)
    }

    /// Rotary embedding of `x [rows, heads, head_dim]` in place at `positions [rows]`.
    fn rope(
        &self,
        x: &mut Tensor<Self::Storage>,
        positions: &Tensor<Self::Storage>,
        rope: &Rope,
    ) -> Result<()> {
        let d = ops::check_rope(x, positions, rope)?;
        self.exec_rope(d, x, positions, rope)
    }

    /// `out = silu(gate) * up`.
    fn silu_mul(
        &self,
        gate: &Tensor<Self::Storage>,
        up: &Tensor<Self::Storage>,
        out: &mut Tensor<Self::Storage>,
    ) -> Result<()> {
        let d = ops::check_same_f32("silu_mul", &[("gate", gate), ("up", up), ("out", out)])?;
        self.exec_silu_mul(d, gate, up, out)
    }

    /// `out = silu(x . W_gate^T) * (x . W_up^T)`: the gate and up projections of an MLP and their
    /// SiLU product in one op (`ops::check_gate_up_silu`), so a backend can read x and both
    /// weights in one pass. `scratch` (f32 `[m, n]` each) is where a backend that composes the op
    /// from `linear` and `silu_mul` puts the two products (the workspace stays allocated once);
    /// what it holds afterwards is unspecified.
    fn gate_up_silu(
        &self,
        x: &Tensor<Self::Storage>,
        w_gate: &Linear<Self::Storage>,
        w_up: &Linear<Self::Storage>,
        scratch: (&mut Tensor<Self::Storage>, &mut Tensor<Self::Storage>),
        out: &mut Tensor<Self::Storage>,
    ) -> Result<()> {
        let d = ops::check_gate_up_silu(x, w_gate, w_up, (&*scratch.0, &*scratch.1), out)?;
        self.exec_gate_up_silu(d, x, w_gate, w_up, scratch, out)
    }

    /// `y[i] = x . w[i]^T` for i in 0..3: attention's q, k and v projections, which read the same
    /// x, as one op (a GPU runs them as one launch at decode, so the narrow k and v products fill
    /// the device together with q). Each product is [`Backend::linear`]'s: any weight dtype and
    /// scale, its own y dtype and width; one `x` `[m, k]` for all three.
    fn qkv(
        &self,
        x: &Tensor<Self::Storage>,
        w: [&Linear<Self::Storage>; 3],
        y: [&mut Tensor<Self::Storage>; 3],
    ) -> Result<()> {
        let d = ops::check_qkv(x, w, [&*y[0], &*y[1], &*y[2]])?;
        self.exec_qkv(d, x, w, y)
    }

    /// `x += y` (the residual connection).
    fn add_assign(&self, x: &mut Tensor<Self::Storage>, y: &Tensor<Self::Storage>) -> Result<()> {
        let d = ops::check_same_f32("add_assign", &[("x", x), ("y", y)])?;
        self.exec_add_assign(d, x, y)
    }

    /// `out[r] = table[ids[r]]`, dequantised to f32; an id beyond the table is `TokenOutOfRange`.
    fn embedding(
        &self,
        table: &Linear<Self::Storage>,
        ids: &Tensor<Self::Storage>,
        out: &mut Tensor<Self::Storage>,
    ) -> Result<()> {
        let d = ops::check_embedding(table, ids, out)?;
        self.exec_embedding(d, table, ids, out)
    }

    /// Writes this step's keys and values into the cache at position `positions[r]` of slot
    /// `slots[r]`, through the block table (`ops::KvCacheLayer`).
    fn kv_store(
        &self,
        k: &Tensor<Self::Storage>,
        v: &Tensor<Self::Storage>,
        cache: &mut KvCacheLayer<Self::Storage>,
        table: &Tensor<Self::Storage>,
        slots: &Tensor<Self::Storage>,
        positions: &Tensor<Self::Storage>,
    ) -> Result<()> {
        let d = ops::check_kv_store(k, v, cache, table, slots, positions)?;
        self.exec_kv_store(d, k, v, cache, table, slots, positions)
    }

    /// Causal grouped-query attention of each query row over its sequence's cached positions
    /// `0..=positions[r]`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Tensor<Self::Storage>,
        cache: &KvCacheLayer<Self::Storage>,
        table: &Tensor<Self::Storage>,
        slots: &Tensor<Self::Storage>,
        positions: &Tensor<Self::Storage>,
        scale: f32,
        out: &mut Tensor<Self::Storage>,
    ) -> Result<()> {
        let d = ops::check_attention(q, cache, table, slots, positions, scale, out)?;
        self.exec_attention(d, q, cache, table, slots, positions, scale, out)
    }

    /// Softmax over experts, top-k, renormalised.
    fn router_topk(
        &self,
        logits: &Tensor<Self::Storage>,
        k: usize,
        ids: &mut Tensor<Self::Storage>,
        weights: &mut Tensor<Self::Storage>,
    ) -> Result<()> {
        let d = ops::check_router_topk(logits, k, ids, weights)?;
        self.exec_router_topk(d, logits, ids, weights)
    }

    /// Index of each row's largest logit (the lowest index among equals; NaN never wins).
    fn argmax(&self, logits: &Tensor<Self::Storage>, out: &mut Tensor<Self::Storage>) -> Result<()> {
        let d = ops::check_pick("argmax", logits, out)?;
        self.exec_argmax(d, logits, out)
    }

    /// One token per row drawn from softmax(logits / temperature) restricted to the top-k and then
    /// the top-p nucleus. Row r draws the uniform `ops::sample_uniform(seeds[r], steps[r], 0)`
    /// (`seeds`, `steps`: u32 `[rows]`), so each sequence has its own stream, independent of the
    /// batch it runs in.
    fn sample(
        &self,
        logits: &Tensor<Self::Storage>,
        params: &SamplingParams,
        seeds: &Tensor<Self::Storage>,
        steps: &Tensor<Self::Storage>,
        out: &mut Tensor<Self::Storage>,
    ) -> Result<()> {
        let d = ops::check_sample(logits, params, seeds, steps, out)?;
        self.exec_sample(d, logits, params, seeds, steps, out)
    }

    /// `out[i] = src[idx[i]]`.
    fn gather_rows(
        &self,
        src: &Tensor<Self::Storage>,
        idx: &Tensor<Self::Storage>,
        out: &mut Tensor<Self::Storage>,
    ) -> Result<()> {
        let d = ops::check_gather_rows(src, idx, out)?;
        self.exec_gather_rows(d, src, idx, out)
    }

    /// `dst[idx[i]] += weights[i] * src[i]`, in order of i.
    fn scatter_add_rows(
        &self,
        dst: &mut Tensor<Self::Storage>,
        idx: &Tensor<Self::Storage>,
        src: &Tensor<Self::Storage>,
        weights: &Tensor<Self::Storage>,
    ) -> Result<()> {
        let d = ops::check_scatter_add_rows(dst, idx, src, weights)?;
        self.exec_scatter_add_rows(d, dst, idx, src, weights)
    }

    /// Mixtral's sparse MLP (`ops::check_experts`): `out[r] = sum over s of weights[r][s] *
    /// down_e(silu(x[r] . gate_e^T) * (x[r] . up_e^T))`, `e = ids[r][s]`, the terms added in order
    /// of expert (the order of transformers' `index_add_`), each picked expert's weights read once
    /// for all the rows that picked it, experts no row picked not read. `scratch` serves the
    /// host-routed path ([`experts_composed`]).
    fn experts(
        &self,
        x: &Tensor<Self::Storage>,
        ids: &Tensor<Self::Storage>,
        weights: &Tensor<Self::Storage>,
        experts: &[Expert<'_, Self::Storage>],
        scratch: &mut ExpertsScratch<Self::Storage>,
        out: &mut Tensor<Self::Storage>,
    ) -> Result<()> {
        let d = ops::check_experts(x, ids, weights, experts, scratch, out)?;
        self.exec_experts(d, x, ids, weights, experts, scratch, out)
    }
}

/// A graph of recorded launches ([`Backend::Graph`]).
pub trait Recorded {
    /// The kernel launches it holds.
    fn launches(&self) -> usize;
}

impl Recorded for std::convert::Infallible {
    fn launches(&self) -> usize {
        match *self {}
    }
}

/// What a [`Wrapped`] backend adds to the backend it wraps. Each method's default changes nothing.
pub trait Hook: Send + Sync {
    /// Called before each `exec_alloc` of `bytes` bytes.
    fn on_alloc(&self, bytes: usize) {
        let _ = bytes;
    }
    /// The e4m3 flavour the wrapper reports, given the one `inner` reports.
    fn native_e4m3(&self, inner: DType) -> DType {
        inner
    }
}

/// `inner` with a [`Hook`]: the one delegating backend. Every method of the kernel layer (memory,
/// `synchronize`, `native_e4m3`, the `exec_*` ops) is forwarded to `inner`, passing through the
/// hook where it has one; the checked layer is the trait's own, so it checks once and reaches
/// `inner`'s kernels through these forwards. A kernel-layer method added to [`Backend`] is
/// forwarded here (a test holds the two lists equal).
#[derive(Debug)]
pub struct Wrapped<B, H> {
    pub inner: B,
    pub hook: H,
}

/// A [`Hook`] that reports another e4m3 flavour (see [`WithNativeE4m3`]).
#[derive(Clone, Copy, Debug)]
pub struct NativeE4m3(pub DType);

impl Hook for NativeE4m3 {
    fn native_e4m3(&self, _inner: DType) -> DType {
        self.0
    }
}

/// `gate_up_silu` from the backend's own kernels: `gate = x . W_gate^T` and `up = x . W_up^T` into
/// the scratch (f32), then `out = silu(gate) * up`. The default of
/// [`Backend::exec_gate_up_silu`], and the path of a fused backend for shapes its kernel does not
/// take. `d` must come from `ops::check_gate_up_silu`.
pub fn gate_up_silu_composed<B: Backend + ?Sized>(
    b: &B,
    d: LinearDims,
    x: &Tensor<B::Storage>,
    w_gate: &Linear<B::Storage>,
    w_up: &Linear<B::Storage>,
    (gate, up): (&mut Tensor<B::Storage>, &mut Tensor<B::Storage>),
    out: &mut Tensor<B::Storage>,
) -> Result<()> {
    b.exec_linear(d, x, w_gate, gate)?;
    b.exec_linear(d, x, w_up, up)?;
    b.exec_silu_mul(RowsDims { rows: d.m, cols: d.n }, gate, up, out)
}

/// `experts` routed on the host, from the backend's own ops: the picks and their weights are read
/// back and checked (an id beyond the experts is `IndexOutOfRange`, a row naming an expert twice an
/// `Argument` error, both before anything is written); `out` is zeroed; then for each picked
/// expert in order, its rows are gathered into the scratch, run through `gate_up_silu` and the down
/// `linear`, and added into `out` times their weights (`scatter_add_rows`). The default of
/// [`Backend::exec_experts`], and a device-routing backend's path for shapes its kernels do not
/// take. `d` must come from `ops::check_experts`.
#[allow(clippy::too_many_arguments)]
pub fn experts_composed<B: Backend + ?Sized>(
    b: &B,
    d: ExpertsDims,
    x: &Tensor<B::Storage>,
    ids: &Tensor<B::Storage>,
    weights: &Tensor<B::Storage>,
    experts: &[Expert<'_, B::Storage>],
    scratch: &mut ExpertsScratch<B::Storage>,
    out: &mut Tensor<B::Storage>,
) -> Result<()> {
    let op = "experts";
    let picks = b.read_u32(ids)?;
    let pick_w = b.read_f32(weights)?;
    let mut routed: Vec<Vec<(u32, f32)>> = vec![Vec::new(); d.experts];
    for (j, (&e, &w)) in picks.iter().zip(&pick_w).enumerate() {
        let row = j / d.k;
        let list =
            routed.get_mut(e as usize).ok_or(Error::IndexOutOfRange { op, row, index: e, len: d.experts })?;
        if list.last().is_some_and(|&(r, _)| r as usize == row) {
            return Err(Error::Argument { op, msg: format!("row {row} picks expert {e} twice") });
        }
        list.push((row as u32, w));
    }
    b.zero(out)?;
    for (expert, list) in experts.iter().zip(&routed) {
        if list.is_empty() {
            continue;
        }
        let idx: Vec<u32> = list.iter().map(|p| p.0).collect();
        let wts: Vec<f32> = list.iter().map(|p| p.1).collect();
        scratch.set_rows(list.len())?;
        let s = &mut *scratch;
        b.write(&mut s.idx, bytemuck::cast_slice(&idx))?;
        b.write(&mut s.weights, bytemuck::cast_slice(&wts))?;
        b.gather_rows(x, &s.idx, &mut s.x)?;
        b.gate_up_silu(&s.x, expert.gate, expert.up, (&mut s.gate, &mut s.up), &mut s.act)?;
        b.linear(&s.act, expert.down, &mut s.out)?;
        b.scatter_add_rows(out, &s.idx, &s.out, &s.weights)?;
    }
    Ok(())
}

/// `inner` reporting another fp8 flavour: every op is `inner`'s (whose kernels take both e4m3
/// flavours); only [`Backend::native_e4m3`] answers `native`. Loading an e4m3fn checkpoint through
/// it with `native = F8E4M3Fnuz` makes the conversion an MI300X load makes, on any machine: the
/// tests compare its results with the unconverted load's on the same `inner`.
pub type WithNativeE4m3<B> = Wrapped<B, NativeE4m3>;

impl<B> WithNativeE4m3<B> {
    pub fn new(inner: B, native: DType) -> Self {
        Wrapped { inner, hook: NativeE4m3(native) }
    }
}

type T<B> = Tensor<<B as Backend>::Storage>;
type L<B> = Linear<<B as Backend>::Storage>;

impl<B: Backend, H: Hook> Backend for Wrapped<B, H> {
    type Storage = B::Storage;
    type Graph = B::Graph;

    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn native_e4m3(&self) -> DType {
        self.hook.native_e4m3(self.inner.native_e4m3())
    }
    fn capture(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<Option<B::Graph>> {
        self.inner.capture(f)
    }
    fn replay(&self, graph: &B::Graph) -> Result<bool> {
        self.inner.replay(graph)
    }
    fn exec_alloc(&self, bytes: usize) -> Result<B::Storage> {
        self.hook.on_alloc(bytes);
        self.inner.exec_alloc(bytes)
    }
    fn exec_write(&self, dst: &mut B::Storage, bytes: &[u8]) -> Result<()> {
        self.inner.exec_write(dst, bytes)
    }
    fn exec_read(&self, src: &B::Storage, out: &mut [u8]) -> Result<()> {
        self.inner.exec_read(src, out)
    }
    fn exec_zero(&self, dst: &mut B::Storage, bytes: usize) -> Result<()> {
        self.inner.exec_zero(dst, bytes)
    }
    fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }
    fn exec_linear(&self, d: LinearDims, x: &T<B>, w: &L<B>, y: &mut T<B>) -> Result<()> {
        self.inner.exec_linear(d, x, w, y)
    }
    fn exec_rms_norm(&self, d: RowsDims, x: &T<B>, weight: &T<B>, eps: f32, y: &mut T<B>) -> Result<()> {
        self.inner.exec_rms_norm(d, x, weight, eps, y)
    }
    fn exec_rope(&self, d: RopeDims, x: &mut T<B>, positions: &T<B>, rope: &Rope) -> Result<()> {
        self.inner.exec_rope(d, x, positions, rope)
    }
    fn exec_silu_mul(&self, d: RowsDims, gate: &T<B>, up: &T<B>, out: &mut T<B>) -> Result<()> {
        self.inner.exec_silu_mul(d, gate, up, out)
    }
    fn exec_add_assign(&self, d: RowsDims, x: &mut T<B>, y: &T<B>) -> Result<()> {
        self.inner.exec_add_assign(d, x, y)
    }
    fn exec_gate_up_silu(
        &self,
        d: LinearDims,
        x: &T<B>,
        w_gate: &L<B>,
        w_up: &L<B>,
        scratch: (&mut T<B>, &mut T<B>),
        out: &mut T<B>,
    ) -> Result<()> {
        self.inner.exec_gate_up_silu(d, x, w_gate, w_up, scratch, out)
    }
    fn exec_qkv(&self, d: [LinearDims; 3], x: &T<B>, w: [&L<B>; 3], y: [&mut T<B>; 3]) -> Result<()> {
        self.inner.exec_qkv(d, x, w, y)
    }

    fn exec_embedding(&self, d: GatherDims, table: &L<B>, ids: &T<B>, out: &mut T<B>) -> Result<()> {
        self.inner.exec_embedding(d, table, ids, out)
    }
    fn exec_kv_store(
        &self,
        d: AttnDims,
        k: &T<B>,
        v: &T<B>,
        cache: &mut KvCacheLayer<B::Storage>,
        table: &T<B>,
        slots: &T<B>,
        positions: &T<B>,
    ) -> Result<()> {
        self.inner.exec_kv_store(d, k, v, cache, table, slots, positions)
    }
    fn exec_attention(
        &self,
        d: AttnDims,
        q: &T<B>,
        cache: &KvCacheLayer<B::Storage>,
        table: &T<B>,
        slots: &T<B>,
        positions: &T<B>,
        scale: f32,
        out: &mut T<B>,
    ) -> Result<()> {
        self.inner.exec_attention(d, q, cache, table, slots, positions, scale, out)
    }
    fn exec_router_topk(&self, d: TopKDims, logits: &T<B>, ids: &mut T<B>, weights: &mut T<B>) -> Result<()> {
        self.inner.exec_router_topk(d, logits, ids, weights)
    }
    fn exec_argmax(&self, d: RowsDims, logits: &T<B>, out: &mut T<B>) -> Result<()> {
        self.inner.exec_argmax(d, logits, out)
    }
    fn exec_sample(
        &self,
        d: RowsDims,
        logits: &T<B>,
        params: &SamplingParams,
        seeds: &T<B>,
        steps: &T<B>,
        out: &mut T<B>,
    ) -> Result<()> {
        self.inner.exec_sample(d, logits, params, seeds, steps, out)
    }
    fn exec_gather_rows(&self, d: GatherDims, src: &T<B>, idx: &T<B>, out: &mut T<B>) -> Result<()> {
        self.inner.exec_gather_rows(d, src, idx, out)
    }
    fn exec_scatter_add_rows(
        &self,
        d: GatherDims,
        dst: &mut T<B>,
        idx: &T<B>,
        src: &T<B>,
        weights: &T<B>,
    ) -> Result<()> {
        self.inner.exec_scatter_add_rows(d, dst, idx, src, weights)
    }
    fn exec_experts(
        &self,
        d: ExpertsDims,
        x: &T<B>,
        ids: &T<B>,
        weights: &T<B>,
        experts: &[Expert<'_, B::Storage>],
        scratch: &mut ExpertsScratch<B::Storage>,
        out: &mut T<B>,
    ) -> Result<()> {
        self.inner.exec_experts(d, x, ids, weights, experts, scratch, out)
    }
    fn experts_on_device(&self, d: ExpertsDims, experts: &[Expert<'_, B::Storage>]) -> bool {
        self.inner.experts_on_device(d, experts)
    }
    fn experts_scratch_rows(&self, d: ExpertsDims) -> usize {
        self.inner.experts_scratch_rows(d)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    /// The names of the methods declared in `src` (lines starting `fn `).
    fn methods(src: &str) -> BTreeSet<&str> {
        src.lines()
            .filter_map(|l| l.trim_start().strip_prefix("fn "))
            .map(|rest| rest.split(|c: char| !(c.is_alphanumeric() || c == '_')).next().unwrap_or(rest))
            .collect()
    }

    /// A default-implemented method that `Wrapped` did not forward would run its default over the
    /// wrapper, bypassing `inner`'s own implementation; so every method of the kernel layer (the
    /// trait up to the checked layer) must be in `Wrapped`'s impl, and nothing else.
    #[test]
    fn wrapped_forwards_every_kernel_method() {
        let src = include_str!("backend.rs");
        let section = |from: &str, to: &str| {
            let start = src.find(from).unwrap_or_else(|| panic!("`{from}` not in backend.rs"));
            let len = src[start..].find(to).unwrap_or_else(|| panic!("`{to}` not after `{from}`"));
            &src[start..start + len]
        };
        let kernel_layer = methods(section("pub trait Backend", "// ---- memory (checked)"));
        let forwarded = methods(section("Backend for Wrapped<B, H> {", "\n}\n"));
        assert!(kernel_layer.len() >= 18, "{kernel_layer:?}");
        let missing: Vec<_> = kernel_layer.difference(&forwarded).collect();
        let extra: Vec<_> = forwarded.difference(&kernel_layer).collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "Wrapped does not forward {missing:?}; forwards {extra:?}, which the kernel layer lacks"
        );
    }
}
