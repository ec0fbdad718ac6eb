//! The weight manifest: every tensor the Llama / Mixtral graph needs, checked for presence, dtype
//! and shape against the config before anything is allocated or computed, then loaded onto a
//! backend. Weights keep their published dtype. On a host backend (`Storage = HostStorage`) they
//! are windows of the memory-mapped files, used in place; elsewhere they are uploaded.
//!
//! One exception: on a device whose fp8 hardware reads e4m3fnuz (`Backend::native_e4m3`, AMD
//! MI300X), e4m3fn weights are converted on the host before the upload, by the runtime's
//! `fp8::linear_to_fnuz` (the conversion its tests exercise too): each code becomes the fnuz code
//! of half its value (the same bits; 0x80, fn's -0, becomes 0x00) and the weight's scale is
//! doubled (no scale becomes a per-tensor scale of 2). Both factors are powers of two, so the
//! real weights, and every product with them, are exactly those of the checkpoint. An fn NaN code
//! has no fnuz counterpart and is a typed error naming the tensor and byte.

use std::any::{Any, TypeId};
use std::collections::{BTreeMap, BTreeSet};

use memwall_runtime::{Backend, DType, Expert, HostStorage, HostTensor, Linear, Tensor, WeightScale, fp8};
use safetensors::tensor::Dtype;

use crate::checkpoint::{Checkpoint, TensorRecord};
use crate::config::ModelConfig;
use crate::error::{CheckpointError, ModelError, Result};
use crate::quant::{Fp8Scheme, QuantConfig};

/// Dtypes a weight matrix may be stored in.
pub const MATRIX_DTYPES: &[Dtype] = &[Dtype::BF16, Dtype::F16, Dtype::F32, Dtype::F8_E4M3];
/// Dtypes a norm weight may be stored in.
pub const VECTOR_DTYPES: &[Dtype] = &[Dtype::BF16, Dtype::F16, Dtype::F32];
/// Dtypes an fp8 scale may be stored in.
pub const SCALE_DTYPES: &[Dtype] = &[Dtype::F32, Dtype::BF16];

/// What a needed tensor is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A weight matrix `[n, k]` (maybe fp8 with a scale).
    Matrix { n: usize, k: usize },
    /// A norm weight `[n]`.
    Vector { n: usize },
}

/// The names and kinds of every tensor the graph of `config` reads, in graph order.
pub fn needed(config: &ModelConfig) -> Vec<(String, Kind)> {
    let h = config.hidden_size;
    let i = config.intermediate_size;
    let mut out =
        vec![("model.embed_tokens.weight".to_string(), Kind::Matrix { n: config.vocab_size, k: h })];
    for l in 0..config.num_layers {
        let p = format!("model.layers.{l}");
        out.push((format!("{p}.input_layernorm.weight"), Kind::Vector { n: h }));
        out.push((format!("{p}.self_attn.q_proj.weight"), Kind::Matrix { n: config.q_dim(), k: h }));
        out.push((format!("{p}.self_attn.k_proj.weight"), Kind::Matrix { n: config.kv_dim(), k: h }));
        out.push((format!("{p}.self_attn.v_proj.weight"), Kind::Matrix { n: config.kv_dim(), k: h }));
        out.push((format!("{p}.self_attn.o_proj.weight"), Kind::Matrix { n: h, k: config.q_dim() }));
        out.push((format!("{p}.post_attention_layernorm.weight"), Kind::Vector { n: h }));
        match config.moe {
            None => {
                out.push((format!("{p}.mlp.gate_proj.weight"), Kind::Matrix { n: i, k: h }));
                out.push((format!("{p}.mlp.up_proj.weight"), Kind::Matrix { n: i, k: h }));
                out.push((format!("{p}.mlp.down_proj.weight"), Kind::Matrix { n: h, k: i }));
            }
            Some(moe) => {
                let m = format!("{p}.block_sparse_moe");
                out.push((format!("{m}.gate.weight"), Kind::Matrix { n: moe.num_experts, k: h }));
                for e in 0..moe.num_experts {
                    out.push((format!("{m}.experts.{e}.w1.weight"), Kind::Matrix { n: i, k: h }));
                    out.push((format!("{m}.experts.{e}.w2.weight"), Kind::Matrix { n: h, k: i }));
                    out.push((format!("{m}.experts.{e}.w3.weight"), Kind::Matrix { n: i, k: h }));
                }
            }
        }
    }
    out.push(("model.norm.weight".to_string(), Kind::Vector { n: h }));
    if !config.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), Kind::Matrix { n: config.vocab_size, k: h }));
    }
    out
}

