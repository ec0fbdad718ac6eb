//! The rows of `memwall wall`: one per (model, weight format, device), as text or JSON.

use std::fmt::Write as _;
use std::path::Path;

use memwall_model::{ConfigError, ModelConfig, PRESETS};
use serde::Serialize;

use super::count::{self, StepBytes, WeightDtype};
use super::estimate::{self, Bound, MAX_BATCH};
use super::hardware::Source;
use super::scenario::ScenarioEstimate;
use super::sram::SramRow;
use super::{Device, Error};

/// A model by name, with its config.
#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    pub name: String,
    pub config: ModelConfig,
}

impl Model {
    /// Every preset of `memwall_model::PRESETS`.
    pub fn presets() -> Result<Vec<Model>, Error> {
        PRESETS.iter().map(|p| Ok(Model { name: p.name.to_string(), config: p.config()? })).collect()
    }

    /// A checkpoint directory holding `config.json` (or the path of a config file), else a preset
    /// name.
    pub fn resolve(arg: &str) -> Result<Model, Error> {
        let path = Path::new(arg);
        if path.is_dir() {
            let config = ModelConfig::from_dir(path)?;
            return Ok(Model { name: display_name(path), config });
        }
        if path.is_file() {
            let config = ModelConfig::from_file(path)?;
            // `ckpt/config.json` is named after `ckpt`; `tiny.json` after `tiny`.
            let name = match (path.file_name(), path.parent()) {
                (Some(f), Some(dir)) if f == "config.json" && !dir.as_os_str().is_empty() => {
                    display_name(dir)
                }
                _ => path.file_stem().map_or_else(|| arg.to_string(), |s| s.to_string_lossy().into_owned()),
            };
            return Ok(Model { name, config });
        }
        match ModelConfig::preset(arg) {
            Ok(config) => {
                let name = memwall_model::Preset::find(arg).map_or(arg, |p| p.name).to_string();
                Ok(Model { name, config })
            }
            Err(ConfigError::UnknownPreset { known, .. }) => Err(Error::InvalidArgument {
                what: "model",
                reason: format!(
                    "`{arg}` is neither a directory holding config.json nor a known model ({known})"
                ),
            }),
            Err(e) => Err(e.into()),
        }
    }
}

fn display_name(path: &Path) -> String {
    let abs = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    abs.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned())
}

/// One row of the report: a model in a weight format on a device, for a batch at a context.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WallRow {
    pub model: String,
    pub dtype: &'static str,
    pub device: String,
    pub device_source: Source,
    /// Sequences decoded together (the `batch_*` and `*_per_step` fields).
    pub batch: u64,
    /// Tokens already in each sequence's KV cache.
    pub context: u64,
    pub params: u64,
    /// Parameters one token goes through (all for a dense model; the picked experts for an MoE).
    pub active_params: u64,
    /// Bytes/s.
    pub bandwidth_bytes_per_s: f64,
    /// Dense FLOP/s for this weight format; `null` when unknown.
    pub peak_flops_per_s: Option<f64>,
    /// Bytes one stream reads per decode step (batch 1 at `context`), counted exactly.
    pub bytes_per_token: f64,
    /// The wall: tokens/s of one stream, `1 / max(bytes / bandwidth, FLOPs / peak)` at batch 1.
    pub wall_tokens_per_s: f64,
    /// The seed's count: every parameter once, 2 bytes in bf16, 1 in fp8.
    pub bytes_per_token_all_params: f64,
    /// `bandwidth / bytes_per_token_all_params`.
    pub wall_tokens_per_s_all_params: f64,
    /// KV cache bytes per token of context, per sequence (bf16).
    pub kv_bytes_per_context_token: f64,
    /// Bytes one step of the whole batch reads, and of what.
    pub bytes_per_step: f64,
    pub bytes_per_step_detail: StepBytes,
    pub flops_per_step: f64,
    /// The step's time floor, seconds.
    pub step_time_s: f64,
    pub bound: Bound,
    /// `batch / step_time_s`.
    pub batch_tokens_per_s: f64,
    /// The smallest batch whose step is compute-bound at this context; `null` if none up to 2^20
    /// or the peak is unknown.
    pub compute_bound_batch: Option<u64>,
    /// Bytes of the stored weights (every expert).
    pub weight_bytes: f64,
    /// Weights plus the batch's KV caches.
    pub memory_needed_bytes: f64,
    pub capacity_bytes: Option<f64>,
    /// Devices needed to hold `memory_needed_bytes`; `null` when the capacity is unknown.
    pub devices_needed: Option<u64>,
    pub fits: Option<bool>,
    /// A measured decode rate of the whole batch, tokens/s (`--achieved-tok-s`, or the benches'
    /// record); `null` when none.
    pub achieved_tokens_per_s: Option<f64>,
    /// `achieved_tokens_per_s / batch_tokens_per_s`: the fraction of the wall achieved.
    pub achieved_fraction_of_wall: Option<f64>,
    /// The model-bandwidth utilisation: `bytes_per_step x achieved steps/s / bandwidth`.
    pub bandwidth_utilisation: Option<f64>,
}

