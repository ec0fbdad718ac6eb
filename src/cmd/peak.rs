//! `memwall peak`: this machine's memory ceiling.

use clap::{Args, ValueEnum};
use memwall::peak::{self, Kernel, Measurement, StreamBuffers};
#[cfg(any(feature = "cuda", feature = "hip", feature = "emulate"))]
use memwall::peak_gpu::{self, GpuKernel, GpuMeasurement, GpuStreamBuffers};
use memwall::runtime::Error;
#[cfg(any(feature = "cuda", feature = "hip", feature = "emulate"))]
use memwall::runtime::gpu::{Device, Gpu};

/// Which device `memwall peak` measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PeakBackend {
    /// This machine's CPU and memory (rayon threads).
    Cpu,
    /// An NVIDIA GPU: the SM read and copy kernels of kernels-cuda/stream.cu and the copy engine,
    /// timed by CUDA events (builds with `--features cuda`).
    Cuda,
    /// An AMD GPU: the same kernels compiled for it (kernels-hip/), and its copy engine
    /// (`hipMemcpyDtoDAsync`), timed by HIP events (builds with `--features hip`).
    Hip,
    /// The same kernels on the SIMT emulator (builds with `--features emulate`): checks the path;
    /// its figures are the CPU emulator's, not a GPU's.
    CudaEmu,
}

/// This machine's memory ceiling: streaming read, copy and triad on 1..=N threads, in decimal
/// GB/s counting bytes read + written, over a working set of max(3 x LLC, 1 GiB); or, with
/// `--backend cuda`, a GPU's, read and copied by its SMs.
#[derive(Args)]
pub struct PeakArgs {
    /// The device to measure.
    #[arg(long, value_enum, default_value_t = PeakBackend::Cpu)]
    backend: PeakBackend,
    /// Measure 1..=N threads (default: every available thread).
    #[arg(long)]
    threads: Option<usize>,
    /// Print one JSON array of measurements instead of a table.
    #[arg(long)]
    json: bool,
    /// Working set in GiB (default: max(3 x LLC, 1 GiB) on the CPU, 4 GiB on a GPU).
    #[arg(long)]
    working_set_gib: Option<f64>,
    /// Timed passes per measurement, after one warm-up pass; the best is reported.
    #[arg(long, default_value_t = 5)]
    passes: usize,
}

const GIB: f64 = (1u64 << 30) as f64;
const MIB: f64 = (1u64 << 20) as f64;

fn arg(msg: String) -> Error {
    Error::Argument { op: "peak", msg }
}

/// `--working-set-gib` in bytes, or `default`.
fn working_set(gib: Option<f64>, default: u64) -> Result<u64, Error> {
    match gib {
        None => Ok(default),
        Some(g) if g.is_finite() && g > 0.0 && g * GIB < u64::MAX as f64 => Ok((g * GIB).ceil() as u64),
        Some(g) => Err(arg(format!("--working-set-gib {g} must be a positive size"))),
    }
}

