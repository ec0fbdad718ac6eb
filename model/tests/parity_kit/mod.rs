#![allow(dead_code)]

//! The parity kit: runs a fixture of `tests/parity/make_fixtures.py` (a small random checkpoint in
//! a published layout, with transformers' f32 logits at every prompt position and its greedy
//! continuation) through the model on any backend and checks logits, greedy tokens, and that a
//! batch of the prompts equals each prompt run alone. Used by `model/tests/parity.rs` (the CPU
//! backends) and the root crate's `tests/gpu_model.rs` (the GPU backends, emulated in CI). Its
//! [`logits`] serve the tests that compare two loads of one checkpoint (`model/tests/fnuz.rs`,
//! `model/tests/checkpoint.rs`, the root crate's `tests/gpu_fnuz.rs`).
//!
//! Tolerance: per-row relative error ||a - b|| / ||b|| <= 1e-4. Both sides compute in f32 from
//! the same exactly-representable weights (the reference backend accumulates in f64); what differs
//! is f32 rounding along ~2 layers of K <= 256 reductions, softmaxes and norms, each contributing a
//! relative error of order sqrt(K) * 2^-24 ~ 1e-6, so 1e-4 leaves two orders of margin while a
//! wrong pairing, scale or head mapping gives errors of order 1.

use std::path::{Path, PathBuf};

use memwall_model::npy;
use memwall_model::{GenerateOptions, Generation, Model, Session, SessionOptions};
use memwall_runtime::{Backend, DType};
use serde_json::Value;

pub const TOLERANCE: f64 = 1e-4;

/// `tests/parity/fixtures` of the workspace root: the kit is compiled into the model crate's tests
/// (manifest `model/`) and the root crate's (manifest `.`).
pub fn fixtures() -> PathBuf {
    // A test executable run away from its checkout (scripts/device-check.sh) is told where.
    if let Some(dir) = std::env::var_os("MEMWALL_FIXTURES") {
        return PathBuf::from(dir);
    }
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let here = manifest.join("tests/parity/fixtures");
    if here.is_dir() { here } else { manifest.join("../tests/parity/fixtures") }
}

struct Expected {
    prompts: Vec<Vec<u32>>,
    greedy: Vec<Vec<u32>>,
    max_new: usize,
}

fn ids(v: &Value) -> Vec<Vec<u32>> {
    v.as_array()
        .expect("list of lists")
        .iter()
        .map(|p| p.as_array().expect("list").iter().map(|x| x.as_u64().expect("id") as u32).collect())
        .collect()
}

fn expected(dir: &Path) -> Expected {
    let text = std::fs::read_to_string(dir.join("expected.json")).expect("expected.json");
    let v: Value = serde_json::from_str(&text).expect("json");
    Expected {
        prompts: ids(&v["prompts"]),
        greedy: ids(&v["greedy"]),
        max_new: v["max_new_tokens"].as_u64().expect("max_new_tokens") as usize,
    }
}

fn npy(path: &Path) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    npy::read_f32(&bytes).unwrap_or_else(|| panic!("{}: not an f32 npy", path.display()))
}

/// Per-row relative error of `got` against `want`, both `[rows, cols]`; panics naming the worst row.
fn assert_rows_close(what: &str, got: &[f32], want: &[f32], cols: usize) {
    assert_eq!(got.len(), want.len(), "{what}: {} values vs {} expected", got.len(), want.len());
    let mut worst = (0.0f64, 0usize);
    for (r, (g, w)) in got.chunks(cols).zip(want.chunks(cols)).enumerate() {
        let diff: f64 = g.iter().zip(w).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum::<f64>().sqrt();
        let norm: f64 = w.iter().map(|b| (*b as f64).powi(2)).sum::<f64>().sqrt();
        let rel = if norm > 0.0 { diff / norm } else { diff };
        assert!(rel.is_finite(), "{what}: row {r} has non-finite values");
        if rel > worst.0 {
            worst = (rel, r);
        }
    }
    assert!(
        worst.0 <= TOLERANCE,
        "{what}: row {} has relative error {:.3e} > {TOLERANCE:e}; first values got {:?} want {:?}",
        worst.1,
        worst.0,
        &got[worst.1 * cols..worst.1 * cols + 4.min(cols)],
        &want[worst.1 * cols..worst.1 * cols + 4.min(cols)]
    );
}

