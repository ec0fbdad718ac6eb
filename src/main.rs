//! The `memwall` command.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use memwall::model::{GenerateOptions, Generation, Session, SessionOptions, npy};
use memwall::runtime::{Backend, DType, SamplingParams};
use memwall::wall::report::{self, WallRow};
use memwall::wall::{self, Device, Error, Model, RequestShape, Scenario, WeightDtype};
use serde::Serialize;

#[derive(Parser)]
#[command(name = "memwall", version, about = "LLM inference kernels at the memory wall")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// What this build holds: backends, dtypes, embedded kernel sources.
    Info,
    /// The memory wall: bytes read per decoded token and the tokens/s they allow, model x device.
    Wall(WallArgs),
    /// Runs a Hugging Face checkpoint (Llama 3.x or Mixtral) on prompt token ids and prints the
    /// generated ids.
    Run(RunArgs),
}

#[derive(Args)]
struct WallArgs {
    /// Models: preset names (llama-3.1-8b, mixtral-8x7b, ...) or checkpoint directories holding
    /// config.json; comma-separated or repeated. Default: every preset.
    #[arg(long = "model", value_name = "NAME|DIR", value_delimiter = ',')]
    models: Vec<String>,
    /// Devices from the datasheet table (h100-sxm, h200, mi300x, ...); comma-separated or repeated.
    /// Default: every device.
    #[arg(long = "device", value_name = "NAME", value_delimiter = ',')]
    devices: Vec<String>,
    /// Weight formats: bf16, fp8 (comma-separated). Default: bf16, the format the models are
    /// published in.
    #[arg(long = "dtype", value_name = "bf16|fp8", value_delimiter = ',')]
    dtypes: Vec<String>,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 1)]
    batch: u64,
    /// Tokens already in each sequence's KV cache.
    #[arg(long, default_value_t = 0)]
    context: u64,
    /// A measured memory bandwidth in GB/s (1e9 bytes/s, read + write counted as the copy
    /// benchmark counts them): adds "this machine" (with one --device: that device, measured).
    #[arg(long, value_name = "X")]
    bandwidth_gbs: Option<f64>,
    /// Print JSON (an array of objects) instead of a table.
    #[arg(long)]
    json: bool,
    /// Also write the roofline of the chosen device (one --device, or the measured one) as SVG.
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
    /// Report the MLPerf scenarios (SingleStream, Server, Offline) for a request shape instead.
    #[arg(long, conflicts_with = "sram")]
    scenarios: bool,
    /// Input tokens per request (with --scenarios).
    #[arg(long, default_value_t = 1024, requires = "scenarios")]
    input_tokens: u64,
    /// Output tokens per request (with --scenarios).
    #[arg(long, default_value_t = 256, requires = "scenarios")]
    output_tokens: u64,
    /// Server's time-per-output-token limit in ms (with --scenarios; MLPerf's llama3.1-8b: 100).
    #[arg(long, default_value_t = 100.0, requires = "scenarios")]
    tpot_ms: f64,
    /// Report the chips needed to hold each model's weights in on-chip SRAM instead. Default model:
    /// llama-3.1-70b.
    #[arg(long)]
    sram: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum BackendName {
    /// The fast CPU backend.
    Cpu,
    /// The reference CPU backend (f64 accumulation; slow, exact).
    CpuRef,
    Cuda,
    Hip,
}

