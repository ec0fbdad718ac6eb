//! Checkpoint reading and the weight manifest: one test per typed error (missing, truncated or
//! corrupt files, sharded indexes, missing tensors, wrong dtypes and shapes, fp8 scales), the fp8
//! scale layouts applied exactly, unused tensors reported, and weights used in place.

mod common;
#[path = "parity_kit/mod.rs"]
mod parity_kit;

use std::path::{Path, PathBuf};

use common::*;
use memwall_model::checkpoint::Checkpoint;
use memwall_model::{CheckpointError, Model, ModelError};
use memwall_runtime::{DType, cpu};
use safetensors::tensor::Dtype;
use serde_json::{Value, json};

fn open_bytes(tag: &str, bytes: &[u8]) -> Result<Checkpoint, CheckpointError> {
    let dir = TempDir::new(tag);
    let p = dir.path().join("model.safetensors");
    std::fs::write(&p, bytes).expect("write");
    Checkpoint::open_files(&[p])
}

/// A valid two-tensor file: `a` F32 [2, 2] then `b` BF16 [3].
fn two_tensors() -> Vec<u8> {
    safetensors_bytes(&[
        encode("a", DType::F32, &[2, 2], &[1.0, 2.0, 3.0, 4.0]),
        encode("b", DType::BF16, &[3], &[1.0; 3]),
    ])
}

/// A file whose header is `header` (JSON text) and whose data is `data_len` zero bytes.
fn with_header(header: &str, data_len: usize) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend(std::iter::repeat_n(0u8, data_len));
    out
}

#[test]
fn valid_file_round_trips() {
    let ck = open_bytes("valid", &two_tensors()).expect("valid file");
    assert_eq!(ck.tensors.len(), 2);
    let a = &ck.tensors["a"];
    assert_eq!((a.st_dtype, a.shape.as_slice(), a.len), (Dtype::F32, &[2usize, 2][..], 16));
    let bytes = ck.bytes(a);
    assert_eq!(f32::from_le_bytes(bytes[12..16].try_into().unwrap()), 4.0);
    assert_eq!(ck.tensors["b"].dtype(), Some(DType::BF16));
}

#[test]
fn missing_file_is_io_error() {
    let dir = TempDir::new("missing");
    let err = Checkpoint::open_files(&[dir.path().join("nope.safetensors")]).unwrap_err();
    assert!(matches!(err, CheckpointError::Io { .. }), "{err}");
    let err = Checkpoint::open_dir(dir.path()).unwrap_err();
    assert!(matches!(err, CheckpointError::NoWeights { .. }), "{err}");
}

#[test]
fn truncated_file() {
    let err = open_bytes("trunc", &[1, 0, 0]).unwrap_err();
    assert!(matches!(err, CheckpointError::Truncated { len: 3, .. }), "{err}");
    // Cut inside the data: the offsets now run past the end.
    let full = two_tensors();
    let err = open_bytes("trunc2", &full[..full.len() - 2]).unwrap_err();
    assert!(matches!(err, CheckpointError::DataLength { .. }), "{err}");
}

#[test]
fn header_length_past_end() {
    let mut b = two_tensors();
    let len = b.len() as u64;
    b[..8].copy_from_slice(&len.to_le_bytes());
    let err = open_bytes("past", &b).unwrap_err();
    assert!(matches!(err, CheckpointError::HeaderPastEnd { .. }), "{err}");
    // A huge length (beyond what the format allows) on a small file is also "past the end".
    b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    let err = open_bytes("past2", &b).unwrap_err();
    assert!(matches!(err, CheckpointError::HeaderPastEnd { .. }), "{err}");
}

#[test]
fn bad_json_header() {
    let err = open_bytes("json", &with_header("{\"a\": {\"dtype\": ", 0)).unwrap_err();
    assert!(matches!(err, CheckpointError::BadHeader { .. }), "{err}");
    let err =
        open_bytes("utf8", &with_header("\u{0}\u{ff}", 0).iter().map(|&b| b | 0x80).collect::<Vec<_>>())
            .unwrap_err();
    assert!(
        matches!(err, CheckpointError::BadHeader { .. } | CheckpointError::HeaderPastEnd { .. }),
        "{err}"
    );
}

