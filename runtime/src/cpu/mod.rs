//! CPU backends. Both keep tensors in host memory (`HostStorage`), so a tensor made by one can be
//! passed to the other: the tests run the same inputs through both.

mod fast;
mod reference;

pub use fast::Fast;
pub use reference::Reference;

use crate::ops::AttnDims;
use crate::{Error, HostStorage, Result, Storage};

pub(crate) fn host_alloc(bytes: usize) -> Result<HostStorage> {
    HostStorage::zeroed(bytes)
}

/// Copies `bytes` into the first `bytes.len()` bytes of `dst` (a tensor's current shape may use
/// only the start of its storage).
pub(crate) fn host_write(dst: &mut HostStorage, bytes: &[u8]) -> Result<()> {
    let len = dst.len_bytes();
    let d = dst.bytes_mut().ok_or(Error::ReadOnly { op: "write", tensor: "dst" })?;
    if bytes.len() > len {
        return Err(Error::OutOfBounds { what: "write".into(), offset: 0, len: bytes.len(), size: len });
    }
    d[..bytes.len()].copy_from_slice(bytes);
    Ok(())
}

/// Copies the first `out.len()` bytes of `src` into `out`.
pub(crate) fn host_read(src: &HostStorage, out: &mut [u8]) -> Result<()> {
    let s = src.bytes();
    if out.len() > s.len() {
        return Err(Error::OutOfBounds { what: "read".into(), offset: 0, len: out.len(), size: s.len() });
    }
    out.copy_from_slice(&s[..out.len()]);
    Ok(())
}

/// `SlotOutOfRange` or `ContextOverflow` for the first row whose `(slot, position)` lies outside
/// the cache: the data-dependent check of `kv_store` and `attention`, made before anything is
/// written.
pub(crate) fn check_cache_rows(
    op: &'static str,
    d: AttnDims,
    slots: &[u32],
    positions: &[u32],
) -> Result<()> {
    for (row, (&slot, &pos)) in slots.iter().zip(positions).enumerate() {
        if slot as usize >= d.slots {
            return Err(Error::SlotOutOfRange { op, row, slot, slots: d.slots });
        }
        if pos as usize >= d.capacity {
            return Err(Error::ContextOverflow { op, row, pos, capacity: d.capacity });
        }
    }
    Ok(())
}

/// `IndexOutOfRange` for the first index that is not a row of the full tensor: the
/// data-dependent check of `gather_rows` and `scatter_add_rows`, made before anything is written.
pub(crate) fn check_indices(op: &'static str, idx: &[u32], len: usize) -> Result<()> {
    for (row, &index) in idx.iter().enumerate() {
        if index as usize >= len {
            return Err(Error::IndexOutOfRange { op, row, index, len });
        }
    }
    Ok(())
}
