//! Decode at the memory wall, measured (`cargo bench --bench decode`): greedy decode at batch 1,
//! 4 and 16 at a short context, and at batch 1 and 4 at an 8K context, of a Llama-3.1-shaped checkpoint with random bf16 weights on the default backend
//! (`cpu::Fast`) through `memwall::model::Session`, against the read ceiling measured in the same
//! run. Batch 1 is the memory wall; the larger batches are the measured points of the roofline
//! (`memwall wall --measure --svg`).
//!
//! 1. Writes the checkpoint (config.json and one safetensors file, `memwall::synth`, every thread
//!    generating and writing its chunks) into a temporary directory: hidden 2048, 12 layers,
//!    intermediate 8192, vocab 32000, 32 query and 8 KV heads, untied lm_head: about 0.86 B
//!    parameters, 1.7 GB, well over 3x the last-level cache of any CPU this runs on, so every step
//!    reads its weights from memory.
//! 2. Measures the read peak (`memwall::peak`, read kernel, all threads, best of 5 passes over
//!    max(3 x LLC, 1 GiB)) before and after the decode; the higher of the two is the peak.
//! 3. Per case (batch size B, context L; `CASES`): fills positions `0..L - PROMPT` of each of the
//!    B sequences with random keys and values (`Session::fill_context`: the bytes a prefill
//!    leaves, without its compute, which on a CPU would take minutes at 8K), prefills B prompts of
//!    `PROMPT` random tokens after them, then times decode steps in criterion's `iter_custom` (one
//!    step = one token for each of the B sequences), each step at the next position; positions
//!    wrap within `WINDOW` so the context stays near L. Bytes and FLOPs per step (weights and the
//!    KV cache read) come from the model's op list (`Session::last_step_cost`, i.e. `OpCost`),
//!    averaged over the timed steps.
//! 4. Prints, per batch, `decode <model> batch <B> context <L>: <tok/s> tok/s = <pct>% of the wall
//!    <wall> tok/s at measured read peak <peak> GB/s` (tokens/s from the median step, robust on a
//!    shared machine) and writes the records `memwall wall` reads (`target/memwall/decode.json`,
//!    see `memwall::wall::record`).
//!
//! Under `cargo test --benches` (`--test`) it runs a tiny model once (a short and a filled
//! context) and writes no record.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use criterion::{Criterion, SamplingMode, Throughput};
use memwall::model::graph::OpCost;
use memwall::model::random::mix64;
use memwall::model::session::Row;
use memwall::model::{Model, Session, SessionOptions};
use memwall::peak::{self, Kernel, StreamBuffers};
use memwall::runtime::{DType, SamplingParams};
use memwall::wall::DecodeRecord;
use serde_json::{Value, json};

/// Tokens in the prompt prefilled before the decode steps (after the filled context, if any).
const PROMPT: usize = 64;
/// Decode positions cycle over `L..L + WINDOW` for context L.
const WINDOW: usize = 32;
const MODEL_NAME: &str = "llama-3.1-shaped-0.86b-random";
/// (batch, context) measured. Batch 1 is the memory wall's case; larger batches read the same
/// weights for more tokens and climb the roofline towards the compute roof. At 8K the KV cache
/// is 192 MiB per sequence (12 layers x 8 KV heads x 64 x 2 bytes x 2, per position) against
/// 1.6 GB of weights read per step: attention's share of the bytes.
const CASES: &[(usize, usize)] = &[(1, PROMPT), (4, PROMPT), (16, PROMPT), (1, 8192), (4, 8192)];
/// The tiny model's cases under `--test`.
const TEST_CASES: &[(usize, usize)] = &[(1, PROMPT), (3, 200)];

fn config(test_mode: bool) -> Value {
    let (hidden, inter, layers, heads, kv_heads, vocab) =
        if test_mode { (256, 512, 2, 4, 2, 1000) } else { (2048, 8192, 12, 32, 8, 32000) };
    json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2
    })
}

