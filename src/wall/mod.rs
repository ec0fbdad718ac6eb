//! The memory wall, computed (pure arithmetic, runs anywhere).
//!
//! Decoding one token at batch 1 reads every weight the token goes through, and the KV cache,
//! from device memory; at batch 1 that takes far longer than the arithmetic, so a device's
//! single-stream speed is capped by its **memory wall**: bandwidth / bytes read per token. This
//! module computes it for a model config and a device:
//!
//! - [`hardware`]: the device table (datasheet bandwidth, capacity, dense peaks, on-chip SRAM) and
//!   devices with a measured bandwidth;
//! - [`count`]: the bytes and FLOPs of one decode step, exactly (one embedding row, the full
//!   lm_head, the experts a batch actually picks, the KV cache at context L) and the seed's way
//!   (every parameter once);
//! - [`estimate`]: the time floor `max(bytes / bandwidth, FLOPs / peak)`, tokens/s of one stream
//!   and of a batch, the batch at which decode turns compute-bound, devices needed;
//! - [`scenario`]: what SingleStream, Server and Offline imply for a request shape;
//! - [`sram`]: chips needed to hold a model in on-chip SRAM, with units;
//! - [`record`]: measured decode rates the benches record, for the report to compare;
//! - [`report`]: the rows of `memwall wall` (text and JSON); [`roofline`]: its SVG picture.
//!
//! Byte figures are decimal (1 GB = 1e9 bytes), like the memory datasheets.

pub mod count;
pub mod estimate;
pub mod hardware;
pub mod record;
pub mod report;
pub mod roofline;
pub mod scenario;
pub mod sram;

use std::path::PathBuf;

use memwall_model::ConfigError;

pub use count::{StepBytes, StepFlops, WeightDtype};
pub use estimate::{Bound, StepEstimate};
pub use hardware::{Device, Source, Sram, THIS_MACHINE};
pub use record::DecodeRecord;
pub use report::{Model, WallRow};
pub use scenario::{RequestShape, Scenario, ScenarioEstimate};

/// Why a memory-wall computation or report could not be made.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),

    #[error("unknown device `{name}`; known devices: {known}")]
    UnknownDevice { name: String, known: String },

    #[error("invalid {what}: {reason}")]
    InvalidArgument { what: &'static str, reason: String },

    #[error("cannot draw the roofline: {0}")]
    Plot(String),

    #[error("cannot write {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}
