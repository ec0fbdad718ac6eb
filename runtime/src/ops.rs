//! The ops of the Llama 3.1 and Mixtral graphs: their arguments, their math, and the checks every
//! backend runs at the boundary (`check_*`). A backend's kernels receive the dims a check returns,
//! so a kernel never sees a shape or dtype it was not written for.
//!
//! Layouts are dense and row-major. "Rows" are tokens: a prefill of T tokens and a decode step of B
//! sequences both present `[rows, ...]` activations. Activations are f32 except the `x` and `y`
//! of a linear layer, which may also be bf16 or f16. Weights may be any float type.

use crate::{Backend, DType, Error, HostStorage, HostTensor, Result, Storage, Tensor};

// ---------------------------------------------------------------------------------------------
// Arguments

/// A weight matrix `[n, k]` (n outputs, k inputs, the Hugging Face `nn.Linear` layout) and how
/// its stored values are scaled: `W_real[j, l] = weight[j, l] * scale(j, l)`.
#[derive(Debug)]
pub struct Linear<S> {
    pub weight: Tensor<S>,
    pub scale: WeightScale<S>,
}

/// The scale of a weight. Scale tensors are f32 or bf16.
#[derive(Debug)]
pub enum WeightScale<S> {
    /// The stored values are the weights.
    None,
    /// One scale for the whole tensor, applied after the reduction.
    PerTensor(f32),
    /// One scale per output row, `[n]` or `[n, 1]`, applied after the reduction.
    PerChannel(Tensor<S>),
    /// One scale per `block_rows x block_cols` block, `[ceil(n / block_rows), ceil(k / block_cols)]`
    /// (DeepSeek-style 128x128 blocks), applied to each block's partial sum.
    Block { block_rows: usize, block_cols: usize, scales: Tensor<S> },
}

impl<S> Linear<S> {
    /// An unscaled weight.
    pub fn plain(weight: Tensor<S>) -> Self {
        Linear { weight, scale: WeightScale::None }
    }
}

impl Linear<HostStorage> {
    /// A copy on `backend`: the same dtypes, shapes and bytes, the same scale. How a weight
    /// prepared on the host (say, converted by `fp8::linear_to_fnuz`) reaches a device; on a host
    /// backend, an owned copy.
    pub fn upload_to<B: Backend>(&self, backend: &B) -> Result<Linear<B::Storage>> {
        let up = |t: &HostTensor| backend.upload(t.dtype(), t.shape(), &t.storage().bytes()[..t.nbytes()]);
        let scale = match &self.scale {
            WeightScale::None => WeightScale::None,
            WeightScale::PerTensor(s) => WeightScale::PerTensor(*s),
            WeightScale::PerChannel(t) => WeightScale::PerChannel(up(t)?),
            WeightScale::Block { block_rows, block_cols, scales } => {
                WeightScale::Block { block_rows: *block_rows, block_cols: *block_cols, scales: up(scales)? }
            }
        };
        Ok(Linear { weight: up(&self.weight)?, scale })
    }
}

/// One expert of a sparse MLP (Mixtral's `block_sparse_moe.experts[e]`): `down(silu(x . gate^T) *
/// (x . up^T))`, gate and up `[inter, hidden]`, down `[hidden, inter]`.
#[derive(Debug)]
pub struct Expert<'a, S> {
    pub gate: &'a Linear<S>,
    pub up: &'a Linear<S>,
    pub down: &'a Linear<S>,
}

impl<S> Clone for Expert<'_, S> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<S> Copy for Expert<'_, S> {}

/// The buffers of `experts`, allocated once for steps of up to `rows` rows of `k` picks (the
/// session's workspace). The host-routed form ([`crate::backend::experts_composed`]) gathers one
/// expert's rows into `x` and keeps its intermediates in `gate`, `up`, `act` and `out`; a backend
/// that routes on the device uses the same five for every pick's row at once (x's rows in expert
/// order, the products, each pick's output), so they hold
/// [`crate::Backend::experts_scratch_rows`] rows.
#[derive(Debug)]
pub struct ExpertsScratch<S> {
    pub idx: Tensor<S>,
    pub weights: Tensor<S>,
    pub x: Tensor<S>,
    pub gate: Tensor<S>,
    pub up: Tensor<S>,
    pub act: Tensor<S>,
    pub out: Tensor<S>,
    rows: usize,
    k: usize,
}

