//! `memwall scenario` end to end on a parity fixture: the three scenarios in the JSON output with
//! token counts the queries imply, a JSONL request file, a KV pool small enough to force
//! preemptions, the SVG, and bad request files as typed errors with a failing exit.

mod common;

use std::path::{Path, PathBuf};

use common::cli::memwall;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/parity/fixtures").join(name)
}

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("memwall-cli-scenario-{}-{name}", std::process::id()))
}

/// `memwall scenario` on the tiny tied-embedding fixture with predictions for the H200 (no
/// measuring of this machine), plus `extra`; the parsed JSON.
fn scenario_json(extra: &[&str]) -> serde_json::Value {
    let dir = fixture("llama_tied_f32");
    let mut args = vec![
        "scenario",
        "--model",
        dir.to_str().unwrap(),
        "--json",
        "--device",
        "h200",
        "--search-steps",
        "2",
    ];
    args.extend_from_slice(extra);
    let (ok, out, err) = memwall(&args);
    assert!(ok, "{err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

fn scenario<'a>(v: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    v["scenarios"]
        .as_array()
        .expect("scenarios")
        .iter()
        .find(|r| r["scenario"] == name)
        .unwrap_or_else(|| panic!("no {name} in {v}"))
}

#[test]
fn all_three_scenarios_on_synthetic_queries() {
    let v = scenario_json(&["--queries", "6", "--input-len", "3..9", "--output-len", "2..5", "--seed", "7"]);
    let mut totals = Vec::new();
    for name in ["SingleStream", "Server", "Offline"] {
        let m = &scenario(&v, name)["measured"];
        assert_eq!(m["queries"], 6, "{name}");
        let (out, tps) = (m["output_tokens"].as_u64().unwrap(), m["tokens_per_s"].as_f64().unwrap());
        assert!((12..=30).contains(&out), "{name}: {out} output tokens for 6 queries of 2..5");
        assert!(tps > 0.0 && tps.is_finite(), "{name}: {tps} tokens/s");
        assert!(m["steps"].as_u64().unwrap() >= 2, "{name}: a step per output token at least");
        totals.push(m["output_tokens"].clone());
    }
    // The same seeded queries in every scenario: only the timing differs.
    assert_eq!(totals[0], totals[1]);
    assert_eq!(totals[0], totals[2]);
    // SingleStream decodes one sequence at a time; Offline batches them.
    assert_eq!(scenario(&v, "SingleStream")["measured"]["mean_decode_batch"], 1.0);
    assert!(scenario(&v, "Offline")["measured"]["mean_decode_batch"].as_f64().unwrap() > 1.0);
    assert_eq!(v["device"], "H200");
}

#[test]
fn jsonl_requests_and_a_small_kv_pool() {
    let path = temp("ok.jsonl");
    let lines = [
        r#"{"input_ids": [1, 2, 3, 4, 5, 6, 7], "max_new_tokens": 6}"#,
        "",
        r#"{"input_ids": [9, 8, 7], "max_new_tokens": 5}"#,
        r#"{"input_ids": [200, 17, 3, 3, 40], "max_new_tokens": 7}"#,
        r#"{"input_ids": [11], "max_new_tokens": 4}"#,
    ];
    std::fs::write(&path, lines.join("\n")).unwrap();
    let svg = temp("plot.svg");
    // Blocks of 4 positions, 6 of them, for 4 slots of up to 13 positions: queries wait for
    // blocks and running ones are preempted.
    let v = scenario_json(&[
        "--scenario",
        "offline",
        "--requests",
        path.to_str().unwrap(),
        "--slots",
        "4",
        "--block-size",
        "4",
        "--kv-blocks",
        "6",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    let m = &scenario(&v, "Offline")["measured"];
    assert_eq!(m["queries"], 4);
    assert_eq!(m["input_tokens"], 7 + 3 + 5 + 1);
    assert_eq!(m["output_tokens"], 6 + 5 + 7 + 4);
    assert!(m["preemptions"].as_u64().unwrap() > 0, "6 blocks were meant to force preemptions: {m}");
    assert_eq!((v["block_size"].as_u64(), v["total_blocks"].as_u64()), (Some(4), Some(6)));
    assert!(v["scenarios"].as_array().unwrap().len() == 1, "only offline was asked for");
    let plot = std::fs::read_to_string(&svg).expect("svg written");
    assert!(plot.contains("<svg") && plot.trim_end().ends_with("</svg>"), "{plot:.200}");
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(&svg);
}

#[test]
fn bad_request_files_are_errors() {
    let dir = fixture("llama_tied_f32");
    let cases: [(&str, &str, &[&str]); 6] = [
        ("malformed", "{\"input_ids\": [1, 2], \"max_new_tokens\": 3}\n{\"input_ids\": [1,", &["line 2"]),
        ("wrong-field", r#"{"prompt": [1, 2], "max_new_tokens": 3}"#, &["line 1", "input_ids"]),
        ("empty-prompt", r#"{"input_ids": [], "max_new_tokens": 3}"#, &["line 1", "input_ids is empty"]),
        ("no-tokens", r#"{"input_ids": [1], "max_new_tokens": 0}"#, &["line 1", "max_new_tokens is 0"]),
        ("empty-file", "\n\n", &["no queries"]),
        ("out-of-vocab", r#"{"input_ids": [1, 256], "max_new_tokens": 2}"#, &["256", "vocabulary"]),
    ];
    for (name, text, want) in cases {
        let path = temp(&format!("{name}.jsonl"));
        std::fs::write(&path, text).unwrap();
        let (ok, out, err) = memwall(&[
            "scenario",
            "--model",
            dir.to_str().unwrap(),
            "--scenario",
            "offline",
            "--device",
            "h200",
            "--requests",
            path.to_str().unwrap(),
        ]);
        let _ = std::fs::remove_file(&path);
        assert!(!ok, "{name}: succeeded: {out}");
        assert!(!err.contains("panicked"), "{name}: {err}");
        for w in want {
            assert!(err.to_lowercase().contains(&w.to_lowercase()), "{name}: {w:?} not in {err}");
        }
    }
    let missing = temp("missing.jsonl");
    let (ok, _, err) =
        memwall(&["scenario", "--model", dir.to_str().unwrap(), "--requests", missing.to_str().unwrap()]);
    assert!(!ok && err.contains("missing.jsonl"), "{err}");
}

#[test]
fn bad_settings_are_errors() {
    let dir = fixture("llama_tied_f32");
    for (flag, value) in [("--slots", "0"), ("--block-size", "0"), ("--max-step-rows", "0")] {
        let (ok, _, err) =
            memwall(&["scenario", "--model", dir.to_str().unwrap(), "--device", "h200", flag, value]);
        assert!(!ok && err.contains("at least 1") && !err.contains("panicked"), "{flag} {value}: {err}");
    }
    let (ok, _, err) =
        memwall(&["scenario", "--model", dir.to_str().unwrap(), "--device", "h200", "--input-len", "9..3"]);
    assert!(!ok && !err.contains("panicked"), "{err}");
}