#[derive(clap::Args)]
struct RunArgs {
    /// The checkpoint directory (config.json and model.safetensors or its sharded index).
    #[arg(long)]
    model: PathBuf,
    /// Prompt token ids, comma separated. Repeat for a batch: one sequence each.
    #[arg(long, required_unless_present = "prompt")]
    tokens: Vec<String>,
    /// Prompt text, encoded with the directory's tokenizer.json (special tokens such as BOS added
    /// as the tokenizer's post-processor says). Repeat for a batch.
    #[arg(long, conflicts_with = "tokens")]
    prompt: Vec<String>,
    /// Tokens to generate per sequence (exactly this many without --stop-at-eos).
    #[arg(long)]
    max_new_tokens: usize,
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendName,
    /// Print one JSON object with the tokens and the timing.
    #[arg(long)]
    json: bool,
    /// Write prefill_logits.npy ([prompt_len, vocab]) and decode_logits.npy ([N, vocab]) here
    /// (with a batch, prefill_logits_{i}.npy and decode_logits_{i}.npy per sequence).
    #[arg(long)]
    dump_logits: Option<PathBuf>,
    /// Stop a sequence at the config's eos_token_id.
    #[arg(long)]
    stop_at_eos: bool,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep the k most likely tokens when sampling (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p when sampling.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

type BoxError = Box<dyn std::error::Error>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info => {
            info();
            Ok(())
        }
        Command::Wall(args) => wall_command(&args).map_err(BoxError::from),
        Command::Run(args) => run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn info() {
    let fast = memwall::default_backend();
    let reference = memwall::runtime::cpu::Reference;
    println!("backends: {} (default), {}", fast.name(), reference.name());
    let dtypes: Vec<&str> = DType::ALL.iter().map(|d| d.name()).collect();
    println!("dtypes: {}", dtypes.join(", "));
    println!(
        "embedded kernel sources: {} CUDA, {} HIP",
        memwall::kernels::CUDA_SOURCES.len(),
        memwall::kernels::HIP_SOURCES.len()
    );
}

/// The devices of the report, and the one the roofline draws (if it can pick one).
fn select_devices(args: &WallArgs) -> Result<(Vec<Device>, Option<Device>), Error> {
    let named: Vec<Device> = args.devices.iter().map(|d| Device::find(d)).collect::<Result<_, _>>()?;
    let mut devices = if named.is_empty() { Device::table() } else { named.clone() };
    let mut drawn = match named.as_slice() {
        [one] => Some(one.clone()),
        _ => None,
    };
    if let Some(gbs) = args.bandwidth_gbs {
        let bandwidth = gbs * 1e9;
        let measured = match named.as_slice() {
            [one] => one.with_measured_bandwidth(bandwidth)?,
            _ => Device::measured(&format!("this machine ({gbs:.0} GB/s measured)"), bandwidth)?,
        };
        drawn = Some(measured.clone());
        devices.push(measured);
    }
    Ok((devices, drawn))
}

fn select_models(args: &WallArgs) -> Result<Vec<Model>, Error> {
    if args.models.is_empty() {
        if args.sram {
            return Ok(vec![Model::resolve("llama-3.1-70b")?]);
        }
        return Model::presets();
    }
    args.models.iter().map(|m| Model::resolve(m)).collect()
}

fn select_dtypes(args: &WallArgs) -> Result<Vec<WeightDtype>, Error> {
    if args.dtypes.is_empty() {
        return Ok(vec![WeightDtype::Bf16]);
    }
    let mut out = Vec::new();
    for d in &args.dtypes {
        let d = WeightDtype::parse(d)?;
        if !out.contains(&d) {
            out.push(d);
        }
    }
    Ok(out)
}

#[derive(Serialize)]
struct ScenarioRow<'a> {
    model: &'a str,
    dtype: &'static str,
    device: &'a str,
    input_tokens: u64,
    output_tokens: u64,
    tpot_limit_ms: f64,
    #[serde(flatten)]
    estimate: wall::ScenarioEstimate,
}

#[derive(Serialize)]
struct SramReportRow<'a> {
    model: &'a str,
    dtype: &'static str,
    #[serde(flatten)]
    row: wall::sram::SramRow,
}

fn print_json<T: Serialize>(value: &T) -> Result<(), Error> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| Error::InvalidArgument { what: "JSON output", reason: e.to_string() })?;
    println!("{text}");
    Ok(())
}