impl<S: Storage> ExpertsScratch<S> {
    /// Scratch on `b` for steps of at most `d.rows` rows, each picking `d.k` of `d.experts`
    /// experts of `d.hidden` / `d.inter` features.
    pub fn alloc<B: Backend<Storage = S> + ?Sized>(b: &B, d: ExpertsDims) -> Result<Self> {
        let held = b.experts_scratch_rows(d).max(d.rows);
        let f32s = |cols: usize| b.alloc(DType::F32, &[held, cols]);
        Ok(ExpertsScratch {
            idx: b.alloc(DType::U32, &[d.rows])?,
            weights: b.alloc(DType::F32, &[d.rows])?,
            x: f32s(d.hidden)?,
            gate: f32s(d.inter)?,
            up: f32s(d.inter)?,
            act: f32s(d.inter)?,
            out: f32s(d.hidden)?,
            rows: d.rows,
            k: d.k,
        })
    }

    /// The most rows a step may have.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The most picks per row a step may make.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Rows of the per-row buffers (`x`, `gate`, `up`, `act`, `out`), at least [`Self::rows`].
    pub fn held_rows(&self) -> usize {
        self.x.max_rows()
    }

    pub(crate) fn set_rows(&mut self, rows: usize) -> Result<()> {
        for t in [
            &mut self.idx,
            &mut self.weights,
            &mut self.x,
            &mut self.gate,
            &mut self.up,
            &mut self.act,
            &mut self.out,
        ] {
            t.set_rows(rows)?;
        }
        Ok(())
    }
}

/// One layer's KV cache, paged: `k` and `v` are `[num_blocks, block_size, kv_heads, head_dim]`,
/// f32, bf16 or f16. A block table (u32 `[slots, max_blocks]`, shared by every layer, passed to
/// `kv_store` and `attention`) maps a sequence slot's positions to blocks: position `p` of slot `s`
/// lives in block `table[s][p / block_size]` at offset `p % block_size`. A block is contiguous
/// (`block_size x kv_heads x head_dim` elements). The contiguous cache of one block per slot is the
/// case `block_size = capacity`, `table[s] = [s]`.
#[derive(Debug)]
pub struct KvCacheLayer<S> {
    pub k: Tensor<S>,
    pub v: Tensor<S>,
}

/// Llama 3 frequency scaling of the rotary embedding (`rope_scaling` with `rope_type: "llama3"`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// Rotary embedding over the whole head, with the Hugging Face pairing of dimension `i` with
/// `i + head_dim / 2`.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    pub head_dim: usize,
    pub theta: f64,
    pub scaling: Option<Llama3RopeScaling>,
}

impl Rope {
    /// The `head_dim / 2` inverse frequencies: `theta^(-2i / head_dim)`, then the llama3 scaling:
    /// wavelengths shorter than `original / high_freq_factor` kept, longer than
    /// `original / low_freq_factor` divided by `factor`, and a linear blend in between.
    pub fn inv_freq(&self) -> Vec<f64> {
        let half = self.head_dim / 2;
        (0..half)
            .map(|i| {
                let f = self.theta.powf(-((2 * i) as f64) / self.head_dim as f64);
                match self.scaling {
                    None => f,
                    Some(s) => {
                        let orig = s.original_max_position_embeddings as f64;
                        let low_wavelen = orig / s.low_freq_factor;
                        let high_wavelen = orig / s.high_freq_factor;
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / s.factor
                        } else {
                            let smooth = (orig / wavelen - s.low_freq_factor)
                                / (s.high_freq_factor - s.low_freq_factor);
                            (1.0 - smooth) * f / s.factor + smooth * f
                        }
                    }
                }
            })
            .collect()
    }

    pub fn check(&self) -> Result<()> {
        let op = "rope";
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return Err(arg(op, format!("head_dim {} must be even and positive", self.head_dim)));
        }
        if !(self.theta.is_finite() && self.theta > 1.0) {
            return Err(arg(op, format!("theta {} must be finite and > 1", self.theta)));
        }
        if let Some(s) = self.scaling {
            let ok = s.factor.is_finite()
                && s.factor >= 1.0
                && s.low_freq_factor > 0.0
                && s.high_freq_factor > s.low_freq_factor
                && s.original_max_position_embeddings > 0;
            if !ok {
                return Err(arg(op, format!("invalid llama3 rope scaling {s:?}")));
            }
        }
        Ok(())
    }
}

/// Sampling settings. `temperature == 0` is greedy (argmax). `top_k == 0` keeps every token;
/// `top_p == 1` keeps every token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
}

impl SamplingParams {
    pub const GREEDY: SamplingParams = SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0 };

    pub fn check(&self) -> Result<()> {
        let op = "sample";
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(arg(op, format!("temperature {} must be finite and >= 0", self.temperature)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(arg(op, format!("top_p {} must be in (0, 1]", self.top_p)));
        }
        Ok(())
    }
}

