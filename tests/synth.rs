//! `memwall::synth` and `memwall synth`: random checkpoints of tiny Llama and Mixtral shapes,
//! loaded back by the loader (its safetensors validation and manifest check), every tensor's bytes
//! against the recipe's values rounded to the dtype, the same bytes for the same seed, a decode
//! through `memwall run`, and bad arguments as errors.

mod common;

use std::path::{Path, PathBuf};

use common::cli::memwall;

use memwall::model::checkpoint::Checkpoint;
use memwall::model::{Model, ModelConfig};
use memwall::runtime::DType;
use memwall::runtime::dtype::decode_f32;
use memwall::synth::{self, SynthError};
use serde_json::{Value, json};

/// A directory removed on drop, unique to the test.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("memwall-synth-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn llama(tied: bool) -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 131,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2
    })
}

fn mixtral() -> Value {
    let mut c = llama(false);
    c["architectures"] = json!(["MixtralForCausalLM"]);
    c["model_type"] = json!("mixtral");
    c["num_local_experts"] = json!(4);
    c["num_experts_per_tok"] = json!(2);
    c
}

/// Every tensor of the checkpoint in `dir` equals its recipe's values rounded to `dtype`, and the
/// checkpoint holds nothing else.
fn assert_matches_recipes(dir: &Path, config: &Value, dtype: DType, seed: u64) {
    let parsed = ModelConfig::from_json(config).expect("config");
    let recipes = synth::recipes(&parsed, seed);
    let ckpt = Checkpoint::open_dir(dir).expect("open the checkpoint");
    assert_eq!(ckpt.tensors.len(), recipes.len());
    for r in &recipes {
        let rec = &ckpt.tensors[&r.name];
        assert_eq!(rec.shape, r.shape, "{}", r.name);
        assert_eq!(rec.dtype(), Some(dtype), "{}", r.name);
        let got = decode_f32(dtype, ckpt.bytes(rec)).expect("decode");
        for (i, &g) in got.iter().enumerate() {
            let v = r.value(i as u64);
            let want = match dtype {
                DType::BF16 => half::bf16::from_f32(v).to_f32(),
                DType::F16 => half::f16::from_f32(v).to_f32(),
                _ => v,
            };
            assert_eq!(g.to_bits(), want.to_bits(), "{} element {i}", r.name);
        }
        // Never a constant tensor: a generator that wrote zeros or one value fails here.
        assert!(got.iter().any(|&g| g != got[0]), "{} is constant", r.name);
    }
}

#[test]
fn llama_and_mixtral_shapes_load_with_the_recipes_values() {
    for (name, config, dtype) in [
        ("llama-bf16", llama(false), DType::BF16),
        ("llama-tied-f16", llama(true), DType::F16),
        ("mixtral-f32", mixtral(), DType::F32),
    ] {
        let dir = TempDir::new(name);
        let report = synth::write_checkpoint(&config, dtype, 5, &dir.0).expect("write");
        let parsed = ModelConfig::from_json(&config).expect("config");
        assert_eq!(report.params, parsed.param_counts().total(), "{name}");
        let file_len = std::fs::metadata(dir.0.join("model.safetensors")).expect("file").len();
        assert_eq!(report.bytes, file_len, "{name}");
        assert_matches_recipes(&dir.0, &config, dtype, 5);
        let written: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.0.join("config.json")).expect("config.json"))
                .expect("json");
        let torch = match dtype {
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
            _ => "float32",
        };
        assert_eq!(written["torch_dtype"], torch, "{name}");
        // The loader: header validation, the manifest (every tensor the graph needs, no other).
        let model = Model::load(memwall::default_backend(), &dir.0, |_, _| {}).expect("load");
        assert!(model.report.unused.is_empty(), "{name}: {:?}", model.report.unused);
        assert_eq!(model.config, ModelConfig::from_json(&written).expect("written config"));
        assert_eq!(model.config.param_counts(), parsed.param_counts());
    }
}

#[test]
fn chunks_past_one_write_land_at_their_offsets() {
    // An 8 MiB chunk holds 4 Mi bf16 elements: an embedding of 40000 x 160 (6.4 M elements) spans
    // two, so the second chunk of a tensor is written at an offset inside it.
    let mut config = llama(false);
    config["vocab_size"] = json!(40000);
    config["hidden_size"] = json!(160);
    config["num_attention_heads"] = json!(10);
    config["num_key_value_heads"] = json!(5);
    config["num_hidden_layers"] = json!(1);
    let dir = TempDir::new("chunks");
    synth::write_checkpoint(&config, DType::BF16, 1, &dir.0).expect("write");
    assert_matches_recipes(&dir.0, &config, DType::BF16, 1);
}

