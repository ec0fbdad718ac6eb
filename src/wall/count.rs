//! Bytes read and FLOPs done by one decode step, counted from a model config.
//!
//! One decode step of a batch of `B` sequences, each with `L` tokens already in its KV cache,
//! reads from device memory:
//! - one embedding row per sequence (the table is gathered, not streamed): `B * hidden` values;
//! - the whole lm_head (`vocab * hidden`), even when it is tied to the embedding: the logits
//!   need every row;
//! - in every layer: the q, k, v and o projections, the two RMSNorm weights, and the MLP; for a
//!   mixture of experts the router and only the experts some token of the batch picked: with
//!   `E` experts, `k` picked per token and independent uniform routing, the expected number of
//!   distinct experts is `E * (1 - (1 - k/E)^B)` (each expert is missed by one token with
//!   probability `1 - k/E`);
//! - the final RMSNorm weight;
//! - the KV cache: `2 * layers * kv_heads * head_dim * L` elements per sequence.
//!
//! Activations, the new KV entries (writes) and the sampling are not counted: they are a few MB at
//! most against GBs of weights.
//!
//! Weight formats ([`WeightDtype`]):
//! - `bf16`: every weight 2 bytes, as the models are published;
//! - `fp8`: the linear layers of the decoder blocks (q, k, v, o, the experts' gate, up and down) in
//!   an 8-bit float with one f32 scale per output row (per-channel weight scales, as the common
//!   fp8 checkpoints of these models store them); the embedding, lm_head, norms and router stay
//!   bf16, as those checkpoints keep them.
//!
//! The KV cache is bf16 in both formats.
//!
//! FLOPs: 2 per multiply-accumulate of every weight a token actually goes through (its `k`
//! experts, not the experts another token picked), plus attention over the context: `q . k` and
//! `p . v` over the `L` cached positions and the new one, `4 * heads * head_dim * (L + 1)` per
//! layer and token. Norms, activations and softmax are left out (they are O(hidden) per token).
//!
//! The seed's count ([`seed_bytes_per_token`]) reads every parameter once, 2 bytes each in bf16
//! and 1 in fp8, and no KV cache.

use memwall_model::{ModelConfig, ParamCounts};
use serde::Serialize;

use super::Error;

/// Bytes of a bf16 value.
const BF16: f64 = 2.0;
/// Bytes of an fp8 value.
const FP8: f64 = 1.0;
/// Bytes of one fp8 per-row scale (f32).
const SCALE: f64 = 4.0;
/// Bytes of one KV cache element (bf16).
pub const KV_ELEMENT_BYTES: u64 = 2;

/// How the weights of the decoder blocks are stored (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightDtype {
    Bf16,
    Fp8,
}

impl WeightDtype {
    pub const ALL: [WeightDtype; 2] = [WeightDtype::Bf16, WeightDtype::Fp8];

    pub const fn name(self) -> &'static str {
        match self {
            WeightDtype::Bf16 => "bf16",
            WeightDtype::Fp8 => "fp8",
        }
    }

    pub fn parse(s: &str) -> Result<WeightDtype, Error> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Ok(WeightDtype::Bf16),
            "fp8" | "float8" | "e4m3" | "e4m3fn" | "e4m3fnuz" => Ok(WeightDtype::Fp8),
            _ => {
                Err(Error::InvalidArgument { what: "dtype", reason: format!("{s:?}: expected bf16 or fp8") })
            }
        }
    }

    /// Bytes per parameter in the seed's count.
    pub const fn seed_bytes_per_param(self) -> f64 {
        match self {
            WeightDtype::Bf16 => BF16,
            WeightDtype::Fp8 => FP8,
        }
    }

    /// Bytes of a `[rows, cols]` linear weight of a decoder block: (values, scales).
    fn linear(self, rows: f64, cols: f64) -> (f64, f64) {
        match self {
            WeightDtype::Bf16 => (rows * cols * BF16, 0.0),
            WeightDtype::Fp8 => (rows * cols * FP8, rows * SCALE),
        }
    }
}

/// The bytes one decode step reads, by tensor family, summed over all layers and the batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct StepBytes {
    /// The gathered embedding rows.
    pub embedding: f64,
    pub lm_head: f64,
    /// q, k, v and o projections (values only; fp8 scales are in `scales`).
    pub attention: f64,
    /// Dense MLP, or the experts read (values only).
    pub mlp: f64,
    pub router: f64,
    /// Every RMSNorm weight, the final one included.
    pub norms: f64,
    /// fp8 per-row scales of the projections and experts read.
    pub scales: f64,
    pub kv_cache: f64,
    /// Expected distinct experts read per layer (1 for a dense model).
    pub experts_per_layer: f64,
}

impl StepBytes {
    pub fn weights(&self) -> f64 {
        self.embedding + self.lm_head + self.attention + self.mlp + self.router + self.norms + self.scales
    }

    pub fn total(&self) -> f64 {
        self.weights() + self.kv_cache
    }
}

/// The FLOPs of one decode step, summed over the batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct StepFlops {
    /// 2 per weight multiply-accumulate actually used.
    pub weights: f64,
    /// Attention over the context.
    pub attention: f64,
}

impl StepFlops {
    pub fn total(&self) -> f64 {
        self.weights + self.attention
    }
}