/// A directory removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes `config.json` and `model.safetensors` (random bf16, `memwall::synth`) into a fresh
/// directory.
fn write_checkpoint(cfg: &Value) -> TempDir {
    let dir = TempDir(std::env::temp_dir().join(format!("memwall-decode-bench-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&dir.0);
    memwall::synth::write_checkpoint(cfg, DType::BF16, 0, &dir.0).expect("write the random checkpoint");
    dir
}

/// The best of `passes` read passes on all threads, GB/s.
fn read_peak(working_set: u64, passes: usize) -> f64 {
    let mut buf = StreamBuffers::new(working_set).expect("allocate the peak working set");
    buf.measure(Kernel::Read, peak::max_threads(), passes).expect("read peak").gb_per_s
}

/// What the timed steps leave behind.
#[derive(Default)]
struct Steps {
    times: Vec<Duration>,
    cost: Vec<OpCost>,
    positions: Vec<u32>,
}

/// Fills `context - PROMPT` positions of `batch` sequences with random keys and values, prefills
/// a random prompt of `PROMPT` tokens after them, then times decode steps of all `batch`
/// sequences at once in criterion's `iter_custom`, each step at the next position (positions wrap
/// within `context..context + WINDOW`).
fn decode_batch<B: memwall::runtime::Backend>(
    c: &mut Criterion,
    model: &Model<B>,
    name: &str,
    (batch, context): (usize, usize),
) -> Steps
where
    B::Storage: 'static,
{
    let options = SessionOptions {
        max_batch: batch,
        capacity: context + WINDOW,
        cache_dtype: DType::BF16,
        ..Default::default()
    };
    let mut session = Session::new(model, options).expect("a session");
    let vocab = model.config.vocab_size as u64;
    let greedy = SamplingParams::GREEDY;
    let seeds = vec![0u32; batch];
    let filled = context - PROMPT;
    let t = Instant::now();
    for slot in 0..batch {
        session.reserve(slot, context + WINDOW).expect("the pool holds every slot at full length");
        session.fill_context(slot, filled, slot as u64).expect("fill the context");
    }
    let fill_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mut tokens = Vec::with_capacity(batch);
    for slot in 0..batch {
        let prompt: Vec<Row> = (filled as u32..context as u32)
            .map(|p| Row {
                token: (mix64(((slot as u64) << 32) | p as u64) % vocab) as u32,
                slot: slot as u32,
                pos: p,
            })
            .collect();
        let first = session
            .step(&prompt, &[PROMPT as u32 - 1], false, false, (&greedy, &[0], &[0]))
            .expect("prefill");
        tokens.push(first.tokens[0]);
    }
    println!(
        "batch {batch} context {context}: {filled} positions filled in {fill_s:.2} s, then a prefill of \
         {batch} x {PROMPT} tokens in {:.2} s",
        t.elapsed().as_secs_f64()
    );

    let steps = Mutex::new(Steps::default());
    let mut pos = context as u32;
    let mut step_no = 1u32;
    let last: Vec<u32> = (0..batch as u32).collect();
    let mut group = c.benchmark_group("decode");
    group.sampling_mode(SamplingMode::Flat).throughput(Throughput::Elements(batch as u64));
    group.bench_function(format!("{name}/batch{batch}/context{context}"), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let rows: Vec<Row> =
                    tokens.iter().enumerate().map(|(s, &token)| Row { token, slot: s as u32, pos }).collect();
                let step_nos = vec![step_no; batch];
                let t = Instant::now();
                let out = session
                    .step(&rows, &last, false, false, (&greedy, &seeds, &step_nos))
                    .expect("decode step");
                let dt = t.elapsed();
                total += dt;
                let mut s = steps.lock().unwrap_or_else(|e| e.into_inner());
                s.times.push(dt);
                s.cost.push(session.last_step_cost().unwrap_or_default());
                s.positions.push(pos);
                tokens.copy_from_slice(&out.tokens);
                step_no += 1;
                pos = if pos as usize + 1 >= context + WINDOW { context as u32 } else { pos + 1 };
            }
            total
        });
    });
    group.finish();
    steps.into_inner().unwrap_or_else(|e| e.into_inner())
}

