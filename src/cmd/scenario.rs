//! `memwall scenario`: the MLPerf scenarios measured on a checkpoint through the continuous-
//! batching scheduler, beside the predictions of `memwall wall` (see `memwall::scenario`).

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use memwall::engine::{SchedulerConfig, SessionEngine, StepEngine};
use memwall::model::session::DEFAULT_BLOCK_SIZE;
use memwall::model::{Session, SessionOptions};
use memwall::runtime::{Backend, DType, SamplingParams};
use memwall::scenario::predict::{self, Prediction};
use memwall::scenario::{self, Arrivals, LenDist, Query, RunSummary, ServerLimits, ServerResult, requests};
use memwall::wall::{Device, Scenario, WeightDtype};
use serde::Serialize;

use super::run::BackendName;

type BoxError = Box<dyn std::error::Error>;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Which {
    SingleStream,
    Server,
    Offline,
    All,
}

#[derive(Args)]
pub struct ScenarioArgs {
    /// The checkpoint directory (config.json and the safetensors).
    #[arg(long)]
    model: PathBuf,
    #[arg(long, value_enum, default_value = "all")]
    scenario: Which,
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendName,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Write decode tokens/s against batch size, measured over the roofline, as SVG.
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
    /// Queries from a JSONL file, one `{"input_ids": [...], "max_new_tokens": n}` per line
    /// (instead of synthetic ones).
    #[arg(long, value_name = "FILE")]
    requests: Option<PathBuf>,
    /// Synthetic queries per run.
    #[arg(long, default_value_t = 16)]
    queries: usize,
    /// Input tokens of a synthetic query: N or MIN..MAX (uniform, inclusive).
    #[arg(long, default_value = "16..64")]
    input_len: String,
    /// Output tokens of a synthetic query: N or MIN..MAX (uniform, inclusive).
    #[arg(long, default_value = "16..64")]
    output_len: String,
    /// Seed of the synthetic queries, of the Poisson arrivals and of each query's sampling stream.
    #[arg(long, default_value_t = 0)]
    seed: u32,
    /// KV cache slots: the most sequences decoded together.
    #[arg(long, default_value_t = 8)]
    slots: usize,
    /// Rows per step (decode rows first, then prefill chunks).
    #[arg(long, default_value_t = 64)]
    max_step_rows: usize,
    /// Positions per KV cache block.
    #[arg(long, default_value_t = DEFAULT_BLOCK_SIZE)]
    block_size: usize,
    /// Blocks in the KV cache pool; 0 (the default): enough for every slot at the longest query.
    /// Fewer makes queries wait for blocks, and running ones be preempted (newest first).
    #[arg(long, default_value_t = 0)]
    kv_blocks: usize,
    /// Run every step op by op (no graph replay of decode steps; see `memwall run --eager`).
    #[arg(long)]
    eager: bool,
    /// Server p99 time-to-first-token limit, ms (default: MLPerf's 2000).
    #[arg(long)]
    ttft_limit_ms: Option<f64>,
    /// Server p99 time-per-output-token limit, ms (default: MLPerf's, 100 for llama3.1-8b, 200
    /// for mixtral-8x7b; a model with experts gets 200).
    #[arg(long)]
    tpot_limit_ms: Option<f64>,
    /// Run Server at this rate only (queries/s) instead of searching.
    #[arg(long)]
    server_rate: Option<f64>,
    /// Server runs of the rate search.
    #[arg(long, default_value_t = 6)]
    search_steps: usize,
    /// Device of the predictions: a datasheet key (h200, h100-sxm, ...) or `this` (this machine,
    /// measured as `memwall wall --measure`: a few seconds). Default: h200 for the CUDA backends,
    /// mi300x for the HIP backends, `this` for the CPU backends.
    #[arg(long)]
    device: Option<String>,
    /// A measured bandwidth, GB/s, for the predictions: this machine (or --device, measured) at it,
    /// without measuring.
    #[arg(long, value_name = "X")]
    bandwidth_gbs: Option<f64>,
    /// Sampling temperature of every query (0: greedy); each query draws its own seeded stream.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
}

pub fn scenario_cmd(args: &ScenarioArgs) -> Result<(), BoxError> {
    super::run::on_backend!(args.backend, b => run_on(b, args))
}

/// One scenario's measurement and prediction.
#[derive(Serialize)]
struct Row {
    scenario: &'static str,
    measured: RunSummary,
    prediction: Prediction,
}

