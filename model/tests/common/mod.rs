//! Tiny random checkpoints written by the tests themselves (no Python): a config, tensors in any
//! dtype, and a temporary directory to hold them.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use memwall_model::checkpoint::serialize;
use memwall_runtime::DType;
use safetensors::tensor::Dtype;
use serde_json::{Value, json};

/// A directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("memwall-model-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("temp dir");
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Deterministic uniform values in [-1, 1) (xorshift), scaled.
pub fn uniform(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

pub fn llama_config(vocab: usize, tie: bool) -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": vocab,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": tie, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2
    })
}

pub fn mixtral_config(vocab: usize) -> Value {
    json!({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": vocab,
        "num_local_experts": 4, "num_experts_per_tok": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2
    })
}

/// Every tensor the config needs, as f32 values: name, shape, values.
pub fn random_weights(config: &Value, seed: u64) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let c = memwall_model::ModelConfig::from_json(config).expect("config");
    let mut out = Vec::new();
    for (i, (name, kind)) in memwall_model::weights::needed(&c).into_iter().enumerate() {
        let seed = seed.wrapping_mul(1000).wrapping_add(i as u64);
        match kind {
            memwall_model::weights::Kind::Matrix { n, k } => {
                let scale = if name.contains("embed") { 1.0 } else { 1.0 / (k as f32).sqrt() };
                out.push((name, vec![n, k], uniform(seed, n * k, scale)));
            }
            memwall_model::weights::Kind::Vector { n } => {
                out.push((name, vec![n], uniform(seed, n, 0.2).iter().map(|x| 1.0 + x).collect()));
            }
        }
    }
    out
}

pub fn st(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::F8E4M3Fn => Dtype::F8_E4M3,
        DType::U32 => Dtype::U32,
        other => panic!("no safetensors dtype for {other}"),
    }
}

/// A stored tensor: name, safetensors dtype, shape, bytes.
pub type Stored = (String, Dtype, Vec<usize>, Vec<u8>);

pub fn encode(name: &str, dtype: DType, shape: &[usize], values: &[f32]) -> Stored {
    let bytes = memwall_runtime::dtype::encode_f32(dtype, values).expect("float dtype");
    (name.to_string(), st(dtype), shape.to_vec(), bytes)
}

/// All tensors stored as `dtype`.
pub fn store_all(w: &[(String, Vec<usize>, Vec<f32>)], dtype: DType) -> Vec<Stored> {
    w.iter().map(|(n, s, v)| encode(n, dtype, s, v)).collect()
}

pub fn safetensors_bytes(tensors: &[Stored]) -> Vec<u8> {
    let refs: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)> =
        tensors.iter().map(|(n, d, s, b)| (n.as_str(), *d, s.clone(), b.clone())).collect();
    serialize(&refs)
}

/// Writes `config.json` and `model.safetensors` into `dir`.
pub fn write_model(dir: &Path, config: &Value, tensors: &[Stored]) {
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config");
    std::fs::write(dir.join("model.safetensors"), safetensors_bytes(tensors)).expect("weights");
}

// ---------------------------------------------------------------------------------------------
// fp8

/// A compressed-tensors `quantization_config` with one group of 8-bit float weights.
pub fn quant_config(strategy: &str) -> Value {
    json!({"quant_method": "compressed-tensors", "format": "float-quantized",
           "config_groups": {"group_0": {"targets": ["Linear"],
               "weights": {"num_bits": 8, "type": "float", "strategy": strategy}}}})
}

/// The fp8 layouts the loader tests cover: (compressed-tensors strategy, scale dtype, name of the
/// scale tensor beside `x.weight`).
pub const FP8_SCHEMES: [(&str, DType, &str); 5] = [
    ("tensor", DType::F32, "weight_scale"),
    ("channel", DType::F32, "weight_scale"),
    ("channel", DType::BF16, "weight_scale_inv"),
    ("block", DType::F32, "weight_scale_inv"),
    ("block", DType::BF16, "weight_scale"),
];

/// [`quant_config`] of `strategy`, with the 16x16 blocks of [`fp8_quantize`] for "block".
pub fn fp8_quant_config(strategy: &str) -> Value {
    let mut qc = quant_config(strategy);
    if strategy == "block" {
        qc["config_groups"]["group_0"]["weights"]["block_structure"] = json!([16, 16]);
    }
    qc
}

/// The scale tensor of the fp8 weight `weight` (`x.weight` -> `x.{scale_name}`): `scales` of
/// `shape` stored as `dtype`.
pub fn fp8_scale(weight: &str, scale_name: &str, dtype: DType, shape: &[usize], scales: &[f32]) -> Stored {
    encode(&weight.replace(".weight", &format!(".{scale_name}")), dtype, shape, scales)
}

/// The stored fp8 weight and its scale for `values` `[n, k]`, and the f32 values they mean.
pub fn fp8_quantize(
    values: &[f32],
    n: usize,
    k: usize,
    scheme: &str,
) -> (Vec<f32>, Vec<usize>, Vec<f32>, Vec<f32>) {
    let bl = 16; // block size used by the tests' block configs
    let scale_at = |scales: &[f32], j: usize, l: usize| match scheme {
        "tensor" => scales[0],
        "channel" => scales[j],
        _ => scales[(j / bl) * k.div_ceil(bl) + l / bl],
    };
    let (shape, count) = match scheme {
        "tensor" => (vec![], 1),
        "channel" => (vec![n, 1], n),
        _ => (vec![n.div_ceil(bl), k.div_ceil(bl)], n.div_ceil(bl) * k.div_ceil(bl)),
    };
    let mut amax = vec![0f32; count];
    for j in 0..n {
        for l in 0..k {
            let s = match scheme {
                "tensor" => 0,
                "channel" => j,
                _ => (j / bl) * k.div_ceil(bl) + l / bl,
            };
            amax[s] = amax[s].max(values[j * k + l].abs());
        }
    }
    let scales: Vec<f32> = amax.iter().map(|a| a.max(1e-6) / 448.0).collect();
    let mut q = Vec::with_capacity(n * k);
    let mut real = Vec::with_capacity(n * k);
    for j in 0..n {
        for l in 0..k {
            let s = scale_at(&scales, j, l);
            let byte = memwall_runtime::dtype::encode_f32(DType::F8E4M3Fn, &[values[j * k + l] / s]).unwrap();
            let v = memwall_runtime::dtype::decode_f32(DType::F8E4M3Fn, &byte).unwrap()[0];
            q.push(v);
            real.push(v * s);
        }
    }
    (q, shape, scales, real)
}
