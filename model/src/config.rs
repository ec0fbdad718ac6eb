//! Hugging Face `config.json` of the models memwall runs: `LlamaForCausalLM` (Llama 3, 3.1, 3.2)
//! and `MixtralForCausalLM`, parsed into a validated [`ModelConfig`].
//!
//! Parsing is strict about anything that changes the math we implement: an activation other than
//! SiLU, biases on the projections, a rope scaling other than `llama3`, a sliding window shorter
//! than the context. Each rejection is a typed [`ConfigError`] that names the field. Fields that do
//! not change the math (`initializer_range`, `use_cache`, ...) are ignored.
//!
//! [`ModelConfig::param_counts`] counts the parameters from the shapes, and [`PRESETS`] holds the
//! published configs of the models the memory-wall report knows by name, so every parameter count
//! in memwall is computed from a config, never typed in.

use std::fmt;
use std::path::{Path, PathBuf};

use memwall_runtime::{DType, Llama3RopeScaling, Rope};
use serde::Serialize;
use serde_json::{Map, Value};

// ---------------------------------------------------------------------------------------------
// Errors

/// Why a `config.json` was not accepted. Every variant names the field at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("config.json is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),

    #[error("config.json must be a JSON object at the top level, found {found}")]
    NotAnObject { found: &'static str },

    #[error("config.json: required field `{field}` is missing")]
    MissingField { field: &'static str },

    #[error("config.json: field `{field}` is {found}, expected {expected}")]
    WrongType { field: &'static str, expected: &'static str, found: String },

    #[error(
        "config.json: unsupported model `{field}` = {value}; memwall runs LlamaForCausalLM (model_type \
         \"llama\") and MixtralForCausalLM (model_type \"mixtral\")"
    )]
    UnsupportedArchitecture { field: &'static str, value: String },

    #[error("config.json: `rope_scaling.rope_type` = {value:?} is not supported; only \"llama3\" is")]
    UnsupportedRopeType { value: String },

    #[error("config.json: `hidden_act` = {value:?} is not supported; only \"silu\" is")]
    UnsupportedActivation { value: String },

    #[error("config.json: `{field}` is true; memwall's projections have no bias")]
    Bias { field: &'static str },

    #[error(
        "config.json: `sliding_window` = {window} is shorter than `max_position_embeddings` = {max_positions}, \
         which changes the attention within the model's context; memwall implements full attention"
    )]
    SlidingWindow { window: u64, max_positions: usize },

    #[error(
        "config.json: `num_attention_heads` = {heads} is not a multiple of `num_key_value_heads` = {kv_heads}"
    )]
    HeadsNotMultipleOfKvHeads { heads: usize, kv_heads: usize },

    #[error("config.json: `{field}` = {value} is invalid: {reason}")]
    Invalid { field: &'static str, value: String, reason: String },

    #[error("unknown model `{name}`; known models: {known}")]
    UnknownPreset { name: String, known: String },
}

pub type Result<T, E = ConfigError> = std::result::Result<T, E>;

// ---------------------------------------------------------------------------------------------
// The config

/// The model families memwall runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Architecture {
    /// `LlamaForCausalLM`, `model_type: "llama"`.
    Llama,
    /// `MixtralForCausalLM`, `model_type: "mixtral"`.
    Mixtral,
}

impl Architecture {
    pub const fn hf_class(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Mixtral => "MixtralForCausalLM",
        }
    }

    pub const fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mixtral => "mixtral",
        }
    }
}

/// The sparse mixture of experts of a Mixtral layer: `num_experts` SwiGLU MLPs, of which the
/// router picks `experts_per_token` for each token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Moe {
    /// `num_local_experts`.
    pub num_experts: usize,
    /// `num_experts_per_tok`.
    pub experts_per_token: usize,
}

/// A validated model config. Field names follow the Hugging Face keys, except where noted.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub hidden_size: usize,
    /// Of the dense MLP, or of one expert.
    pub intermediate_size: usize,
    /// `num_hidden_layers`.
    pub num_layers: usize,
    /// `num_attention_heads`.
    pub num_heads: usize,
    /// `num_key_value_heads`; defaults to `num_attention_heads`.
    pub num_kv_heads: usize,
    /// Defaults to `hidden_size / num_attention_heads`.
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// `torch_dtype` (or the newer `dtype`): the dtype the checkpoint was published in.
    pub torch_dtype: Option<DType>,
    /// `bos_token_id`, as a list (a config may give one id, a list, or null).
    pub bos_token_ids: Vec<u32>,
    /// `eos_token_id`, as a list.
    pub eos_token_ids: Vec<u32>,
    /// Mixtral's experts; `None` for a dense model.
    pub moe: Option<Moe>,
}