fn wall_command(args: &WallArgs) -> Result<(), Error> {
    let models = select_models(args)?;
    let (devices, drawn) = select_devices(args)?;
    let dtypes = select_dtypes(args)?;
    for m in &models {
        report::check_workload(&m.config, args.batch, args.context)?;
    }
    if let Some(path) = &args.svg {
        let Some(device) = &drawn else {
            return Err(Error::InvalidArgument {
                what: "--svg",
                reason: "the roofline is drawn for one device: name it with --device".into(),
            });
        };
        let text = wall::roofline::svg(&models, dtypes[0], device, args.context)?;
        std::fs::write(path, text).map_err(|source| Error::Io { path: path.clone(), source })?;
    }

    if args.scenarios {
        let shape = RequestShape { input_tokens: args.input_tokens, output_tokens: args.output_tokens };
        let scenarios = [
            Scenario::SingleStream,
            Scenario::Server { tpot_limit_s: args.tpot_ms / 1e3 },
            Scenario::Offline,
        ];
        let mut rows = Vec::new();
        let mut text = String::new();
        for m in &models {
            for &dtype in &dtypes {
                for d in &devices {
                    let estimates: Vec<_> = scenarios
                        .iter()
                        .map(|&s| wall::scenario::estimate(&m.config, dtype, d, shape, s))
                        .collect::<Result<_, _>>()?;
                    let title = format!("{} {}", m.name, dtype.name());
                    text.push_str(&report::render_scenarios(&title, &d.name, &estimates));
                    text.push('\n');
                    rows.extend(estimates.into_iter().map(|estimate| ScenarioRow {
                        model: &m.name,
                        dtype: dtype.name(),
                        device: &d.name,
                        input_tokens: shape.input_tokens,
                        output_tokens: shape.output_tokens,
                        tpot_limit_ms: args.tpot_ms,
                        estimate,
                    }));
                }
            }
        }
        if args.json {
            return print_json(&rows);
        }
        println!(
            "Requests of {} input and {} output tokens; Server holds each decode step within {} ms.\n",
            shape.input_tokens, shape.output_tokens, args.tpot_ms
        );
        print!("{text}");
        return Ok(());
    }

    if args.sram {
        let mut rows = Vec::new();
        let mut text = String::new();
        for m in &models {
            for &dtype in &dtypes {
                let bytes = wall::count::stored_weight_bytes(&m.config, dtype);
                let sram_rows = wall::sram::report(bytes, &devices);
                text.push_str(&report::render_sram(&format!("{} {}", m.name, dtype.name()), &sram_rows));
                text.push('\n');
                rows.extend(sram_rows.into_iter().map(|row| SramReportRow {
                    model: &m.name,
                    dtype: dtype.name(),
                    row,
                }));
            }
        }
        if args.json {
            return print_json(&rows);
        }
        print!("{text}");
        return Ok(());
    }

    let mut rows: Vec<WallRow> = Vec::new();
    for m in &models {
        for &dtype in &dtypes {
            for d in &devices {
                rows.push(report::wall_row(m, dtype, d, args.batch, args.context)?);
            }
        }
    }
    if args.json {
        return print_json(&rows);
    }
    print!("{}", report::render_table(&rows));
    Ok(())
}

/// Parses `1,2,3` into token ids.
fn parse_ids(text: &str) -> Result<Vec<u32>, BoxError> {
    text.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<u32>().map_err(|e| format!("--tokens: `{s}` is not a token id: {e}").into()))
        .collect()
}