#[derive(Serialize)]
struct Output {
    model: String,
    backend: String,
    clock: &'static str,
    device: String,
    weight_dtype: &'static str,
    slots: usize,
    row_budget: usize,
    block_size: usize,
    total_blocks: usize,
    queries: String,
    scenarios: Vec<Row>,
    server: Option<ServerResult>,
    notes: Vec<String>,
}

const CLOCK: &str =
    "engine clock: advanced by each step's measured duration; idle gaps to the next arrival skipped";

fn device_for(args: &ScenarioArgs, notes: &mut Vec<String>) -> Result<Device, BoxError> {
    let default = match args.backend {
        BackendName::Cuda | BackendName::CudaEmu => "h200",
        BackendName::Hip | BackendName::HipEmu => "mi300x",
        BackendName::Cpu | BackendName::CpuRef => "this",
    };
    let name = args.device.clone().unwrap_or_else(|| default.into());
    let this = super::wall::is_this_machine(&name);
    Ok(match (this, args.bandwidth_gbs) {
        (true, Some(bw)) => {
            let flops = memwall::peak::estimate_peak_flops().map(|f| f.flops_per_s);
            Device::this_machine(bw * 1e9, flops)?
        }
        (true, None) => {
            let (device, note) = super::wall::measure_this_machine()?;
            notes.push(note);
            device
        }
        (false, Some(bw)) => Device::find(&name)?.with_measured_bandwidth(bw * 1e9)?,
        (false, None) => Device::find(&name)?,
    })
}

fn bar(len: usize, what: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(len as u64);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{msg:24} {bar:40} {pos}/{len} queries {elapsed}")
    {
        bar.set_style(style);
    }
    bar.set_message(what.to_string());
    bar
}

