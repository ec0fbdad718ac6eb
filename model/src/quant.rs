//! The FP8 weight layouts of `config.json`'s `quantization_config` (or the older
//! `compression_config` key): compressed-tensors (`quant_method: "compressed-tensors"`, float 8-bit
//! weights with a `tensor`, `channel` or `block` strategy) and the DeepSeek-style `"fp8"` method
//! (`weight_block_size`). `config.rs` does not read these keys (its owner keeps it to the model's
//! math), so this module reads them from the same file.
//!
//! Activation quantization (`input_activations`, `activation_scheme`) is not applied: memwall
//! computes activations in f32 (or bf16/f16), and the weights are dequantized exactly by their
//! scale, which is what the published weights mean.

use serde_json::Value;

use crate::error::CheckpointError;

/// How an fp8 weight's scale is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Scheme {
    /// One scale, shape `[]` or `[1]`.
    PerTensor,
    /// One scale per output row, `[n, 1]` (or `[n]`).
    PerChannel,
    /// One scale per `rows x cols` block, `[ceil(n / rows), ceil(k / cols)]`.
    Block { rows: usize, cols: usize },
}

impl std::fmt::Display for Fp8Scheme {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fp8Scheme::PerTensor => write!(f, "per-tensor"),
            Fp8Scheme::PerChannel => write!(f, "per-channel"),
            Fp8Scheme::Block { rows, cols } => write!(f, "{rows}x{cols} block"),
        }
    }
}

/// The quantization section of a config.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantConfig {
    /// `quant_method`.
    pub method: String,
    /// The scale layout the config announces; `None` when it does not say (the layout is then
    /// read from each scale's shape).
    pub scheme: Option<Fp8Scheme>,
}

impl QuantConfig {
    /// The scheme of a scale of `shape` for an `n x k` weight, or `None` if the shape fits no
    /// published layout (or not the one the config announces).
    pub fn scheme_for(&self, shape: &[usize], n: usize, k: usize) -> Option<Fp8Scheme> {
        let fits = |s: Fp8Scheme| match s {
            Fp8Scheme::PerTensor => shape.is_empty() || shape == [1],
            Fp8Scheme::PerChannel => shape == [n, 1] || shape == [n],
            Fp8Scheme::Block { rows, cols } => shape == [n.div_ceil(rows), k.div_ceil(cols)],
        };
        match self.scheme {
            Some(s) => fits(s).then_some(s),
            None => [Fp8Scheme::PerTensor, Fp8Scheme::PerChannel, Fp8Scheme::Block { rows: 128, cols: 128 }]
                .into_iter()
                .find(|&s| fits(s)),
        }
    }
}

fn quant_err(field: &str, value: &Value, reason: &str) -> CheckpointError {
    CheckpointError::Quant { field: field.to_string(), value: value.to_string(), reason: reason.to_string() }
}

/// Reads `quantization_config` (or `compression_config`) of a decoded `config.json`; `None` when
/// there is neither.
pub fn parse(config: &Value) -> Result<Option<QuantConfig>, CheckpointError> {
    let (key, q) = match (config.get("quantization_config"), config.get("compression_config")) {
        (Some(q), _) if !q.is_null() => ("quantization_config", q),
        (_, Some(q)) if !q.is_null() => ("compression_config", q),
        _ => return Ok(None),
    };
    if !q.is_object() {
        return Err(quant_err(key, q, "expected an object"));
    }
    let method_field = format!("{key}.quant_method");
    let method = match q.get("quant_method") {
        Some(Value::String(s)) => s.clone(),
        // Old compression configs name the format only.
        None if key == "compression_config" => "compressed-tensors".to_string(),
        Some(v) => return Err(quant_err(&method_field, v, "expected a string")),
        None => return Err(quant_err(&method_field, &Value::Null, "missing")),
    };
    let scheme = match method.as_str() {
        "compressed-tensors" => compressed_tensors_scheme(key, q)?,
        "fp8" => fp8_scheme(key, q)?,
        _ => {
            return Err(quant_err(
                &method_field,
                &Value::String(method),
                "memwall reads fp8 weights of \"compressed-tensors\" and \"fp8\" checkpoints",
            ));
        }
    };
    Ok(Some(QuantConfig { method, scheme }))
}

fn block_size(field: &str, v: &Value) -> Result<Fp8Scheme, CheckpointError> {
    let dims: Option<Vec<usize>> = v
        .as_array()
        .map(|a| a.iter().map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok())).collect())
        .and_then(|d: Option<Vec<usize>>| d);
    match dims.as_deref() {
        Some(&[rows, cols]) if rows > 0 && cols > 0 => Ok(Fp8Scheme::Block { rows, cols }),
        _ => Err(quant_err(field, v, "expected two positive integers")),
    }
}

fn fp8_scheme(key: &str, q: &Value) -> Result<Option<Fp8Scheme>, CheckpointError> {
    match q.get("weight_block_size") {
        None | Some(Value::Null) => Ok(Some(Fp8Scheme::PerTensor)),
        Some(v) => block_size(&format!("{key}.weight_block_size"), v).map(Some),
    }
}

fn compressed_tensors_scheme(key: &str, q: &Value) -> Result<Option<Fp8Scheme>, CheckpointError> {
    let Some(groups) = q.get("config_groups").and_then(Value::as_object) else {
        return Ok(None);
    };
    let mut schemes = Vec::new();
    for (name, group) in groups {
        let field = format!("{key}.config_groups.{name}.weights");
        let Some(w) = group.get("weights").filter(|w| !w.is_null()) else { continue };
        let num_bits = w.get("num_bits").and_then(Value::as_u64);
        let kind = w.get("type").and_then(Value::as_str);
        if num_bits != Some(8) || kind != Some("float") {
            return Err(quant_err(&field, w, "memwall reads 8-bit float weights only"));
        }
        let scheme = match w.get("strategy").and_then(Value::as_str) {
            Some("tensor") => Fp8Scheme::PerTensor,
            Some("channel") => Fp8Scheme::PerChannel,
            Some("block") => match w.get("block_structure") {
                Some(v) => block_size(&format!("{field}.block_structure"), v)?,
                None => Fp8Scheme::Block { rows: 128, cols: 128 },
            },
            _ => {
                return Err(quant_err(
                    &format!("{field}.strategy"),
                    w.get("strategy").unwrap_or(&Value::Null),
                    "expected \"tensor\", \"channel\" or \"block\"",
                ));
            }
        };
        if !schemes.contains(&scheme) {
            schemes.push(scheme);
        }
    }
    // Several groups with different strategies: each scale's shape says which it is.
    Ok(if schemes.len() == 1 { Some(schemes[0]) } else { None })
}
