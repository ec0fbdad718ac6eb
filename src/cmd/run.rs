//! `memwall run`: a Hugging Face checkpoint on prompt token ids.

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use memwall::model::session::{DEFAULT_BLOCK_SIZE, DEFAULT_MAX_PREFILL_ROWS};
use memwall::model::{GenerateOptions, Generation, Session, SessionOptions, npy};
use memwall::runtime::{Backend, DType, SamplingParams};

type BoxError = Box<dyn std::error::Error>;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum BackendName {
    /// The fast CPU backend.
    Cpu,
    /// The reference CPU backend (f64 accumulation; slow, exact).
    CpuRef,
    /// An NVIDIA GPU through cudarc (builds with `--features cuda`).
    Cuda,
    /// The CUDA kernels run on the CPU by the SIMT emulator (builds with `--features emulate`;
    /// slow: for checking the GPU path without a GPU).
    CudaEmu,
    /// An AMD GPU through the HIP runtime (builds with `--features hip`).
    Hip,
    /// The HIP build of the kernels (warp 64, `kernels-hip/hip.h`) run on the CPU by the SIMT
    /// emulator (builds with `--features emulate`; slow: the AMD path's logic without an AMD GPU).
    HipEmu,
}

/// Element type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum KvDType {
    F32,
    Bf16,
    F16,
}

impl KvDType {
    fn dtype(self) -> DType {
        match self {
            KvDType::F32 => DType::F32,
            KvDType::Bf16 => DType::BF16,
            KvDType::F16 => DType::F16,
        }
    }
}

#[derive(Args)]
pub struct RunArgs {
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
    /// Seed of every sequence's sampling (each sequence draws its own stream, so a batch samples
    /// exactly as each sequence alone).
    #[arg(long, default_value_t = 0)]
    seed: u32,
    /// Element type of the KV cache. f32 (the default) keeps the logits equal to transformers'
    /// f32 run; bf16 and f16 halve the cache and the bytes attention reads, rounding each stored
    /// key and value.
    #[arg(long, value_enum, default_value = "f32")]
    kv_dtype: KvDType,
    /// Most prompt positions (over all sequences) per prefill step: longer prompts are prefilled
    /// in chunks of this many, which bounds the workspace (and the logits of every position with
    /// --dump-logits) without changing any result.
    #[arg(long, default_value_t = DEFAULT_MAX_PREFILL_ROWS)]
    max_prefill_rows: usize,
    /// Positions per KV cache block (the cache is paged: each sequence's positions live in
    /// blocks of this many, named by its block table).
    #[arg(long, default_value_t = DEFAULT_BLOCK_SIZE)]
    block_size: usize,
    /// Blocks in the KV cache pool; 0 (the default): enough for every sequence at its full
    /// length. Fewer than the run needs is an error (OutOfBlocks) before any compute.
    #[arg(long, default_value_t = 0)]
    kv_blocks: usize,
    /// Run every step op by op. By default a GPU backend records each decode step shape as a
    /// CUDA / HIP graph the second time it runs and replays it from then on (one host launch per
    /// step); the results are the same either way.
    #[arg(long)]
    eager: bool,
}

/// Parses `1,2,3` into token ids.
fn parse_ids(text: &str) -> Result<Vec<u32>, BoxError> {
    text.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<u32>().map_err(|e| format!("--tokens: `{s}` is not a token id: {e}").into()))
        .collect()
}

pub fn run(args: &RunArgs) -> Result<(), BoxError> {
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
    on_backend!(args.backend, b => run_on(b, args, &prompts, tokenizer.as_ref()))
}

/// `$body` with `$b` bound to the backend `$name` names (a `BackendName`), or the error saying how
/// to build it when this build lacks it; `$body`'s value (a `Result<_, BoxError>`) is returned.
macro_rules! on_backend {
    ($name:expr, $b:ident => $body:expr) => {{
        use $crate::cmd::run::BackendName;
        match $name {
            BackendName::Cpu => {
                let $b = memwall::default_backend();
                $body
            }
            BackendName::CpuRef => {
                let $b = memwall::runtime::cpu::Reference;
                $body
            }
            #[cfg(feature = "cuda")]
            BackendName::Cuda => {
                let $b = memwall::cuda_backend(0)?;
                $body
            }
            #[cfg(feature = "hip")]
            BackendName::Hip => {
                let $b = memwall::hip_backend(0)?;
                $body
            }
            #[cfg(feature = "emulate")]
            BackendName::CudaEmu => {
                let $b = memwall::emulated_backend(memwall::runtime::gpu::emu::Schedule::Forward)?;
                $body
            }
            #[cfg(feature = "emulate")]
            BackendName::HipEmu => {
                let $b = memwall::emulated_hip_backend(memwall::runtime::gpu::emu::Schedule::Forward)?;
                $body
            }
            #[allow(unreachable_patterns)]
            other => {
                let why = match other {
                    BackendName::Cuda => "build with `--features cuda`",
                    BackendName::Hip => "build with `--features hip`",
                    _ => "build with `--features emulate`",
                };
                Err(format!("backend {other:?} is not in this build ({why}); use --backend cpu").into())
            }
        }
    }};
}
pub(crate) use on_backend;

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
    let stats = &model.report.stats;
    if stats.converted_tensors > 0 && !args.json {
        eprintln!(
            "note: {} e4m3fn tensors ({} bytes) converted to {} for {}",
            stats.converted_tensors,
            stats.converted_bytes,
            model.backend.native_e4m3(),
            model.backend.name()
        );
    }
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let capacity = longest.saturating_add(args.max_new_tokens).max(1);
    if args.max_prefill_rows == 0 {
        return Err("--max-prefill-rows must be at least 1".into());
    }
    if args.block_size == 0 {
        return Err("--block-size must be at least 1".into());
    }
    let options = SessionOptions {
        max_batch: prompts.len().max(1),
        capacity,
        cache_dtype: args.kv_dtype.dtype(),
        max_prefill_rows: args.max_prefill_rows,
        block_size: args.block_size,
        num_blocks: args.kv_blocks,
        graphs: !args.eager,
    };
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
                "prefill_steps": t.prefill_steps,
                "decode_steps": t.decode_steps,
                "decode_tokens": t.decode_tokens,
                "prefill_tokens_per_s": per_s(t.prefill_tokens, t.prefill_s),
                "decode_tokens_per_s": per_s(t.decode_tokens, t.decode_s),
            },
            "unused_tensors": model.report.unused,
            "weights": {
                "mapped_bytes": model.report.stats.mapped_bytes,
                "copied_bytes": model.report.stats.copied_bytes,
                // e4m3fn weights converted at load for a device that reads e4m3fnuz (AMD CDNA3).
                "converted_tensors": model.report.stats.converted_tensors,
                "converted_bytes": model.report.stats.converted_bytes,
            },
            "session": {
                "kv_dtype": session.options().cache_dtype.to_string(),
                "max_prefill_rows": session.options().max_prefill_rows,
                "block_size": session.options().block_size,
                "kv_blocks": session.options().num_blocks,
                "capacity": session.options().capacity,
            },
            // Decode steps replayed as recorded graphs (GPU backends; 0 with --eager).
            "graphs": {
                "enabled": session.options().graphs,
                "recorded": session.graph_stats().recorded,
                "replayed_steps": session.graph_stats().replayed_steps,
                "recorded_launches": session.graph_stats().recorded_launches,
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