fn run_on<B: Backend>(backend: B, args: &ScenarioArgs) -> Result<(), BoxError>
where
    B::Storage: 'static,
{
    let loading = indicatif::ProgressBar::new(0);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("loading {bar:40} {pos}/{len} tensors {elapsed}")
    {
        loading.set_style(style);
    }
    let model = memwall::model::Model::load(backend, &args.model, |done, total| {
        loading.set_length(total as u64);
        loading.set_position(done as u64);
    })?;
    loading.finish_and_clear();
    let config = model.config.clone();
    let (queries, source): (Vec<Query>, String) = match &args.requests {
        Some(path) => (requests::read_jsonl(path)?, format!("{} (JSONL)", path.display())),
        None => {
            let (i, o) = (LenDist::parse(&args.input_len)?, LenDist::parse(&args.output_len)?);
            let q = requests::synthetic(args.queries, i, o, config.vocab_size, args.seed as u64)?;
            (
                q,
                format!(
                    "{} synthetic (seed {}, input {}, output {})",
                    args.queries, args.seed, args.input_len, args.output_len
                ),
            )
        }
    };
    if args.slots == 0 || args.max_step_rows == 0 || args.block_size == 0 {
        return Err("--slots, --max-step-rows and --block-size must be at least 1".into());
    }
    let capacity = queries.iter().map(|q| q.input_ids.len() + q.max_new_tokens).max().unwrap_or(1);
    let options = SessionOptions {
        max_batch: args.slots,
        capacity,
        cache_dtype: DType::F32,
        max_prefill_rows: args.max_step_rows,
        block_size: args.block_size,
        num_blocks: args.kv_blocks,
        graphs: !args.eager,
    };
    let session = Session::new(&model, options)?;
    let mut engine = SessionEngine::new(session, config.vocab_size);
    let sampling = SamplingParams { temperature: args.temperature, top_k: args.top_k, top_p: args.top_p };
    let sched_config = SchedulerConfig { sampling, max_step_rows: Some(args.max_step_rows) };
    let row_budget = args.max_step_rows.min(engine.max_step_rows());
    let (block_size, total_blocks) = (engine.block_size(), engine.total_blocks());

    let mut notes = Vec::new();
    let device = device_for(args, &mut notes)?;
    let dtype = if model.report.quant.is_some() { WeightDtype::Fp8 } else { WeightDtype::Bf16 };
    let limits = {
        let d = ServerLimits::mlperf(config.moe.is_some());
        ServerLimits {
            ttft_s: args.ttft_limit_ms.map_or(d.ttft_s, |ms| ms / 1e3),
            tpot_s: args.tpot_limit_ms.map_or(d.tpot_s, |ms| ms / 1e3),
        }
    };
    if !(limits.ttft_s > 0.0 && limits.tpot_s > 0.0 && limits.ttft_s.is_finite() && limits.tpot_s.is_finite())
    {
        return Err("--ttft-limit-ms and --tpot-limit-ms must be positive".into());
    }
    let want = |w: Which| args.scenario == w || args.scenario == Which::All;
    let n = queries.len();
    let seed = args.seed;
    let mut rows = Vec::new();
    let shape = |s: &RunSummary| predict::mean_shape(s.input_tokens, s.output_tokens, s.queries);

    let mut single: Option<RunSummary> = None;
    if want(Which::SingleStream) {
        let b = bar(n, "single-stream");
        let (e, s) = scenario::with_scheduler(engine, sched_config, |sched| {
            scenario::drive(sched, &queries, &Arrivals::Sequential, seed, |d| b.set_position(d as u64))
        })?;
        b.finish_and_clear();
        engine = e;
        let p =
            predict::predict(&config, dtype, &device, shape(&s), Scenario::SingleStream, s.mean_decode_batch);
        single = Some(s.clone());
        rows.push(Row { scenario: "SingleStream", measured: s, prediction: p });
    }
    let mut server = None;
    if want(Which::Server) {
        // Start the search at the rate one stream sustains.
        let start = match (args.server_rate, &single) {
            (Some(r), _) => r,
            (None, Some(s)) => 1.0 / s.latency_s.mean.max(1e-9),
            (None, None) => {
                let probe = &queries[..n.min(2)];
                let (e, s) = scenario::with_scheduler(engine, sched_config, |sched| {
                    scenario::drive(sched, probe, &Arrivals::Sequential, seed, |_| {})
                })?;
                engine = e;
                1.0 / s.latency_s.mean.max(1e-9)
            }
        };
        let steps = if args.server_rate.is_some() { 1 } else { args.search_steps };
        let mut slot = Some(engine);
        let result = scenario::server_search(start, steps, limits, |rate| {
            let e = slot.take().ok_or_else(|| memwall::engine::EngineError::Config("engine lost".into()))?;
            let b = bar(n, &format!("server {rate:.3} q/s"));
            let arrivals = requests::poisson_arrivals(n, rate, seed as u64);
            let (e, s) = scenario::with_scheduler(e, sched_config, |sched| {
                scenario::drive(sched, &queries, &Arrivals::At(arrivals), seed, |d| b.set_position(d as u64))
            })?;
            b.finish_and_clear();
            slot = Some(e);
            Ok(s)
        })?;
        engine = slot.ok_or("engine lost")?;
        let tpot = Scenario::Server { tpot_limit_s: limits.tpot_s };
        let measured = match &result.best {
            Some(s) => s.clone(),
            None => result.trials.last().map(|t| t.summary.clone()).unwrap_or_default(),
        };
        let p = predict::predict(&config, dtype, &device, shape(&measured), tpot, measured.mean_decode_batch);
        rows.push(Row { scenario: "Server", measured, prediction: p });
        server = Some(result);
    }
    if want(Which::Offline) {
        let b = bar(n, "offline");
        let (e, s) = scenario::with_scheduler(engine, sched_config, |sched| {
            scenario::drive(sched, &queries, &Arrivals::At(vec![0.0; n]), seed, |d| b.set_position(d as u64))
        })?;
        b.finish_and_clear();
        engine = e;
        let p = predict::predict(&config, dtype, &device, shape(&s), Scenario::Offline, s.mean_decode_batch);
        rows.push(Row { scenario: "Offline", measured: s, prediction: p });
    }
    drop(engine);

    if let Some(path) = &args.svg {
        let mut all: Vec<scenario::BatchSteps> = Vec::new();
        let runs = rows
            .iter()
            .map(|r| &r.measured)
            .chain(server.iter().flat_map(|s| s.trials.iter().map(|t| &t.summary)));
        for s in runs {
            for b in &s.decode_steps {
                match all.iter_mut().find(|a| a.batch == b.batch) {
                    Some(a) => {
                        a.steps += b.steps;
                        a.seconds += b.seconds;
                    }
                    None => all.push(*b),
                }
            }
        }
        all.sort_by_key(|b| b.batch);
        let context = rows.first().map_or(0, |r| {
            let s = shape(&r.measured);
            s.input_tokens + s.output_tokens / 2
        });
        let name = args
            .model
            .file_name()
            .map_or_else(|| args.model.display().to_string(), |n| n.to_string_lossy().into());
        let text = scenario::plot::svg(&name, &config, dtype, &device, context, &all, args.slots)?;
        std::fs::write(path, text).map_err(|e| format!("--svg {}: {e}", path.display()))?;
    }

    let out = Output {
        model: args.model.display().to_string(),
        backend: model.backend.name().to_string(),
        clock: CLOCK,
        device: device.name.clone(),
        weight_dtype: dtype.name(),
        slots: args.slots,
        row_budget,
        block_size,
        total_blocks,
        queries: source,
        scenarios: rows,
        server,
        notes,
    };
    if args.json {
        println!("{}", serde_json::to_string(&out)?);
    } else {
        print!("{}", render(&out));
    }
    Ok(())
}