impl WallRow {
    /// This row with a measured decode rate of the batch (tokens/s) beside its wall.
    pub fn with_achieved(mut self, tokens_per_s: f64) -> Result<WallRow, Error> {
        if !(tokens_per_s.is_finite() && tokens_per_s > 0.0) {
            return Err(Error::InvalidArgument {
                what: "achieved tokens/s",
                reason: format!("{tokens_per_s}: must be finite and positive"),
            });
        }
        let steps_per_s = tokens_per_s / self.batch as f64;
        self.achieved_tokens_per_s = Some(tokens_per_s);
        self.achieved_fraction_of_wall = Some(tokens_per_s / self.batch_tokens_per_s);
        self.bandwidth_utilisation = Some(self.bytes_per_step * steps_per_s / self.bandwidth_bytes_per_s);
        Ok(self)
    }
}

/// Checks a batch and context against the model.
pub fn check_workload(config: &ModelConfig, batch: u64, context: u64) -> Result<(), Error> {
    if batch == 0 || batch > MAX_BATCH {
        return Err(Error::InvalidArgument {
            what: "batch",
            reason: format!("{batch}: must be between 1 and {MAX_BATCH}"),
        });
    }
    if context >= config.max_position_embeddings as u64 {
        return Err(Error::InvalidArgument {
            what: "context",
            reason: format!(
                "{context} tokens: the model's max_position_embeddings is {}, so a decode step sees at \
                 most {} tokens of context",
                config.max_position_embeddings,
                config.max_position_embeddings - 1
            ),
        });
    }
    Ok(())
}

/// The report row of `model` in `dtype` on `device` for `batch` sequences at `context`.
pub fn wall_row(
    model: &Model,
    dtype: WeightDtype,
    device: &Device,
    batch: u64,
    context: u64,
) -> Result<WallRow, Error> {
    let c = &model.config;
    check_workload(c, batch, context)?;
    let p = c.param_counts();
    let single = estimate::step(c, dtype, device, 1, context);
    let step = estimate::step(c, dtype, device, batch, context);
    let seed_bytes = count::seed_bytes_per_token(c, dtype);
    let memory_needed = estimate::memory_needed(c, dtype, batch, context);
    let devices_needed = estimate::devices_needed(c, dtype, device, batch, context);
    Ok(WallRow {
        model: model.name.clone(),
        dtype: dtype.name(),
        device: device.name.clone(),
        device_source: device.source,
        batch,
        context,
        params: p.total(),
        active_params: p.active_per_token(),
        bandwidth_bytes_per_s: device.bandwidth,
        peak_flops_per_s: estimate::peak_flops(device, dtype),
        bytes_per_token: single.bytes.total(),
        wall_tokens_per_s: single.tokens_per_s,
        bytes_per_token_all_params: seed_bytes,
        wall_tokens_per_s_all_params: device.bandwidth / seed_bytes,
        kv_bytes_per_context_token: count::kv_bytes_per_token(c),
        bytes_per_step: step.bytes.total(),
        bytes_per_step_detail: step.bytes,
        flops_per_step: step.flops.total(),
        step_time_s: step.time_s,
        bound: step.bound,
        batch_tokens_per_s: step.tokens_per_s,
        compute_bound_batch: estimate::compute_bound_batch(c, dtype, device, context),
        weight_bytes: count::stored_weight_bytes(c, dtype),
        memory_needed_bytes: memory_needed,
        capacity_bytes: device.capacity,
        devices_needed,
        fits: devices_needed.map(|n| n == 1),
        achieved_tokens_per_s: None,
        achieved_fraction_of_wall: None,
        bandwidth_utilisation: None,
    })
}

fn gb(bytes: f64) -> String {
    format!("{:.2}", bytes / 1e9)
}

fn opt<T: ToString>(v: Option<T>, none: &str) -> String {
    v.map_or_else(|| none.to_string(), |v| v.to_string())
}

