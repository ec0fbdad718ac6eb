//! e4m3fn checkpoints loaded for a device that reads e4m3fnuz (`Backend::native_e4m3`, AMD
//! MI300X): through `WithNativeE4m3` over the reference backend, every fp8 matrix (the embedding
//! and lm_head included) arrives as e4m3fnuz with its scale doubled, and the logits equal those of
//! the unconverted load on the same reference backend. Equal, not close: the reference computes in
//! f64, where halving every stored value and doubling every scale are exact power-of-two
//! rescalings that leave each product, sum and scaled sum the same number (the derivation is in
//! `runtime/tests/fnuz.rs`), and both loads run the same ops in the same order. An fn NaN code
//! and a scale that overflows when doubled are typed errors.

mod common;
#[path = "parity_kit/mod.rs"]
mod parity_kit;

use std::path::Path;

use common::*;
use memwall_model::weights::{FeedForward, Weights};
use memwall_model::{CheckpointError, Model, ModelError};
use memwall_runtime::{Backend, DType, HostTensor, Linear, WeightScale, WithNativeE4m3, cpu};
use serde_json::Value;

fn fnuz_reference() -> WithNativeE4m3<cpu::Reference> {
    WithNativeE4m3::new(cpu::Reference, DType::F8E4M3Fnuz)
}

/// A tiny model with every matrix in e4m3fn (`scheme` "tensor", "channel" or "block" 16x16, scales
/// of `scale_dtype` named `scale_name`) and the norms in f32.
fn fp8_model(config: Value, scheme: &str, scale_dtype: DType, scale_name: &str) -> (Value, Vec<Stored>) {
    let mut cfg = config;
    let mut stored = Vec::new();
    for (name, shape, values) in random_weights(&cfg, 23) {
        if shape.len() == 2 {
            let (mut q, sshape, scales, _) = fp8_quantize(&values, shape[0], shape[1], scheme);
            // Some of fn's -0 (0x80), which must reach the fnuz device as 0x00, not its NaN.
            q.iter_mut().step_by(97).for_each(|v| *v = -0.0);
            stored.push(encode(&name, DType::F8E4M3Fn, &shape, &q));
            stored.push(fp8_scale(&name, scale_name, scale_dtype, &sshape, &scales));
        } else {
            stored.push(encode(&name, DType::F32, &shape, &values));
        }
    }
    cfg["quantization_config"] = fp8_quant_config(scheme);
    (cfg, stored)
}

/// Every matrix of the loaded weights, by a name.
fn matrices<S>(w: &Weights<S>) -> Vec<(String, &Linear<S>)> {
    let mut out = vec![("embed".to_string(), &w.embed)];
    out.extend(w.lm_head.as_ref().map(|l| ("lm_head".to_string(), l)));
    for (l, layer) in w.layers.iter().enumerate() {
        for (n, m) in [("q", &layer.q), ("k", &layer.k), ("v", &layer.v), ("o", &layer.o)] {
            out.push((format!("{l}.{n}"), m));
        }
        match &layer.ffn {
            FeedForward::Dense(mlp) => out.extend(
                [("gate", &mlp.gate), ("up", &mlp.up), ("down", &mlp.down)]
                    .map(|(n, m)| (format!("{l}.{n}"), m)),
            ),
            FeedForward::Moe { router, experts } => {
                out.push((format!("{l}.router"), router));
                for (e, mlp) in experts.iter().enumerate() {
                    out.extend(
                        [("w1", &mlp.gate), ("w3", &mlp.up), ("w2", &mlp.down)]
                            .map(|(n, m)| (format!("{l}.{e}.{n}"), m)),
                    );
                }
            }
        }
    }
    out
}

fn f32s(t: &HostTensor) -> Vec<f32> {
    cpu::Reference.read_f32(t).unwrap()
}

/// The prefill and decode logits of a short greedy generation (`parity_kit::logits`).
fn logits<B: Backend>(m: &Model<B>) -> Vec<f32>
where
    B::Storage: 'static,
{
    parity_kit::logits(m, &[&[5, 9, 33, 60], &[1, 63]])
}

fn load_pair(dir: &Path) -> (Model<cpu::Reference>, Model<WithNativeE4m3<cpu::Reference>>) {
    let plain = Model::load(cpu::Reference, dir, |_, _| {}).expect("plain load");
    let fnuz = Model::load(fnuz_reference(), dir, |_, _| {}).expect("fnuz load");
    (plain, fnuz)
}

