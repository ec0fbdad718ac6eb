//! Parity with transformers on the CPU backends: every fixture of `tests/parity/make_fixtures.py`
//! through the model on `cpu::Reference` and `cpu::Fast` (the harness and the tolerance's
//! derivation: `parity_kit/mod.rs`).

mod parity_kit;

use memwall_runtime::cpu;
use parity_kit::{TOLERANCE, check_case_on, fixtures};
use serde_json::Value;

/// Each fixture on both CPU backends. The reference computes each row on its own with f64 sums,
/// so a batch can differ from a single run only by the order of f64 sums: 1e-6. The fast backend
/// may pick another kernel (GEMM vs GEMV) for a batch, changing the order of f32 sums: allow the
/// parity tolerance.
fn check_case(name: &str) {
    check_case_on(cpu::Reference, name, 1e-6);
    check_case_on(cpu::Fast::default(), name, TOLERANCE);
}

#[test]
fn llama31_gqa_bf16_llama3_rope() {
    check_case("llama31_gqa_bf16");
}

#[test]
fn llama_tied_embeddings_f32() {
    check_case("llama_tied_f32");
}

#[test]
fn llama_multi_head_f16() {
    check_case("llama_mha_f16");
}

#[test]
fn mixtral_top2_of_8_bf16_sharded() {
    check_case("mixtral_top2_bf16");
}

#[test]
fn mixtral_top1_f32() {
    check_case("mixtral_top1_f32");
}

#[test]
fn llama_fp8_per_channel() {
    check_case("llama_fp8_channel");
}

/// The llama3-scaled rotary frequencies against transformers' own `inv_freq` (every fixture; the
/// llama31 and fp8 ones are scaled, in all three regimes). transformers computes them in f32: the
/// power `theta^(2i/d)` of an f32 exponent has relative error about ln(theta) * 2^-24 ~ 6e-7, so
/// 1e-5 is generous while a missing or wrong scaling is off by up to `factor` = 4.
#[test]
fn rope_inv_freq_matches_transformers() {
    for name in ["llama31_gqa_bf16", "llama_fp8_channel", "llama_tied_f32", "mixtral_top2_bf16"] {
        let dir = fixtures().join(name);
        let text = std::fs::read_to_string(dir.join("expected.json")).expect("expected.json");
        let v: Value = serde_json::from_str(&text).expect("json");
        let want: Vec<f64> =
            v["inv_freq"].as_array().expect("inv_freq").iter().map(|x| x.as_f64().unwrap()).collect();
        let config = memwall_model::ModelConfig::from_dir(&dir).expect("config");
        let got = config.rope().inv_freq();
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-5 * w.abs(), "{name}: inv_freq[{i}] = {g} vs transformers {w}");
        }
    }
}