impl ModelConfig {
    /// Parses the text of a `config.json`.
    pub fn from_json_str(text: &str) -> Result<ModelConfig> {
        let value: Value = serde_json::from_str(text)?;
        ModelConfig::from_json(&value)
    }

    /// Reads and parses a `config.json` file.
    pub fn from_file(path: &Path) -> Result<ModelConfig> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Io { path: path.to_path_buf(), source })?;
        ModelConfig::from_json_str(&text)
    }

    /// Reads `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<ModelConfig> {
        ModelConfig::from_file(&dir.join("config.json"))
    }

    /// Parses an already-decoded `config.json`.
    pub fn from_json(value: &Value) -> Result<ModelConfig> {
        let Value::Object(map) = value else {
            return Err(ConfigError::NotAnObject { found: json_kind(value) });
        };
        let c = Fields(map);
        let architecture = architecture(&c)?;

        let hidden_size = c.dim("hidden_size")?;
        let intermediate_size = c.dim("intermediate_size")?;
        let num_layers = c.dim("num_hidden_layers")?;
        let num_heads = c.dim("num_attention_heads")?;
        let num_kv_heads = c.opt_dim("num_key_value_heads")?.unwrap_or(num_heads);
        if num_heads % num_kv_heads != 0 {
            return Err(ConfigError::HeadsNotMultipleOfKvHeads { heads: num_heads, kv_heads: num_kv_heads });
        }
        let head_dim = match c.opt_dim("head_dim")? {
            Some(d) => d,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => {
                return Err(ConfigError::Invalid {
                    field: "head_dim",
                    value: "absent".into(),
                    reason: format!(
                        "the default hidden_size / num_attention_heads = {hidden_size} / {num_heads} is not \
                         an integer"
                    ),
                });
            }
        };
        if head_dim % 2 != 0 {
            return Err(invalid("head_dim", head_dim, "the rotary embedding needs an even head_dim"));
        }
        let vocab_size = c.dim("vocab_size")?;
        let max_position_embeddings = c.dim("max_position_embeddings")?;

        let rms_norm_eps = c.float("rms_norm_eps")?;
        if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0) {
            return Err(invalid("rms_norm_eps", rms_norm_eps, "must be finite and > 0"));
        }
        let rope_theta = c.float("rope_theta")?;
        if !(rope_theta.is_finite() && rope_theta > 1.0) {
            return Err(invalid("rope_theta", rope_theta, "must be finite and > 1"));
        }
        let rope_scaling = rope_scaling(&c)?;

        if let Some(act) = c.opt_str("hidden_act")?
            && act != "silu"
        {
            return Err(ConfigError::UnsupportedActivation { value: act.to_string() });
        }
        for field in ["attention_bias", "mlp_bias"] {
            if c.opt_bool(field)? == Some(true) {
                return Err(ConfigError::Bias { field });
            }
        }
        // A window at least as long as the context never masks anything: the math is full attention.
        if let Some(window) = c.opt_u64("sliding_window")?
            && window < max_position_embeddings as u64
        {
            return Err(ConfigError::SlidingWindow { window, max_positions: max_position_embeddings });
        }

        let tie_word_embeddings = c.opt_bool("tie_word_embeddings")?.unwrap_or(false);
        let torch_dtype = match c.opt_str("torch_dtype")? {
            Some(s) => Some(torch_dtype("torch_dtype", s)?),
            None => match c.opt_str("dtype")? {
                Some(s) => Some(torch_dtype("dtype", s)?),
                None => None,
            },
        };
        let bos_token_ids = c.token_ids("bos_token_id")?;
        let eos_token_ids = c.token_ids("eos_token_id")?;

        let moe = match architecture {
            Architecture::Llama => None,
            Architecture::Mixtral => {
                let num_experts = c.dim("num_local_experts")?;
                let experts_per_token = c.dim("num_experts_per_tok")?;
                if experts_per_token > num_experts {
                    return Err(ConfigError::Invalid {
                        field: "num_experts_per_tok",
                        value: experts_per_token.to_string(),
                        reason: format!("more than num_local_experts = {num_experts}"),
                    });
                }
                Some(Moe { num_experts, experts_per_token })
            }
        };

        let config = ModelConfig {
            architecture,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings,
            torch_dtype,
            bos_token_ids,
            eos_token_ids,
            moe,
        };
        config.rope().check().map_err(|e| ConfigError::Invalid {
            field: "rope_scaling",
            value: format!("{:?}", config.rope_scaling),
            reason: e.to_string(),
        })?;
        // Counts saturate (see `param_counts`): a total of u64::MAX means one of them overflowed.
        // Also keep the total below 2^53 so the f64 byte counts of the memory-wall report are exact.
        let total = config.param_counts().total();
        if total >= 1 << 53 {
            return Err(ConfigError::Invalid {
                field: "hidden_size",
                value: hidden_size.to_string(),
                reason: format!("the model would have {total} (>= 2^53) parameters"),
            });
        }
        Ok(config)
    }

    /// The published config of a model memwall knows by name (see [`PRESETS`]).
    pub fn preset(name: &str) -> Result<ModelConfig> {
        let preset = Preset::find(name).ok_or_else(|| ConfigError::UnknownPreset {
            name: name.to_string(),
            known: PRESETS.iter().map(|p| p.name).collect::<Vec<_>>().join(", "),
        })?;
        preset.config()
    }

    /// The rotary embedding of this model.
    pub fn rope(&self) -> Rope {
        Rope { head_dim: self.head_dim, theta: self.rope_theta, scaling: self.rope_scaling }
    }

    /// `num_heads * head_dim`: the width of the query and of the attention output.
    pub fn q_dim(&self) -> usize {
        self.num_heads.saturating_mul(self.head_dim)
    }

    /// `num_kv_heads * head_dim`: the width of the key and of the value.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads.saturating_mul(self.head_dim)
    }

    /// Experts per layer (1 for a dense model) and experts each token uses (1 for a dense model).
    pub fn experts(&self) -> (usize, usize) {
        match self.moe {
            Some(m) => (m.num_experts, m.experts_per_token),
            None => (1, 1),
        }
    }

    /// The parameters of the model, by tensor family, from the shapes in this config.
    ///
    /// Saturating arithmetic: `from_json` rejects configs whose total does not fit in a u64, so
    /// for a parsed config every count is exact; a config built by hand with absurd dimensions
    /// gets `u64::MAX` rather than a wrapped count or a panic.
    pub fn param_counts(&self) -> ParamCounts {
        let u = |x: usize| x as u64;
        let h = u(self.hidden_size);
        let (experts, experts_per_token) = self.experts();
        let embedding = u(self.vocab_size).saturating_mul(h);
        // q_proj [q_dim, h], k_proj and v_proj [kv_dim, h], o_proj [h, q_dim].
        let q = u(self.q_dim()).saturating_mul(h);
        let kv = u(self.kv_dim()).saturating_mul(h);
        ParamCounts {
            embedding,
            lm_head: if self.tie_word_embeddings { 0 } else { embedding },
            final_norm: h,
            layers: u(self.num_layers),
            attention: q.saturating_mul(2).saturating_add(kv.saturating_mul(2)),
            // gate_proj and up_proj [i, h], down_proj [h, i].
            expert: u(self.intermediate_size).saturating_mul(h).saturating_mul(3),
            experts: u(experts),
            experts_per_token: u(experts_per_token),
            router: if self.moe.is_some() { u(experts).saturating_mul(h) } else { 0 },
            norms: h.saturating_mul(2),
        }
    }
}