/// (a) the converted weights are e4m3fnuz with the same bytes except 0x80 -> 0x00 and doubled
/// scales; (b) the logits equal the unconverted load's.
fn check_converted(tag: &str, cfg: &Value, stored: &[Stored]) {
    let dir = TempDir::new(tag);
    write_model(dir.path(), cfg, stored);
    let (plain, fnuz) = load_pair(dir.path());
    let (a, b) = (matrices(&plain.weights), matrices(&fnuz.weights));
    assert_eq!(a.len(), b.len());
    let mut fp8_bytes = 0u64;
    for ((name, p), (_, u)) in a.iter().zip(&b) {
        assert_eq!(p.weight.dtype(), DType::F8E4M3Fn, "{tag} {name}: the plain load keeps e4m3fn");
        assert_eq!(u.weight.dtype(), DType::F8E4M3Fnuz, "{tag} {name}: converted for the fnuz device");
        assert_eq!(p.weight.shape(), u.weight.shape());
        let (pb, ub) = (p.weight.storage().bytes(), u.weight.storage().bytes());
        for (i, (&c, &v)) in pb[..p.weight.nbytes()].iter().zip(&ub[..u.weight.nbytes()]).enumerate() {
            let want = if c == 0x80 { 0x00 } else { c };
            assert_eq!(v, want, "{tag} {name} byte {i}: fn {c:#04x} -> fnuz {v:#04x}");
        }
        assert!(pb.contains(&0x80), "{tag} {name}: the test weight holds fn -0");
        fp8_bytes += p.weight.nbytes() as u64;
        match (&p.scale, &u.scale) {
            (WeightScale::PerTensor(s), WeightScale::PerTensor(d)) => assert_eq!(*d, 2.0 * s, "{tag} {name}"),
            (WeightScale::PerChannel(s), WeightScale::PerChannel(d))
            | (WeightScale::Block { scales: s, .. }, WeightScale::Block { scales: d, .. }) => {
                assert_eq!((s.dtype(), s.shape()), (d.dtype(), d.shape()), "{tag} {name}");
                let doubled: Vec<f32> = f32s(s).iter().map(|v| 2.0 * v).collect();
                assert_eq!(f32s(d), doubled, "{tag} {name}: scales doubled");
            }
            (s, d) => panic!("{tag} {name}: scale {s:?} became {d:?}"),
        }
    }
    let stats = fnuz.report.stats;
    assert_eq!(stats.converted_tensors, a.len(), "{tag}: {stats:?}");
    assert_eq!(stats.converted_bytes, fp8_bytes, "{tag}: {stats:?}");
    assert_eq!(stats.tensors, plain.report.stats.tensors, "{tag}");
    assert_eq!(
        stats.mapped_bytes + stats.copied_bytes,
        plain.report.stats.mapped_bytes + plain.report.stats.copied_bytes
    );
    assert_eq!(plain.report.stats.converted_tensors, 0, "a host backend never converts");
    assert!(plain.report.stats.mapped_bytes >= fp8_bytes, "the plain load maps its fp8 weights in place");

    let (la, lb) = (logits(&plain), logits(&fnuz));
    assert_eq!(la.len(), lb.len());
    assert!(la.iter().all(|v| v.is_finite()), "{tag}: non-finite logits");
    // f32 `==`: the sign of an exact zero is the one thing the conversion may change.
    for (i, (x, y)) in la.iter().zip(&lb).enumerate() {
        assert!(x == y, "{tag}: logit {i}: {x:e} unconverted vs {y:e} converted");
    }
}

#[test]
fn converted_llama_gives_the_same_logits() {
    for (scheme, sd, name) in FP8_SCHEMES {
        let (cfg, stored) = fp8_model(llama_config(64, false), scheme, sd, name);
        check_converted(&format!("llama-{scheme}-{sd}"), &cfg, &stored);
    }
    // Tied embeddings: the table is the lm_head, converted once.
    let (cfg, stored) = fp8_model(llama_config(64, true), "channel", DType::BF16, "weight_scale");
    check_converted("llama-tied", &cfg, &stored);
}

#[test]
fn converted_mixtral_gives_the_same_logits() {
    let (cfg, stored) = fp8_model(mixtral_config(64), "block", DType::F32, "weight_scale_inv");
    check_converted("mixtral-block", &cfg, &stored);
}

/// transformers' fp8 fixture (per-channel e4m3fn projections, bf16 lm_head): converted, it still
/// matches transformers' logits and greedy tokens (the kit's 1e-4, derived there), and its logits
/// equal the unconverted load's exactly.
#[test]
fn published_fp8_fixture_converted() {
    parity_kit::check_case_on(fnuz_reference(), "llama_fp8_channel", parity_kit::TOLERANCE);
    let (plain, fnuz) = load_pair(&parity_kit::fixtures().join("llama_fp8_channel"));
    // 2 layers x 7 projections; the embedding and lm_head are bf16 there.
    assert_eq!(fnuz.report.stats.converted_tensors, 14, "{:?}", fnuz.report.stats);
    let (a, b) = (logits(&plain), logits(&fnuz));
    assert!(a.iter().zip(&b).all(|(x, y)| x == y && x.is_finite()), "converted logits differ");
}

