//! The session's static workspace: everything is allocated in `Session::new` (a backend that counts
//! `exec_alloc` sees none during generation), and a prefill run in chunks of `max_prefill_rows`
//! rows gives the same tokens and logits as one pass over the whole prompt.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};

use common::*;
use memwall_model::session::{DEFAULT_MAX_PREFILL_ROWS, Row};
use memwall_model::{GenerateOptions, Generation, Model, ModelError, Session, SessionOptions};
use memwall_runtime::{Backend, DType, Hook, SamplingParams, Wrapped, cpu};
use serde_json::Value;

/// Counts the allocations of the backend it hooks.
#[derive(Debug, Default)]
struct Allocs(AtomicUsize);

impl Hook for Allocs {
    fn on_alloc(&self, _bytes: usize) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// A backend that runs `inner` and counts its allocations.
type Counting<B> = Wrapped<B, Allocs>;

fn counting<B>(inner: B) -> Counting<B> {
    Wrapped { inner, hook: Allocs::default() }
}

fn allocs<B>(b: &Counting<B>) -> usize {
    b.hook.0.load(Ordering::SeqCst)
}

fn model<B: Backend>(backend: B, cfg: &Value, dtype: DType, dir: &TempDir) -> Model<B>
where
    B::Storage: 'static,
{
    let w = random_weights(cfg, 21);
    write_model(dir.path(), cfg, &store_all(&w, dtype));
    Model::load(backend, dir.path(), |_, _| {}).expect("load")
}

/// The test models: Llama (f32 weights) and Mixtral (bf16, 4 experts, top-2).
fn cases() -> [(&'static str, Value, DType); 2] {
    [("llama", llama_config(64, false), DType::F32), ("mixtral", mixtral_config(64), DType::BF16)]
}

/// Prompts of uneven lengths: 10 rows, so chunks of 3 or 4 rows cut inside prompts and some
/// chunks end no sequence.
fn prompts() -> Vec<Vec<u32>> {
    vec![vec![5, 6, 7, 8, 9], vec![10, 11], vec![12, 13, 14]]
}

fn opts(batch: usize, capacity: usize, prefill: usize, cache: DType) -> SessionOptions {
    SessionOptions {
        max_batch: batch,
        capacity,
        cache_dtype: cache,
        max_prefill_rows: prefill,
        ..Default::default()
    }
}

fn recorded(n: usize) -> GenerateOptions {
    GenerateOptions { max_new_tokens: n, record_logits: true, ..Default::default() }
}

fn sampled(n: usize) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens: n,
        sampling: SamplingParams { temperature: 1.3, top_k: 20, top_p: 0.9 },
        seed: 11,
        ..Default::default()
    }
}

/// `Session::new` allocates the KV cache (k and v per layer) and each workspace buffer once;
/// generating (prefill in chunks and whole, decode, a batch of uneven prompts, greedy with logits
/// read back and sampled, then a single prompt, then raw steps) allocates nothing more.
#[test]
fn generation_allocates_nothing_after_new() {
    fn check<B: Backend>(inner: B, name: &str, cfg: &Value, dtype: DType)
    where
        B::Storage: 'static,
    {
        let dir = TempDir::new(name);
        let m = model(counting(inner), cfg, dtype, &dir);
        let who = format!("{name} on {}", m.backend.name());
        for prefill in [1, 4, DEFAULT_MAX_PREFILL_ROWS] {
            let before = allocs(&m.backend);
            let mut s = Session::new(&m, opts(3, 32, prefill, DType::BF16)).expect("session");
            // k and v per layer, the block table; the workspace's 17 buffers of every model, plus
            // the dense MLP's 3 or Mixtral's 3 router buffers and 7 of the expert bucket. Each
            // exactly once.
            let layers = m.config.num_layers;
            let workspace = if m.config.moe.is_some() { 17 + 3 + 7 } else { 17 + 3 };
            assert_eq!(allocs(&m.backend) - before, 2 * layers + 1 + workspace, "{who}: allocations of new");
            let after_new = allocs(&m.backend);
            let g = s.generate(&prompts(), &recorded(6)).expect("generate");
            assert_eq!(g.tokens.iter().map(Vec::len).collect::<Vec<_>>(), [6, 6, 6]);
            s.generate(&prompts(), &sampled(5)).expect("sampled");
            s.generate(&[vec![3, 1, 4, 1, 5, 9, 2, 6]], &recorded(3)).expect("single");
            let rows: Vec<Row> = (0..3).map(|slot| Row { token: 7, slot, pos: 0 }).collect();
            let greedy = SamplingParams::GREEDY;
            for slot in 0..3 {
                s.reserve(slot, 1).expect("reserve");
            }
            s.step(&rows, &[0, 1, 2], false, true, (&greedy, &[0; 3], &[0; 3])).expect("step");
            s.step(&rows[..1], &[], false, false, (&greedy, &[], &[])).expect("step picking nothing");
            assert_eq!(
                allocs(&m.backend),
                after_new,
                "{who}, max_prefill_rows {prefill}: generate allocated"
            );
        }
    }
    for (name, cfg, dtype) in cases() {
        check(cpu::Reference, name, &cfg, dtype);
        check(cpu::Fast::default(), name, &cfg, dtype);
    }
}