fn run(args: &RunArgs) -> Result<(), BoxError> {
    let (prompts, tokenizer) = if args.prompt.is_empty() {
        (args.tokens.iter().map(|t| parse_ids(t)).collect::<Result<_, _>>()?, None)
    } else {
        let path = args.model.join("tokenizer.json");
        if !path.is_file() {
            return Err(format!("--prompt needs {}; pass --tokens instead", path.display()).into());
        }
        let tok = tokenizers::Tokenizer::from_file(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut prompts = Vec::with_capacity(args.prompt.len());
        for text in &args.prompt {
            let enc = tok.encode(text.as_str(), true).map_err(|e| format!("--prompt {text:?}: {e}"))?;
            prompts.push(enc.get_ids().to_vec());
        }
        (prompts, Some(tok))
    };
    match args.backend {
        BackendName::Cpu => run_on(memwall::default_backend(), args, &prompts, tokenizer.as_ref()),
        BackendName::CpuRef => run_on(memwall::runtime::cpu::Reference, args, &prompts, tokenizer.as_ref()),
        BackendName::Cuda | BackendName::Hip => {
            let name = if args.backend == BackendName::Cuda { "cuda" } else { "hip" };
            Err(format!("the {name} backend is not built in this version of memwall; use --backend cpu")
                .into())
        }
    }
}

fn run_on<B: Backend>(
    backend: B,
    args: &RunArgs,
    prompts: &[Vec<u32>],
    tokenizer: Option<&tokenizers::Tokenizer>,
) -> Result<(), BoxError>
where
    B::Storage: 'static,
{
    // A progress bar on stderr (drawn only on a terminal), per tensor loaded.
    let bar = indicatif::ProgressBar::new(0);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("loading {bar:40} {pos}/{len} tensors {elapsed}")
    {
        bar.set_style(style);
    }
    let model = memwall::model::Model::load(backend, &args.model, |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })?;
    bar.finish_and_clear();
    if !model.report.unused.is_empty() && !args.json {
        eprintln!("note: {} tensors of the checkpoint are not used: {}", model.report.unused.len(), {
            let shown: Vec<&str> = model.report.unused.iter().take(8).map(String::as_str).collect();
            shown.join(", ")
        });
    }
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let capacity = longest.saturating_add(args.max_new_tokens).max(1);
    let options = SessionOptions { max_batch: prompts.len().max(1), capacity, cache_dtype: DType::F32 };
    let mut session = Session::new(&model, options)?;
    let gen_opts = GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        sampling: SamplingParams { temperature: args.temperature, top_k: args.top_k, top_p: args.top_p },
        seed: args.seed,
        stop_at_eos: args.stop_at_eos,
        record_logits: args.dump_logits.is_some(),
    };
    let g = session.generate(prompts, &gen_opts)?;
    if let Some(dir) = &args.dump_logits {
        dump(dir, &g, prompts, model.config.vocab_size)?;
    }
    if args.json {
        let tokens =
            if g.tokens.len() == 1 { serde_json::json!(g.tokens[0]) } else { serde_json::json!(g.tokens) };
        let t = g.timing;
        let per_s = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        let text: Option<Vec<String>> = match tokenizer {
            None => None,
            Some(tok) => Some(
                g.tokens
                    .iter()
                    .map(|t| tok.decode(t, true).map_err(|e| format!("decoding the output: {e}")))
                    .collect::<Result<_, _>>()?,
            ),
        };
        let out = serde_json::json!({
            "tokens": tokens,
            "prompt_tokens": if prompts.len() == 1 { serde_json::json!(prompts[0]) } else { serde_json::json!(prompts) },
            "text": text,
            "backend": model.backend.name(),
            "timing": {
                "load_s": model.report.seconds,
                "prefill_s": t.prefill_s,
                "decode_s": t.decode_s,
                "prefill_tokens": t.prefill_tokens,
                "decode_steps": t.decode_steps,
                "decode_tokens": t.decode_tokens,
                "prefill_tokens_per_s": per_s(t.prefill_tokens, t.prefill_s),
                "decode_tokens_per_s": per_s(t.decode_tokens, t.decode_s),
            },
            "unused_tensors": model.report.unused,
            "weights": {
                "mapped_bytes": model.report.stats.mapped_bytes,
                "copied_bytes": model.report.stats.copied_bytes,
            },
            "graph": {
                "ops_per_step": model.graph.step_ops(false).count(),
                // The last step run (a decode step unless N <= 1), from the op list.
                "last_step": session.last_step_cost(),
            },
        });
        println!("{out}");
    } else {
        for seq in &g.tokens {
            let ids: Vec<String> = seq.iter().map(u32::to_string).collect();
            println!("{}", ids.join(","));
        }
    }
    Ok(())
}

fn dump(dir: &Path, g: &Generation, prompts: &[Vec<u32>], vocab: usize) -> Result<(), BoxError> {
    std::fs::create_dir_all(dir).map_err(|e| format!("--dump-logits {}: {e}", dir.display()))?;
    for (i, prompt) in prompts.iter().enumerate() {
        let suffix = if prompts.len() == 1 { String::new() } else { format!("_{i}") };
        let write = |name: &str, rows: usize, data: &[f32]| -> Result<(), BoxError> {
            let path = dir.join(format!("{name}{suffix}.npy"));
            npy::write_f32(&path, &[rows, vocab], data).map_err(|e| format!("{}: {e}", path.display()).into())
        };
        write("prefill_logits", prompt.len(), &g.prefill_logits[i])?;
        write("decode_logits", g.tokens[i].len(), &g.decode_logits[i])?;
    }
    Ok(())
}
