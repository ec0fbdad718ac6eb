//! A loaded model: its config, its weights on a backend, and its graph.

use std::path::Path;
use std::time::Instant;

use memwall_runtime::cost::{self, ScaleLayout};
use memwall_runtime::{Backend, DType, Linear, Tensor};

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::graph::{Graph, MatRef, NormRef, Op, OpCost, StepShape};
use crate::quant::{self, QuantConfig};
use crate::weights::{self, FeedForward, LoadStats, Mlp, Weights};

/// What loading found and did.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadReport {
    /// Tensors of the checkpoint the graph does not read.
    pub unused: Vec<String>,
    pub stats: LoadStats,
    pub quant: Option<QuantConfig>,
    pub files: usize,
    pub seconds: f64,
}

/// A model on a backend.
pub struct Model<B: Backend> {
    pub backend: B,
    pub config: ModelConfig,
    pub weights: Weights<B::Storage>,
    pub graph: Graph,
    pub report: LoadReport,
}

impl<B: Backend> Model<B>
where
    B::Storage: 'static,
{
    /// Loads `dir` (`config.json` and the safetensors) onto `backend`. Every tensor is checked
    /// against the config before anything is allocated; `progress(done, total)` is called per
    /// tensor loaded.
    pub fn load(backend: B, dir: &Path, progress: impl FnMut(usize, usize)) -> Result<Model<B>> {
        let start = Instant::now();
        let config = ModelConfig::from_dir(dir)?;
        // `config.rs` does not keep the quantization section; read it from the same file.
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|source| crate::config::ConfigError::Io { path: path.clone(), source })?;
        let raw: serde_json::Value = serde_json::from_str(&text).map_err(crate::config::ConfigError::Json)?;
        let quant = quant::parse(&raw)?;
        let ckpt = Checkpoint::open_dir(dir)?;
        let manifest = weights::check(&config, quant.as_ref(), &ckpt)?;
        let (weights, stats) = weights::load(&backend, &config, &ckpt, &manifest, progress)?;
        let report = LoadReport {
            unused: manifest.unused,
            stats,
            quant,
            files: ckpt.files.len(),
            seconds: start.elapsed().as_secs_f64(),
        };
        let graph = Graph::build(&config);
        Ok(Model { backend, config, weights, graph, report })
    }
}

impl<B: Backend> Model<B> {
    /// The matrix an op names.
    pub fn matrix(&self, m: MatRef) -> Result<&Linear<B::Storage>> {
        let w = &self.weights;
        let layer = |l: usize| {
            w.layers
                .get(l)
                .ok_or_else(|| ModelError::Session(format!("the graph names layer {l}, not loaded")))
        };
        let dense = |l: usize| -> Result<&Mlp<B::Storage>> {
            match &layer(l)?.ffn {
                FeedForward::Dense(m) => Ok(m),
                FeedForward::Moe { .. } => Err(ModelError::Session(format!("layer {l} has no dense MLP"))),
            }
        };
        Ok(match m {
            MatRef::Embed => &w.embed,
            MatRef::LmHead => w.lm_head.as_ref().unwrap_or(&w.embed),
            MatRef::Q(l) => &layer(l)?.q,
            MatRef::K(l) => &layer(l)?.k,
            MatRef::V(l) => &layer(l)?.v,
            MatRef::O(l) => &layer(l)?.o,
            MatRef::Gate(l) => &dense(l)?.gate,
            MatRef::Up(l) => &dense(l)?.up,
            MatRef::Down(l) => &dense(l)?.down,
            MatRef::Router(l) => match &layer(l)?.ffn {
                FeedForward::Moe { router, .. } => router,
                FeedForward::Dense(_) => return Err(ModelError::Session(format!("layer {l} has no router"))),
            },
        })
    }

    /// The experts of a Mixtral layer.
    pub fn experts(&self, layer: usize) -> Result<&[Mlp<B::Storage>]> {
        match self.weights.layers.get(layer).map(|l| &l.ffn) {
            Some(FeedForward::Moe { experts, .. }) => Ok(experts),
            _ => Err(ModelError::Session(format!("layer {layer} has no experts"))),
        }
    }

    pub fn norm(&self, n: NormRef) -> Result<&Tensor<B::Storage>> {
        let layer =
            |l: usize| self.weights.layers.get(l).ok_or_else(|| ModelError::Session(format!("no layer {l}")));
        Ok(match n {
            NormRef::Attn(l) => &layer(l)?.attn_norm,
            NormRef::Mlp(l) => &layer(l)?.mlp_norm,
            NormRef::Final => &self.weights.final_norm,
        })
    }

