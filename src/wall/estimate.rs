//! The time floor of a decode step and what follows from it: the wall (tokens/s of one stream),
//! tokens/s of a batch, the batch at which decode turns compute-bound, and how many devices the
//! model needs.
//!
//! A step can go no faster than its memory traffic at the device's bandwidth, nor than its FLOPs
//! at the device's dense peak: `time >= max(bytes / bandwidth, flops / peak)`. This is the
//! roofline bound; real kernels reach a fraction of it.

use memwall_model::ModelConfig;
use serde::Serialize;

use super::Device;
use super::count::{self, StepBytes, StepFlops, WeightDtype};

/// The largest batch the searches consider.
pub const MAX_BATCH: u64 = 1 << 20;

/// Which roof bounds a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Bound {
    Memory,
    Compute,
}

/// The time floor of one decode step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct StepEstimate {
    pub batch: u64,
    pub context: u64,
    pub bytes: StepBytes,
    pub flops: StepFlops,
    /// `bytes / bandwidth`, seconds.
    pub memory_time_s: f64,
    /// `flops / peak`, seconds; `None` when the device's peak is unknown.
    pub compute_time_s: Option<f64>,
    /// The floor: the larger of the two.
    pub time_s: f64,
    pub bound: Bound,
    /// `batch / time_s`: tokens/s of the whole batch (for batch 1, the wall).
    pub tokens_per_s: f64,
    /// FLOPs per byte read.
    pub arithmetic_intensity: f64,
    /// `flops / time_s`: the FLOP/s the roofline allows.
    pub attainable_flops: f64,
}

/// The dense peak the weights' format runs at: fp8 matrix units for fp8 weights where the device
/// has them; otherwise bf16 (fp8 weights are then converted to bf16 on the fly).
pub fn peak_flops(device: &Device, dtype: WeightDtype) -> Option<f64> {
    match dtype {
        WeightDtype::Bf16 => device.bf16_flops,
        WeightDtype::Fp8 => device.fp8_flops.or(device.bf16_flops),
    }
}

/// The time floor of one decode step of `batch` sequences at context `context`.
pub fn step(
    config: &ModelConfig,
    dtype: WeightDtype,
    device: &Device,
    batch: u64,
    context: u64,
) -> StepEstimate {
    let bytes = count::step_bytes(config, dtype, batch, context);
    let flops = count::step_flops(config, batch, context);
    floor(bytes, flops, device, dtype, batch, context)
}

pub(crate) fn floor(
    bytes: StepBytes,
    flops: StepFlops,
    device: &Device,
    dtype: WeightDtype,
    batch: u64,
    context: u64,
) -> StepEstimate {
    let memory_time_s = bytes.total() / device.bandwidth;
    let compute_time_s = peak_flops(device, dtype).map(|peak| flops.total() / peak);
    let (time_s, bound) = match compute_time_s {
        Some(c) if c > memory_time_s => (c, Bound::Compute),
        _ => (memory_time_s, Bound::Memory),
    };
    StepEstimate {
        batch,
        context,
        bytes,
        flops,
        memory_time_s,
        compute_time_s,
        time_s,
        bound,
        tokens_per_s: batch as f64 / time_s,
        arithmetic_intensity: flops.total() / bytes.total(),
        attainable_flops: flops.total() / time_s,
    }
}

/// The wall: tokens/s of one stream at context `context`, `1 / time floor` of a batch-1 step.
pub fn wall_tokens_per_s(config: &ModelConfig, dtype: WeightDtype, device: &Device, context: u64) -> f64 {
    step(config, dtype, device, 1, context).tokens_per_s
}

/// The seed's wall: `bandwidth / (parameters * bytes per parameter)`.
pub fn seed_wall_tokens_per_s(config: &ModelConfig, dtype: WeightDtype, device: &Device) -> f64 {
    device.bandwidth / count::seed_bytes_per_token(config, dtype)
}

/// The smallest batch whose step is compute-bound at context `context`, or `None` if the device's
/// peak is unknown or no batch up to [`MAX_BATCH`] gets there (at long contexts the KV cache, read
/// once per sequence, keeps attention memory-bound at any batch).
///
/// `flops / peak - bytes / bandwidth` is convex in the batch (FLOPs are linear in it; bytes are
/// linear plus the concave expected-experts term) and negative at batch 0, so once it turns
/// non-negative it stays so: a bisection finds the crossing.
pub fn compute_bound_batch(
    config: &ModelConfig,
    dtype: WeightDtype,
    device: &Device,
    context: u64,
) -> Option<u64> {
    let peak = peak_flops(device, dtype)?;
    let compute_bound = |b: u64| {
        let bytes = count::step_bytes(config, dtype, b, context).total();
        let flops = count::step_flops(config, b, context).total();
        flops / peak >= bytes / device.bandwidth
    };
    let mut hi = 1;
    while !compute_bound(hi) {
        if hi >= MAX_BATCH {
            return None;
        }
        hi *= 2;
    }
    let mut lo = hi / 2; // not compute-bound (or 0)
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if compute_bound(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Some(hi)
}

/// Bytes of device memory a batch needs: the weights and, per sequence, the KV cache of its
/// `context` tokens and the new one.
pub fn memory_needed(config: &ModelConfig, dtype: WeightDtype, batch: u64, context: u64) -> f64 {
    count::stored_weight_bytes(config, dtype)
        + batch as f64 * (context as f64 + 1.0) * count::kv_bytes_per_token(config)
}

/// How many of `device` the batch needs to fit (`ceil(memory / capacity)`), or `None` when the
/// capacity is unknown.
pub fn devices_needed(
    config: &ModelConfig,
    dtype: WeightDtype,
    device: &Device,
    batch: u64,
    context: u64,
) -> Option<u64> {
    let capacity = device.capacity?;
    let n = (memory_needed(config, dtype, batch, context) / capacity).ceil();
    // n >= 1 as memory is positive; the cast saturates for absurd sizes instead of wrapping.
    Some((n as u64).max(1))
}

/// The largest batch that fits in `capacity` bytes with every sequence at `context` tokens, capped
/// at [`MAX_BATCH`]; 0 when not even one fits.
pub fn max_batch_in(config: &ModelConfig, dtype: WeightDtype, capacity: f64, context: u64) -> u64 {
    let free = capacity - count::stored_weight_bytes(config, dtype);
    let per_sequence = (context as f64 + 1.0) * count::kv_bytes_per_token(config);
    if free < per_sequence {
        return 0;
    }
    ((free / per_sequence).floor() as u64).min(MAX_BATCH)
}