/// Lays out rows of cells in aligned columns: the first `left` columns left-aligned, the rest
/// right-aligned.
pub fn columns(header: &[&str], rows: &[Vec<String>], left: usize) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut s = String::new();
        for (i, (cell, w)) in cells.zip(&widths).enumerate() {
            if i > 0 {
                s.push_str("  ");
            }
            if i < left {
                let _ = write!(s, "{cell:<w$}");
            } else {
                let _ = write!(s, "{cell:>w$}");
            }
        }
        out.push_str(s.trim_end());
        out.push('\n');
    };
    line(&mut header.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

/// The text table of `memwall wall`, with a legend.
pub fn render_table(rows: &[WallRow]) -> String {
    let achieved = rows.iter().any(|r| r.achieved_tokens_per_s.is_some());
    let mut header = vec![
        "model",
        "dtype",
        "device",
        "batch",
        "context",
        "GB/token",
        "GB/token(seed)",
        "wall tok/s",
        "wall tok/s(seed)",
        "batch tok/s",
        "bound",
        "compute-bound at batch",
        "devices",
    ];
    if achieved {
        header.extend(["achieved tok/s", "% of wall", "bandwidth util."]);
    }
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let mut cells = vec![
                r.model.clone(),
                r.dtype.to_string(),
                r.device.clone(),
                r.batch.to_string(),
                r.context.to_string(),
                gb(r.bytes_per_token),
                gb(r.bytes_per_token_all_params),
                format!("{:.1}", r.wall_tokens_per_s),
                format!("{:.1}", r.wall_tokens_per_s_all_params),
                format!("{:.0}", r.batch_tokens_per_s),
                match r.bound {
                    Bound::Memory => "memory".to_string(),
                    Bound::Compute => "compute".to_string(),
                },
                opt(r.compute_bound_batch, "never"),
                opt(r.devices_needed, "?"),
            ];
            if achieved {
                let pct =
                    |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{:.1}%", 100.0 * v));
                cells.extend([
                    r.achieved_tokens_per_s.map_or_else(|| "-".to_string(), |v| format!("{v:.2}")),
                    pct(r.achieved_fraction_of_wall),
                    pct(r.bandwidth_utilisation),
                ]);
            }
            cells
        })
        .collect();
    let mut out = columns(&header, &cells, 3);
    out.push_str(
        "\nGB/token: bytes one stream reads per decode step (1 GB = 1e9 bytes): one embedding row, the full \
         lm_head,\n  the weights and the experts actually picked, the KV cache at the given context. \
         (seed): every parameter once.\nwall tok/s: one stream, bandwidth / bytes (the time floor \
         max(bytes/bandwidth, FLOPs/peak) at batch 1).\nbatch tok/s: the whole batch at that floor. \
         bound: which roof the batch's step hits.\ncompute-bound at batch: the smallest batch whose \
         step is compute-bound at this context.\ndevices: how many of the device hold the weights \
         and the batch's KV caches (the wall figures are for one).\n",
    );
    if achieved {
        out.push_str(
            "achieved tok/s: a measured decode rate of the batch; % of wall: over batch tok/s; bandwidth \
             util.: bytes per step x steps/s / bandwidth\n  (the model-bandwidth utilisation).\n",
        );
    }
    out
}

/// The text table of the scenarios.
pub fn render_scenarios(model: &str, device: &str, rows: &[ScenarioEstimate]) -> String {
    let header = ["scenario", "devices", "batch", "TPOT ms", "TTFT ms", "tokens/s", "requests/s"];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.scenario.to_string(),
                r.devices.to_string(),
                r.batch.to_string(),
                format!("{:.2}", r.time_per_output_token_s * 1e3),
                format!("{:.1}", r.time_to_first_token_s * 1e3),
                format!("{:.0}", r.tokens_per_s),
                format!("{:.2}", r.requests_per_s),
            ]
        })
        .collect();
    format!(
        "Scenarios for {model} on {device} (floors; queueing not modelled):\n{}",
        columns(&header, &cells, 1)
    )
}

/// The text table of the SRAM arithmetic.
pub fn render_sram(model: &str, rows: &[SramRow]) -> String {
    let header = ["chip", "SRAM", "SRAM bytes", "model / SRAM", "chips to hold it"];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.chip.clone(),
                r.sram.clone(),
                format!("{:.4e}", r.sram_bytes),
                format!("{:.1}", r.ratio),
                r.chips.to_string(),
            ]
        })
        .collect();
    let bytes = rows.first().map_or(0.0, |r| r.model_bytes);
    format!(
        "Chips whose on-chip SRAM holds {model} ({:.2} GB = {bytes:.4e} bytes):\n{}",
        bytes / 1e9,
        columns(&header, &cells, 2)
    )
}
