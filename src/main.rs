//! The `memwall` command.

mod cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use memwall::runtime::{Backend, DType};

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
    /// This machine's memory ceiling: streaming read, copy and triad on 1..=N threads, in decimal
    /// GB/s counting bytes read + written, over a working set of max(3 x LLC, 1 GiB).
    Peak(cmd::peak::PeakArgs),
    /// The memory wall: bytes read per decoded token and the tokens/s they allow, model x device.
    Wall(cmd::wall::WallArgs),
    /// Runs a Hugging Face checkpoint (Llama 3.x or Mixtral) on prompt token ids and prints the
    /// generated ids.
    Run(cmd::run::RunArgs),
    /// The MLPerf scenarios (SingleStream, Server, Offline) measured on a checkpoint through the
    /// continuous-batching scheduler, beside the wall and roofline predictions.
    Scenario(cmd::scenario::ScenarioArgs),
    /// Writes a checkpoint of a model's shape with random weights (config.json and
    /// model.safetensors) for `memwall run` and the benches.
    Synth(cmd::synth::SynthArgs),
}

type BoxError = Box<dyn std::error::Error>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info => {
            info();
            Ok(())
        }
        Command::Peak(args) => cmd::peak::peak_cmd(&args).map_err(BoxError::from),
        Command::Wall(args) => cmd::wall::wall_command(&args).map_err(BoxError::from),
        Command::Run(args) => cmd::run::run(&args),
        Command::Scenario(args) => cmd::scenario::scenario_cmd(&args),
        Command::Synth(args) => cmd::synth::synth_cmd(&args).map_err(BoxError::from),
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
    match memwall::kernels::CUDA_NVCC {
        None => println!(
            "CUDA fatbins: none (no nvcc at build time; the CUDA backend would compile the sources with NVRTC)"
        ),
        Some(nvcc) => {
            let images = memwall::kernels::CUDA_FATBINS;
            let targets = images.first().map_or(String::new(), |i| i.targets.join(", "));
            let kernels: usize = memwall::kernels::CUDA_KERNELS.iter().map(|(_, _, k)| k.len()).sum();
            let bytes: usize = images.iter().map(|i| i.fatbin.len()).sum();
            println!(
                "CUDA fatbins: {} images, {bytes} bytes, SASS for {targets} ({kernels} kernel entries), by {nvcc}",
                images.len()
            );
        }
    }
}