/// The parameter count of a model by tensor family. Per-layer fields count one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ParamCounts {
    /// `embed_tokens`: `vocab_size * hidden_size`.
    pub embedding: u64,
    /// `lm_head`: `vocab_size * hidden_size`, or 0 when tied to the embedding.
    pub lm_head: u64,
    /// The final RMSNorm weight.
    pub final_norm: u64,
    /// `num_hidden_layers`.
    pub layers: u64,
    /// Per layer: q, k, v and o projections.
    pub attention: u64,
    /// One expert's (or the dense MLP's) gate, up and down projections.
    pub expert: u64,
    /// Experts per layer (1 for a dense model).
    pub experts: u64,
    /// Experts each token goes through (1 for a dense model).
    pub experts_per_token: u64,
    /// Per layer: the router (`block_sparse_moe.gate`), 0 for a dense model.
    pub router: u64,
    /// Per layer: the input and post-attention RMSNorm weights.
    pub norms: u64,
}

impl ParamCounts {
    /// Per layer: every MLP weight (all experts).
    pub fn mlp(&self) -> u64 {
        self.expert.saturating_mul(self.experts)
    }

    /// One layer's parameters.
    pub fn per_layer(&self) -> u64 {
        self.attention.saturating_add(self.mlp()).saturating_add(self.router).saturating_add(self.norms)
    }

