//! The status word through which kernels report data-dependent errors.
//!
//! Layout (little-endian u32 words, mirrored by `mw::report` in `kernels-cuda/common.cuh`):
//! `[code, row, value, limit]` where `code = (op << 8) | kind`. The first report wins (the kernel
//! claims `code` with an atomic compare-and-swap from 0, then writes the other words), later ones
//! are dropped; the host reads the words after the queue is drained and clears them.

use crate::Error;

/// Bytes of the status buffer.
pub const STATUS_BYTES: usize = 16;

/// What went wrong (`kind`, the low byte of `code`).
pub const TOKEN_OUT_OF_RANGE: u32 = 1;
pub const SLOT_OUT_OF_RANGE: u32 = 2;
pub const CONTEXT_OVERFLOW: u32 = 3;
pub const INDEX_OUT_OF_RANGE: u32 = 4;
pub const BLOCK_OUT_OF_RANGE: u32 = 5;
pub const DUPLICATE_INDEX: u32 = 6;

/// Which op reported it (`op`, `code >> 8`).
pub const OP_EMBEDDING: u32 = 1;
pub const OP_KV_STORE: u32 = 2;
pub const OP_ATTENTION: u32 = 3;
pub const OP_GATHER_ROWS: u32 = 4;
pub const OP_SCATTER_ADD_ROWS: u32 = 5;
pub const OP_EXPERTS: u32 = 6;

fn op_name(op: u32) -> &'static str {
    match op {
        OP_EMBEDDING => "embedding",
        OP_KV_STORE => "kv_store",
        OP_ATTENTION => "attention",
        OP_GATHER_ROWS => "gather_rows",
        OP_SCATTER_ADD_ROWS => "scatter_add_rows",
        OP_EXPERTS => "experts",
        _ => "kernel",
    }
}

/// The error the status words hold, or `None` when no kernel reported one.
pub fn decode(bytes: &[u8; STATUS_BYTES]) -> Option<Error> {
    let w =
        |i: usize| u32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]]);
    let (code, row, value, limit) = (w(0), w(1) as usize, w(2), w(3) as usize);
    if code == 0 {
        return None;
    }
    let op = op_name(code >> 8);
    Some(match code & 0xff {
        TOKEN_OUT_OF_RANGE => Error::TokenOutOfRange { op, row, id: value, vocab: limit },
        SLOT_OUT_OF_RANGE => Error::SlotOutOfRange { op, row, slot: value, slots: limit },
        CONTEXT_OVERFLOW => Error::ContextOverflow { op, row, pos: value, capacity: limit },
        INDEX_OUT_OF_RANGE => Error::IndexOutOfRange { op, row, index: value, len: limit },
        BLOCK_OUT_OF_RANGE => Error::BlockOutOfRange { op, row, block: value, blocks: limit },
        DUPLICATE_INDEX => Error::Argument { op, msg: format!("row {row} picks expert {value} twice") },
        kind => {
            Error::Argument { op, msg: format!("kernel reported unknown error kind {kind} at row {row}") }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(w: [u32; 4]) -> [u8; STATUS_BYTES] {
        let mut b = [0u8; STATUS_BYTES];
        for (i, v) in w.iter().enumerate() {
            b[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    #[test]
    fn decodes_each_kind() {
        assert_eq!(decode(&words([0, 5, 6, 7])), None);
        assert_eq!(
            decode(&words([(OP_EMBEDDING << 8) | TOKEN_OUT_OF_RANGE, 2, 1000, 999])),
            Some(Error::TokenOutOfRange { op: "embedding", row: 2, id: 1000, vocab: 999 })
        );
        assert_eq!(
            decode(&words([(OP_ATTENTION << 8) | CONTEXT_OVERFLOW, 1, 64, 64])),
            Some(Error::ContextOverflow { op: "attention", row: 1, pos: 64, capacity: 64 })
        );
        assert_eq!(
            decode(&words([(OP_KV_STORE << 8) | SLOT_OUT_OF_RANGE, 0, 4, 4])),
            Some(Error::SlotOutOfRange { op: "kv_store", row: 0, slot: 4, slots: 4 })
        );
        assert_eq!(
            decode(&words([(OP_GATHER_ROWS << 8) | INDEX_OUT_OF_RANGE, 3, 9, 9])),
            Some(Error::IndexOutOfRange { op: "gather_rows", row: 3, index: 9, len: 9 })
        );
        assert_eq!(
            decode(&words([(OP_ATTENTION << 8) | BLOCK_OUT_OF_RANGE, 2, 70, 64])),
            Some(Error::BlockOutOfRange { op: "attention", row: 2, block: 70, blocks: 64 })
        );
    }
}
