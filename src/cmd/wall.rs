//! `memwall wall`: the memory wall, model x device.

use std::path::PathBuf;

use clap::Args;
use memwall::peak;
use memwall::wall::report::{self, WallRow};
use memwall::wall::roofline::MeasuredPoint;
use memwall::wall::{self, DecodeRecord, Device, Error, Model, RequestShape, Scenario, Source, WeightDtype};
use serde::Serialize;

#[derive(Args)]
pub struct WallArgs {
    /// Models: preset names (llama-3.1-8b, mixtral-8x7b, ...) or checkpoint directories holding
    /// config.json; comma-separated or repeated. Default: every preset.
    #[arg(long = "model", value_name = "NAME|DIR", value_delimiter = ',')]
    models: Vec<String>,
    /// Devices from the datasheet table (h100-sxm, h200, mi300x, ...), or `this` for this machine
    /// measured (as --measure); comma-separated or repeated. Default: every datasheet device.
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
    /// Measure this machine (`memwall peak`'s read kernel, all threads, best of 3 passes over
    /// max(3 x LLC, 1 GiB); a few seconds) and add it as a device: "this machine", its bandwidth
    /// the measured read ceiling (decimal GB/s), its compute roof an estimate (cores x GHz x FMA
    /// ports x f32 SIMD lanes x 2).
    #[arg(long)]
    measure: bool,
    /// A decode rate you measured, tokens/s of the whole batch: each row of a measured device
    /// (this machine, --bandwidth-gbs) or, if there is none, every row shows it beside its wall.
    #[arg(long, value_name = "X")]
    achieved_tok_s: Option<f64>,
    /// The decode record written by `cargo bench --bench decode` (default:
    /// $CARGO_TARGET_DIR/memwall/decode.json, else target/memwall/decode.json): when it exists, a
    /// row for its model on the machine it ran on, with the tokens/s it achieved.
    #[arg(long, value_name = "FILE")]
    record: Option<PathBuf>,
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

/// Whether a `--device` argument names this machine.
pub(crate) fn is_this_machine(name: &str) -> bool {
    let key: String = name.chars().filter(|c| c.is_ascii_alphanumeric()).collect::<String>().to_lowercase();
    key == wall::THIS_MACHINE || key == "thismachine"
}

/// This machine, measured: the read ceiling on all threads and the estimated compute peak.
pub(crate) fn measure_this_machine() -> Result<(Device, String), Error> {
    let failed = |e: memwall::runtime::Error| Error::InvalidArgument {
        what: "measurement of this machine",
        reason: e.to_string(),
    };
    let working_set = peak::working_set_bytes();
    let threads = peak::max_threads();
    let read = peak::StreamBuffers::new(working_set)
        .and_then(|mut b| b.measure(peak::Kernel::Read, threads, 3))
        .map_err(failed)?;
    let flops = peak::estimate_peak_flops();
    let device = Device::this_machine(read.gb_per_s * 1e9, flops.map(|f| f.flops_per_s))?;
    let note = format!(
        "this machine: read {:.1} GB/s measured ({threads} threads, best of 3 passes over {:.2} GB); compute {}",
        read.gb_per_s,
        read.bytes_per_pass as f64 / 1e9,
        flops.map_or_else(|| "peak unknown (no clock in /proc/cpuinfo)".to_string(), |f| f.formula())
    );
    Ok((device, note))
}

/// The devices of the report, the one the roofline draws (if it can pick one), and a note on
/// what was measured.
struct Devices {
    all: Vec<Device>,
    drawn: Option<Device>,
    note: Option<String>,
}

fn select_devices(args: &WallArgs) -> Result<Devices, Error> {
    let named: Vec<Device> = args
        .devices
        .iter()
        .filter(|d| !is_this_machine(d))
        .map(|d| Device::find(d))
        .collect::<Result<_, _>>()?;
    let this_named = args.devices.iter().any(|d| is_this_machine(d));
    let mut devices = if named.is_empty() && !this_named { Device::table() } else { named.clone() };
    let mut drawn = match named.as_slice() {
        [one] if !this_named => Some(one.clone()),
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
    let mut note = None;
    if args.measure || this_named {
        let (this, text) = measure_this_machine()?;
        drawn = Some(this.clone());
        devices.push(this);
        note = Some(text);
    }
    Ok(Devices { all: devices, drawn, note })
}

/// The benches' decode records (one per batch size of the run), if they exist and their model
/// passes the `--model` filter: the model (from the config they carry), the machine they ran on
/// (at the highest read peak the run measured), and the records.
fn recorded(args: &WallArgs) -> Result<Option<(Model, Device, Vec<DecodeRecord>)>, Error> {
    let path = args.record.clone().unwrap_or_else(wall::record::default_path);
    let records = DecodeRecord::load_all(&path)?;
    let Some(record) = records.first() else {
        if args.record.is_some() {
            return Err(Error::InvalidArgument {
                what: "--record",
                reason: format!("{} does not exist", path.display()),
            });
        }
        return Ok(None);
    };
    if !args.models.is_empty() && !args.models.contains(&record.model) {
        return Ok(None);
    }
    let config = memwall::model::ModelConfig::from_json(&record.config)?;
    let model = Model { name: record.model.clone(), config };
    let peak = records.iter().map(|r| r.peak_read_gb_s).fold(0.0, f64::max);
    let device = Device::this_machine(peak * 1e9, record.estimated_peak_flops_per_s)?;
    let device = Device { name: format!("{} in {}", device.name, path.display()), ..device };
    Ok(Some((model, device, records)))
}

/// The models named (or the presets), less the decode record's model, which comes with its record.
fn select_models(args: &WallArgs, recorded: Option<&str>) -> Result<Vec<Model>, Error> {
    if args.models.is_empty() {
        if args.sram {
            return Ok(vec![Model::resolve("llama-3.1-70b")?]);
        }
        return Model::presets();
    }
    args.models.iter().filter(|m| Some(m.as_str()) != recorded).map(|m| Model::resolve(m)).collect()
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

pub fn wall_command(args: &WallArgs) -> Result<(), Error> {
    let table = !args.scenarios && !args.sram;
    let record = if table { recorded(args)? } else { None };
    let mut models = select_models(args, record.as_ref().map(|(m, _, _)| m.name.as_str()))?;
    let Devices { all: devices, drawn, note } = select_devices(args)?;
    let dtypes = select_dtypes(args)?;
    for m in &models {
        report::check_workload(&m.config, args.batch, args.context)?;
    }
    if let Some(x) = args.achieved_tok_s
        && !(x.is_finite() && x > 0.0)
    {
        return Err(Error::InvalidArgument {
            what: "--achieved-tok-s",
            reason: format!("{x}: must be finite and positive"),
        });
    }
    let mut rows: Vec<WallRow> = Vec::new();
    if table {
        let any_measured = devices.iter().any(|d| d.source == Source::Measured);
        for m in &models {
            for &dtype in &dtypes {
                for d in &devices {
                    let row = report::wall_row(m, dtype, d, args.batch, args.context)?;
                    rows.push(match args.achieved_tok_s {
                        Some(x) if d.source == Source::Measured || !any_measured => row.with_achieved(x)?,
                        _ => row,
                    });
                }
            }
        }
        if let Some((model, device, records)) = &record {
            for r in records {
                let dtype = WeightDtype::parse(&r.dtype)?;
                report::check_workload(&model.config, r.batch, r.context)?;
                rows.push(
                    report::wall_row(model, dtype, device, r.batch, r.context)?
                        .with_achieved(r.tokens_per_s)?,
                );
            }
        }
    }

    if let Some(path) = &args.svg {
        let Some(device) = &drawn else {
            return Err(Error::InvalidArgument {
                what: "--svg",
                reason: "the roofline is drawn for one device: name it with --device (or --measure)".into(),
            });
        };
        // Measured points: the rows of the drawn device with an achieved rate, and the record.
        let mut measured: Vec<MeasuredPoint> = rows
            .iter()
            .filter(|r| r.device == device.name && r.dtype == dtypes[0].name())
            .filter_map(|r| {
                let steps_per_s = r.achieved_tokens_per_s? / r.batch as f64;
                Some(MeasuredPoint {
                    label: format!("{} batch {} ({:.1} tok/s)", r.model, r.batch, r.achieved_tokens_per_s?),
                    intensity: r.flops_per_step / r.bytes_per_step,
                    flops_per_s: r.flops_per_step * steps_per_s,
                })
            })
            .collect();
        if let Some((_, _, records)) = &record {
            for r in records {
                measured.push(MeasuredPoint {
                    label: format!(
                        "{} batch {} context {} on {} ({:.1} tok/s, read peak {:.1} GB/s)",
                        r.model, r.batch, r.context, r.backend, r.tokens_per_s, r.peak_read_gb_s
                    ),
                    intensity: r.flops_per_step / r.bytes_per_step,
                    flops_per_s: r.flops_per_step * r.tokens_per_s / r.batch as f64,
                });
            }
        }
        // The record's model, when named (or nothing else is), is drawn predicted as well.
        if let Some((model, _, _)) = &record
            && (models.is_empty() || args.models.contains(&model.name))
        {
            models.push(model.clone());
        }
        let text = wall::roofline::svg(&models, dtypes[0], device, args.context, &measured)?;
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

    if args.json {
        return print_json(&rows);
    }
    if let Some(note) = &note {
        println!("{note}\n");
    }
    print!("{}", report::render_table(&rows));
    if let Some((_, _, records)) = &record {
        let r = &records[0];
        println!(
            "\nRecorded by benches/decode.rs ({} weights on {}; bytes and FLOPs from the op list):",
            r.dtype, r.backend
        );
        for r in records {
            println!("  {} ({} steps timed)", r.summary(), r.steps);
        }
    }
    Ok(())
}