    /// Every parameter of the checkpoint (a tied lm_head counted once).
    pub fn total(&self) -> u64 {
        self.embedding
            .saturating_add(self.lm_head)
            .saturating_add(self.final_norm)
            .saturating_add(self.layers.saturating_mul(self.per_layer()))
    }

    /// The parameters one token goes through: all but the experts the router did not pick (the
    /// "active parameters" of the Mixtral announcements, embedding table included).
    pub fn active_per_token(&self) -> u64 {
        let per_layer = self
            .attention
            .saturating_add(self.expert.saturating_mul(self.experts_per_token))
            .saturating_add(self.router)
            .saturating_add(self.norms);
        self.embedding
            .saturating_add(self.lm_head)
            .saturating_add(self.final_norm)
            .saturating_add(self.layers.saturating_mul(per_layer))
    }
}

// ---------------------------------------------------------------------------------------------
// Presets

/// A published model config, embedded so counts come from the config, not from a typed-in total.
#[derive(Clone, Copy, Debug)]
pub struct Preset {
    /// The name the command line accepts.
    pub name: &'static str,
    /// The Hugging Face repository the config was published in.
    pub hf_repo: &'static str,
    /// The published `config.json`, its fields that matter to memwall, verbatim.
    pub config_json: &'static str,
}

impl Preset {
    /// Finds a preset by its name or its Hugging Face repository, ignoring case and punctuation
    /// (`llama-3.1-8b`, `Llama3.1-8B`, `meta-llama/Llama-3.1-8B` all name the same preset).
    pub fn find(name: &str) -> Option<&'static Preset> {
        let key = normalize(name);
        PRESETS.iter().find(|p| {
            let repo = p.hf_repo.rsplit('/').next().unwrap_or(p.hf_repo);
            key == normalize(p.name) || key == normalize(repo) || key == normalize(p.hf_repo)
        })
    }

    pub fn config(&self) -> Result<ModelConfig> {
        ModelConfig::from_json_str(self.config_json)
    }
}

fn normalize(s: &str) -> String {
    s.chars().filter(|c| c.is_ascii_alphanumeric()).map(|c| c.to_ascii_lowercase()).collect()
}

/// The models the memory-wall report knows by name, in the order it lists them.
pub const PRESETS: &[Preset] = &[
    Preset { name: "llama-3.1-8b", hf_repo: "meta-llama/Llama-3.1-8B", config_json: LLAMA_3_1_8B },
    Preset { name: "llama-3.1-70b", hf_repo: "meta-llama/Llama-3.1-70B", config_json: LLAMA_3_1_70B },
    Preset { name: "llama-3.1-405b", hf_repo: "meta-llama/Llama-3.1-405B", config_json: LLAMA_3_1_405B },
    Preset { name: "llama-3.2-1b", hf_repo: "meta-llama/Llama-3.2-1B", config_json: LLAMA_3_2_1B },
    Preset { name: "llama-3.2-3b", hf_repo: "meta-llama/Llama-3.2-3B", config_json: LLAMA_3_2_3B },
    Preset { name: "mixtral-8x7b", hf_repo: "mistralai/Mixtral-8x7B-v0.1", config_json: MIXTRAL_8X7B },
    Preset { name: "mixtral-8x22b", hf_repo: "mistralai/Mixtral-8x22B-v0.1", config_json: MIXTRAL_8X22B },
];

// The Llama 3.1 configs share the llama3 rope scaling (factor 8, original context 8192) and the
// 128256-token vocabulary; the 3.2 models use factor 32 and tie the lm_head to the embedding.

const LLAMA_3_1_8B: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "attention_bias": false, "mlp_bias": false, "hidden_act": "silu",
  "bos_token_id": 128000, "eos_token_id": 128001,
  "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
  "num_attention_heads": 32, "num_key_value_heads": 8,
  "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 128256
}"#;