#[test]
fn overlapping_offsets() {
    let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
    let err = open_bytes("overlap", &with_header(h, 12)).unwrap_err();
    assert!(matches!(err, CheckpointError::BadOffsets { .. }), "{err}");
}

#[test]
fn gap_between_tensors() {
    let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}}"#;
    let err = open_bytes("gap", &with_header(h, 20)).unwrap_err();
    assert!(matches!(err, CheckpointError::BadOffsets { .. }), "{err}");
}

#[test]
fn offsets_out_of_bounds() {
    let h = r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    let err = open_bytes("oob", &with_header(h, 8)).unwrap_err();
    assert!(matches!(err, CheckpointError::DataLength { .. }), "{err}");
}

#[test]
fn trailing_bytes() {
    let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    let err = open_bytes("trail", &with_header(h, 12)).unwrap_err();
    assert!(matches!(err, CheckpointError::DataLength { .. }), "{err}");
}

#[test]
fn byte_length_not_matching_dtype_and_shape() {
    let h = r#"{"a":{"dtype":"BF16","shape":[3],"data_offsets":[0,8]}}"#;
    let err = open_bytes("len", &with_header(h, 8)).unwrap_err();
    assert!(matches!(err, CheckpointError::ByteLength { .. }), "{err}");
}

#[test]
fn shape_overflow() {
    let h = r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}}"#;
    let err = open_bytes("ovf", &with_header(h, 8)).unwrap_err();
    assert!(matches!(err, CheckpointError::Overflow { .. }), "{err}");
}

fn write_shards(dir: &Path, index: &Value, shards: &[(&str, Vec<u8>)]) -> PathBuf {
    for (name, bytes) in shards {
        std::fs::write(dir.join(name), bytes).expect("shard");
    }
    let p = dir.join("model.safetensors.index.json");
    std::fs::write(&p, index.to_string()).expect("index");
    p
}