/// A needed tensor, found and checked.
#[derive(Clone, Debug)]
pub struct Resolved {
    pub name: String,
    pub kind: Kind,
    pub rec: TensorRecord,
    pub scale: Option<ResolvedScale>,
}

#[derive(Clone, Debug)]
pub struct ResolvedScale {
    pub name: String,
    pub rec: TensorRecord,
    pub scheme: Fp8Scheme,
}

/// The checked manifest of a checkpoint: every needed tensor resolved, and the tensors left over.
#[derive(Clone, Debug)]
pub struct Manifest {
    pub tensors: Vec<Resolved>,
    /// Tensors of the checkpoint the graph does not read (`input_scale`, a tied `lm_head`, ...).
    pub unused: Vec<String>,
}

fn dtype_list(d: &[Dtype]) -> String {
    d.iter().map(|d| format!("{d:?}")).collect::<Vec<_>>().join(", ")
}

fn scale_names(weight: &str) -> Option<(String, String)> {
    let prefix = weight.strip_suffix(".weight")?;
    Some((format!("{prefix}.weight_scale"), format!("{prefix}.weight_scale_inv")))
}

/// Checks every tensor `config` needs against the checkpoint (presence, dtype, shape, fp8
/// scales) and every scale against its weight. Allocates nothing on any device.
pub fn check(
    config: &ModelConfig,
    quant: Option<&QuantConfig>,
    ckpt: &Checkpoint,
) -> Result<Manifest, CheckpointError> {
    let mut used: BTreeSet<String> = BTreeSet::new();
    let mut tensors = Vec::new();
    for (name, kind) in needed(config) {
        let rec = ckpt.tensors.get(&name).ok_or_else(|| CheckpointError::Missing { tensor: name.clone() })?;
        let (allowed, shape) = match kind {
            Kind::Matrix { n, k } => (MATRIX_DTYPES, vec![n, k]),
            Kind::Vector { n } => (VECTOR_DTYPES, vec![n]),
        };
        if !allowed.contains(&rec.st_dtype) {
            return Err(CheckpointError::WrongDType {
                tensor: name,
                got: format!("{:?}", rec.st_dtype),
                expected: dtype_list(allowed),
            });
        }
        if rec.shape != shape {
            return Err(CheckpointError::WrongShape {
                tensor: name,
                got: rec.shape.clone(),
                expected: shape,
            });
        }
        let scale = match (rec.st_dtype, kind) {
            (Dtype::F8_E4M3, Kind::Matrix { n, k }) => Some(resolve_scale(&name, n, k, quant, ckpt)?),
            _ => None,
        };
        used.insert(name.clone());
        if let Some(s) = &scale {
            used.insert(s.name.clone());
        }
        tensors.push(Resolved { name, kind, rec: rec.clone(), scale });
    }
    // Scales and fp8 weights pair up, whether the graph reads them or not.
    for (name, rec) in &ckpt.tensors {
        let weight = name
            .strip_suffix(".weight_scale_inv")
            .or_else(|| name.strip_suffix(".weight_scale"))
            .map(|p| format!("{p}.weight"));
        if let Some(weight) = weight {
            let paired = ckpt.tensors.get(&weight).is_some_and(|w| w.st_dtype == Dtype::F8_E4M3);
            if !paired {
                return Err(CheckpointError::OrphanScale { scale: name.clone(), weight });
            }
        } else if rec.st_dtype == Dtype::F8_E4M3
            && let Some((s, s_inv)) = scale_names(name)
            && !ckpt.tensors.contains_key(&s)
            && !ckpt.tensors.contains_key(&s_inv)
        {
            return Err(CheckpointError::MissingScale { tensor: name.clone() });
        }
    }

    let unused = ckpt.tensors.keys().filter(|n| !used.contains(*n)).cloned().collect();
    Ok(Manifest { tensors, unused })
}