const LLAMA_3_1_70B: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "attention_bias": false, "mlp_bias": false, "hidden_act": "silu",
  "bos_token_id": 128000, "eos_token_id": 128001,
  "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
  "num_attention_heads": 64, "num_key_value_heads": 8,
  "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 128256
}"#;

const LLAMA_3_1_405B: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "attention_bias": false, "mlp_bias": false, "hidden_act": "silu",
  "bos_token_id": 128000, "eos_token_id": 128001,
  "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
  "num_attention_heads": 128, "num_key_value_heads": 8,
  "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 128256
}"#;

const LLAMA_3_2_1B: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "attention_bias": false, "mlp_bias": false, "hidden_act": "silu",
  "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64,
  "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
  "num_attention_heads": 32, "num_key_value_heads": 8,
  "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
  "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "tie_word_embeddings": true, "torch_dtype": "bfloat16", "vocab_size": 128256
}"#;

const LLAMA_3_2_3B: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "attention_bias": false, "mlp_bias": false, "hidden_act": "silu",
  "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 128,
  "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
  "num_attention_heads": 24, "num_key_value_heads": 8,
  "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
  "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "tie_word_embeddings": true, "torch_dtype": "bfloat16", "vocab_size": 128256
}"#;

const MIXTRAL_8X7B: &str = r#"{
  "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
  "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
  "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
  "num_attention_heads": 32, "num_key_value_heads": 8,
  "num_local_experts": 8, "num_experts_per_tok": 2,
  "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
  "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 32000
}"#;

const MIXTRAL_8X22B: &str = r#"{
  "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
  "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
  "hidden_size": 6144, "intermediate_size": 16384, "num_hidden_layers": 56,
  "num_attention_heads": 48, "num_key_value_heads": 8,
  "num_local_experts": 8, "num_experts_per_tok": 2,
  "max_position_embeddings": 65536, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
  "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 32000
}"#;

// ---------------------------------------------------------------------------------------------
// Field access with errors that name the field

struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    /// The field's value, with JSON null read as absent (Hugging Face writes unset options as null).
    fn get(&self, field: &'static str) -> Option<&Value> {
        self.0.get(field).filter(|v| !v.is_null())
    }

    fn opt_u64(&self, field: &'static str) -> Result<Option<u64>> {
        self.get(field).map(|v| as_u64(field, v)).transpose()
    }

    /// An optional dimension: a positive integer that fits in usize.
    fn opt_dim(&self, field: &'static str) -> Result<Option<usize>> {
        let Some(n) = self.opt_u64(field)? else { return Ok(None) };
        if n == 0 {
            return Err(invalid(field, n, "must be positive"));
        }
        usize::try_from(n).map(Some).map_err(|_| invalid(field, n, "does not fit in this machine's usize"))
    }

    fn dim(&self, field: &'static str) -> Result<usize> {
        self.opt_dim(field)?.ok_or(ConfigError::MissingField { field })
    }

    fn float(&self, field: &'static str) -> Result<f64> {
        let v = self.get(field).ok_or(ConfigError::MissingField { field })?;
        as_f64(field, v)
    }

    fn opt_bool(&self, field: &'static str) -> Result<Option<bool>> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(wrong_type(field, "a boolean", v)),
        }
    }

    fn opt_str(&self, field: &'static str) -> Result<Option<&str>> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(wrong_type(field, "a string", v)),
        }
    }

    /// A token id, a list of token ids, or null.
    fn token_ids(&self, field: &'static str) -> Result<Vec<u32>> {
        let id = |v: &Value| {
            let n = as_u64(field, v)?;
            u32::try_from(n).map_err(|_| invalid(field, n, "token ids are 32-bit"))
        };
        match self.get(field) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items.iter().map(id).collect(),
            Some(v) => Ok(vec![id(v)?]),
        }
    }
}

fn as_u64(field: &'static str, v: &Value) -> Result<u64> {
    if let Some(n) = v.as_u64() {
        return Ok(n);
    }
    // Accept integral floats (`4096.0`), which some tools write.
    if let Some(f) = v.as_f64()
        && f.fract() == 0.0
        && f >= 0.0
        && f < u64::MAX as f64
    {
        return Ok(f as u64);
    }
    Err(wrong_type(field, "a non-negative integer", v))
}

