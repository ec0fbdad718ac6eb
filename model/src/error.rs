//! The model crate's typed errors: a checkpoint that cannot be read or does not fit its config, and
//! a request the allocated session cannot run. Nothing in this crate panics on bad input.

use std::path::PathBuf;

use crate::config::ConfigError;

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// Why a checkpoint directory was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{dir}: no model.safetensors.index.json and no model.safetensors")]
    NoWeights { dir: PathBuf },

    #[error("{path}: truncated: {len} bytes, shorter than the 8-byte header length")]
    Truncated { path: PathBuf, len: u64 },

    #[error("{path}: the header length runs past the end of the {file_len}-byte file")]
    HeaderPastEnd { path: PathBuf, file_len: u64 },

    #[error("{path}: the header length is larger than the 100 MB the format allows")]
    HeaderTooLarge { path: PathBuf },

    #[error("{path}: the header is not valid JSON: {reason}")]
    BadHeader { path: PathBuf, reason: String },

    #[error("{path}: the offsets of tensor `{tensor}` overlap another tensor or leave a gap")]
    BadOffsets { path: PathBuf, tensor: String },

    #[error("{path}: a tensor's byte length does not match its dtype and shape")]
    ByteLength { path: PathBuf },

    #[error(
        "{path}: the tensors' offsets do not end at the end of the file (offsets out of bounds, \
         truncated data or trailing bytes)"
    )]
    DataLength { path: PathBuf },

    #[error("{path}: a tensor's shape overflows the address space")]
    Overflow { path: PathBuf },

    #[error("{path}: invalid sharded index: {reason}")]
    BadIndex { path: PathBuf, reason: String },

    #[error("the index names `{tensor}` in {file}, which does not hold it")]
    NotInShard { tensor: String, file: String },

    #[error("tensor `{tensor}` is stored twice, in {first} and {second}")]
    Duplicate { tensor: String, first: String, second: String },

    #[error("tensor `{tensor}` is missing from the checkpoint")]
    Missing { tensor: String },

    #[error("tensor `{tensor}` has dtype {got}, expected one of {expected}")]
    WrongDType { tensor: String, got: String, expected: String },

    #[error("tensor `{tensor}` has shape {got:?}, expected {expected:?}")]
    WrongShape { tensor: String, got: Vec<usize>, expected: Vec<usize> },

    #[error("fp8 weight `{tensor}` has no `weight_scale` or `weight_scale_inv` beside it")]
    MissingScale { tensor: String },

    #[error("scale `{scale}` has no fp8 weight `{weight}` beside it")]
    OrphanScale { scale: String, weight: String },

    #[error("weight `{tensor}` has both a `weight_scale` and a `weight_scale_inv`")]
    TwoScales { tensor: String },

    #[error("scale `{scale}` has shape {got:?}, which is not the {scheme} scale of a {n}x{k} weight")]
    ScaleShape { scale: String, got: Vec<usize>, scheme: String, n: usize, k: usize },

    #[error("scale `{scale}` holds {value}, not a finite positive number")]
    ScaleValue { scale: String, value: f32 },

    #[error(
        "fp8 weight `{tensor}` holds the e4m3fn NaN code {code:#04x} at byte {offset} of its data (byte \
         {file_offset} of {path}): it has no e4m3fnuz value, so the weight cannot be converted for this \
         device's fp8 format"
    )]
    Fp8NanCode { tensor: String, path: PathBuf, offset: usize, file_offset: usize, code: u8 },

    #[error(
        "scale `{scale}`: element {index} = {value:e} overflows {dtype} when doubled for the e4m3fnuz \
         weight"
    )]
    ScaleOverflow { scale: String, index: usize, value: f32, dtype: String },

    #[error("fp8 weight `{tensor}` but config.json has no `quantization_config` (or `compression_config`)")]
    NoQuantConfig { tensor: String },

    #[error("config.json: `{field}` = {value} is not supported: {reason}")]
    Quant { field: String, value: String, reason: String },
}

/// Every error of the model crate.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Config(#[from] ConfigError),

    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),

    #[error(transparent)]
    Runtime(#[from] memwall_runtime::Error),

    #[error("sequence {seq}: token id {id} at index {index} is out of range for a vocabulary of {vocab}")]
    TokenOutOfRange { seq: usize, index: usize, id: u32, vocab: usize },

    #[error("sequence {seq} has an empty prompt")]
    EmptyPrompt { seq: usize },

    #[error(
        "sequence {seq}: {prompt} prompt tokens + {new} new tokens need {needed} positions, more than the \
         {capacity} of the KV cache"
    )]
    CacheTooShort { seq: usize, prompt: usize, new: usize, needed: usize, capacity: usize },

    #[error(
        "sequence {seq}: {prompt} prompt tokens + {new} new tokens need {needed} positions, more than \
         max_position_embeddings = {max_positions}"
    )]
    BeyondMaxPositions { seq: usize, prompt: usize, new: usize, needed: usize, max_positions: usize },

    #[error("a batch of {got} sequences is larger than the {allocated} slots allocated")]
    BatchTooLarge { got: usize, allocated: usize },

    #[error("an empty batch: give at least one sequence")]
    EmptyBatch,

    #[error("slot {slot} needs {needed} more KV cache blocks, only {free} are free")]
    OutOfBlocks { slot: usize, needed: usize, free: usize },

    #[error("slot {slot}: position {pos} lies beyond the {reserved} positions reserved (Session::reserve)")]
    NotReserved { slot: usize, pos: usize, reserved: usize },

    #[error("session: {0}")]
    Session(String),
}
