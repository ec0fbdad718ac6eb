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

/// Zeroes the first `bytes` bytes of `dst`.
pub(crate) fn host_zero(dst: &mut HostStorage, bytes: usize) -> Result<()> {
    let len = dst.len_bytes();
    let d = dst.bytes_mut().ok_or(Error::ReadOnly { op: "zero", tensor: "dst" })?;
    if bytes > len {
        return Err(Error::OutOfBounds { what: "zero".into(), offset: 0, len: bytes, size: len });
    }
    d[..bytes].fill(0);
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

/// `SlotOutOfRange`, `ContextOverflow` or `BlockOutOfRange` for the first row whose `(slot,
/// position)` lies outside the cache: the data-dependent check of `kv_store` and `attention`,
/// made before anything is written. `table` is the block table `[slots, max_blocks]`; a row
/// needs the entry of its position's block (`kv_store`) or, with `through`, the entries of every
/// block up to it (`attention` reads positions `0..=pos`). Entries no row needs are not read.
pub(crate) fn check_cache_rows(
    op: &'static str,
    d: AttnDims,
    table: &[u32],
    slots: &[u32],
    positions: &[u32],
    through: bool,
) -> Result<()> {
    for (row, (&slot, &pos)) in slots.iter().zip(positions).enumerate() {
        if slot as usize >= d.slots {
            return Err(Error::SlotOutOfRange { op, row, slot, slots: d.slots });
        }
        if pos as usize >= d.capacity {
            return Err(Error::ContextOverflow { op, row, pos, capacity: d.capacity });
        }
        let last = pos as usize / d.block_size;
        let first = if through { 0 } else { last };
        let entries = &table[slot as usize * d.max_blocks..][first..=last];
        if let Some(&block) = entries.iter().find(|&&b| b as usize >= d.num_blocks) {
            return Err(Error::BlockOutOfRange { op, row, block, blocks: d.num_blocks });
        }
    }
    Ok(())
}

/// Offset (in elements) of position `pos` of `slot`, kv head `kv_head`, element 0, in a paged
/// cache: `((table[slot][pos / block_size] * block_size + pos % block_size) * kv_heads + kv_head)
/// * head_dim`. The entry must have been checked by [`check_cache_rows`].
#[inline(always)]
pub(crate) fn paged_offset(d: AttnDims, table: &[u32], slot: usize, pos: usize, kv_head: usize) -> usize {
    let block = table[slot * d.max_blocks + pos / d.block_size] as usize;
    ((block * d.block_size + pos % d.block_size) * d.kv_heads + kv_head) * d.head_dim
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
