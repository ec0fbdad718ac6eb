//! memwall model: Hugging Face configs, the weight manifest and the static graph that runs on any
//! `memwall_runtime::Backend`.
//!
//! - [`checkpoint`]: safetensors files over memory maps (one file or sharded), typed errors.
//! - [`quant`]: the fp8 layouts of `quantization_config` / `compression_config`.
//! - [`weights`]: the manifest (every tensor the graph needs, checked before any compute) and
//!   loading onto a backend, in place on host backends.

pub mod checkpoint;
pub mod config;
pub mod error;
pub mod quant;
pub mod weights;

pub use config::{ConfigError, ModelConfig, PRESETS, ParamCounts, Preset};
pub use error::{CheckpointError, ModelError};
pub use memwall_runtime as runtime;
pub mod graph;
pub mod model;
pub mod npy;
pub mod random;
pub mod session;

pub use model::{LoadReport, Model};
pub use session::{BlockPool, GenerateOptions, Generation, GraphStats, Session, SessionOptions};
