//! The config parser: the presets' parameter counts against the published totals, the rope, and
//! one test per rejection.

use memwall_model::config::{Architecture, ConfigError, ModelConfig, PRESETS, Preset};
use memwall_runtime::DType;
use serde_json::{Value, json};

fn preset(name: &str) -> ModelConfig {
    match ModelConfig::preset(name) {
        Ok(c) => c,
        Err(e) => panic!("preset {name}: {e}"),
    }
}

/// `computed` within 0.5% of `published` (the published totals are rounded to 3 or 4 significant
/// figures, i.e. to at most 0.5% of the value).
fn assert_near(name: &str, computed: u64, published: f64) {
    let rel = (computed as f64 - published).abs() / published;
    assert!(
        rel <= 0.005,
        "{name}: computed {computed} vs published {published:e}: off by {:.3}%",
        rel * 100.0
    );
}

#[test]
fn every_preset_parses() {
    for p in PRESETS {
        let c = match p.config() {
            Ok(c) => c,
            Err(e) => panic!("{}: {e}", p.name),
        };
        assert_eq!(c.torch_dtype, Some(DType::BF16), "{}", p.name);
        assert!(Preset::find(p.hf_repo).is_some(), "{} by repo", p.name);
    }
}

#[test]
fn preset_totals_match_the_published_ones() {
    // Sources of the published totals:
    // - Llama 3.1 8B / 70B / 405B, Llama 3.2 1B / 3B: the "Model size" (parameter count read from
    //   the safetensors headers) shown on the Hugging Face pages of meta-llama/Llama-3.1-8B
    //   (8.03B), meta-llama/Llama-3.1-70B (70.6B), meta-llama/Llama-3.1-405B (406B; 405.9B to one
    //   more digit), meta-llama/Llama-3.2-1B (1.24B) and meta-llama/Llama-3.2-3B (3.21B).
    // - Mixtral 8x7B: Mistral AI, "Mixtral of experts" (mistral.ai/news/mixtral-of-experts, Dec
    //   2023): "46.7B total parameters but only uses 12.9B parameters per token".
    // - Mixtral 8x22B: Mistral AI, "Cheaper, Better, Faster, Stronger" (mistral.ai/news/mixtral-8x22b,
    //   Apr 2024): "only 39B active parameters out of 141B".
    let cases = [
        ("llama-3.1-8b", 8.03e9),
        ("llama-3.1-70b", 70.6e9),
        ("llama-3.1-405b", 405.9e9),
        ("llama-3.2-1b", 1.24e9),
        ("llama-3.2-3b", 3.21e9),
        ("mixtral-8x7b", 46.7e9),
        ("mixtral-8x22b", 141e9),
    ];
    for (name, published) in cases {
        assert_near(name, preset(name).param_counts().total(), published);
    }
    assert_near("mixtral-8x7b active", preset("mixtral-8x7b").param_counts().active_per_token(), 12.9e9);
    assert_near("mixtral-8x22b active", preset("mixtral-8x22b").param_counts().active_per_token(), 39e9);
}

#[test]
fn llama_3_1_8b_counts_exactly() {
    let p = preset("llama-3.1-8b").param_counts();
    assert_eq!(p.embedding, 128_256 * 4096);
    assert_eq!(p.lm_head, 128_256 * 4096);
    // q and o 4096x4096, k and v 1024x4096 (8 kv heads of 128).
    assert_eq!(p.attention, 2 * 4096 * 4096 + 2 * 1024 * 4096);
    assert_eq!(p.mlp(), 3 * 4096 * 14336);
    assert_eq!(p.router, 0);
    assert_eq!(p.total(), 8_030_261_248);
    assert_eq!(p.active_per_token(), p.total());
}

#[test]
fn tied_embeddings_are_counted_once() {
    let c = preset("llama-3.2-1b");
    assert!(c.tie_word_embeddings);
    assert_eq!(c.head_dim, 64);
    let p = c.param_counts();
    assert_eq!(p.lm_head, 0);
    assert_eq!(p.total(), 1_235_814_400);
}

#[test]
fn mixtral_experts_and_router() {
    let c = preset("mixtral-8x7b");
    assert_eq!(c.architecture, Architecture::Mixtral);
    let m = c.moe.expect("mixtral has experts");
    assert_eq!((m.num_experts, m.experts_per_token), (8, 2));
    let p = c.param_counts();
    assert_eq!(p.router, 8 * 4096);
    assert_eq!(p.mlp(), 8 * 3 * 4096 * 14336);
    assert_eq!(p.total(), 46_702_792_704);
}

