//! The per-element and per-row ops of `kernels-cuda/elementwise.cu`: `add_assign`, `silu_mul`,
//! `rms_norm`, `rope`.

use super::super::{Device, Gpu, GpuStorage, LaunchCfg};
use super::addr;
use crate::ops::{RopeDims, RowsDims};
use crate::{Backend, Result, Rope, Tensor};

type T<D> = Tensor<GpuStorage<<D as Device>::Buffer>>;

/// `AddAssignParams` of `kernels-cuda/params/elementwise.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct AddAssignParams {
    pub x: u64,
    pub y: u64,
    pub n: u64,
}

/// Threads per block of the grid-stride element kernels.
pub const ELEMENT_THREADS: u32 = 256;
/// Enough blocks per SM to hide latency; more only adds scheduling.
const BLOCKS_PER_SM: u64 = 8;

/// Grid of a 1-D grid-stride kernel over `n` elements, `per_thread` elements per thread per pass.
pub fn element_grid(n: u64, per_thread: u64, sm_count: u32) -> u32 {
    let wanted = n.div_ceil(u64::from(ELEMENT_THREADS) * per_thread.max(1));
    let cap = u64::from(sm_count.max(1)) * BLOCKS_PER_SM;
    // At least one block; at most `cap`, which fits in u32 for any real SM count.
    wanted.clamp(1, cap) as u32
}

pub(crate) fn add_assign<D: Device>(g: &Gpu<D>, d: RowsDims, x: &mut T<D>, y: &T<D>) -> Result<()> {
    let n = d.rows as u64 * d.cols as u64;
    let p = AddAssignParams { x: addr::<D>(x), y: addr::<D>(y), n };
    let cfg = LaunchCfg::linear(element_grid(n, 1, g.device().info().sm_count), ELEMENT_THREADS, 0);
    // SAFETY: x and y are f32 tensors of rows x cols elements (checked by `check_same_f32`), so
    // the n elements the kernel touches lie inside both buffers; x is borrowed mutably.
    unsafe { g.launch("add_assign_f32", cfg, &p) }
}

pub(crate) fn silu_mul<D: Device>(
    g: &Gpu<D>,
    _d: RowsDims,
    _gate: &T<D>,
    _up: &T<D>,
    _out: &mut T<D>,
) -> Result<()> {
    Err(super::unsupported("silu_mul", g.name()))
}

pub(crate) fn rms_norm<D: Device>(
    g: &Gpu<D>,
    _d: RowsDims,
    _x: &T<D>,
    _weight: &T<D>,
    _eps: f32,
    _y: &mut T<D>,
) -> Result<()> {
    Err(super::unsupported("rms_norm", g.name()))
}

pub(crate) fn rope<D: Device>(
    g: &Gpu<D>,
    _d: RopeDims,
    _x: &mut T<D>,
    _positions: &T<D>,
    _rope: &Rope,
) -> Result<()> {
    Err(super::unsupported("rope", g.name()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_grid_covers_small_and_caps_large() {
        assert_eq!(element_grid(1, 1, 132), 1);
        assert_eq!(element_grid(256, 1, 132), 1);
        assert_eq!(element_grid(257, 1, 132), 2);
        assert_eq!(element_grid(1 << 40, 1, 132), 132 * 8);
        assert_eq!(element_grid(1 << 40, 4, 0), 8);
    }

    #[test]
    fn params_are_three_words() {
        assert_eq!(std::mem::size_of::<AddAssignParams>(), 24);
        assert_eq!(std::mem::offset_of!(AddAssignParams, n), 16);
    }
}