/// `prompts` as one batch, `max_new` greedy tokens each, in a session of `capacity` positions.
fn run<B: Backend>(model: &Model<B>, prompts: &[Vec<u32>], max_new: usize, capacity: usize) -> Generation
where
    B::Storage: 'static,
{
    let opts =
        SessionOptions { max_batch: prompts.len(), capacity, cache_dtype: DType::F32, ..Default::default() };
    let mut session = Session::new(model, opts).expect("session");
    let options = GenerateOptions { max_new_tokens: max_new, record_logits: true, ..Default::default() };
    session.generate(prompts, &options).unwrap_or_else(|e| panic!("generate: {e}"))
}

/// The logits of 3 greedy tokens after each of `prompts` (one batch, a session of 16 positions):
/// each prompt's prefill rows, then its decode rows, prompt after prompt. For comparing two loads
/// of one checkpoint.
pub fn logits<B: Backend>(model: &Model<B>, prompts: &[&[u32]]) -> Vec<f32>
where
    B::Storage: 'static,
{
    let prompts: Vec<Vec<u32>> = prompts.iter().map(|p| p.to_vec()).collect();
    let max_new = 3;
    let g = run(model, &prompts, max_new, 16);
    assert_eq!((g.prefill_logits.len(), g.decode_logits.len()), (prompts.len(), prompts.len()));
    let all: Vec<f32> =
        g.prefill_logits.iter().zip(&g.decode_logits).flat_map(|(p, d)| p.iter().chain(d)).copied().collect();
    let rows: usize = prompts.iter().map(|p| p.len() + max_new).sum();
    assert_eq!(all.len(), rows * model.config.vocab_size, "a row of logits per prompt position and token");
    all
}

/// Runs a fixture on `backend`. `batch_tol`: the relative difference allowed between a batched
/// and a single run of the same prompt.
pub fn check_case_on<B: Backend>(backend: B, name: &str, batch_tol: f64)
where
    B::Storage: 'static,
{
    let dir = fixtures().join(name);
    let exp = expected(&dir);
    let model = Model::load(backend, &dir, |_, _| {}).unwrap_or_else(|e| panic!("{name}: load: {e}"));
    let name = &format!("{name} on {}", model.backend.name());
    let vocab = model.config.vocab_size;
    let mut singles = Vec::new();
    for (i, prompt) in exp.prompts.iter().enumerate() {
        let g = run(&model, std::slice::from_ref(prompt), exp.max_new, 64);
        let (shape, prefill) = npy(&dir.join(format!("prefill_logits_{i}.npy")));
        assert_eq!(shape, [prompt.len(), vocab], "{name}: prefill fixture shape");
        assert_rows_close(&format!("{name} prompt {i} prefill"), &g.prefill_logits[0], &prefill, vocab);
        let (shape, decode) = npy(&dir.join(format!("decode_logits_{i}.npy")));
        assert_eq!(shape, [exp.max_new, vocab], "{name}: decode fixture shape");
        assert_rows_close(&format!("{name} prompt {i} decode"), &g.decode_logits[0], &decode, vocab);
        assert_eq!(g.tokens[0], exp.greedy[i], "{name} prompt {i}: greedy tokens");
        singles.push(g);
    }
    // The prompts as one batch (different lengths): the same tokens and logits as alone.
    let batch = run(&model, &exp.prompts, exp.max_new, 64);
    for (i, single) in singles.iter().enumerate() {
        assert_eq!(batch.tokens[i], single.tokens[0], "{name}: batch tokens of prompt {i}");
        let what = format!("{name} batch vs single {i}");
        let rel = |a: &[f32], b: &[f32]| {
            let d: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum();
            let n: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
            (d / n).sqrt()
        };
        assert!(
            rel(&batch.prefill_logits[i], &single.prefill_logits[0]) <= batch_tol,
            "{what}: prefill logits"
        );
        assert!(rel(&batch.decode_logits[i], &single.decode_logits[0]) <= batch_tol, "{what}: decode logits");
    }
}
