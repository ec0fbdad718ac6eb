//! The runtime's typed errors. Every check at an op's boundary returns one of these; no op panics
//! or reads out of bounds on bad input.

use crate::DType;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum Error {
    #[error("{op}: tensor `{tensor}` has dtype {got}, expected one of {allowed:?}")]
    DType { op: &'static str, tensor: &'static str, got: DType, allowed: Vec<DType> },

    #[error("{op}: tensor `{tensor}` has shape {got:?}, expected {expected}")]
    Shape { op: &'static str, tensor: &'static str, got: Vec<usize>, expected: String },

    #[error("{op}: invalid argument: {msg}")]
    Argument { op: &'static str, msg: String },

    #[error("{op}: `{tensor}` is scaled {got}, but `{like}` {expected}; both must be scaled alike")]
    ScaleMismatch {
        op: &'static str,
        tensor: &'static str,
        got: String,
        like: &'static str,
        expected: String,
    },

    #[error("{op}: token id {id} at row {row} is out of range for a vocabulary of {vocab}")]
    TokenOutOfRange { op: &'static str, row: usize, id: u32, vocab: usize },

    #[error("{op}: position {pos} at row {row} is beyond the KV cache length {capacity}")]
    ContextOverflow { op: &'static str, row: usize, pos: u32, capacity: usize },

    #[error("{op}: sequence slot {slot} at row {row} is beyond the {slots} slots allocated")]
    SlotOutOfRange { op: &'static str, row: usize, slot: u32, slots: usize },

    #[error(
        "{op}: row {row} reads block {block} through the block table, beyond the {blocks} blocks of the cache"
    )]
    BlockOutOfRange { op: &'static str, row: usize, block: u32, blocks: usize },

    #[error("{op}: index {index} at row {row} is out of range for {len} rows")]
    IndexOutOfRange { op: &'static str, row: usize, index: u32, len: usize },

    #[error("tensor of {dtype} {shape:?} needs {expected} bytes, got {got}")]
    ByteLength { dtype: DType, shape: Vec<usize>, expected: usize, got: usize },

    #[error("{what}: bytes {offset}..{offset}+{len} lie outside the {size} bytes available")]
    OutOfBounds { what: String, offset: usize, len: usize, size: usize },

    #[error("tensor shape {shape:?} overflows the address space")]
    ShapeOverflow { shape: Vec<usize> },

    #[error("{what} at byte offset {offset} is not aligned to {align} bytes")]
    Misaligned { what: String, offset: usize, align: usize },

    #[error("{op}: tensor `{tensor}` is a read-only mapping and cannot be written")]
    ReadOnly { op: &'static str, tensor: &'static str },

    #[error("{device}: out of memory allocating {bytes} bytes: {reason}")]
    OutOfMemory { device: String, bytes: usize, reason: String },

    #[error("{device}: {msg}")]
    Device { device: String, msg: String },

    #[error("{backend}: operation {op} is not supported: {reason}")]
    Unsupported { backend: &'static str, op: &'static str, reason: String },
}