fn fnuz_load_err(tag: &str, cfg: &Value, stored: &[Stored]) -> CheckpointError {
    let dir = TempDir::new(tag);
    write_model(dir.path(), cfg, stored);
    // The same checkpoint loads on a device that reads e4m3fn (nothing is converted there).
    Model::load(cpu::Reference, dir.path(), |_, _| {}).expect("loads unconverted");
    match Model::load(fnuz_reference(), dir.path(), |_, _| {}) {
        Ok(_) => panic!("{tag}: loaded"),
        Err(ModelError::Checkpoint(e)) => e,
        Err(other) => panic!("{tag}: expected a checkpoint error, got {other}"),
    }
}

#[test]
fn fn_nan_code_is_a_typed_error_naming_tensor_and_byte() {
    let (cfg, mut stored) = fp8_model(llama_config(64, false), "channel", DType::F32, "weight_scale");
    let target = "model.layers.1.mlp.down_proj.weight";
    let i = stored.iter().position(|t| t.0 == target).unwrap();
    let at = 777;
    stored[i].3[at] = 0xff;
    let dir = TempDir::new("nan");
    write_model(dir.path(), &cfg, &stored);
    let file = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let e = fnuz_load_err("nan", &cfg, &stored);
    let CheckpointError::Fp8NanCode { tensor, path, offset, file_offset, code } = &e else {
        panic!("expected Fp8NanCode, got {e}");
    };
    assert_eq!((tensor.as_str(), *offset, *code), (target, at, 0xff), "{e}");
    assert!(path.ends_with("model.safetensors"), "{e}");
    // The reported file position holds the NaN code, and the message names tensor and byte.
    assert_eq!(file[*file_offset], 0xff, "{e}");
    let msg = e.to_string();
    assert!(msg.contains(target) && msg.contains("byte 777") && msg.contains("0xff"), "{msg}");

    // The other NaN code, in the embedding table.
    let (cfg, mut stored) = fp8_model(llama_config(64, false), "tensor", DType::F32, "weight_scale");
    let i = stored.iter().position(|t| t.0 == "model.embed_tokens.weight").unwrap();
    stored[i].3[0] = 0x7f;
    let e = fnuz_load_err("nan-embed", &cfg, &stored);
    assert!(
        matches!(&e, CheckpointError::Fp8NanCode { tensor, offset: 0, code: 0x7f, .. } if tensor == "model.embed_tokens.weight"),
        "{e}"
    );
}

#[test]
fn scale_overflowing_when_doubled_is_a_typed_error() {
    let target = "model.layers.0.self_attn.v_proj.weight_scale";
    // A per-tensor f32 scale at f32::MAX.
    let (cfg, mut stored) = fp8_model(llama_config(64, false), "tensor", DType::F32, "weight_scale");
    let i = stored.iter().position(|t| t.0 == target).unwrap();
    stored[i] = encode(target, DType::F32, &[], &[f32::MAX]);
    let e = fnuz_load_err("ovf-tensor", &cfg, &stored);
    assert!(matches!(&e, CheckpointError::ScaleOverflow { scale, index: 0, .. } if scale == target), "{e}");
    // A per-channel bf16 scale whose element 5 is bf16's largest finite value.
    let (cfg, mut stored) = fp8_model(llama_config(64, false), "channel", DType::BF16, "weight_scale");
    let i = stored.iter().position(|t| t.0 == target).unwrap();
    stored[i].3[10..12].copy_from_slice(&half::bf16::MAX.to_le_bytes());
    let e = fnuz_load_err("ovf-channel", &cfg, &stored);
    assert!(
        matches!(&e, CheckpointError::ScaleOverflow { scale, index: 5, dtype, .. } if scale == target && dtype == "bf16"),
        "{e}"
    );
}

/// Non-fp8 checkpoints load on an fnuz device unchanged (and bf16 stays in place on the host).
#[test]
fn non_fp8_weights_are_not_converted() {
    let cfg = llama_config(64, false);
    let stored = store_all(&random_weights(&cfg, 5), DType::BF16);
    let dir = TempDir::new("bf16");
    write_model(dir.path(), &cfg, &stored);
    let (plain, fnuz) = load_pair(dir.path());
    assert_eq!(fnuz.report.stats, plain.report.stats);
    assert_eq!(fnuz.report.stats.converted_tensors, 0);
    assert!(matrices(&fnuz.weights).iter().all(|(_, m)| m.weight.dtype() == DType::BF16));
    assert_eq!(logits(&plain), logits(&fnuz));
}