fn as_f64(field: &'static str, v: &Value) -> Result<f64> {
    v.as_f64().ok_or_else(|| wrong_type(field, "a number", v))
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn wrong_type(field: &'static str, expected: &'static str, v: &Value) -> ConfigError {
    ConfigError::WrongType { field, expected, found: format!("{} ({v})", json_kind(v)) }
}

fn invalid(field: &'static str, value: impl fmt::Display, reason: &str) -> ConfigError {
    ConfigError::Invalid { field, value: value.to_string(), reason: reason.to_string() }
}

fn architecture(c: &Fields) -> Result<Architecture> {
    let from_class = |s: &str| match s {
        "LlamaForCausalLM" => Some(Architecture::Llama),
        "MixtralForCausalLM" => Some(Architecture::Mixtral),
        _ => None,
    };
    let by_class = match c.get("architectures") {
        None => None,
        Some(Value::Array(items)) => {
            let [Value::String(class)] = items.as_slice() else {
                return Err(ConfigError::UnsupportedArchitecture {
                    field: "architectures",
                    value: Value::Array(items.clone()).to_string(),
                });
            };
            let arch = from_class(class).ok_or_else(|| ConfigError::UnsupportedArchitecture {
                field: "architectures",
                value: format!("{class:?}"),
            })?;
            Some(arch)
        }
        Some(v) => return Err(wrong_type("architectures", "a list of one class name", v)),
    };
    let by_type = match c.opt_str("model_type")? {
        None => None,
        Some("llama") => Some(Architecture::Llama),
        Some("mixtral") => Some(Architecture::Mixtral),
        Some(other) => {
            return Err(ConfigError::UnsupportedArchitecture {
                field: "model_type",
                value: format!("{other:?}"),
            });
        }
    };
    match (by_class, by_type) {
        (Some(a), Some(b)) if a != b => Err(ConfigError::UnsupportedArchitecture {
            field: "model_type",
            value: format!("{:?} (architectures says {})", b.model_type(), a.hf_class()),
        }),
        (Some(a), _) | (None, Some(a)) => Ok(a),
        (None, None) => Err(ConfigError::MissingField { field: "architectures" }),
    }
}

fn rope_scaling(c: &Fields) -> Result<Option<Llama3RopeScaling>> {
    let field = "rope_scaling";
    let map = match c.get(field) {
        None => return Ok(None),
        Some(Value::Object(map)) => map,
        Some(v) => return Err(wrong_type(field, "an object or null", v)),
    };
    let s = Fields(map);
    // Older configs name the kind `type`; Llama 3.1 writes `rope_type`.
    let kind = match s.opt_str("rope_type")? {
        Some(k) => k,
        None => s.opt_str("type")?.ok_or(ConfigError::MissingField { field: "rope_scaling.rope_type" })?,
    };
    match kind {
        "default" => return Ok(None),
        "llama3" => {}
        other => return Err(ConfigError::UnsupportedRopeType { value: other.to_string() }),
    }
    let num = |key: &'static str, field: &'static str| -> Result<f64> {
        let v = s.get(key).ok_or(ConfigError::MissingField { field })?;
        as_f64(field, v)
    };
    let original = s
        .get("original_max_position_embeddings")
        .ok_or(ConfigError::MissingField { field: "rope_scaling.original_max_position_embeddings" })?;
    let original = as_u64("rope_scaling.original_max_position_embeddings", original)?;
    Ok(Some(Llama3RopeScaling {
        factor: num("factor", "rope_scaling.factor")?,
        low_freq_factor: num("low_freq_factor", "rope_scaling.low_freq_factor")?,
        high_freq_factor: num("high_freq_factor", "rope_scaling.high_freq_factor")?,
        original_max_position_embeddings: usize::try_from(original).map_err(|_| {
            invalid("rope_scaling.original_max_position_embeddings", original, "does not fit in usize")
        })?,
    }))
}

fn torch_dtype(field: &'static str, s: &str) -> Result<DType> {
    match s {
        "bfloat16" => Ok(DType::BF16),
        "float16" => Ok(DType::F16),
        "float32" => Ok(DType::F32),
        other => Err(ConfigError::Invalid {
            field,
            value: format!("{other:?}"),
            reason: "expected \"bfloat16\", \"float16\" or \"float32\"".into(),
        }),
    }
}
