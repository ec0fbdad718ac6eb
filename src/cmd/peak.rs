//! `memwall peak`: this machine's memory ceiling.

use clap::Args;
use memwall::peak::{self, Kernel, Measurement, StreamBuffers};
use memwall::runtime::Error;

/// This machine's memory ceiling: streaming read, copy and triad on 1..=N threads, in decimal
/// GB/s counting bytes read + written, over a working set of max(3 x LLC, 1 GiB).
#[derive(Args)]
pub struct PeakArgs {
    /// Measure 1..=N threads (default: every available thread).
    #[arg(long)]
    threads: Option<usize>,
    /// Print one JSON array of measurements instead of a table.
    #[arg(long)]
    json: bool,
    /// Working set in GiB (default: max(3 x LLC, 1 GiB)).
    #[arg(long)]
    working_set_gib: Option<f64>,
    /// Timed passes per measurement, after one warm-up pass; the best is reported.
    #[arg(long, default_value_t = 5)]
    passes: usize,
}

const GIB: f64 = (1u64 << 30) as f64;
const MIB: f64 = (1u64 << 20) as f64;

pub fn peak_cmd(args: &PeakArgs) -> Result<(), Error> {
    let PeakArgs { threads, json, working_set_gib, passes } = *args;
    let arg = |msg: String| Error::Argument { op: "peak", msg };
    let max_threads = threads.unwrap_or_else(peak::max_threads);
    if max_threads == 0 {
        return Err(arg("--threads must be at least 1".into()));
    }
    let llc = peak::llc_bytes();
    let default_ws = peak::working_set_for(llc);
    let working_set = match working_set_gib {
        None => default_ws,
        Some(g) if g.is_finite() && g > 0.0 && g * GIB < u64::MAX as f64 => (g * GIB).ceil() as u64,
        Some(g) => return Err(arg(format!("--working-set-gib {g} must be a positive size"))),
    };

    let mut buffers = StreamBuffers::new(working_set)?;
    let mut results: Vec<Measurement> = Vec::new();
    for t in 1..=max_threads {
        let pool = peak::thread_pool(t)?;
        for kernel in Kernel::ALL {
            results.push(buffers.measure_on(kernel, &pool, passes)?);
        }
    }

    if json {
        let rows: Vec<serde_json::Value> = results
            .iter()
            .map(|m| {
                serde_json::json!({
                    "kernel": m.kernel.name(),
                    "threads": m.threads,
                    "bytes_per_pass": m.bytes_per_pass,
                    "seconds": m.seconds,
                    "gb_per_s": m.gb_per_s,
                    "working_set_bytes": buffers.bytes(),
                    "llc_bytes": llc,
                })
            })
            .collect();
        println!("{}", serde_json::Value::Array(rows));
        return Ok(());
    }

    match llc {
        Some(l) => println!("last-level cache: {:.0} MiB (sysfs, cpu0)", l as f64 / MIB),
        None => println!("last-level cache: unknown (sysfs says nothing)"),
    }
    let how = match working_set_gib {
        Some(_) => "set by --working-set-gib".to_string(),
        None => format!("max({} x LLC, 1 GiB)", peak::LLC_FACTOR),
    };
    println!(
        "working set: {:.3} GiB = {:.3} GB ({how}); best of {passes} passes after 1 warm-up",
        buffers.bytes() as f64 / GIB,
        buffers.bytes() as f64 / 1e9
    );
    if llc.is_some_and(|l| buffers.bytes() < peak::LLC_FACTOR * l) {
        println!(
            "warning: the working set is under {} x the LLC; caches inflate these figures",
            peak::LLC_FACTOR
        );
    }
    println!("GB/s (1e9 bytes/s, bytes read + written; copy counts 2x its array, triad 3x)");
    print!("{:<8}", "kernel");
    for t in 1..=max_threads {
        print!("{:>12}", format!("{t} thread{}", if t == 1 { "" } else { "s" }));
    }
    println!();
    for kernel in Kernel::ALL {
        print!("{:<8}", kernel.name());
        for m in results.iter().filter(|m| m.kernel == kernel) {
            print!("{:>12.2}", m.gb_per_s);
        }
        println!();
    }
    Ok(())
}
