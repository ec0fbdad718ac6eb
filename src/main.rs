//! The `memwall` command.

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
}

fn main() {
    let cli = Cli::parse();
    match cli.command {
        Command::Info => info(),
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