fn resolve_scale(
    weight: &str,
    n: usize,
    k: usize,
    quant: Option<&QuantConfig>,
    ckpt: &Checkpoint,
) -> Result<ResolvedScale, CheckpointError> {
    let quant = quant.ok_or_else(|| CheckpointError::NoQuantConfig { tensor: weight.to_string() })?;
    let (s, s_inv) =
        scale_names(weight).ok_or_else(|| CheckpointError::MissingScale { tensor: weight.into() })?;
    let (name, rec) = match (ckpt.tensors.get(&s), ckpt.tensors.get(&s_inv)) {
        (Some(_), Some(_)) => return Err(CheckpointError::TwoScales { tensor: weight.to_string() }),
        (Some(r), None) => (s, r),
        (None, Some(r)) => (s_inv, r),
        (None, None) => return Err(CheckpointError::MissingScale { tensor: weight.to_string() }),
    };
    if !SCALE_DTYPES.contains(&rec.st_dtype) {
        return Err(CheckpointError::WrongDType {
            tensor: name,
            got: format!("{:?}", rec.st_dtype),
            expected: dtype_list(SCALE_DTYPES),
        });
    }
    let scheme = quant.scheme_for(&rec.shape, n, k).ok_or_else(|| CheckpointError::ScaleShape {
        scale: name.clone(),
        got: rec.shape.clone(),
        scheme: quant.scheme.map_or("any published".to_string(), |s| s.to_string()),
        n,
        k,
    })?;
    Ok(ResolvedScale { name, rec: rec.clone(), scheme })
}

// ---------------------------------------------------------------------------------------------
// Loaded weights

/// One expert's (or the dense MLP's) SwiGLU projections.
#[derive(Debug)]
pub struct Mlp<S> {
    /// `gate_proj` / `w1`, `[i, h]`.
    pub gate: Linear<S>,
    /// `up_proj` / `w3`, `[i, h]`.
    pub up: Linear<S>,
    /// `down_proj` / `w2`, `[h, i]`.
    pub down: Linear<S>,
}

impl<S> Mlp<S> {
    /// The three projections as the runtime's `experts` op takes one expert.
    pub fn expert(&self) -> Expert<'_, S> {
        Expert { gate: &self.gate, up: &self.up, down: &self.down }
    }
}

#[derive(Debug)]
pub enum FeedForward<S> {
    Dense(Mlp<S>),
    Moe { router: Linear<S>, experts: Vec<Mlp<S>> },
}

#[derive(Debug)]
pub struct LayerWeights<S> {
    pub attn_norm: Tensor<S>,
    pub q: Linear<S>,
    pub k: Linear<S>,
    pub v: Linear<S>,
    pub o: Linear<S>,
    pub mlp_norm: Tensor<S>,
    pub ffn: FeedForward<S>,
}

#[derive(Debug)]
pub struct Weights<S> {
    pub embed: Linear<S>,
    /// `None` when tied to the embedding.
    pub lm_head: Option<Linear<S>>,
    pub final_norm: Tensor<S>,
    pub layers: Vec<LayerWeights<S>>,
}

/// How the weights reached the backend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadStats {
    /// Bytes used in place from the memory maps.
    pub mapped_bytes: u64,
    /// Bytes copied to the backend.
    pub copied_bytes: u64,
    pub tensors: usize,
    /// e4m3fn weights converted to e4m3fnuz for the device (their scales, doubled, are counted
    /// in `tensors` and `copied_bytes` like any other).
    pub converted_tensors: usize,
    /// The bytes of those weights (also counted in `copied_bytes`).
    pub converted_bytes: u64,
}

/// A tensor of the checkpoint on the backend: in place when the backend keeps host memory and the
/// bytes are aligned for the dtype, else uploaded.
fn tensor_on<B: Backend>(
    backend: &B,
    ckpt: &Checkpoint,
    rec: &TensorRecord,
    dtype: DType,
    stats: &mut LoadStats,
) -> Result<Tensor<B::Storage>>
where
    B::Storage: 'static,
{
    stats.tensors += 1;
    if TypeId::of::<B::Storage>() == TypeId::of::<HostStorage>() {
        let map = ckpt.files[rec.file].map.clone();
        if let Ok(host) = HostStorage::mapped(map, rec.offset, rec.len, dtype.size()) {
            let boxed: Box<dyn Any> = Box::new(host);
            if let Ok(storage) = boxed.downcast::<B::Storage>() {
                stats.mapped_bytes += rec.len as u64;
                return Ok(Tensor::new(*storage, dtype, &rec.shape)?);
            }
        }
    }
    stats.copied_bytes += rec.len as u64;
    Ok(backend.upload(dtype, &rec.shape, ckpt.bytes(rec))?)
}

fn runtime_dtype(rec: &TensorRecord, name: &str) -> Result<DType> {
    rec.dtype().ok_or_else(|| {
        ModelError::Checkpoint(CheckpointError::WrongDType {
            tensor: name.to_string(),
            got: format!("{:?}", rec.st_dtype),
            expected: dtype_list(MATRIX_DTYPES),
        })
    })
}

