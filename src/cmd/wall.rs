//! `memwall wall`: the memory wall, model x device.

use std::path::PathBuf;

use clap::Args;
use memwall::wall::report::{self, WallRow};
use memwall::wall::{self, Device, Error, Model, RequestShape, Scenario, WeightDtype};
use serde::Serialize;

#[derive(Args)]
pub struct WallArgs {
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

pub fn wall_command(args: &WallArgs) -> Result<(), Error> {
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