#[test]
fn rope_of_llama_3_1() {
    let rope = preset("llama-3.1-8b").rope();
    assert_eq!(rope.head_dim, 128);
    assert_eq!(rope.theta, 500_000.0);
    let s = rope.scaling.expect("llama 3.1 scales its rope");
    assert_eq!(
        (s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings),
        (8.0, 1.0, 4.0, 8192)
    );
    assert!(rope.check().is_ok());
    assert_eq!(preset("mixtral-8x7b").rope().scaling, None);
}

// ---------------------------------------------------------------------------------------------
// Parsing details and errors

fn base() -> Value {
    serde_json::from_str(PRESETS[0].config_json).expect("preset is JSON")
}

fn with(key: &str, value: Value) -> Value {
    let mut v = base();
    v[key] = value;
    v
}

fn without(key: &str) -> Value {
    let mut v = base();
    v.as_object_mut().expect("object").remove(key);
    v
}

fn parse(v: &Value) -> Result<ModelConfig, ConfigError> {
    ModelConfig::from_json(v)
}

#[test]
fn defaults_and_alternative_forms() {
    let c = parse(&without("num_key_value_heads")).expect("kv heads default to heads");
    assert_eq!(c.num_kv_heads, 32);
    let c = parse(&with("eos_token_id", json!([128001, 128008, 128009]))).expect("eos list");
    assert_eq!(c.eos_token_ids, vec![128001, 128008, 128009]);
    assert_eq!(c.bos_token_ids, vec![128000]);
    let c = parse(&with("bos_token_id", Value::Null)).expect("null bos");
    assert!(c.bos_token_ids.is_empty());
    let c = parse(&with("rope_scaling", Value::Null)).expect("null rope scaling");
    assert_eq!(c.rope_scaling, None);
    let c = parse(&with("sliding_window", json!(131072))).expect("window as long as the context");
    assert_eq!(c.max_position_embeddings, 131072);
    let c = parse(&with("sliding_window", Value::Null)).expect("null window");
    assert_eq!(c.num_layers, 32);
    let mut v = without("torch_dtype");
    v["dtype"] = json!("float16");
    assert_eq!(parse(&v).expect("newer `dtype` key").torch_dtype, Some(DType::F16));
    assert!(matches!(ModelConfig::from_json_str("{"), Err(ConfigError::Json(_))));
}

#[test]
fn missing_required_fields_are_named() {
    for field in [
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
    ] {
        match parse(&without(field)) {
            Err(ConfigError::MissingField { field: f }) => assert_eq!(f, field),
            other => panic!("{field}: {other:?}"),
        }
    }
    let mut v = without("architectures");
    v.as_object_mut().expect("object").remove("model_type");
    assert!(matches!(parse(&v), Err(ConfigError::MissingField { field: "architectures" })));
    let mut v = base();
    v["rope_scaling"].as_object_mut().expect("object").remove("factor");
    assert!(matches!(parse(&v), Err(ConfigError::MissingField { field: "rope_scaling.factor" })));
    let mut moe: Value = serde_json::from_str(PRESETS[5].config_json).expect("JSON");
    moe.as_object_mut().expect("object").remove("num_local_experts");
    assert!(matches!(parse(&moe), Err(ConfigError::MissingField { field: "num_local_experts" })));
}

#[test]
fn wrong_types_are_named() {
    match parse(&with("hidden_size", json!("4096"))) {
        Err(ConfigError::WrongType { field: "hidden_size", .. }) => {}
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        parse(&with("tie_word_embeddings", json!(1))),
        Err(ConfigError::WrongType { field: "tie_word_embeddings", .. })
    ));
    assert!(matches!(
        parse(&with("num_hidden_layers", json!(-3))),
        Err(ConfigError::WrongType { field: "num_hidden_layers", .. })
    ));
    assert!(matches!(parse(&json!([1, 2])), Err(ConfigError::NotAnObject { .. })));
}

#[test]
fn unsupported_architectures() {
    let mut v = with("architectures", json!(["Qwen2ForCausalLM"]));
    v["model_type"] = json!("qwen2");
    assert!(matches!(parse(&v), Err(ConfigError::UnsupportedArchitecture { field: "architectures", .. })));
    let v = with("model_type", json!("mistral"));
    assert!(matches!(parse(&v), Err(ConfigError::UnsupportedArchitecture { field: "model_type", .. })));
    // The two keys disagree.
    let v = with("model_type", json!("mixtral"));
    assert!(matches!(parse(&v), Err(ConfigError::UnsupportedArchitecture { field: "model_type", .. })));
}