/// The uniform number in [0, 1) drawn under `seed` at `step` for `row`: a counter-based hash
/// (splitmix64 finaliser over the three counters), so every backend, CPU or GPU, draws the same
/// number without sharing generator state.
///
/// The `sample` op gives every row its own stream: row r of a step draws
/// `sample_uniform(seeds[r], steps[r], 0)`, with its sequence's seed and its sequence's step (the
/// count of tokens that sequence generated before). A sequence's draws therefore do not depend on
/// its position in a batch nor on the other sequences, and a batch samples exactly as each
/// sequence run alone. (The `row` counter stays for other uses; `sample` always passes 0.)
pub fn sample_uniform(seed: u64, step: u64, row: u64) -> f64 {
    fn mix(mut z: u64) -> u64 {
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;
    let h = mix(mix(mix(seed.wrapping_add(GOLDEN)) ^ step.wrapping_add(GOLDEN)) ^ row.wrapping_add(GOLDEN));
    // 53 random bits -> [0, 1).
    (h >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

// ---------------------------------------------------------------------------------------------
// Dims returned by the checks

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearDims {
    /// Rows of `x` and `y` (tokens).
    pub m: usize,
    /// Output features (rows of the weight).
    pub n: usize,
    /// Input features.
    pub k: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowsDims {
    pub rows: usize,
    pub cols: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeDims {
    pub rows: usize,
    pub heads: usize,
    pub head_dim: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnDims {
    /// Query rows (tokens).
    pub rows: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Sequence slots (rows of the block table).
    pub slots: usize,
    /// Positions one slot can address: `max_blocks * block_size`.
    pub capacity: usize,
    /// Positions per cache block.
    pub block_size: usize,
    /// Blocks of the cache.
    pub num_blocks: usize,
    /// Entries per row of the block table.
    pub max_blocks: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TopKDims {
    pub rows: usize,
    pub experts: usize,
    pub k: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatherDims {
    /// Rows of the full tensor.
    pub rows: usize,
    /// Rows gathered or scattered.
    pub picked: usize,
    pub cols: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertsDims {
    /// Rows of x and out (tokens).
    pub rows: usize,
    /// Picks per row.
    pub k: usize,
    /// Experts of the layer.
    pub experts: usize,
    pub hidden: usize,
    /// The experts' intermediate features.
    pub inter: usize,
}

// ---------------------------------------------------------------------------------------------
// Checks

const F32_ONLY: &[DType] = &[DType::F32];
const U32_ONLY: &[DType] = &[DType::U32];
const SCALE_TYPES: &[DType] = &[DType::F32, DType::BF16];
const CACHE_TYPES: &[DType] = &[DType::F32, DType::BF16, DType::F16];

pub(crate) fn arg(op: &'static str, msg: String) -> Error {
    Error::Argument { op, msg }
}

pub fn expect_dtype(op: &'static str, name: &'static str, got: DType, allowed: &[DType]) -> Result<()> {
    if allowed.contains(&got) {
        Ok(())
    } else {
        Err(Error::DType { op, tensor: name, got, allowed: allowed.to_vec() })
    }
}

fn shape_err(op: &'static str, name: &'static str, got: &[usize], expected: impl Into<String>) -> Error {
    Error::Shape { op, tensor: name, got: got.to_vec(), expected: expected.into() }
}

/// `shape` must have `want.len()` dims; each `Some(d)` in `want` must match. Returns the dims.
fn expect_shape<const N: usize>(
    op: &'static str,
    name: &'static str,
    shape: &[usize],
    want: [Option<usize>; N],
) -> Result<[usize; N]> {
    let describe = || {
        let dims: Vec<String> = want.iter().map(|d| d.map_or("_".into(), |d| d.to_string())).collect();
        format!("[{}]", dims.join(", "))
    };
    if shape.len() != N {
        return Err(shape_err(op, name, shape, describe()));
    }
    let mut out = [0; N];
    for i in 0..N {
        if want[i].is_some_and(|d| d != shape[i]) {
            return Err(shape_err(op, name, shape, describe()));
        }
        out[i] = shape[i];
    }
    Ok(out)
}

fn nonempty(op: &'static str, name: &'static str, shape: &[usize]) -> Result<()> {
    if shape.contains(&0) {
        return Err(shape_err(op, name, shape, "no zero-sized dimension"));
    }
    Ok(())
}

fn check_float_weight<S: Storage>(op: &'static str, w: &Linear<S>) -> Result<(usize, usize)> {
    check_named_weight(op, ("weight", "scale"), w)
}

/// [`check_float_weight`] with the weight and its scale named `names` in the errors.
fn check_named_weight<S: Storage>(
    op: &'static str,
    (weight_name, scale_name): (&'static str, &'static str),
    w: &Linear<S>,
) -> Result<(usize, usize)> {
    let weight = &w.weight;
    expect_dtype(op, weight_name, weight.dtype(), &DType::FLOATS)?;
    let [n, k] = expect_shape(op, weight_name, weight.shape(), [None, None])?;
    nonempty(op, weight_name, weight.shape())?;
    match &w.scale {
        WeightScale::None => {}
        WeightScale::PerTensor(s) => {
            if !s.is_finite() {
                return Err(arg(op, format!("per-tensor scale {s} is not finite")));
            }
        }
        WeightScale::PerChannel(s) => {
            expect_dtype(op, scale_name, s.dtype(), SCALE_TYPES)?;
            let ok = s.shape() == [n] || s.shape() == [n, 1];
            if !ok {
                return Err(shape_err(op, scale_name, s.shape(), format!("[{n}] or [{n}, 1]")));
            }
        }
        WeightScale::Block { block_rows, block_cols, scales } => {
            if *block_rows == 0 || *block_cols == 0 {
                return Err(arg(op, format!("block scale of {block_rows}x{block_cols}")));
            }
            expect_dtype(op, scale_name, scales.dtype(), SCALE_TYPES)?;
            expect_shape(
                op,
                scale_name,
                scales.shape(),
                [Some(n.div_ceil(*block_rows)), Some(k.div_ceil(*block_cols))],
            )?;
        }
    }
    Ok((n, k))
}

/// `y[m, n] = x[m, k] . W[n, k]^T`, W dequantised by its scale.
pub fn check_linear<S: Storage>(x: &Tensor<S>, w: &Linear<S>, y: &Tensor<S>) -> Result<LinearDims> {
    let op = "linear";
    let (n, k) = check_float_weight(op, w)?;
    expect_dtype(op, "x", x.dtype(), &DType::ACTIVATIONS)?;
    expect_dtype(op, "y", y.dtype(), &DType::ACTIVATIONS)?;
    let [m, _] = expect_shape(op, "x", x.shape(), [None, Some(k)])?;
    nonempty(op, "x", x.shape())?;
    expect_shape(op, "y", y.shape(), [Some(m), Some(n)])?;
    Ok(LinearDims { m, n, k })
}

/// `y[i] = x . w[i]^T` for attention's q, k and v projections (`qkv`): each product checked as
/// [`check_linear`] checks one, its weight, scale and output named `w_q`, `q_scale`, `y_q` (and
/// `_k`, `_v`) in errors; all three read the one `x` `[m, k]`.
pub fn check_qkv<S: Storage>(
    x: &Tensor<S>,
    w: [&Linear<S>; 3],
    y: [&Tensor<S>; 3],
) -> Result<[LinearDims; 3]> {
    let op = "qkv";
    let names = [("w_q", "q_scale", "y_q"), ("w_k", "k_scale", "y_k"), ("w_v", "v_scale", "y_v")];
    expect_dtype(op, "x", x.dtype(), &DType::ACTIVATIONS)?;
    let mut dims = [LinearDims { m: 0, n: 0, k: 0 }; 3];
    for (i, (w_name, scale_name, y_name)) in names.into_iter().enumerate() {
        let (n, k) = check_named_weight(op, (w_name, scale_name), w[i])?;
        let [m, _] = expect_shape(op, "x", x.shape(), [None, Some(k)])?;
        nonempty(op, "x", x.shape())?;
        expect_dtype(op, y_name, y[i].dtype(), &DType::ACTIVATIONS)?;
        expect_shape(op, y_name, y[i].shape(), [Some(m), Some(n)])?;
        dims[i] = LinearDims { m, n, k };
    }
    Ok(dims)
}

/// How a weight is scaled, for [`check_gate_up_silu`]: the kind, the scale dtype and the block
/// shape, never the scale values (two per-tensor scales may differ).
fn scale_kind<S: Storage>(scale: &WeightScale<S>) -> String {
    match scale {
        WeightScale::None => "unscaled".into(),
        WeightScale::PerTensor(_) => "per tensor".into(),
        WeightScale::PerChannel(s) => format!("per channel ({})", s.dtype()),
        WeightScale::Block { block_rows, block_cols, scales } => {
            format!("in {block_rows}x{block_cols} blocks ({})", scales.dtype())
        }
    }
}

/// `out[m, n] = silu(x . W_gate^T) * (x . W_up^T)`: the MLP's gate and up projections and their
/// SiLU product as one op. `w_gate` and `w_up` are `[n, k]` weights of the same dtype, scaled
/// alike (the same kind, scale dtype and block shape; per-tensor values may differ); x `[m, k]`
/// of any activation dtype; out and the scratch `gate`, `up` f32 `[m, n]` (where a backend
/// composes the op from `linear` and `silu_mul`, the two products land there; their contents
/// afterwards are unspecified).
pub fn check_gate_up_silu<S: Storage>(
    x: &Tensor<S>,
    w_gate: &Linear<S>,
    w_up: &Linear<S>,
    (gate, up): (&Tensor<S>, &Tensor<S>),
    out: &Tensor<S>,
) -> Result<LinearDims> {
    let op = "gate_up_silu";
    let (n, k) = check_gate_up_silu_weights(op, w_gate, w_up)?;
    expect_dtype(op, "x", x.dtype(), &DType::ACTIVATIONS)?;
    let [m, _] = expect_shape(op, "x", x.shape(), [None, Some(k)])?;
    nonempty(op, "x", x.shape())?;
    for (name, t) in [("gate", gate), ("up", up), ("out", out)] {
        expect_dtype(op, name, t.dtype(), F32_ONLY)?;
        expect_shape(op, name, t.shape(), [Some(m), Some(n)])?;
    }
    Ok(LinearDims { m, n, k })
}

/// Gate and up weights of one shape `(n, k)` and dtype, scaled alike.
fn check_gate_up_silu_weights<S: Storage>(
    op: &'static str,
    w_gate: &Linear<S>,
    w_up: &Linear<S>,
) -> Result<(usize, usize)> {
    let (n, k) = check_named_weight(op, ("w_gate", "gate_scale"), w_gate)?;
    check_named_weight(op, ("w_up", "up_scale"), w_up)?;
    if w_up.weight.shape() != w_gate.weight.shape() {
        return Err(shape_err(op, "w_up", w_up.weight.shape(), format!("[{n}, {k}] (as w_gate)")));
    }
    expect_dtype(op, "w_up", w_up.weight.dtype(), &[w_gate.weight.dtype()])?;
    let (gate_kind, up_kind) = (scale_kind(&w_gate.scale), scale_kind(&w_up.scale));
    if gate_kind != up_kind {
        return Err(Error::ScaleMismatch {
            op,
            tensor: "w_up",
            got: up_kind,
            like: "w_gate",
            expected: gate_kind,
        });
    }
    Ok((n, k))
}

/// `y = x / sqrt(mean(x^2) + eps) * weight`, per row; x, y f32 `[rows, cols]`, weight `[cols]`.
pub fn check_rms_norm<S: Storage>(
    x: &Tensor<S>,
    weight: &Tensor<S>,
    eps: f32,
    y: &Tensor<S>,
) -> Result<RowsDims> {
    let op = "rms_norm";
    expect_dtype(op, "x", x.dtype(), F32_ONLY)?;
    expect_dtype(op, "y", y.dtype(), F32_ONLY)?;
    expect_dtype(op, "weight", weight.dtype(), &DType::FLOATS)?;
    let [rows, cols] = expect_shape(op, "x", x.shape(), [None, None])?;
    nonempty(op, "x", x.shape())?;
    expect_shape(op, "weight", weight.shape(), [Some(cols)])?;
    expect_shape(op, "y", y.shape(), [Some(rows), Some(cols)])?;
    if !(eps.is_finite() && eps > 0.0) {
        return Err(arg(op, format!("eps {eps} must be finite and > 0")));
    }
    Ok(RowsDims { rows, cols })
}

/// Rotates `x [rows, heads, head_dim]` in place by the angles `positions[row] * inv_freq[i]`.
pub fn check_rope<S: Storage>(x: &Tensor<S>, positions: &Tensor<S>, rope: &Rope) -> Result<RopeDims> {
    let op = "rope";
    rope.check()?;
    expect_dtype(op, "x", x.dtype(), F32_ONLY)?;
    expect_dtype(op, "positions", positions.dtype(), U32_ONLY)?;
    let [rows, heads, head_dim] = expect_shape(op, "x", x.shape(), [None, None, Some(rope.head_dim)])?;
    nonempty(op, "x", x.shape())?;
    expect_shape(op, "positions", positions.shape(), [Some(rows)])?;
    Ok(RopeDims { rows, heads, head_dim })
}

/// Elementwise ops over two f32 tensors of the same `[rows, cols]` shape, plus the output.
pub fn check_same_f32<S: Storage>(
    op: &'static str,
    named: &[(&'static str, &Tensor<S>)],
) -> Result<RowsDims> {
    let (first_name, first) = named[0];
    expect_dtype(op, first_name, first.dtype(), F32_ONLY)?;
    let [rows, cols] = expect_shape(op, first_name, first.shape(), [None, None])?;
    nonempty(op, first_name, first.shape())?;
    for &(name, t) in &named[1..] {
        expect_dtype(op, name, t.dtype(), F32_ONLY)?;
        expect_shape(op, name, t.shape(), [Some(rows), Some(cols)])?;
    }
    Ok(RowsDims { rows, cols })
}

/// `out[r] = table[ids[r]]` dequantised; table `[vocab, cols]`, ids u32 `[rows]`, out f32.
pub fn check_embedding<S: Storage>(
    table: &Linear<S>,
    ids: &Tensor<S>,
    out: &Tensor<S>,
) -> Result<GatherDims> {
    let op = "embedding";
    let (vocab, cols) = check_float_weight(op, table)?;
    expect_dtype(op, "ids", ids.dtype(), U32_ONLY)?;
    expect_dtype(op, "out", out.dtype(), F32_ONLY)?;
    let [picked] = expect_shape(op, "ids", ids.shape(), [None])?;
    nonempty(op, "ids", ids.shape())?;
    expect_shape(op, "out", out.shape(), [Some(picked), Some(cols)])?;
    Ok(GatherDims { rows: vocab, picked, cols })
}

/// The cache `[num_blocks, block_size, kv_heads, head_dim]` and block table `[slots, max_blocks]`
/// (u32): `[num_blocks, block_size, kv_heads, head_dim, slots, max_blocks]`.
fn check_cache<S: Storage>(
    op: &'static str,
    cache: &KvCacheLayer<S>,
    table: &Tensor<S>,
) -> Result<[usize; 6]> {
    expect_dtype(op, "k_cache", cache.k.dtype(), CACHE_TYPES)?;
    expect_dtype(op, "v_cache", cache.v.dtype(), CACHE_TYPES)?;
    let [blocks, block_size, kv_heads, head_dim] =
        expect_shape(op, "k_cache", cache.k.shape(), [None, None, None, None])?;
    nonempty(op, "k_cache", cache.k.shape())?;
    if cache.v.shape() != cache.k.shape() {
        return Err(shape_err(op, "v_cache", cache.v.shape(), format!("{:?} (as k_cache)", cache.k.shape())));
    }
    expect_dtype(op, "block_table", table.dtype(), U32_ONLY)?;
    let [slots, max_blocks] = expect_shape(op, "block_table", table.shape(), [None, None])?;
    nonempty(op, "block_table", table.shape())?;
    // Block ids are u32 and positions u32 (the kernels' arithmetic).
    if blocks > u32::MAX as usize || max_blocks.checked_mul(block_size).is_none_or(|c| c > u32::MAX as usize)
    {
        return Err(arg(
            op,
            format!("{blocks} blocks of {block_size} positions, {max_blocks} per slot: beyond u32"),
        ));
    }
    Ok([blocks, block_size, kv_heads, head_dim, slots, max_blocks])
}

fn attn_dims(rows: usize, heads: usize, c: [usize; 6]) -> AttnDims {
    let [num_blocks, block_size, kv_heads, head_dim, slots, max_blocks] = c;
    AttnDims {
        rows,
        heads,
        kv_heads,
        head_dim,
        slots,
        capacity: max_blocks * block_size,
        block_size,
        num_blocks,
        max_blocks,
    }
}

fn check_row_index<S: Storage>(
    op: &'static str,
    name: &'static str,
    t: &Tensor<S>,
    rows: usize,
) -> Result<()> {
    expect_dtype(op, name, t.dtype(), U32_ONLY)?;
    expect_shape(op, name, t.shape(), [Some(rows)])?;
    Ok(())
}

/// Stores `k, v [rows, kv_heads, head_dim]` (f32) at position `positions[r]` of slot `slots[r]`:
/// `cache[table[s][p / block_size], p % block_size]`.
pub fn check_kv_store<S: Storage>(
    k: &Tensor<S>,
    v: &Tensor<S>,
    cache: &KvCacheLayer<S>,
    table: &Tensor<S>,
    slots: &Tensor<S>,
    positions: &Tensor<S>,
) -> Result<AttnDims> {
    let op = "kv_store";
    let c = check_cache(op, cache, table)?;
    let [_, _, kv_heads, head_dim, _, _] = c;
    expect_dtype(op, "k", k.dtype(), F32_ONLY)?;
    expect_dtype(op, "v", v.dtype(), F32_ONLY)?;
    let [rows, _, _] = expect_shape(op, "k", k.shape(), [None, Some(kv_heads), Some(head_dim)])?;
    nonempty(op, "k", k.shape())?;
    expect_shape(op, "v", v.shape(), [Some(rows), Some(kv_heads), Some(head_dim)])?;
    check_row_index(op, "slots", slots, rows)?;
    check_row_index(op, "positions", positions, rows)?;
    Ok(attn_dims(rows, kv_heads, c))
}

/// Causal attention of `q [rows, heads, head_dim]` over positions `0..=positions[r]` of slot
/// `slots[r]` (read through the block table, as [`check_kv_store`] writes them) with
/// grouped-query heads (query head h reads kv head `h / (heads / kv_heads)`), softmax scale
/// `scale`, into `out [rows, heads, head_dim]` (f32). Prefill (rows = the prompt's positions) and
/// batched decode (one row per sequence) are the same op.
pub fn check_attention<S: Storage>(
    q: &Tensor<S>,
    cache: &KvCacheLayer<S>,
    table: &Tensor<S>,
    slots: &Tensor<S>,
    positions: &Tensor<S>,
    scale: f32,
    out: &Tensor<S>,
) -> Result<AttnDims> {
    let op = "attention";
    let c = check_cache(op, cache, table)?;
    let [_, _, kv_heads, head_dim, _, _] = c;
    expect_dtype(op, "q", q.dtype(), F32_ONLY)?;
    expect_dtype(op, "out", out.dtype(), F32_ONLY)?;
    let [rows, heads, _] = expect_shape(op, "q", q.shape(), [None, None, Some(head_dim)])?;
    nonempty(op, "q", q.shape())?;
    if !heads.is_multiple_of(kv_heads) {
        return Err(arg(op, format!("{heads} query heads is not a multiple of {kv_heads} kv heads")));
    }
    expect_shape(op, "out", out.shape(), [Some(rows), Some(heads), Some(head_dim)])?;
    check_row_index(op, "slots", slots, rows)?;
    check_row_index(op, "positions", positions, rows)?;
    if !(scale.is_finite() && scale > 0.0) {
        return Err(arg(op, format!("softmax scale {scale} must be finite and > 0")));
    }
    Ok(attn_dims(rows, heads, c))
}

/// Router: softmax over `logits [rows, experts]` (f32), the `k` largest (ties to the lower
/// index, in descending order), renormalised to sum to 1; ids u32 and weights f32 `[rows, k]`.
pub fn check_router_topk<S: Storage>(
    logits: &Tensor<S>,
    k: usize,
    ids: &Tensor<S>,
    weights: &Tensor<S>,
) -> Result<TopKDims> {
    let op = "router_topk";
    expect_dtype(op, "logits", logits.dtype(), F32_ONLY)?;
    let [rows, experts] = expect_shape(op, "logits", logits.shape(), [None, None])?;
    nonempty(op, "logits", logits.shape())?;
    if k == 0 || k > experts {
        return Err(arg(op, format!("top-{k} of {experts} experts")));
    }
    expect_dtype(op, "ids", ids.dtype(), U32_ONLY)?;
    expect_dtype(op, "weights", weights.dtype(), F32_ONLY)?;
    expect_shape(op, "ids", ids.shape(), [Some(rows), Some(k)])?;
    expect_shape(op, "weights", weights.shape(), [Some(rows), Some(k)])?;
    Ok(TopKDims { rows, experts, k })
}

/// Per row of `logits [rows, vocab]` (f32) one token id into `out` (u32 `[rows]`).
pub fn check_pick<S: Storage>(op: &'static str, logits: &Tensor<S>, out: &Tensor<S>) -> Result<RowsDims> {
    expect_dtype(op, "logits", logits.dtype(), F32_ONLY)?;
    let [rows, cols] = expect_shape(op, "logits", logits.shape(), [None, None])?;
    nonempty(op, "logits", logits.shape())?;
    if u32::try_from(cols).is_err() {
        return Err(shape_err(op, "logits", logits.shape(), "a vocabulary that fits u32"));
    }
    check_row_index(op, "out", out, rows)?;
    Ok(RowsDims { rows, cols })
}

/// Seeded sampling: `check_pick` plus one u32 seed and one u32 step per row (`seeds`, `steps`
/// `[rows]`); row r draws `sample_uniform(seeds[r], steps[r], 0)` (see [`sample_uniform`]).
pub fn check_sample<S: Storage>(
    logits: &Tensor<S>,
    params: &SamplingParams,
    seeds: &Tensor<S>,
    steps: &Tensor<S>,
    out: &Tensor<S>,
) -> Result<RowsDims> {
    let op = "sample";
    params.check()?;
    let d = check_pick(op, logits, out)?;
    check_row_index(op, "seeds", seeds, d.rows)?;
    check_row_index(op, "steps", steps, d.rows)?;
    Ok(d)
}

fn check_rows_pick<S: Storage>(
    op: &'static str,
    (full_name, full): (&'static str, &Tensor<S>),
    idx: &Tensor<S>,
    (part_name, part): (&'static str, &Tensor<S>),
) -> Result<GatherDims> {
    expect_dtype(op, full_name, full.dtype(), F32_ONLY)?;
    expect_dtype(op, part_name, part.dtype(), F32_ONLY)?;
    let [rows, cols] = expect_shape(op, full_name, full.shape(), [None, None])?;
    nonempty(op, full_name, full.shape())?;
    expect_dtype(op, "idx", idx.dtype(), U32_ONLY)?;
    let [picked] = expect_shape(op, "idx", idx.shape(), [None])?;
    nonempty(op, "idx", idx.shape())?;
    expect_shape(op, part_name, part.shape(), [Some(picked), Some(cols)])?;
    Ok(GatherDims { rows, picked, cols })
}

/// `out[i] = src[idx[i]]`; src f32 `[rows, cols]`, idx u32 `[picked]`, out `[picked, cols]`.
pub fn check_gather_rows<S: Storage>(
    src: &Tensor<S>,
    idx: &Tensor<S>,
    out: &Tensor<S>,
) -> Result<GatherDims> {
    check_rows_pick("gather_rows", ("src", src), idx, ("out", out))
}

/// `dst[idx[i]] += weights[i] * src[i]`, in order of i; dst f32 `[rows, cols]`, idx u32
/// `[picked]`, src `[picked, cols]`, weights f32 `[picked]`. (Mixtral's expert combine.)
pub fn check_scatter_add_rows<S: Storage>(
    dst: &Tensor<S>,
    idx: &Tensor<S>,
    src: &Tensor<S>,
    weights: &Tensor<S>,
) -> Result<GatherDims> {
    let op = "scatter_add_rows";
    let dims = check_rows_pick(op, ("dst", dst), idx, ("src", src))?;
    expect_dtype(op, "weights", weights.dtype(), F32_ONLY)?;
    expect_shape(op, "weights", weights.shape(), [Some(dims.picked)])?;
    Ok(dims)
}

/// Mixtral's sparse MLP: `out[r] = sum over s < k of weights[r][s] * expert_e(x[r])`, `e =
/// ids[r][s]`, each `expert_e` an [`Expert`]; x, out f32 `[rows, hidden]`, ids u32 and weights f32
/// `[rows, k]`. Every expert has one shape (gate and up `[inter, hidden]` of one dtype, scaled
/// alike; down `[hidden, inter]`). The scratch holds `rows` rows of `k` picks. Data-dependent (the kernel's):
/// an id beyond the experts is `IndexOutOfRange`, a row naming one expert twice an `Argument`
/// error.
pub fn check_experts<S: Storage>(
    x: &Tensor<S>,
    ids: &Tensor<S>,
    weights: &Tensor<S>,
    experts: &[Expert<'_, S>],
    scratch: &ExpertsScratch<S>,
    out: &Tensor<S>,
) -> Result<ExpertsDims> {
    let op = "experts";
    let first = experts.first().ok_or_else(|| arg(op, "no experts".into()))?;
    let (inter, hidden) = check_named_weight(op, ("w_gate", "gate_scale"), first.gate)?;
    for e in experts {
        let gate = check_gate_up_silu_weights(op, e.gate, e.up)?;
        if gate != (inter, hidden) {
            return Err(shape_err(
                op,
                "w_gate",
                e.gate.weight.shape(),
                format!("[{inter}, {hidden}] (as expert 0)"),
            ));
        }
        let down = check_named_weight(op, ("w_down", "down_scale"), e.down)?;
        if down != (hidden, inter) {
            return Err(shape_err(op, "w_down", e.down.weight.shape(), format!("[{hidden}, {inter}]")));
        }
    }
    expect_dtype(op, "x", x.dtype(), F32_ONLY)?;
    let [rows, _] = expect_shape(op, "x", x.shape(), [None, Some(hidden)])?;
    nonempty(op, "x", x.shape())?;
    expect_dtype(op, "ids", ids.dtype(), U32_ONLY)?;
    let [_, k] = expect_shape(op, "ids", ids.shape(), [Some(rows), None])?;
    nonempty(op, "ids", ids.shape())?;
    if k > experts.len() {
        return Err(arg(op, format!("{k} picks per row of {} experts", experts.len())));
    }
    expect_dtype(op, "weights", weights.dtype(), F32_ONLY)?;
    expect_shape(op, "weights", weights.shape(), [Some(rows), Some(k)])?;
    expect_dtype(op, "out", out.dtype(), F32_ONLY)?;
    expect_shape(op, "out", out.shape(), [Some(rows), Some(hidden)])?;
    if scratch.rows() < rows
        || scratch.k() < k
        || scratch.x.shape()[1..] != [hidden]
        || scratch.gate.shape()[1..] != [inter]
    {
        return Err(arg(
            op,
            format!(
                "scratch of {} rows of {} picks of {:?} / {:?} features for {rows} rows of {k} picks of {hidden} / {inter}",
                scratch.rows(),
                scratch.k(),
                &scratch.x.shape()[1..],
                &scratch.gate.shape()[1..]
            ),
        ));
    }
    Ok(ExpertsDims { rows, k, experts: experts.len(), hidden, inter })
}
