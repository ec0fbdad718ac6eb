//! `memwall synth`: a random checkpoint of a model's shape.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use memwall::runtime::DType;
use memwall::synth::{self, SynthError};

/// Element type of the weights written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SynthDtype {
    Bf16,
    F16,
    F32,
}

#[derive(Args)]
pub struct SynthArgs {
    /// The model's shape: a preset (llama-3.1-8b, mixtral-8x7b, ...; `memwall wall` lists them),
    /// a config.json, or a directory holding one.
    #[arg(long)]
    shape: String,
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: SynthDtype,
    /// The directory to write (absent or empty).
    #[arg(long)]
    out: PathBuf,
    /// Seed of the values: the same seed and shape give the same bytes.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print one JSON object (dir, tensors, params, bytes, seconds) instead of a line.
    #[arg(long)]
    json: bool,
}

pub fn synth_cmd(args: &SynthArgs) -> Result<(), SynthError> {
    let dtype = match args.dtype {
        SynthDtype::Bf16 => DType::BF16,
        SynthDtype::F16 => DType::F16,
        SynthDtype::F32 => DType::F32,
    };
    let config = synth::config_for(&args.shape)?;
    let r = synth::write_checkpoint(&config, dtype, args.seed, &args.out)?;
    if args.json {
        println!("{}", serde_json::to_string(&r).unwrap_or_default());
    } else {
        println!(
            "wrote {}: {} tensors, {:.3} B parameters, {:.2} GB of {dtype} in {:.1} s ({:.2} GB/s)",
            r.dir.display(),
            r.tensors,
            r.params as f64 / 1e9,
            r.bytes as f64 / 1e9,
            r.seconds,
            r.bytes as f64 / r.seconds.max(1e-9) / 1e9
        );
    }
    Ok(())
}