#[test]
fn unsupported_rope_type() {
    let mut v = base();
    v["rope_scaling"]["rope_type"] = json!("yarn");
    match parse(&v) {
        Err(ConfigError::UnsupportedRopeType { value }) => assert_eq!(value, "yarn"),
        other => panic!("{other:?}"),
    }
    // A llama3 scaling whose factors make no sense.
    let mut v = base();
    v["rope_scaling"]["high_freq_factor"] = json!(0.5);
    assert!(matches!(parse(&v), Err(ConfigError::Invalid { field: "rope_scaling", .. })));
}

#[test]
fn unsupported_activation_and_biases() {
    match parse(&with("hidden_act", json!("gelu"))) {
        Err(ConfigError::UnsupportedActivation { value }) => assert_eq!(value, "gelu"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        parse(&with("attention_bias", json!(true))),
        Err(ConfigError::Bias { field: "attention_bias" })
    ));
    assert!(matches!(parse(&with("mlp_bias", json!(true))), Err(ConfigError::Bias { field: "mlp_bias" })));
}

#[test]
fn sliding_window_within_the_context() {
    let mut v: Value = serde_json::from_str(PRESETS[5].config_json).expect("JSON");
    v["sliding_window"] = json!(4096);
    match parse(&v) {
        Err(ConfigError::SlidingWindow { window, max_positions }) => {
            assert_eq!((window, max_positions), (4096, 32768))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn heads_must_be_a_multiple_of_kv_heads() {
    match parse(&with("num_key_value_heads", json!(5))) {
        Err(ConfigError::HeadsNotMultipleOfKvHeads { heads, kv_heads }) => {
            assert_eq!((heads, kv_heads), (32, 5))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn bad_values() {
    for field in ["hidden_size", "num_hidden_layers", "vocab_size", "num_key_value_heads", "head_dim"] {
        match parse(&with(field, json!(0))) {
            Err(ConfigError::Invalid { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{field}: {other:?}"),
        }
    }
    assert!(matches!(
        parse(&with("head_dim", json!(127))),
        Err(ConfigError::Invalid { field: "head_dim", .. })
    ));
    assert!(matches!(
        parse(&with("rms_norm_eps", json!(-1.0))),
        Err(ConfigError::Invalid { field: "rms_norm_eps", .. })
    ));
    assert!(matches!(
        parse(&with("rope_theta", json!(0.5))),
        Err(ConfigError::Invalid { field: "rope_theta", .. })
    ));
    // hidden_size not divisible by the heads, and no head_dim to say otherwise.
    assert!(matches!(
        parse(&with("hidden_size", json!(4100))),
        Err(ConfigError::Invalid { field: "head_dim", .. })
    ));
    // Absurd sizes: the parameter count would not be exact in the report's arithmetic.
    assert!(matches!(
        parse(&with("vocab_size", json!(1u64 << 40))),
        Err(ConfigError::Invalid { field: "hidden_size", .. })
    ));
    let mut moe: Value = serde_json::from_str(PRESETS[5].config_json).expect("JSON");
    moe["num_experts_per_tok"] = json!(9);
    assert!(matches!(parse(&moe), Err(ConfigError::Invalid { field: "num_experts_per_tok", .. })));
    assert!(matches!(
        parse(&with("torch_dtype", json!("int4"))),
        Err(ConfigError::Invalid { field: "torch_dtype", .. })
    ));
}

#[test]
fn presets_by_name() {
    assert!(Preset::find("Llama3.1-8B").is_some());
    assert!(Preset::find("mistralai/Mixtral-8x22B-v0.1").is_some());
    assert!(matches!(ModelConfig::preset("gpt-2"), Err(ConfigError::UnknownPreset { .. })));
}

#[test]
fn reads_a_checkpoint_directory() {
    let dir = std::env::temp_dir().join(format!("memwall-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::fs::write(dir.join("config.json"), PRESETS[3].config_json).expect("write");
    let c = ModelConfig::from_dir(&dir).expect("reads config.json");
    assert_eq!(c.hidden_size, 2048);
    std::fs::remove_dir_all(&dir).expect("cleanup");
    assert!(matches!(ModelConfig::from_dir(&dir), Err(ConfigError::Io { .. })));
}