#[test]
fn the_same_seed_gives_the_same_bytes() {
    let (a, b, c) = (TempDir::new("seed-a"), TempDir::new("seed-b"), TempDir::new("seed-c"));
    synth::write_checkpoint(&llama(false), DType::BF16, 9, &a.0).expect("write a");
    synth::write_checkpoint(&llama(false), DType::BF16, 9, &b.0).expect("write b");
    synth::write_checkpoint(&llama(false), DType::BF16, 10, &c.0).expect("write c");
    let read = |d: &TempDir| std::fs::read(d.0.join("model.safetensors")).expect("read");
    assert_eq!(read(&a), read(&b));
    let (ra, rc) = (read(&a), read(&c));
    assert_eq!(ra.len(), rc.len());
    assert_ne!(ra, rc);
}

#[test]
fn bad_arguments_are_typed_errors() {
    let dir = TempDir::new("errors");
    std::fs::create_dir_all(&dir.0).expect("mkdir");
    std::fs::write(dir.0.join("other"), b"x").expect("write");
    let r = synth::write_checkpoint(&llama(false), DType::BF16, 0, &dir.0);
    assert!(matches!(r, Err(SynthError::NotEmpty { .. })), "{r:?}");
    let fresh = TempDir::new("errors-fresh");
    let mut bad = llama(false);
    bad["hidden_act"] = json!("gelu");
    assert!(matches!(synth::write_checkpoint(&bad, DType::BF16, 0, &fresh.0), Err(SynthError::Config(_))));
    assert!(matches!(
        synth::write_checkpoint(&llama(false), DType::U32, 0, &fresh.0),
        Err(SynthError::DType(DType::U32))
    ));
    assert!(!fresh.0.exists(), "nothing is written for a bad config or dtype");
    assert!(matches!(synth::config_for("llama-9000"), Err(SynthError::UnknownShape { .. })));
    // A preset and a config file name the same shape.
    let preset = synth::config_for("llama-3.1-8b").expect("preset");
    assert_eq!(preset["hidden_size"], 4096);
    let file = dir.0.join("tiny.json");
    std::fs::write(&file, llama(false).to_string()).expect("write config");
    assert_eq!(synth::config_for(file.to_str().expect("utf-8")).expect("file"), llama(false));
}

#[test]
fn synth_then_run_on_the_command_line() {
    let work = TempDir::new("cli");
    std::fs::create_dir_all(&work.0).expect("mkdir");
    let config = work.0.join("config.json");
    std::fs::write(&config, llama(false).to_string()).expect("write config");
    let out = work.0.join("ckpt");
    let out_s = out.to_str().expect("utf-8");
    let (ok, stdout, err) = memwall(&[
        "synth",
        "--shape",
        config.to_str().expect("utf-8"),
        "--dtype",
        "bf16",
        "--out",
        out_s,
        "--json",
    ]);
    assert!(ok, "{err}");
    let report: Value = serde_json::from_str(stdout.trim()).expect("json");
    assert_eq!(
        report["tensors"],
        ModelConfig::from_json(&llama(false))
            .map(|c| memwall::model::weights::needed(&c).len())
            .expect("config")
    );
    let (ok, stdout, err) = memwall(&[
        "run",
        "--model",
        out_s,
        "--tokens",
        "1,2,3",
        "--max-new-tokens",
        "5",
        "--kv-dtype",
        "bf16",
        "--json",
    ]);
    assert!(ok, "{err}");
    let run: Value = serde_json::from_str(stdout.trim()).expect("json");
    assert_eq!(run["tokens"].as_array().map(Vec::len), Some(5));
    assert_eq!(run["timing"]["decode_tokens"], 4);
    // The directory is now not empty: a second synth refuses it and says why.
    let (ok, _, err) = memwall(&["synth", "--shape", "llama-3.1-8b", "--out", out_s]);
    assert!(!ok);
    assert!(err.contains("not an empty directory"), "{err}");
    let (ok, _, err) = memwall(&["synth", "--shape", "no-such-model", "--out", out_s]);
    assert!(!ok);
    assert!(err.contains("llama-3.1-8b"), "the known shapes are listed: {err}");
}