fn main() {
    let started = Instant::now();
    let test_mode = std::env::args().any(|a| a == "--test");
    let mut c = Criterion::default()
        .without_plots()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(8))
        .configure_from_args();

    let cfg = config(test_mode);
    let name = if test_mode { "tiny-llama-random" } else { MODEL_NAME };
    let dir = write_checkpoint(&cfg);
    let weight_bytes = std::fs::metadata(dir.0.join("model.safetensors")).map_or(0, |m| m.len());
    let llc = peak::llc_bytes();
    let working_set = peak::working_set_for(llc);
    println!(
        "checkpoint: {name}, {:.2} GB of bf16 weights ({:.1}x the {} last-level cache), written in {:.1} s",
        weight_bytes as f64 / 1e9,
        llc.map_or(f64::NAN, |l| weight_bytes as f64 / l as f64),
        llc.map_or("unknown".to_string(), |l| format!("{} MiB", l >> 20)),
        started.elapsed().as_secs_f64()
    );

    let peak_before = if test_mode { 1.0 } else { read_peak(working_set, 5) };

    let model =
        Model::load(memwall::default_backend(), &dir.0, |_, _| {}).expect("load the random checkpoint");
    let cases = if test_mode { TEST_CASES } else { CASES };
    let mut timed = Vec::new();
    for &(batch, context) in cases {
        timed.push((batch, context, decode_batch(&mut c, &model, name, (batch, context))));
    }
    drop(model);

    let peak_after = if test_mode { 1.0 } else { read_peak(working_set, 5) };
    let peak_gb_s = peak_before.max(peak_after);
    println!("read peak: {peak_before:.2} GB/s before, {peak_after:.2} GB/s after the decode");

    let mut records = Vec::new();
    for (batch, context, steps) in timed {
        let n = steps.times.len();
        if n == 0 {
            println!("decode batch {batch} context {context}: no step was timed");
            continue;
        }
        let mut sorted = steps.times.clone();
        sorted.sort();
        let median = sorted[n / 2].as_secs_f64();
        let mean =
            |f: &dyn Fn(&OpCost) -> u64| steps.cost.iter().map(|c| f(c) as f64).sum::<f64>() / n as f64;
        // Tokens in each sequence's KV cache before a step: its position.
        let context = (steps.positions.iter().map(|&p| p as f64).sum::<f64>() / n as f64).round() as u64;
        let record = DecodeRecord {
            model: name.to_string(),
            backend: "cpu::Fast".to_string(),
            dtype: "bf16".to_string(),
            batch: batch as u64,
            context,
            steps: n as u64,
            tokens_per_s: batch as f64 / median,
            bytes_per_step: mean(&|c| c.bytes_read),
            flops_per_step: mean(&|c| c.flops),
            peak_read_gb_s: peak_gb_s,
            estimated_peak_flops_per_s: peak::estimate_peak_flops().map(|f| f.flops_per_s),
            config: cfg.clone(),
        };
        println!(
            "batch {batch} context {context}: {n} steps timed, median {:.1} ms, fastest {:.1} ms; {:.3} GB and {:.2} GFLOP per \
             step (op list)",
            median * 1e3,
            sorted[0].as_secs_f64() * 1e3,
            record.bytes_per_step / 1e9,
            record.flops_per_step / 1e9
        );
        records.push(record);
    }
    if test_mode {
        println!("test mode: a tiny model, no read peak measured, nothing recorded");
        return;
    }
    for record in &records {
        println!("{}", record.summary());
        if record.bandwidth_utilisation() > 1.0 {
            println!("  above the measured read peak: a bench bug, or a read kernel that is not the ceiling");
        }
    }
    let path = memwall::wall::record::default_path();
    match DecodeRecord::save_all(&records, &path) {
        Ok(()) => println!("recorded in {} (memwall wall shows it)", path.display()),
        Err(e) => println!("could not write the record: {e}"),
    }
    println!("total {:.0} s", started.elapsed().as_secs_f64());
}
