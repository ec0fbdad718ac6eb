//! The memory-ceiling kernels of `kernels-cuda/stream.cu`: an SM-driven read and copy over raw
//! device buffers, for `memwall peak` on a GPU and the benches' ceiling. Not model ops: they take
//! device buffers, not tensors.

use super::super::{Device, DeviceInfo, Gpu, LaunchCfg, dim};
use crate::{Error, Result};

/// `StreamParams` of `kernels-cuda/params/stream.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct StreamParams {
    pub dst: u64,
    pub src: u64,
    pub sum: u64,
    pub vecs: u64,
}

const _: () = assert!(std::mem::size_of::<StreamParams>() == 32);

/// Bytes per vector: one 16-byte load (and store) per vector.
pub const STREAM_VEC_BYTES: usize = 16;
/// Threads per block (whole warps on every target).
pub const STREAM_THREADS: u32 = 256;
/// Blocks per SM of the grid: 2048 resident threads per SM on sm_80 and sm_90.
pub const STREAM_BLOCKS_PER_SM: u64 = 8;
/// `STREAM_UNROLL` of stream.cu: loads in flight per thread.
pub const STREAM_UNROLL: u64 = 4;

/// Every kernel name these launchers may use.
pub fn kernel_names() -> Vec<&'static str> {
    vec!["stream_read_u32", "stream_copy_u32"]
}

/// The grid over `vecs` vectors: enough blocks to fill every SM, fewer when the work is smaller
/// (each thread takes at least one unrolled group); never empty.
pub fn stream_grid(vecs: u64, info: &DeviceInfo) -> Result<LaunchCfg> {
    let per_block = u64::from(STREAM_THREADS) * STREAM_UNROLL;
    let full = u64::from(info.sm_count.max(1)) * STREAM_BLOCKS_PER_SM;
    let blocks = vecs.div_ceil(per_block).clamp(1, full.min(u64::from(info.max_grid[0]).max(1)));
    Ok(LaunchCfg::linear(dim("stream", "blocks", blocks as usize)?, STREAM_THREADS, 0))
}

/// Checks `bytes` for a stream kernel over buffers of the given lengths and addresses.
fn check(op: &'static str, bytes: usize, bufs: &[(&str, usize, u64)]) -> Result<u64> {
    let bad = |msg: String| Error::Argument { op, msg };
    if bytes == 0 || !bytes.is_multiple_of(STREAM_VEC_BYTES) {
        return Err(bad(format!("{bytes} bytes: a positive multiple of {STREAM_VEC_BYTES} is needed")));
    }
    for &(what, len, address) in bufs {
        if len < bytes {
            return Err(bad(format!("{what} holds {len} bytes, fewer than the {bytes} asked for")));
        }
        if !address.is_multiple_of(STREAM_VEC_BYTES as u64) {
            return Err(bad(format!("{what} at {address:#x} is not {STREAM_VEC_BYTES}-byte aligned")));
        }
    }
    Ok((bytes / STREAM_VEC_BYTES) as u64)
}

impl<D: Device> Gpu<D> {
    /// Queues the read of `src[..bytes]`: sets `sum[..4]` to the wrapping sum of its
    /// little-endian u32 words (every byte read once, by the SMs). `bytes` a multiple of 16.
    pub fn stream_read(&self, src: &D::Buffer, bytes: usize, sum: &mut D::Buffer) -> Result<()> {
        let op = "stream_read";
        let vecs = check(op, bytes, &[("src", D::len(src), D::address(src))])?;
        if D::len(sum) < 4 {
            return Err(Error::Argument {
                op,
                msg: format!("sum holds {} bytes, fewer than 4", D::len(sum)),
            });
        }
        self.device().write(sum, 0, &[0u8; 4])?;
        let p = StreamParams { dst: 0, src: D::address(src), sum: D::address(sum), vecs };
        let cfg = stream_grid(vecs, self.device().info())?;
        // SAFETY: `check` verified src holds 16 * vecs bytes at a 16-byte aligned address and sum
        // at least one word; the kernel reads only those and adds to sum[0]; sum is &mut.
        unsafe { self.launch("stream_read_u32", cfg, &p) }
    }

    /// Queues the SM copy of `src[..bytes]` to `dst[..bytes]`. `bytes` a multiple of 16.
    pub fn stream_copy(&self, dst: &mut D::Buffer, src: &D::Buffer, bytes: usize) -> Result<()> {
        let op = "stream_copy";
        let vecs = check(
            op,
            bytes,
            &[("dst", D::len(dst), D::address(dst)), ("src", D::len(src), D::address(src))],
        )?;
        let p = StreamParams { dst: D::address(dst), src: D::address(src), sum: 0, vecs };
        let cfg = stream_grid(vecs, self.device().info())?;
        // SAFETY: `check` verified both buffers hold 16 * vecs bytes at 16-byte aligned
        // addresses; they are distinct buffers (dst is &mut, src shared), so they do not overlap.
        unsafe { self.launch("stream_copy_u32", cfg, &p) }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_h200 as info;
    use super::*;

    #[test]
    fn the_grid_fills_the_device_and_shrinks_with_the_work() {
        let h200 = info();
        // 4 GiB of vectors: every SM gets STREAM_BLOCKS_PER_SM blocks.
        assert_eq!(stream_grid(1 << 28, &h200).unwrap().grid[0], 132 * 8);
        // One vector, or one unrolled group per thread of one block: one block.
        assert_eq!(stream_grid(1, &h200).unwrap().grid[0], 1);
        assert_eq!(stream_grid(1024, &h200).unwrap().grid[0], 1);
        assert_eq!(stream_grid(1025, &h200).unwrap().grid[0], 2);
        assert_eq!(stream_grid(0, &h200).unwrap().grid[0], 1);
    }

    #[test]
    fn sizes_must_be_whole_vectors_inside_the_buffers() {
        assert!(check("t", 0, &[]).is_err());
        assert!(check("t", 17, &[]).is_err());
        assert_eq!(check("t", 32, &[("a", 32, 256)]).unwrap(), 2);
        assert!(check("t", 48, &[("a", 32, 256)]).is_err());
        assert!(check("t", 16, &[("a", 32, 8)]).is_err());
    }
}