fn scalar_scale(ckpt: &Checkpoint, s: &ResolvedScale) -> Result<f32> {
    let b = ckpt.bytes(&s.rec);
    let value = match (s.rec.st_dtype, b) {
        (Dtype::F32, [a, b, c, d]) => f32::from_le_bytes([*a, *b, *c, *d]),
        (Dtype::BF16, [a, b]) => half::bf16::from_le_bytes([*a, *b]).to_f32(),
        _ => {
            return Err(CheckpointError::ScaleShape {
                scale: s.name.clone(),
                got: s.rec.shape.clone(),
                scheme: "per-tensor".into(),
                n: 1,
                k: 1,
            }
            .into());
        }
    };
    if !(value.is_finite() && value > 0.0) {
        return Err(CheckpointError::ScaleValue { scale: s.name.clone(), value }.into());
    }
    Ok(value)
}

/// The scale of matrix `r` as the checkpoint stores it, its scale tensor (if it has one) made by
/// `tensor` from the scale's record and dtype.
fn matrix_scale<S>(
    ckpt: &Checkpoint,
    r: &Resolved,
    tensor: impl FnOnce(&TensorRecord, DType) -> Result<Tensor<S>>,
) -> Result<WeightScale<S>> {
    let Some(s) = &r.scale else { return Ok(WeightScale::None) };
    Ok(match s.scheme {
        Fp8Scheme::PerTensor => WeightScale::PerTensor(scalar_scale(ckpt, s)?),
        Fp8Scheme::PerChannel => WeightScale::PerChannel(tensor(&s.rec, runtime_dtype(&s.rec, &s.name)?)?),
        Fp8Scheme::Block { rows, cols } => WeightScale::Block {
            block_rows: rows,
            block_cols: cols,
            scales: tensor(&s.rec, runtime_dtype(&s.rec, &s.name)?)?,
        },
    })
}

/// A conversion error of matrix `r`, as the checkpoint error naming the tensor (and byte) at fault.
fn convert_err(ckpt: &Checkpoint, r: &Resolved, e: fp8::ConvertError) -> ModelError {
    let scale = r.scale.as_ref();
    let scale_name = || scale.map_or_else(|| r.name.clone(), |s| s.name.clone());
    ModelError::Checkpoint(match e {
        fp8::ConvertError::NanCode { offset, code } => CheckpointError::Fp8NanCode {
            tensor: r.name.clone(),
            path: ckpt.files[r.rec.file].path.clone(),
            offset,
            file_offset: r.rec.offset + offset,
            code,
        },
        fp8::ConvertError::ScaleOverflow { index, value, dtype } => {
            CheckpointError::ScaleOverflow { scale: scale_name(), index, value, dtype: dtype.to_string() }
        }
        // `check` admitted only f32 and bf16 scales of whole elements, and `load` converts only
        // e4m3fn weights, copied into owned memory; kept typed all the same.
        fp8::ConvertError::ScaleBytes { .. } => CheckpointError::WrongDType {
            tensor: scale_name(),
            got: format!("{:?}", scale.map_or(r.rec.st_dtype, |s| s.rec.st_dtype)),
            expected: dtype_list(SCALE_DTYPES),
        },
        fp8::ConvertError::NotE4m3fn { .. } => CheckpointError::WrongDType {
            tensor: r.name.clone(),
            got: format!("{:?}", r.rec.st_dtype),
            expected: dtype_list(&[Dtype::F8_E4M3]),
        },
        fp8::ConvertError::ReadOnly { tensor } => {
            return ModelError::Runtime(memwall_runtime::Error::ReadOnly {
                op: "fp8::linear_to_fnuz",
                tensor,
            });
        }
    })
}

/// An e4m3fn matrix on a device that reads e4m3fnuz: the weight and its scale copied from the
/// checkpoint into owned host memory, converted there by `fp8::linear_to_fnuz` (one pass over the
/// codes, in parallel), and uploaded.
fn fnuz_linear_on<B: Backend>(
    backend: &B,
    ckpt: &Checkpoint,
    r: &Resolved,
    stats: &mut LoadStats,
) -> Result<Linear<B::Storage>> {
    let owned = |rec: &TensorRecord, dtype: DType| -> Result<HostTensor> {
        Ok(Tensor::new(HostStorage::from_bytes(ckpt.bytes(rec))?, dtype, &rec.shape)?)
    };
    let mut host = Linear { weight: owned(&r.rec, DType::F8E4M3Fn)?, scale: matrix_scale(ckpt, r, owned)? };
    let converted = fp8::linear_to_fnuz(&mut host).map_err(|e| convert_err(ckpt, r, e))?;
    let linear = host.upload_to(backend)?;
    let scale_tensors =
        usize::from(matches!(linear.scale, WeightScale::PerChannel(_) | WeightScale::Block { .. }));
    stats.tensors += 1 + scale_tensors;
    stats.copied_bytes += (converted.code_bytes + converted.scale_bytes) as u64;
    stats.converted_tensors += 1;
    stats.converted_bytes += converted.code_bytes as u64;
    Ok(linear)
}