pub fn peak_cmd(args: &PeakArgs) -> Result<(), Error> {
    let PeakArgs { backend, threads, json, working_set_gib, passes } = *args;
    if backend != PeakBackend::Cpu && threads.is_some() {
        return Err(arg("--threads is for --backend cpu".into()));
    }
    match backend {
        PeakBackend::Cpu => {}
        #[cfg(feature = "cuda")]
        PeakBackend::Cuda => {
            let g = memwall::cuda_backend(0)?;
            let ws = working_set(working_set_gib, peak_gpu::DEFAULT_WORKING_SET)?;
            let time = |f: &mut dyn FnMut() -> Result<(), Error>| g.device().time(f);
            let copy =
                |dst: &mut memwall::runtime::gpu::cuda::CudaBuffer,
                 src: &memwall::runtime::gpu::cuda::CudaBuffer| g.device().copy(dst, src);
            return gpu_peak(&g, ws, passes, json, &time, Some(&copy), "CUDA event times");
        }
        #[cfg(feature = "hip")]
        PeakBackend::Hip => {
            let g = memwall::hip_backend(0)?;
            let ws = working_set(working_set_gib, peak_gpu::DEFAULT_WORKING_SET)?;
            let time = |f: &mut dyn FnMut() -> Result<(), Error>| g.device().time(f);
            let copy =
                |dst: &mut memwall::runtime::gpu::hip::HipBuffer,
                 src: &memwall::runtime::gpu::hip::HipBuffer| { g.device().copy(dst, src) };
            return gpu_peak(&g, ws, passes, json, &time, Some(&copy), "HIP event times");
        }
        #[cfg(feature = "emulate")]
        PeakBackend::CudaEmu => {
            let g = memwall::emulated_backend(memwall::runtime::gpu::emu::Schedule::Forward)?;
            let ws = working_set(working_set_gib, 1 << 20)?;
            let time = peak_gpu::host_time(&g);
            return gpu_peak(&g, ws, passes, json, &time, None, "host wall-clock times of the CPU emulator");
        }
        #[allow(unreachable_patterns)]
        other => {
            let (backend, what, feature) = match other {
                PeakBackend::Cuda => ("cuda", "CUDA", "cuda"),
                PeakBackend::Hip => ("hip", "HIP", "hip"),
                _ => ("cuda-emu", "emulated GPU", "emulate"),
            };
            return Err(Error::Unsupported {
                backend,
                op: "peak",
                reason: format!("this build has no {what} backend: build with `--features {feature}`"),
            });
        }
    }
    let max_threads = threads.unwrap_or_else(peak::max_threads);
    if max_threads == 0 {
        return Err(arg("--threads must be at least 1".into()));
    }
    let llc = peak::llc_bytes();
    let working_set = working_set(working_set_gib, peak::working_set_for(llc))?;

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

/// `memwall peak` on a GPU: the SM read and copy kernels (and, on CUDA, the copy engine), each the
/// best of `passes` after a warm-up, checked after timing, against the datasheet part the driver
/// name matches.
#[cfg(any(feature = "cuda", feature = "hip", feature = "emulate"))]
fn gpu_peak<D: Device>(
    g: &Gpu<D>,
    working_set: u64,
    passes: usize,
    json: bool,
    time: peak_gpu::Timer<'_>,
    copy: Option<peak_gpu::EngineCopy<'_, D>>,
    timing: &str,
) -> Result<(), Error> {
    let info = g.device().info().clone();
    let datasheet = memwall::wall::Device::for_driver_name(&info.name, info.total_memory);
    let mut buffers = GpuStreamBuffers::new(g, working_set, 0x7065_616b)?;
    let mut kernels = vec![GpuKernel::Read, GpuKernel::Copy];
    if copy.is_some() {
        kernels.push(GpuKernel::CopyEngine);
    }
    let results: Vec<GpuMeasurement> =
        kernels.iter().map(|&k| buffers.measure(g, k, passes, time, copy)).collect::<Result<_, _>>()?;
    let fraction = |m: &GpuMeasurement| datasheet.as_ref().map(|d| m.gb_per_s * 1e9 / d.bandwidth);
    if json {
        let rows: Vec<serde_json::Value> = results
            .iter()
            .map(|m| {
                serde_json::json!({
                    "device": info.name,
                    "kernel": m.kernel.name(),
                    "bytes_per_pass": m.bytes_per_pass,
                    "seconds": m.seconds,
                    "gb_per_s": m.gb_per_s,
                    "datasheet": datasheet.as_ref().map(|d| d.key.clone()),
                    "fraction_of_datasheet": fraction(m),
                    "working_set_bytes": buffers.bytes(),
                })
            })
            .collect();
        println!("{}", serde_json::Value::Array(rows));
        return Ok(());
    }
    println!("device: {} ({} SMs, {:.1} GiB)", info.name, info.sm_count, info.total_memory as f64 / GIB);
    match &datasheet {
        Some(d) => println!("datasheet: {} {:.0} GB/s", d.name, d.bandwidth / 1e9),
        None => println!("datasheet: no entry for this part (memwall wall lists the known ones)"),
    }
    println!(
        "working set: {:.3} GiB = {:.3} GB read; the copy moves half of it to a second buffer; best of {passes} passes after 1 warm-up, {timing}; results checked",
        buffers.bytes() as f64 / GIB,
        buffers.bytes() as f64 / 1e9
    );
    println!("GB/s (1e9 bytes/s, bytes read + written)");
    println!("{:<14}{:>12}{:>14}", "kernel", "GB/s", "of datasheet");
    for m in &results {
        let pct = fraction(m).map_or("-".to_string(), |f| format!("{:.1}%", 100.0 * f));
        let name = match m.kernel {
            GpuKernel::CopyEngine => "copy (engine)".to_string(),
            k => format!("{} (SMs)", k.name()),
        };
        println!("{name:<14}{:>12.1}{pct:>14}", m.gb_per_s);
    }
    Ok(())
}
