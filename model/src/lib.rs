//! memwall model: Hugging Face configs, the weight manifest and the static graph that runs on any
//! `memwall_runtime::Backend`. Filled by the model issue; the workspace foundation only reserves
//! the crate so the dependency graph (model -> runtime, root -> both) is fixed from the start.

pub mod config;

pub use config::{ConfigError, ModelConfig, PRESETS, ParamCounts, Preset};
pub use memwall_runtime as runtime;