/// Runs the prompts with prefill chunks of `prefill` rows.
fn run<B: Backend>(m: &Model<B>, prefill: usize, cache: DType, o: &GenerateOptions) -> Generation {
    let mut s = Session::new(m, opts(3, 32, prefill, cache)).expect("session");
    let g = s.generate(&prompts(), o).expect("generate");
    let steps = 10usize.div_ceil(s.options().max_prefill_rows);
    assert_eq!(g.timing.prefill_steps, steps, "prefill steps of chunks of {prefill}");
    g
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter().map(|r| r.iter().map(|x| x.to_bits()).collect()).collect()
}

/// Largest per-row relative error `||a - b|| / ||b||` over `[rows, cols]` matrices.
fn worst_rel(a: &[f32], b: &[f32], cols: usize) -> f64 {
    assert_eq!(a.len(), b.len());
    a.chunks(cols)
        .zip(b.chunks(cols))
        .map(|(x, y)| {
            let d: f64 = x.iter().zip(y).map(|(p, q)| (*p as f64 - *q as f64).powi(2)).sum();
            let n: f64 = y.iter().map(|q| (*q as f64).powi(2)).sum();
            (d / n).sqrt()
        })
        .fold(0.0, f64::max)
}

/// Prefill in chunks of 1, 3 and 4 rows (cutting inside prompts, with chunks in which no sequence
/// ends) against one pass over all 10 rows, with an f32 and a bf16 cache, greedy with the logits
/// read back and seeded sampling.
///
/// What is asserted, and why:
/// - Reference backend: tokens equal and every logit bitwise equal. Each of its ops computes each
///   row on its own (f64 sums in a fixed order per row), attention reads every key and value from
///   the cache (those of the row's own chunk too, so a bf16 cache rounds them the same way in
///   both runs), and each Mixtral row gets its experts' outputs added in expert order whatever
///   the chunk. A chunk boundary changes which rows run together, never a row's arithmetic.
/// - Fast backend: tokens equal and per-row relative error <= 1e-4 against its own whole-prompt
///   run. Its linear picks GEMV for one row and GEMM tiles above, so a row's f32 sums may be
///   taken in another order: each K <= 64 reduction changes by O(sqrt(K) * 2^-24) ~ 5e-7
///   relative, through two layers of norms, softmaxes and residual adds; 1e-4 leaves two orders
///   of margin (as in the parity tests), while a chunk attending to a wrong or missing cache
///   position changes logits by O(1). (Measured at these shapes: bitwise equal as well.)
#[test]
fn chunked_prefill_equals_whole_prefill() {
    for (name, cfg, dtype) in cases() {
        let dir = TempDir::new(name);
        let reference = model(cpu::Reference, &cfg, dtype, &dir);
        // The same files (written once, mapped twice).
        let fast = Model::load(cpu::Fast::default(), dir.path(), |_, _| {}).expect("load");
        let vocab = reference.config.vocab_size;
        for cache in [DType::F32, DType::BF16] {
            let who = format!("{name}, {cache} cache");
            let whole = run(&reference, 10, cache, &recorded(6));
            let whole_fast = run(&fast, 10, cache, &recorded(6));
            let whole_sampled = run(&reference, DEFAULT_MAX_PREFILL_ROWS, cache, &sampled(6));
            for prefill in [1, 3, 4] {
                let who = format!("{who}, chunks of {prefill}");
                let g = run(&reference, prefill, cache, &recorded(6));
                assert_eq!(g.tokens, whole.tokens, "{who}: tokens");
                assert_eq!(bits(&g.prefill_logits), bits(&whole.prefill_logits), "{who}: prefill logits");
                assert_eq!(bits(&g.decode_logits), bits(&whole.decode_logits), "{who}: decode logits");
                let s = run(&reference, prefill, cache, &sampled(6));
                assert_eq!(s.tokens, whole_sampled.tokens, "{who}: sampled tokens");

                let f = run(&fast, prefill, cache, &recorded(6));
                assert_eq!(f.tokens, whole_fast.tokens, "{who} on fast: tokens");
                for (i, (a, b)) in f.prefill_logits.iter().zip(&whole_fast.prefill_logits).enumerate() {
                    let rel = worst_rel(a, b, vocab);
                    assert!(rel <= 1e-4, "{who} on fast: prefill logits of sequence {i}: {rel:e}");
                }
                for (i, (a, b)) in f.decode_logits.iter().zip(&whole_fast.decode_logits).enumerate() {
                    let rel = worst_rel(a, b, vocab);
                    assert!(rel <= 1e-4, "{who} on fast: decode logits of sequence {i}: {rel:e}");
                }
            }
        }
    }
}