    /// Bytes read and FLOPs of `op` in a step shaped `s`, with a KV cache of `cache_dtype`.
    pub fn op_cost(&self, op: &Op, s: &StepShape, cache_dtype: DType) -> OpCost {
        let c = &self.config;
        let f32b = 4u64;
        let rows = s.rows as u64;
        let h = c.hidden_size as u64;
        // Weight, scales and x read once (`memwall_runtime::cost`, the one place bytes are counted);
        // activations are f32. Shapes come from loaded tensors, so the count cannot overflow; 0 if
        // it somehow did.
        let traffic = |w: &Linear<B::Storage>, m: u64| {
            let (n, k) = (w.weight.shape()[0], w.weight.shape()[1]);
            cost::linear_traffic(m as usize, n, k, w.weight.dtype(), ScaleLayout::of(&w.scale), DType::F32)
                .unwrap_or_default()
        };
        let linear_bytes = |w: &Linear<B::Storage>| -> u64 {
            let t = traffic(w, 0);
            t.weight + t.scales
        };
        let linear = |w: &Linear<B::Storage>, m: u64| -> OpCost {
            let (n, k) = (w.weight.shape()[0] as u64, w.weight.shape()[1] as u64);
            OpCost { bytes_read: traffic(w, m).read(), flops: 2 * m * n * k }
        };
        match op {
            Op::Embedding { .. } => {
                // One row of the table per token (and its scales, if any, counted whole).
                let w = &self.weights.embed;
                let row = w.weight.nbytes() as u64 / w.weight.shape()[0].max(1) as u64;
                OpCost {
                    bytes_read: rows * (row + 4) + (linear_bytes(w) - w.weight.nbytes() as u64),
                    flops: 0,
                }
            }
            Op::RmsNorm { weight, .. } => {
                let wb = self.norm(*weight).map_or(0, |t| t.nbytes() as u64);
                OpCost { bytes_read: rows * h * f32b + wb, flops: 4 * rows * h }
            }
            Op::Linear { w, x, .. } => {
                let m = if matches!(x, crate::graph::Buf::LastHidden) { s.seqs as u64 } else { rows };
                self.matrix(*w).map_or(OpCost::default(), |w| linear(w, m))
            }
            Op::Rope { heads, .. } => {
                let n = rows * *heads as u64 * c.head_dim as u64;
                OpCost { bytes_read: n * f32b + rows * 4, flops: 3 * n }
            }
            Op::KvStore { .. } => {
                OpCost { bytes_read: 2 * rows * c.kv_dim() as u64 * f32b + 8 * rows, flops: 0 }
            }
            Op::Attention { .. } => {
                // The live K and V, q and the rows' slot and position (`memwall_runtime::cost`).
                let bytes = cost::attention_traffic(
                    s.rows,
                    s.attended,
                    c.num_heads,
                    c.num_kv_heads,
                    c.head_dim,
                    cache_dtype,
                    cache_dtype,
                    DType::F32,
                )
                .map_or(0, |b| b.read());
                OpCost { bytes_read: bytes, flops: 4 * s.attended * c.q_dim() as u64 }
            }
            Op::Qkv { w, .. } => match (self.matrix(w[0]), self.matrix(w[1]), self.matrix(w[2])) {
                // The three weights and their scales once, x once (in q's `read`), y written.
                (Ok(q), Ok(k), Ok(v)) => {
                    let flops = [q, k, v].iter().map(|w| linear(w, rows).flops).sum();
                    OpCost { bytes_read: traffic(q, rows).read() + linear_bytes(k) + linear_bytes(v), flops }
                }
                _ => OpCost::default(),
            },
            Op::GateUpSilu { gate, up, .. } => match (self.matrix(*gate), self.matrix(*up)) {
                // Both weights and their scales once, x once (in gate's `read`), as the fused
                // kernel reads them (`cost::gate_up_silu_traffic`); the products never reach memory.
                (Ok(g), Ok(u)) => {
                    let (n, k) = (g.weight.shape()[0] as u64, g.weight.shape()[1] as u64);
                    OpCost {
                        bytes_read: traffic(g, rows).read() + linear_bytes(u),
                        flops: 4 * rows * n * k + 6 * rows * n,
                    }
                }
                _ => OpCost::default(),
            },
            Op::AddAssign { .. } => OpCost { bytes_read: 2 * rows * h * f32b, flops: rows * h },
            Op::RouterTopk { .. } => {
                let e = c.experts().0 as u64;
                OpCost { bytes_read: rows * e * f32b, flops: 4 * rows * e }
            }
            Op::Experts { layer, .. } => {
                let Ok(experts) = self.experts(*layer) else { return OpCost::default() };
                let (e, k) = c.experts();
                let counts: Vec<f64> = match s.expert_rows.get(*layer) {
                    Some(v) if v.len() == e => v.iter().map(|&n| n as f64).collect(),
                    // Uniform routing: each expert is picked by a row with probability k / e.
                    _ => vec![s.rows as f64 * k as f64 / e as f64; e],
                };
                let mut cost = OpCost::default();
                for (x, n) in experts.iter().zip(counts) {
                    let p_used = if s.expert_rows.get(*layer).is_some_and(|v| v.len() == e) {
                        if n > 0.0 { 1.0 } else { 0.0 }
                    } else {
                        1.0 - (1.0 - k as f64 / e as f64).powi(s.rows as i32)
                    };
                    let wbytes = linear_bytes(&x.gate) + linear_bytes(&x.up) + linear_bytes(&x.down);
                    let i = c.intermediate_size as f64;
                    cost += OpCost {
                        bytes_read: (p_used * wbytes as f64 + n * (h as f64 + 2.0 * i) * 4.0).round() as u64,
                        flops: (n * 6.0 * h as f64 * i).round() as u64,
                    };
                }
                cost
            }
            Op::GatherRows { src, .. } => {
                let cols =
                    if matches!(src, crate::graph::Buf::AllLogits) { c.vocab_size } else { c.hidden_size };
                OpCost { bytes_read: s.seqs as u64 * (cols as u64 * f32b + 4), flops: 0 }
            }
        }
    }

    /// The summed cost of a step's ops.
    pub fn step_cost(&self, s: &StepShape, all_logits: bool, cache_dtype: DType) -> OpCost {
        let mut total = OpCost::default();
        for op in self.graph.step_ops(all_logits) {
            total += self.op_cost(op, s, cache_dtype);
        }
        total
    }
}