/// Loads the checked manifest onto `backend`; e4m3fn weights are converted to e4m3fnuz when the
/// backend's fp8 hardware reads that (see the module docs).
pub fn load<B: Backend>(
    backend: &B,
    config: &ModelConfig,
    ckpt: &Checkpoint,
    manifest: &Manifest,
    mut progress: impl FnMut(usize, usize),
) -> Result<(Weights<B::Storage>, LoadStats)>
where
    B::Storage: 'static,
{
    let mut stats = LoadStats::default();
    let mut matrices: BTreeMap<String, Linear<B::Storage>> = BTreeMap::new();
    let mut vectors: BTreeMap<String, Tensor<B::Storage>> = BTreeMap::new();
    let total = manifest.tensors.len();
    let to_fnuz = backend.native_e4m3() == DType::F8E4M3Fnuz;
    for (i, r) in manifest.tensors.iter().enumerate() {
        let dtype = runtime_dtype(&r.rec, &r.name)?;
        match r.kind {
            Kind::Vector { .. } => {
                vectors.insert(r.name.clone(), tensor_on(backend, ckpt, &r.rec, dtype, &mut stats)?);
            }
            Kind::Matrix { .. } => {
                let linear = if to_fnuz && dtype == DType::F8E4M3Fn {
                    fnuz_linear_on(backend, ckpt, r, &mut stats)?
                } else {
                    let weight = tensor_on(backend, ckpt, &r.rec, dtype, &mut stats)?;
                    let scale =
                        matrix_scale(ckpt, r, |rec, sd| tensor_on(backend, ckpt, rec, sd, &mut stats))?;
                    Linear { weight, scale }
                };
                matrices.insert(r.name.clone(), linear);
            }
        }
        progress(i + 1, total);
    }
    let missing = |name: &str| ModelError::Checkpoint(CheckpointError::Missing { tensor: name.to_string() });
    let mut mat = |name: String| matrices.remove(&name).ok_or_else(|| missing(&name));
    let embed = mat("model.embed_tokens.weight".into())?;
    let lm_head = if config.tie_word_embeddings { None } else { Some(mat("lm_head.weight".into())?) };
    let mut layers = Vec::with_capacity(config.num_layers);
    let mut vec_of = |name: String| vectors.remove(&name).ok_or_else(|| missing(&name));
    let mut norms = Vec::new();
    for l in 0..config.num_layers {
        let p = format!("model.layers.{l}");
        norms.push((
            vec_of(format!("{p}.input_layernorm.weight"))?,
            vec_of(format!("{p}.post_attention_layernorm.weight"))?,
        ));
    }
    let final_norm = vec_of("model.norm.weight".into())?;
    for (l, (attn_norm, mlp_norm)) in norms.into_iter().enumerate() {
        let p = format!("model.layers.{l}");
        let ffn = match config.moe {
            None => FeedForward::Dense(Mlp {
                gate: mat(format!("{p}.mlp.gate_proj.weight"))?,
                up: mat(format!("{p}.mlp.up_proj.weight"))?,
                down: mat(format!("{p}.mlp.down_proj.weight"))?,
            }),
            Some(moe) => {
                let m = format!("{p}.block_sparse_moe");
                let router = mat(format!("{m}.gate.weight"))?;
                let mut experts = Vec::with_capacity(moe.num_experts);
                for e in 0..moe.num_experts {
                    experts.push(Mlp {
                        gate: mat(format!("{m}.experts.{e}.w1.weight"))?,
                        up: mat(format!("{m}.experts.{e}.w3.weight"))?,
                        down: mat(format!("{m}.experts.{e}.w2.weight"))?,
                    });
                }
                FeedForward::Moe { router, experts }
            }
        };
        layers.push(LayerWeights {
            attn_norm,
            q: mat(format!("{p}.self_attn.q_proj.weight"))?,
            k: mat(format!("{p}.self_attn.k_proj.weight"))?,
            v: mat(format!("{p}.self_attn.v_proj.weight"))?,
            o: mat(format!("{p}.self_attn.o_proj.weight"))?,
            mlp_norm,
            ffn,
        });
    }
    Ok((Weights { embed, lm_head, final_norm, layers }, stats))
}
