//! What the MLPerf scenarios imply for a request shape, from the time floors of
//! [`super::estimate`]: why a tokens/s figure means nothing without its scenario.
//!
//! - **SingleStream**: one request at a time: a prefill of the input, then one batch-1 decode step
//!   per further output token. Bound by the wall.
//! - **Server**: many users; the system batches decode steps as long as a step stays under the
//!   time-per-output-token limit (and the KV caches fit).
//! - **Offline**: all requests at once; the batch is as large as memory allows.
//!
//! Decode steps are costed at the mid-point context `input + output / 2` (bytes and FLOPs are
//! linear in the context). Server and Offline amortise prefills over the batch: a prefill costs its
//! FLOPs at the peak (batched prefills are compute-bound), or, on a device with no known peak, its
//! weight reads shared by the batch. Queueing (the p99 of Poisson arrivals), the time-to-first-
//! token limit and prefill interrupting decode are not modelled: the figures are upper bounds.
//!
//! A model that does not fit on one device runs on as many as it needs, as one ideal
//! tensor-parallel system ([`Device::times`]).

use memwall_model::ModelConfig;
use serde::Serialize;

use super::count::{self, WeightDtype};
use super::estimate::{self, MAX_BATCH, peak_flops};
use super::{Device, Error};

/// Tokens in and out of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct RequestShape {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(tag = "scenario", rename_all = "snake_case")]
pub enum Scenario {
    SingleStream,
    /// Batches as long as a decode step stays within `tpot_limit_s`.
    Server {
        tpot_limit_s: f64,
    },
    Offline,
}

impl Scenario {
    pub const fn name(&self) -> &'static str {
        match self {
            Scenario::SingleStream => "SingleStream",
            Scenario::Server { .. } => "Server",
            Scenario::Offline => "Offline",
        }
    }
}

/// The floor a scenario implies.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ScenarioEstimate {
    pub scenario: &'static str,
    /// Devices working as one.
    pub devices: u64,
    /// Sequences decoded together.
    pub batch: u64,
    /// Time of one decode step at the mid-point context, seconds.
    pub time_per_output_token_s: f64,
    /// The prefill of one request on the idle system, seconds.
    pub time_to_first_token_s: f64,
    /// Output tokens per second of the whole system.
    pub tokens_per_s: f64,
    pub requests_per_s: f64,
}

/// What `scenario` implies for requests of `shape` on `device`.
pub fn estimate(
    config: &ModelConfig,
    dtype: WeightDtype,
    device: &Device,
    shape: RequestShape,
    scenario: Scenario,
) -> Result<ScenarioEstimate, Error> {
    if shape.output_tokens == 0 {
        return Err(Error::InvalidArgument { what: "output tokens", reason: "must be at least 1".into() });
    }
    let total_context = shape.input_tokens.saturating_add(shape.output_tokens);
    if total_context > config.max_position_embeddings as u64 {
        return Err(Error::InvalidArgument {
            what: "request shape",
            reason: format!(
                "{} input + {} output tokens exceed the model's max_position_embeddings {}",
                shape.input_tokens, shape.output_tokens, config.max_position_embeddings
            ),
        });
    }
    let devices = estimate::devices_needed(config, dtype, device, 1, total_context).unwrap_or(1);
    let system = device.times(devices);
    let mid_context = shape.input_tokens.saturating_add(shape.output_tokens / 2);

    // Prefill of one request: its weights read once (experts as `input_tokens` tokens pick them),
    // its FLOPs at the peak.
    let prefill_bytes = count::step_bytes(config, dtype, shape.input_tokens.max(1), 0).total();
    let prefill_flops = count::prefill_flops(config, shape.input_tokens).total();
    let peak = peak_flops(&system, dtype);
    let prefill_memory_s = prefill_bytes / system.bandwidth;
    let ttft = peak.map_or(prefill_memory_s, |p| (prefill_flops / p).max(prefill_memory_s));

    let step_time = |batch: u64| estimate::step(config, dtype, &system, batch, mid_context).time_s;
    let max_batch = match system.capacity {
        Some(c) => estimate::max_batch_in(config, dtype, c, total_context),
        None => MAX_BATCH,
    };
    if max_batch == 0 {
        return Err(Error::InvalidArgument {
            what: "request shape",
            reason: format!("not even one request of {total_context} tokens fits on {}", system.name),
        });
    }

    let batch = match scenario {
        Scenario::SingleStream => 1,
        Scenario::Offline => max_batch,
        Scenario::Server { tpot_limit_s } => {
            if !(tpot_limit_s.is_finite() && tpot_limit_s > 0.0) {
                return Err(Error::InvalidArgument {
                    what: "tpot limit",
                    reason: format!("{tpot_limit_s} s: must be positive"),
                });
            }
            if step_time(1) > tpot_limit_s {
                return Err(Error::InvalidArgument {
                    what: "tpot limit",
                    reason: format!(
                        "{:.1} ms is below the batch-1 step floor of {:.1} ms on {}",
                        tpot_limit_s * 1e3,
                        step_time(1) * 1e3,
                        system.name
                    ),
                });
            }
            // The step time grows with the batch: bisect for the largest batch within the limit.
            let (mut lo, mut hi) = (1, max_batch);
            while lo < hi {
                let mid = lo + (hi - lo).div_ceil(2);
                if step_time(mid) <= tpot_limit_s { lo = mid } else { hi = mid - 1 }
            }
            lo
        }
    };

    let tpot = step_time(batch);
    let out = shape.output_tokens as f64;
    let (tokens_per_s, requests_per_s) = match scenario {
        Scenario::SingleStream => {
            // The prefill yields the first output token; each further one is a decode step.
            let latency = ttft + (out - 1.0) * tpot;
            (out / latency, 1.0 / latency)
        }
        Scenario::Server { .. } | Scenario::Offline => {
            let prefill_share = match peak {
                Some(p) => prefill_flops / p,
                None => prefill_memory_s / batch as f64,
            };
            let per_request = prefill_share + out * tpot / batch as f64;
            (out / per_request, 1.0 / per_request)
        }
    };
    Ok(ScenarioEstimate {
        scenario: scenario.name(),
        devices,
        batch,
        time_per_output_token_s: tpot,
        time_to_first_token_s: ttft,
        tokens_per_s,
        requests_per_s,
    })
}