/// The options are checked and capped, and a step beyond the workspace is a typed error that
/// leaves the session usable.
#[test]
fn options_and_step_limits() {
    let dir = TempDir::new("limits");
    let m = model(cpu::Reference, &llama_config(64, false), DType::F32, &dir);
    let e = Session::new(&m, opts(2, 16, 0, DType::F32)).err().expect("0 prefill rows");
    assert!(matches!(e, ModelError::Session(_)), "{e}");
    // No prefill has more rows than the cache has positions: 2 x 16.
    let s = Session::new(&m, opts(2, 16, 1000, DType::F32)).unwrap();
    assert_eq!(s.options().max_prefill_rows, 32);
    // A decode step of max_batch rows fits even when prefill chunks are smaller.
    let mut s = Session::new(&m, opts(4, 16, 2, DType::F32)).unwrap();
    assert_eq!(s.max_step_rows(), 4);
    let greedy = SamplingParams::GREEDY;
    let rows: Vec<Row> = (0..5).map(|i| Row { token: 3, slot: i % 4, pos: i / 4 }).collect();
    for slot in 0..4 {
        s.reserve(slot, 2).unwrap();
    }
    let e = s.step(&rows, &[0], false, false, (&greedy, &[0], &[0])).unwrap_err();
    assert!(matches!(e, ModelError::Session(ref msg) if msg.contains("at most 4")), "{e}");
    let e = s.step(&rows[..3], &[0], true, false, (&greedy, &[0], &[0])).unwrap_err();
    assert!(matches!(e, ModelError::Session(ref msg) if msg.contains("at most 2")), "{e}");
    let e = s.step(&rows[..4], &[0, 1, 2, 3, 0], false, false, (&greedy, &[0; 5], &[0; 5])).unwrap_err();
    assert!(matches!(e, ModelError::BatchTooLarge { got: 5, allocated: 4 }), "{e}");
    let out = s.step(&rows[..4], &[0, 1, 2, 3], false, false, (&greedy, &[0; 4], &[0; 4])).unwrap();
    assert_eq!(out.tokens.len(), 4);
    // A prompt longer than a chunk: prefilled in chunks of 2.
    let g = s.generate(&[vec![1, 2, 3, 4, 5]], &recorded(2)).unwrap();
    assert_eq!(g.timing.prefill_steps, 3);
    assert_eq!(g.prefill_logits[0].len(), 5 * 64);
}
