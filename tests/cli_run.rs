//! `memwall run` end to end on a parity fixture: the greedy ids transformers produced, the logits
//! dumped as .npy, the JSON output, a batch, and the typed errors as messages with a failing exit.

mod common;

use std::path::{Path, PathBuf};

use common::cli::memwall;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/parity/fixtures").join(name)
}

fn expected(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).expect("expected.json");
    serde_json::from_str(&text).expect("json")
}

fn csv(v: &serde_json::Value) -> String {
    let ids: Vec<String> = v.as_array().expect("ids").iter().map(|x| x.to_string()).collect();
    ids.join(",")
}

#[test]
fn run_prints_greedy_ids_and_dumps_logits() {
    let name = "mixtral_top2_bf16";
    let exp = expected(name);
    let dir = fixture(name);
    let dump = std::env::temp_dir().join(format!("memwall-cli-dump-{}", std::process::id()));
    let prompt = csv(&exp["prompts"][0]);
    let (ok, out, err) = memwall(&[
        "run",
        "--model",
        dir.to_str().unwrap(),
        "--tokens",
        &prompt,
        "--max-new-tokens",
        "8",
        "--backend",
        "cpu-ref",
        "--dump-logits",
        dump.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    assert_eq!(out.trim(), csv(&exp["greedy"][0]));
    let vocab = 256;
    let pre = std::fs::read(dump.join("prefill_logits.npy")).expect("prefill npy");
    let dec = std::fs::read(dump.join("decode_logits.npy")).expect("decode npy");
    let (ps, pv) = memwall::model::npy::read_f32(&pre).expect("npy");
    let (ds, dv) = memwall::model::npy::read_f32(&dec).expect("npy");
    assert_eq!(ps, [exp["prompts"][0].as_array().unwrap().len(), vocab]);
    assert_eq!(ds, [8, vocab]);
    // Row 0 of the decode logits is the last prefill row.
    assert_eq!(dv[..vocab], pv[pv.len() - vocab..]);
    let _ = std::fs::remove_dir_all(&dump);
}

#[test]
fn run_json_batch() {
    let name = "llama_tied_f32";
    let exp = expected(name);
    let dir = fixture(name);
    let (p0, p1) = (csv(&exp["prompts"][0]), csv(&exp["prompts"][1]));
    let (ok, out, err) = memwall(&[
        "run",
        "--model",
        dir.to_str().unwrap(),
        "--tokens",
        &p0,
        "--tokens",
        &p1,
        "--max-new-tokens",
        "8",
        "--backend",
        "cpu-ref",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    assert_eq!(v["tokens"], exp["greedy"]);
    assert!(v["timing"]["decode_s"].as_f64().is_some());
}

/// `--max-prefill-rows` cuts the prefill into chunks without changing anything: on the reference
/// backend every row is computed on its own, so the dumped logits are bitwise those of one pass.
/// `--kv-dtype` allocates the cache in that type (the JSON says so); a bf16 cache still runs the
/// fixture to N tokens.
#[test]
fn run_chunked_prefill_and_kv_dtype() {
    let name = "mixtral_top2_bf16";
    let exp = expected(name);
    let dir = fixture(name);
    let d = dir.to_str().unwrap();
    let prompt = csv(&exp["prompts"][0]);
    let len = exp["prompts"][0].as_array().unwrap().len();
    assert!(len > 3, "the fixture prompt must be longer than a chunk");
    let dumps = |tag: &str| std::env::temp_dir().join(format!("memwall-cli-{tag}-{}", std::process::id()));
    let (whole, chunked) = (dumps("whole"), dumps("chunked"));
    let base = ["run", "--model", d, "--tokens", &prompt, "--max-new-tokens", "4", "--backend", "cpu-ref"];
    let (ok, out1, err) = memwall(&[&base[..], &["--dump-logits", whole.to_str().unwrap()]].concat());
    assert!(ok, "{err}");
    let (ok, out2, err) = memwall(
        &[&base[..], &["--max-prefill-rows", "3", "--json", "--dump-logits", chunked.to_str().unwrap()]]
            .concat(),
    );
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out2.trim()).expect("json");
    assert_eq!(csv(&v["tokens"]), out1.trim());
    assert_eq!(v["timing"]["prefill_steps"], len.div_ceil(3));
    assert_eq!(v["session"]["max_prefill_rows"], 3);
    assert_eq!(v["session"]["kv_dtype"], "f32");
    for file in ["prefill_logits.npy", "decode_logits.npy"] {
        let a = std::fs::read(whole.join(file)).expect("npy");
        let b = std::fs::read(chunked.join(file)).expect("npy");
        assert!(a == b, "{file}: chunked prefill changed the logits");
    }
    let _ = std::fs::remove_dir_all(&whole);
    let _ = std::fs::remove_dir_all(&chunked);

    for kv in ["bf16", "f16"] {
        let (ok, out, err) = memwall(&[&base[..], &["--kv-dtype", kv, "--json"]].concat());
        assert!(ok, "{kv}: {err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).expect("json");
        assert_eq!(v["session"]["kv_dtype"], kv);
        assert_eq!(v["tokens"].as_array().map(Vec::len), Some(4), "{kv}");
    }
}

#[test]
fn run_errors() {
    let dir = fixture("llama_tied_f32");
    let d = dir.to_str().unwrap();
    for (args, msg) in [
        (vec!["--tokens", "1,256", "--max-new-tokens", "2", "--backend", "cpu-ref"], "out of range"),
        (vec!["--tokens", "1,x", "--max-new-tokens", "2", "--backend", "cpu-ref"], "not a token id"),
        (vec!["--tokens", "1", "--max-new-tokens", "200", "--backend", "cpu-ref"], "max_position_embeddings"),
        (vec!["--tokens", "1,2", "--max-new-tokens", "2", "--kv-dtype", "fp8"], "invalid value 'fp8'"),
        (vec!["--tokens", "1,2", "--max-new-tokens", "2", "--max-prefill-rows", "0"], "at least 1"),
    ] {
        let mut all = vec!["run", "--model", d];
        all.extend(args);
        let (ok, _, err) = memwall(&all);
        assert!(!ok, "{all:?} succeeded");
        assert!(err.contains(msg), "{all:?}: {err}");
    }
    let (ok, _, err) =
        memwall(&["run", "--model", "/nonexistent/memwall", "--tokens", "1", "--max-new-tokens", "1"]);
    assert!(!ok);
    assert!(err.contains("cannot read"), "{err}");
}

/// `--backend cuda` and `--backend hip`: without the feature, an error saying how to build it;
/// with it and no device, the backend's own no-device error (a GPU machine runs it for real).
#[test]
fn run_on_a_gpu_is_an_error_without_a_device() {
    let dir = fixture("llama_tied_f32");
    let d = dir.to_str().unwrap();
    for (backend, want) in common::cli::gpus_without_a_device() {
        let (ok, _, err) =
            memwall(&["run", "--model", d, "--tokens", "1,2", "--max-new-tokens", "2", "--backend", backend]);
        assert!(!ok, "{backend} ran without a device");
        assert!(err.contains(&want), "{backend}: {err}");
    }
}

/// `--backend cuda-emu` and `--backend hip-emu` run the CUDA and HIP builds of the kernels through
/// the unchanged graph (on the SIMT emulator) and report their backend; the ids they generate are
/// compared with the CPU in tests/gpu_model.rs (logits, with tolerances), not here. The fp8
/// checkpoint is converted to e4m3fnuz for hip-emu (an AMD CDNA3 stand-in) and not for cuda-emu.
/// Decode steps replay a graph from the third on (the first runs op by op, the second records),
/// and `--eager` generates the same ids with none.
#[test]
fn run_on_the_emulated_gpus() {
    for (backend, converts) in [("cuda-emu", false), ("hip-emu", true)] {
        for fixture_name in ["llama_tied_f32", "llama_fp8_channel"] {
            let dir = fixture(fixture_name);
            let d = dir.to_str().unwrap();
            let args = [
                "run",
                "--model",
                d,
                "--tokens",
                "1,2,3",
                "--max-new-tokens",
                "4",
                "--backend",
                backend,
                "--json",
            ];
            let (ok, out, err) = memwall(&args);
            if !cfg!(feature = "emulate") {
                assert!(!ok && err.contains("--features emulate"), "{err}");
                return;
            }
            assert!(ok, "{backend} {fixture_name}: {err}");
            let v: serde_json::Value = serde_json::from_str(out.trim()).expect("json");
            assert_eq!(v["backend"], backend);
            assert_eq!(v["tokens"].as_array().map(Vec::len), Some(4));
            let graphs = &v["graphs"];
            assert_eq!(graphs["enabled"], true, "{backend}: {graphs}");
            assert_eq!(
                (graphs["recorded"].as_u64(), graphs["replayed_steps"].as_u64()),
                (Some(1), Some(2)),
                "{graphs}"
            );
            let (ok, eager, err) = memwall(&[&args[..], &["--eager"]].concat());
            assert!(ok, "{backend} {fixture_name} --eager: {err}");
            let e: serde_json::Value = serde_json::from_str(eager.trim()).expect("json");
            assert_eq!(e["tokens"], v["tokens"], "{backend} {fixture_name}: --eager ids");
            assert_eq!(
                (e["graphs"]["enabled"].as_bool(), e["graphs"]["replayed_steps"].as_u64()),
                (Some(false), Some(0))
            );
            let converted = v["weights"]["converted_tensors"].as_u64().expect("converted_tensors");
            let fp8 = fixture_name.contains("fp8");
            assert_eq!(
                converted > 0,
                converts && fp8,
                "{backend} {fixture_name}: {converted} tensors converted"
            );
        }
    }
}

#[test]
fn run_prompt_text_uses_the_tokenizer() {
    let name = "llama_tied_f32";
    let exp = expected(name);
    let dir = fixture(name);
    let d = dir.to_str().unwrap();
    let text = exp["text_prompt"].as_str().expect("text_prompt");
    let (ok, out, err) = memwall(&[
        "run",
        "--model",
        d,
        "--prompt",
        text,
        "--max-new-tokens",
        "4",
        "--backend",
        "cpu-ref",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("json");
    // The ids the Python tokenizers library gave for the same text (BOS prepended).
    assert_eq!(v["prompt_tokens"], exp["text_prompt_ids"]);
    assert!(v["text"][0].is_string());
    // And the generation equals the one from those ids.
    let ids = csv(&exp["text_prompt_ids"]);
    let (ok, out2, err) =
        memwall(&["run", "--model", d, "--tokens", &ids, "--max-new-tokens", "4", "--backend", "cpu-ref"]);
    assert!(ok, "{err}");
    assert_eq!(out2.trim(), csv(&v["tokens"]));
    // Without a tokenizer.json, a clear error.
    let other = fixture("llama_mha_f16");
    let (ok, _, err) =
        memwall(&["run", "--model", other.to_str().unwrap(), "--prompt", "x", "--max-new-tokens", "1"]);
    assert!(!ok);
    assert!(err.contains("tokenizer.json"), "{err}");
}