#[test]
fn sharded_index() {
    let dir = TempDir::new("shards");
    let s1 = safetensors_bytes(&[encode("a", DType::F32, &[2], &[1.0, 2.0])]);
    let s2 = safetensors_bytes(&[encode("b", DType::F32, &[1], &[3.0])]);
    let idx = json!({"metadata": {}, "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}});
    write_shards(dir.path(), &idx, &[("s1.safetensors", s1.clone()), ("s2.safetensors", s2.clone())]);
    let ck = Checkpoint::open_dir(dir.path()).expect("sharded");
    assert_eq!((ck.files.len(), ck.tensors.len()), (2, 2));
    assert_eq!(ck.tensors["b"].file, 1);

    // The index names a tensor in a file that does not hold it.
    let bad = json!({"weight_map": {"a": "s2.safetensors", "b": "s2.safetensors"}});
    let p = write_shards(dir.path(), &bad, &[]);
    let err = Checkpoint::open_index(&p).unwrap_err();
    assert!(matches!(err, CheckpointError::NotInShard { .. }), "{err}");

    // A tensor stored in two shards.
    let dup = safetensors_bytes(&[encode("a", DType::F32, &[2], &[1.0, 2.0])]);
    let twice = json!({"weight_map": {"a": "s1.safetensors", "b": "s3.safetensors"}});
    let p = write_shards(dir.path(), &twice, &[("s3.safetensors", dup)]);
    let err = Checkpoint::open_index(&p).unwrap_err();
    assert!(matches!(err, CheckpointError::Duplicate { .. }), "{err}");

    // A shard path that leaves the directory, a missing map, bad JSON.
    for (v, tag) in
        [(json!({"weight_map": {"a": "../s1.safetensors"}}), "escape"), (json!({"weights": {}}), "no map")]
    {
        let p = write_shards(dir.path(), &v, &[]);
        let err = Checkpoint::open_index(&p).unwrap_err();
        assert!(matches!(err, CheckpointError::BadIndex { .. }), "{tag}: {err}");
    }
    std::fs::write(dir.path().join("model.safetensors.index.json"), "{").expect("write");
    let err = Checkpoint::open_dir(dir.path()).unwrap_err();
    assert!(matches!(err, CheckpointError::BadIndex { .. }), "{err}");
}

// ---------------------------------------------------------------------------------------------
// The manifest

fn load_err(tag: &str, config: &Value, tensors: &[Stored]) -> ModelError {
    let dir = TempDir::new(tag);
    write_model(dir.path(), config, tensors);
    match Model::load(cpu::Reference, dir.path(), |_, _| {}) {
        Ok(_) => panic!("{tag}: loaded"),
        Err(e) => e,
    }
}

fn ckpt_err(e: ModelError) -> CheckpointError {
    match e {
        ModelError::Checkpoint(c) => c,
        other => panic!("expected a checkpoint error, got {other}"),
    }
}

fn tiny_f32() -> (Value, Vec<Stored>) {
    let cfg = llama_config(64, false);
    let w = random_weights(&cfg, 7);
    (cfg, store_all(&w, DType::F32))
}

#[test]
fn missing_tensor() {
    let (cfg, mut t) = tiny_f32();
    t.retain(|x| x.0 != "model.layers.1.self_attn.k_proj.weight");
    let e = ckpt_err(load_err("miss", &cfg, &t));
    assert!(
        matches!(&e, CheckpointError::Missing { tensor } if tensor.contains("layers.1.self_attn.k_proj")),
        "{e}"
    );
}

#[test]
fn wrong_shape() {
    let (cfg, mut t) = tiny_f32();
    let i = t.iter().position(|x| x.0 == "model.layers.0.mlp.up_proj.weight").unwrap();
    t[i] = encode("model.layers.0.mlp.up_proj.weight", DType::F32, &[32, 64], &vec![0.5; 32 * 64]);
    let e = ckpt_err(load_err("shape", &cfg, &t));
    assert!(matches!(&e, CheckpointError::WrongShape { expected, .. } if expected == &[64, 32]), "{e}");
}

#[test]
fn wrong_dtype() {
    let (cfg, mut t) = tiny_f32();
    let i = t.iter().position(|x| x.0 == "model.norm.weight").unwrap();
    t[i] = ("model.norm.weight".into(), Dtype::I32, vec![32], vec![0; 128]);
    let e = ckpt_err(load_err("dtype", &cfg, &t));
    assert!(matches!(e, CheckpointError::WrongDType { .. }), "{e}");
    // fp8 norms are not a published layout.
    let (cfg, mut t) = tiny_f32();
    let i = t.iter().position(|x| x.0 == "model.norm.weight").unwrap();
    t[i] = encode("model.norm.weight", DType::F8E4M3Fn, &[32], &[1.0; 32]);
    let e = ckpt_err(load_err("dtype8", &cfg, &t));
    assert!(matches!(e, CheckpointError::WrongDType { .. }), "{e}");
}

#[test]
fn tied_model_reports_lm_head_unused_and_maps_in_place() {
    let cfg = llama_config(64, true);
    let w = random_weights(&cfg, 3);
    let mut t = store_all(&w, DType::BF16);
    t.push(encode("lm_head.weight", DType::BF16, &[64, 32], &vec![0.25; 64 * 32]));
    t.push(encode("model.layers.0.self_attn.rotary_emb.inv_freq", DType::F32, &[4], &[1.0; 4]));
    let dir = TempDir::new("tied");
    write_model(dir.path(), &cfg, &t);
    let m = Model::load(cpu::Reference, dir.path(), |_, _| {}).expect("load");
    assert_eq!(m.report.unused, ["lm_head.weight", "model.layers.0.self_attn.rotary_emb.inv_freq"]);
    // bf16 tensors written back to back stay 2-byte aligned: every needed tensor is used in place.
    assert_eq!(m.report.stats.copied_bytes, 0);
    assert!(m.report.stats.mapped_bytes > 0);
}

#[test]
fn misaligned_tensor_is_copied_not_refused() {
    let (cfg, mut t) = tiny_f32();
    // A 1-byte tensor first shifts every f32 tensor after it off 4-byte alignment (the header is
    // padded to 8). Only the tensors that land misaligned are copied.
    t.insert(0, ("extra.byte".into(), Dtype::U8, vec![1], vec![7]));
    let dir = TempDir::new("misal");
    write_model(dir.path(), &cfg, &t);
    let m = Model::load(cpu::Reference, dir.path(), |_, _| {}).expect("load");
    assert!(m.report.stats.copied_bytes > 0, "{:?}", m.report.stats);
    assert_eq!(m.report.unused, ["extra.byte"]);
}

// ---------------------------------------------------------------------------------------------
// fp8

/// A tiny model in fp8 (`scheme`, scale dtype, scale name) and the same model in f32 with the
/// dequantized values: the two must give the same logits.
fn fp8_pair(scheme: &str, scale_dtype: DType, scale_name: &str) -> (Value, Vec<Stored>, Vec<Stored>) {
    let mut cfg = llama_config(64, false);
    let w = random_weights(&cfg, 11);
    let mut q_stored = Vec::new();
    let mut ref_stored = Vec::new();
    for (name, shape, values) in &w {
        let is_proj = name.ends_with("_proj.weight");
        if is_proj {
            let (q, sshape, scales, _) = fp8_quantize(values, shape[0], shape[1], scheme);
            q_stored.push(encode(name, DType::F8E4M3Fn, shape, &q));
            let scale = fp8_scale(name, scale_name, scale_dtype, &sshape, &scales);
            // Scales rounded to the stored dtype are what the weights mean.
            let scales_r = memwall_runtime::dtype::decode_f32(scale_dtype, &scale.3).unwrap();
            q_stored.push(scale);
            let real: Vec<f32> = (0..values.len())
                .map(|i| {
                    let (j, l) = (i / shape[1], i % shape[1]);
                    let s = match scheme {
                        "tensor" => scales_r[0],
                        "channel" => scales_r[j],
                        _ => scales_r[(j / 16) * shape[1].div_ceil(16) + l / 16],
                    };
                    q[i] * s
                })
                .collect();
            ref_stored.push(encode(name, DType::F32, shape, &real));
        } else {
            q_stored.push(encode(name, DType::F32, shape, values));
            ref_stored.push(encode(name, DType::F32, shape, values));
        }
    }
    cfg["quantization_config"] = fp8_quant_config(scheme);
    (cfg, q_stored, ref_stored)
}

fn logits_of(dir: &Path) -> Vec<f32> {
    let m = Model::load(cpu::Reference, dir, |_, _| {}).expect("load");
    parity_kit::logits(&m, &[&[5, 9, 33, 60]])
}

#[test]
fn fp8_scales_applied_exactly() {
    for (scheme, sd, name) in FP8_SCHEMES {
        let (cfg, q, r) = fp8_pair(scheme, sd, name);
        let dq = TempDir::new("fp8q");
        write_model(dq.path(), &cfg, &q);
        let mut rcfg = cfg.clone();
        rcfg.as_object_mut().unwrap().remove("quantization_config");
        let dr = TempDir::new("fp8r");
        write_model(dr.path(), &rcfg, &r);
        let (a, b) = (logits_of(dq.path()), logits_of(dr.path()));
        // Same real weights; only where the scale multiplies (after the f64 reduction, or per
        // block partial sum) differs: a few f64 roundings, far below f32 output rounding (6e-8).
        let err = a.iter().zip(&b).map(|(x, y)| (x - y).abs() as f64).fold(0.0, f64::max);
        let norm = b.iter().map(|y| y.abs() as f64).fold(0.0, f64::max);
        assert!(err <= 1e-6 * norm, "{scheme} {sd} {name}: max abs diff {err:e} vs max {norm}");
    }
}

#[test]
fn fp8_errors() {
    let (cfg, q, _) = fp8_pair("channel", DType::F32, "weight_scale");
    let target = "model.layers.0.self_attn.q_proj";

    let no_scale: Vec<Stored> =
        q.iter().filter(|t| t.0 != format!("{target}.weight_scale")).cloned().collect();
    let e = ckpt_err(load_err("noscale", &cfg, &no_scale));
    assert!(matches!(e, CheckpointError::MissingScale { .. }), "{e}");

    // A scale beside a weight that is not fp8, and a scale with no weight at all.
    let mut bf = q.clone();
    let i = bf.iter().position(|t| t.0 == format!("{target}.weight")).unwrap();
    bf[i] = encode(&format!("{target}.weight"), DType::BF16, &[32, 32], &vec![0.1; 32 * 32]);
    let e = ckpt_err(load_err("orphan", &cfg, &bf));
    assert!(matches!(e, CheckpointError::OrphanScale { .. }), "{e}");
    let mut extra = q.clone();
    extra.push(encode("model.layers.0.mlp.nothing.weight_scale", DType::F32, &[1], &[1.0]));
    let e = ckpt_err(load_err("orphan2", &cfg, &extra));
    assert!(matches!(e, CheckpointError::OrphanScale { .. }), "{e}");

    let mut two = q.clone();
    two.push(encode(&format!("{target}.weight_scale_inv"), DType::F32, &[32, 1], &[1.0; 32]));
    let e = ckpt_err(load_err("two", &cfg, &two));
    assert!(matches!(e, CheckpointError::TwoScales { .. }), "{e}");

    let mut bad_shape = q.clone();
    let i = bad_shape.iter().position(|t| t.0 == format!("{target}.weight_scale")).unwrap();
    bad_shape[i] = encode(&format!("{target}.weight_scale"), DType::F32, &[16, 1], &[1.0; 16]);
    let e = ckpt_err(load_err("sshape", &cfg, &bad_shape));
    assert!(matches!(e, CheckpointError::ScaleShape { .. }), "{e}");

    let mut f16_scale = q.clone();
    let i = f16_scale.iter().position(|t| t.0 == format!("{target}.weight_scale")).unwrap();
    f16_scale[i] = encode(&format!("{target}.weight_scale"), DType::F16, &[32, 1], &[1.0; 32]);
    let e = ckpt_err(load_err("sdtype", &cfg, &f16_scale));
    assert!(matches!(e, CheckpointError::WrongDType { .. }), "{e}");

    let mut no_qc = cfg.clone();
    no_qc.as_object_mut().unwrap().remove("quantization_config");
    let e = ckpt_err(load_err("noqc", &no_qc, &q));
    assert!(matches!(e, CheckpointError::NoQuantConfig { .. }), "{e}");

    let mut gptq = cfg.clone();
    gptq["quantization_config"] = json!({"quant_method": "gptq", "bits": 4});
    let e = ckpt_err(load_err("gptq", &gptq, &q));
    assert!(
        matches!(&e, CheckpointError::Quant { field, .. } if field == "quantization_config.quant_method"),
        "{e}"
    );

    // The older key works the same.
    let mut old = cfg.clone();
    let qc = old.as_object_mut().unwrap().remove("quantization_config").unwrap();
    old["compression_config"] = qc;
    let dir = TempDir::new("oldkey");
    write_model(dir.path(), &old, &q);
    Model::load(cpu::Reference, dir.path(), |_, _| {}).expect("compression_config");

    // A per-tensor scale of zero.
    let (cfg_t, mut qt, _) = fp8_pair("tensor", DType::F32, "weight_scale");
    let i = qt.iter().position(|t| t.0 == format!("{target}.weight_scale")).unwrap();
    qt[i] = encode(&format!("{target}.weight_scale"), DType::F32, &[], &[0.0]);
    let e = ckpt_err(load_err("zero", &cfg_t, &qt));
    assert!(matches!(e, CheckpointError::ScaleValue { .. }), "{e}");
}

#[test]
fn deepseek_style_fp8_method() {
    let (mut cfg, q, _) = fp8_pair("block", DType::F32, "weight_scale_inv");
    cfg["quantization_config"] =
        json!({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]});
    let dir = TempDir::new("dsfp8");
    write_model(dir.path(), &cfg, &q);
    Model::load(cpu::Reference, dir.path(), |_, _| {}).expect("fp8 method with block size");
}