fn render(o: &Output) -> String {
    let ms = |s: f64| format!("{:.1}", s * 1e3);
    let header = [
        "scenario",
        "queries/s",
        "tokens/s",
        "TTFT p50/p99 ms",
        "TPOT p50/p99 ms",
        "latency p50/p90 ms",
        "mean batch",
        "predicted tok/s (batch)",
        "roofline tok/s at mean batch",
        "wall tok/s (batch 1)",
    ];
    let cells: Vec<Vec<String>> = o
        .scenarios
        .iter()
        .map(|r| {
            let m = &r.measured;
            let p = &r.prediction;
            vec![
                r.scenario.to_string(),
                format!("{:.3}", m.queries_per_s),
                format!("{:.1}", m.tokens_per_s),
                format!("{}/{}", ms(m.ttft_s.p50), ms(m.ttft_s.p99)),
                format!("{}/{}", ms(m.tpot_s.p50), ms(m.tpot_s.p99)),
                format!("{}/{}", ms(m.latency_s.p50), ms(m.latency_s.p90)),
                format!("{:.2}", m.mean_decode_batch),
                match &p.estimate {
                    Some(e) => format!("{:.0} ({})", e.tokens_per_s, e.batch),
                    None => "n/a".to_string(),
                },
                format!("{:.0} ({})", p.roofline_tokens_per_s, p.batch),
                format!("{:.0}", p.wall_tokens_per_s),
            ]
        })
        .collect();
    let mut s = format!(
        "memwall scenario: {} on {} ({} slots, {} rows per step, KV blocks {} x {} positions)\nqueries: {}\n\
         predictions: {} weights on {}\n\n",
        o.model,
        o.backend,
        o.slots,
        o.row_budget,
        o.total_blocks,
        o.block_size,
        o.queries,
        o.weight_dtype,
        o.device
    );
    s.push_str(&memwall::wall::report::columns(&header, &cells, 1));
    if let Some(sv) = &o.server {
        s.push_str(&format!(
            "\nServer: p99 limits TTFT {} ms, TPOT {} ms; ",
            ms(sv.limits.ttft_s),
            ms(sv.limits.tpot_s)
        ));
        match sv.rate_qps {
            Some(r) if sv.search_capped => s.push_str(&format!(
                "every rate tried held, up to {r:.3} q/s (the search stopped before a failing rate)\n"
            )),
            Some(r) => s.push_str(&format!("highest rate that held: {r:.3} q/s\n")),
            None => s.push_str("no rate tried held the limits (the Server row shows the last run)\n"),
        }
        for t in &sv.trials {
            s.push_str(&format!(
                "  {:.3} q/s: p99 TTFT {} ms, p99 TPOT {} ms: {}\n",
                t.rate_qps,
                ms(t.summary.ttft_s.p99),
                ms(t.summary.tpot_s.p99),
                if t.held { "held" } else { "failed" }
            ));
        }
    }
    for r in &o.scenarios {
        if let Some(e) = &r.prediction.estimate_error {
            s.push_str(&format!("{}: no wall estimate: {e}\n", r.scenario));
        }
    }
    s.push_str(&format!(
        "\nTimes: {}.\npredicted tok/s: `memwall wall --scenarios` for the mean request shape (its own batch choice: 1, \
         the largest within the TPOT limit, the largest that fits);\nroofline tok/s: batch / floor of a decode step at \
         the batch this run decoded at; wall tok/s: one stream.\n",
        o.clock
    ));
    for n in &o.notes {
        s.push_str(n);
        s.push('\n');
    }
    s
}
