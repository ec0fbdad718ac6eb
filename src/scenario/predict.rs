//! The predictions of `memwall wall` for a measured scenario: the wall scenario estimate
//! ([`crate::wall::scenario::estimate`], which picks its own batch: 1, the largest within the
//! TPOT limit, or the largest that fits) and the roofline at the batch the run actually decoded
//! at (`batch / floor of a decode step`), for the same model, weight format and device.

use memwall_model::ModelConfig;
use serde::Serialize;

use crate::wall::estimate;
use crate::wall::{Device, RequestShape, Scenario, ScenarioEstimate, WeightDtype};

/// What the wall arithmetic predicts for one scenario.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Prediction {
    pub scenario: &'static str,
    /// The wall scenario estimate, or why there is none.
    pub estimate: Option<ScenarioEstimate>,
    pub estimate_error: Option<String>,
    /// Batch 1 at the mid-point context: the memory wall of one stream, tokens/s.
    pub wall_tokens_per_s: f64,
    /// The mean decode batch the run measured, rounded (at least 1).
    pub batch: u64,
    /// `batch / time floor` of a decode step of that batch at the mid-point context.
    pub roofline_tokens_per_s: f64,
}

/// The request shape of a run: mean input and output lengths, rounded (at least 1 output).
pub fn mean_shape(input_tokens: usize, output_tokens: usize, queries: usize) -> RequestShape {
    let q = queries.max(1) as f64;
    RequestShape {
        input_tokens: (input_tokens as f64 / q).round() as u64,
        output_tokens: ((output_tokens as f64 / q).round() as u64).max(1),
    }
}

/// Tokens/s the roofline allows a decode step of `batch` sequences at `context`.
pub fn roofline_tokens_per_s(
    config: &ModelConfig,
    dtype: WeightDtype,
    device: &Device,
    batch: u64,
    context: u64,
) -> f64 {
    estimate::step(config, dtype, device, batch.max(1), context).tokens_per_s
}

pub fn predict(
    config: &ModelConfig,
    dtype: WeightDtype,
    device: &Device,
    shape: RequestShape,
    scenario: Scenario,
    measured_batch: f64,
) -> Prediction {
    let context = shape.input_tokens + shape.output_tokens / 2;
    let batch = (measured_batch.round() as u64).max(1);
    let (estimate, estimate_error) =
        match crate::wall::scenario::estimate(config, dtype, device, shape, scenario) {
            Ok(e) => (Some(e), None),
            Err(e) => (None, Some(e.to_string())),
        };
    Prediction {
        scenario: scenario.name(),
        estimate,
        estimate_error,
        wall_tokens_per_s: estimate::wall_tokens_per_s(config, dtype, device, context),
        batch,
        roofline_tokens_per_s: roofline_tokens_per_s(config, dtype, device, batch, context),
    }
}
