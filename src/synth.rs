//! Random checkpoints of a model's shape: `config.json` and one `model.safetensors` holding every
//! tensor the graph reads (`memwall_model::weights::needed`), random values in bf16, f16 or f32.
//! `memwall synth` writes one; benches/decode.rs writes its CPU checkpoint with it; the GPU check
//! (scripts/device-check.sh) writes a Llama-3.1-8B-shaped one (16 GB of bf16) on the GPU machine
//! rather than carrying it there.
//!
//! Values: element `i` of tensor number `t` (in manifest order) is `offset + scale * u`, `u`
//! uniform in [-1, 1) from a hash of (`seed`, `t`, `i`) alone, so any element can be recomputed
//! ([`TensorRecipe::value`]) and the file is the same whatever the thread count. Matrices have
//! `scale = 1 / sqrt(k)` (the embedding 1) and `offset = 0`, so every product's sum stays of order
//! one through the layers; norm weights `1 + 0.2 u`. Rounded to the dtype to nearest even.
//!
//! Writing: the safetensors header first (tensors in manifest order, contiguous, the header padded
//! with spaces to 8 bytes), the file sized, then chunks of `CHUNK_BYTES` generated and written at
//! their offsets on every rayon thread: about memory speed on a RAM disk.

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use memwall_model::random::{mix64, unit};
use memwall_model::weights::{self, Kind};
use memwall_model::{ConfigError, ModelConfig, PRESETS, Preset};
use memwall_runtime::DType;
use rayon::prelude::*;
use serde_json::{Map, Value, json};

/// Bytes generated and written by one task.
const CHUNK_BYTES: usize = 8 << 20;

/// Why a checkpoint could not be written.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error(transparent)]
    Config(#[from] ConfigError),

    #[error("`{shape}` is neither a config.json, a directory holding one, nor a known model ({known})")]
    UnknownShape { shape: String, known: String },

    #[error("synth writes bf16, f16 or f32 weights, not {0}")]
    DType(DType),

    #[error("{path} exists and is not an empty directory: synth writes into a new or empty one")]
    NotEmpty { path: PathBuf },

    #[error("tensor {name} of shape {shape:?} does not fit in memory offsets")]
    Overflow { name: String, shape: Vec<usize> },

    #[error("cannot write {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SynthError + '_ {
    move |source| SynthError::Io { path: path.to_path_buf(), source }
}

/// The config of `shape`: a preset name (`memwall_model::PRESETS`), a config.json, or a directory
/// holding one.
pub fn config_for(shape: &str) -> Result<Value, SynthError> {
    let path = Path::new(shape);
    let file = if path.is_dir() { path.join("config.json") } else { path.to_path_buf() };
    let text = if file.is_file() {
        std::fs::read_to_string(&file).map_err(|source| ConfigError::Io { path: file.clone(), source })?
    } else if let Some(p) = Preset::find(shape) {
        p.config_json.to_string()
    } else {
        return Err(SynthError::UnknownShape {
            shape: shape.to_string(),
            known: PRESETS.iter().map(|p| p.name).collect::<Vec<_>>().join(", "),
        });
    };
    Ok(serde_json::from_str(&text).map_err(ConfigError::Json)?)
}

/// How one tensor's values are made.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorRecipe {
    pub name: String,
    pub shape: Vec<usize>,
    /// The hash key of this tensor's elements.
    pub seed: u64,
    pub scale: f32,
    pub offset: f32,
}

impl TensorRecipe {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Element `i` before rounding to the checkpoint's dtype.
    pub fn value(&self, i: u64) -> f32 {
        self.offset + self.scale * unit(self.seed, i)
    }

    /// Elements `start..start + out.len() / size` encoded as `dtype` into `out`.
    fn fill(&self, dtype: DType, start: u64, out: &mut [u8]) {
        match dtype {
            DType::BF16 => {
                for (i, b) in out.chunks_exact_mut(2).enumerate() {
                    b.copy_from_slice(&half::bf16::from_f32(self.value(start + i as u64)).to_le_bytes());
                }
            }
            DType::F16 => {
                for (i, b) in out.chunks_exact_mut(2).enumerate() {
                    b.copy_from_slice(&half::f16::from_f32(self.value(start + i as u64)).to_le_bytes());
                }
            }
            _ => {
                for (i, b) in out.chunks_exact_mut(4).enumerate() {
                    b.copy_from_slice(&self.value(start + i as u64).to_le_bytes());
                }
            }
        }
    }
}

/// The tensors of `config`'s checkpoint, in manifest order, for `seed`.
pub fn recipes(config: &ModelConfig, seed: u64) -> Vec<TensorRecipe> {
    weights::needed(config)
        .into_iter()
        .enumerate()
        .map(|(t, (name, kind))| {
            let seed = mix64(seed ^ mix64(t as u64));
            match kind {
                Kind::Matrix { n, k } => {
                    let scale = if name.contains("embed_tokens") { 1.0 } else { 1.0 / (k as f32).sqrt() };
                    TensorRecipe { name, shape: vec![n, k], seed, scale, offset: 0.0 }
                }
                Kind::Vector { n } => TensorRecipe { name, shape: vec![n], seed, scale: 0.2, offset: 1.0 },
            }
        })
        .collect()
}

/// What [`write_checkpoint`] wrote.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SynthReport {
    pub dir: PathBuf,
    pub tensors: usize,
    pub params: u64,
    /// Size of model.safetensors.
    pub bytes: u64,
    pub seconds: f64,
}

fn dtype_names(dtype: DType) -> Result<(&'static str, &'static str), SynthError> {
    match dtype {
        DType::BF16 => Ok(("BF16", "bfloat16")),
        DType::F16 => Ok(("F16", "float16")),
        DType::F32 => Ok(("F32", "float32")),
        other => Err(SynthError::DType(other)),
    }
}