/// Expected number of distinct experts a batch of `batch` tokens reads in one layer, when each
/// token picks `k` of `experts` uniformly and independently: `E * (1 - (1 - k/E)^B)`.
pub fn expected_distinct_experts(experts: u64, k: u64, batch: u64) -> f64 {
    if experts == 0 {
        return 0.0;
    }
    let e = experts as f64;
    let miss = 1.0 - (k.min(experts) as f64) / e;
    // powi takes an i32; beyond 2^31 tokens every expert is read anyway.
    let b = i32::try_from(batch).unwrap_or(i32::MAX);
    e * (1.0 - miss.powi(b))
}

/// Bytes of KV cache per token of context, per sequence: `2 * layers * kv_heads * head_dim * 2`.
pub fn kv_bytes_per_token(config: &ModelConfig) -> f64 {
    2.0 * config.num_layers as f64 * config.kv_dim() as f64 * KV_ELEMENT_BYTES as f64
}

/// Per layer, the attention projections' bytes as stored: (values, scales).
fn attention_bytes(config: &ModelConfig, dtype: WeightDtype) -> (f64, f64) {
    let h = config.hidden_size as f64;
    let q = config.q_dim() as f64;
    let kv = config.kv_dim() as f64;
    let parts = [dtype.linear(q, h), dtype.linear(kv, h), dtype.linear(kv, h), dtype.linear(h, q)];
    parts.iter().fold((0.0, 0.0), |(w, s), (pw, ps)| (w + pw, s + ps))
}

/// One expert's (or the dense MLP's) bytes as stored: (values, scales).
fn expert_bytes(config: &ModelConfig, dtype: WeightDtype) -> (f64, f64) {
    let h = config.hidden_size as f64;
    let i = config.intermediate_size as f64;
    let parts = [dtype.linear(i, h), dtype.linear(i, h), dtype.linear(h, i)];
    parts.iter().fold((0.0, 0.0), |(w, s), (pw, ps)| (w + pw, s + ps))
}

/// The bytes one decode step of `batch` sequences at context `context` reads.
pub fn step_bytes(config: &ModelConfig, dtype: WeightDtype, batch: u64, context: u64) -> StepBytes {
    let p: ParamCounts = config.param_counts();
    let layers = config.num_layers as f64;
    let h = config.hidden_size as f64;
    let (attn, attn_scales) = attention_bytes(config, dtype);
    let (expert, expert_scales) = expert_bytes(config, dtype);
    let experts_per_layer = expected_distinct_experts(p.experts, p.experts_per_token, batch);
    StepBytes {
        embedding: batch as f64 * h * BF16,
        // A tied lm_head is the embedding matrix, read in full all the same.
        lm_head: p.embedding as f64 * BF16,
        attention: layers * attn,
        mlp: layers * experts_per_layer * expert,
        router: layers * p.router as f64 * BF16,
        norms: (layers * p.norms as f64 + p.final_norm as f64) * BF16,
        scales: layers * (attn_scales + experts_per_layer * expert_scales),
        kv_cache: batch as f64 * context as f64 * kv_bytes_per_token(config),
        experts_per_layer,
    }
}

/// The FLOPs of one decode step of `batch` sequences at context `context`.
pub fn step_flops(config: &ModelConfig, batch: u64, context: u64) -> StepFlops {
    let b = batch as f64;
    StepFlops {
        weights: b * 2.0 * matmul_params_per_token(config),
        attention: b * attention_flops_per_position(config) * (context as f64 + 1.0),
    }
}

/// The FLOPs of a prefill of `tokens` tokens of one sequence (weights, and causal attention: the
/// token at position `p` attends over `p + 1` positions).
pub fn prefill_flops(config: &ModelConfig, tokens: u64) -> StepFlops {
    let t = tokens as f64;
    StepFlops {
        weights: t * 2.0 * matmul_params_per_token(config),
        attention: attention_flops_per_position(config) * t * (t + 1.0) / 2.0,
    }
}

/// The weights one token multiplies with: the projections, its `k` experts, the router, lm_head.
fn matmul_params_per_token(config: &ModelConfig) -> f64 {
    let p = config.param_counts();
    let per_layer = p.attention + p.expert * p.experts_per_token + p.router;
    // The embedding is a gather, not a product; lm_head is the embedding when tied.
    p.layers as f64 * per_layer as f64 + p.embedding as f64
}

/// FLOPs per attended position per token, over all layers: `q . k` and `p . v`, `2 * 2 * heads *
/// head_dim` per layer.
fn attention_flops_per_position(config: &ModelConfig) -> f64 {
    4.0 * config.num_layers as f64 * config.q_dim() as f64
}

/// The seed's bytes per token: every parameter once (a tied lm_head once), 2 bytes in bf16 and 1
/// in fp8, no KV cache.
pub fn seed_bytes_per_token(config: &ModelConfig, dtype: WeightDtype) -> f64 {
    config.param_counts().total() as f64 * dtype.seed_bytes_per_param()
}

/// The bytes the weights occupy in device memory (every expert, fp8 scales included).
pub fn stored_weight_bytes(config: &ModelConfig, dtype: WeightDtype) -> f64 {
    let p = config.param_counts();
    let layers = config.num_layers as f64;
    let (attn, attn_scales) = attention_bytes(config, dtype);
    let (expert, expert_scales) = expert_bytes(config, dtype);
    let per_layer =
        attn + attn_scales + p.experts as f64 * (expert + expert_scales) + (p.router + p.norms) as f64 * BF16;
    (p.embedding + p.lm_head + p.final_norm) as f64 * BF16 + layers * per_layer
}