/// Writes `config.json` (`config` with `torch_dtype` set to `dtype` and any quantization section
/// removed) and `model.safetensors` (every tensor of [`recipes`]) into `dir`, which must be absent
/// or empty.
pub fn write_checkpoint(
    config: &Value,
    dtype: DType,
    seed: u64,
    dir: &Path,
) -> Result<SynthReport, SynthError> {
    let start = Instant::now();
    let (st_dtype, torch_dtype) = dtype_names(dtype)?;
    let mut config = config.clone();
    if let Value::Object(map) = &mut config {
        map.insert("torch_dtype".into(), json!(torch_dtype));
        map.remove("quantization_config");
        map.remove("compression_config");
    }
    let parsed = ModelConfig::from_json(&config)?;
    if dir.exists() {
        let mut entries =
            std::fs::read_dir(dir).map_err(|_| SynthError::NotEmpty { path: dir.to_path_buf() })?;
        if entries.next().is_some() {
            return Err(SynthError::NotEmpty { path: dir.to_path_buf() });
        }
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let config_path = dir.join("config.json");
    let text = serde_json::to_string_pretty(&config).map_err(ConfigError::Json)?;
    std::fs::write(&config_path, text).map_err(io(&config_path))?;

    let tensors = recipes(&parsed, seed);
    let size = dtype.size() as u64;
    let mut header = Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt", "memwall_synth_seed": seed.to_string()}));
    let mut offsets = Vec::with_capacity(tensors.len());
    let mut end = 0u64;
    for t in &tensors {
        let bytes = (t.numel() as u64)
            .checked_mul(size)
            .filter(|b| end.checked_add(*b).is_some())
            .ok_or_else(|| SynthError::Overflow { name: t.name.clone(), shape: t.shape.clone() })?;
        header.insert(
            t.name.clone(),
            json!({"dtype": st_dtype, "shape": t.shape, "data_offsets": [end, end + bytes]}),
        );
        offsets.push(end);
        end += bytes;
    }
    let mut header = serde_json::to_vec(&Value::Object(header)).map_err(ConfigError::Json)?;
    // The data starts 8-byte aligned: pad the header with spaces, as the safetensors writer does.
    while !(8 + header.len()).is_multiple_of(8) {
        header.push(b' ');
    }
    let data_start = 8 + header.len() as u64;

    let path = dir.join("model.safetensors");
    let mut file = File::create(&path).map_err(io(&path))?;
    file.write_all(&(header.len() as u64).to_le_bytes()).map_err(io(&path))?;
    file.write_all(&header).map_err(io(&path))?;
    file.set_len(data_start + end).map_err(io(&path))?;
    drop(file);

    // (tensor, first element, elements) of every chunk.
    let per_chunk = (CHUNK_BYTES as u64 / size) as usize;
    let chunks: Vec<(usize, usize, usize)> = tensors
        .iter()
        .enumerate()
        .flat_map(|(t, r)| {
            let n = r.numel();
            (0..n.div_ceil(per_chunk)).map(move |c| (t, c * per_chunk, per_chunk.min(n - c * per_chunk)))
        })
        .collect();
    chunks.par_iter().try_for_each_init(
        || (OpenOptions::new().write(true).open(&path), Vec::<u8>::new()),
        |(file, buf), &(t, first, len)| -> Result<(), SynthError> {
            let file = file.as_mut().map_err(|e| SynthError::Io {
                path: path.clone(),
                source: std::io::Error::new(e.kind(), e.to_string()),
            })?;
            buf.resize(len * size as usize, 0);
            tensors[t].fill(dtype, first as u64, buf);
            file.seek(SeekFrom::Start(data_start + offsets[t] + first as u64 * size)).map_err(io(&path))?;
            file.write_all(buf).map_err(io(&path))
        },
    )?;
    Ok(SynthReport {
        dir: dir.to_path_buf(),
        tensors: tensors.len(),
        params: tensors.iter().map(|t| t.numel() as u64).sum(),
        bytes: data_start + end,
        seconds: start.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_in_range_and_differ_by_tensor() {
        let config = ModelConfig::from_json(&config_for("llama-3.2-1b").expect("preset")).expect("config");
        let r = recipes(&config, 7);
        assert_eq!(r[0].name, "model.embed_tokens.weight");
        let q = r.iter().find(|t| t.name.ends_with("layers.0.self_attn.q_proj.weight")).expect("q_proj");
        let bound = 1.0 / 2048f32.sqrt();
        for i in 0..1000 {
            assert!(q.value(i).abs() <= bound);
            assert!((-1.0..1.0).contains(&r[0].value(i)));
        }
        let norm = r.iter().find(|t| t.name == "model.norm.weight").expect("norm");
        assert!((0..1000).all(|i| (0.8..=1.2).contains(&norm.value(i))));
        assert_ne!(r[1].value(0), r[2].value(0));
        assert_ne!(recipes(&config, 8)[0].value(0), r[0].value(0));
        // Tied: no lm_head tensor.
        assert!(r.iter().all(|t| t.name != "lm_head.weight"));
    }

    #[test]
    fn unknown_shape_and_dtype_are_errors() {
        assert!(matches!(config_for("no-such-model"), Err(SynthError::UnknownShape { .. })));
        let c = config_for("llama-3.2-1b").expect("preset");
        let dir = std::env::temp_dir().join(format!("memwall-synth-dtype-{}", std::process::id()));
        assert!(matches!(write_checkpoint(&c, DType::F8E4M3Fn, 0, &dir), Err(SynthError::DType(_))));
        assert!(!dir.exists());
    }
}
