//! The per-element and per-row ops of `kernels-cuda/elementwise.cu`: `add_assign`, `silu_mul`,
//! `rms_norm`, `rope`.

use super::super::{Device, DeviceInfo, Gpu, GpuStorage, LaunchCfg, dim};
use super::addr;
use crate::ops::{RopeDims, RowsDims};
use crate::{Backend, DType, Error, Result, Rope, Tensor};

type T<D> = Tensor<GpuStorage<<D as Device>::Buffer>>;

/// `AddAssignParams` of `kernels-cuda/params/elementwise.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct AddAssignParams {
    pub x: u64,
    pub y: u64,
    pub n: u64,
}

/// `SiluMulParams` of `kernels-cuda/params/elementwise.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct SiluMulParams {
    pub out: u64,
    pub gate: u64,
    pub up: u64,
    pub n: u64,
}

/// `RmsNormParams` of `kernels-cuda/params/elementwise.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RmsNormParams {
    pub y: u64,
    pub x: u64,
    pub weight: u64,
    pub rows: u64,
    pub cols: u64,
    pub eps: f32,
    pub pad: u32,
}

/// `MW_ROPE_MAX_HALF` of `kernels-cuda/params/elementwise.h`: the most pairs (`head_dim / 2`) a
/// rope launch takes, its inverse frequencies travelling in the params.
pub const ROPE_MAX_HALF: usize = 256;

/// `RopeParams` of `kernels-cuda/params/elementwise.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RopeParams {
    pub x: u64,
    pub positions: u64,
    pub rows: u64,
    pub heads: u32,
    pub half: u32,
    pub heads_per_block: u32,
    pub pad: u32,
    pub inv_freq: [f64; ROPE_MAX_HALF],
}

const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<AddAssignParams>() == 24 && offset_of!(AddAssignParams, n) == 16);
    assert!(size_of::<SiluMulParams>() == 32 && offset_of!(SiluMulParams, n) == 24);
    assert!(size_of::<RmsNormParams>() == 48);
    assert!(offset_of!(RmsNormParams, cols) == 32 && offset_of!(RmsNormParams, eps) == 40);
    assert!(size_of::<RopeParams>() == 40 + 8 * ROPE_MAX_HALF);
    assert!(offset_of!(RopeParams, heads) == 24 && offset_of!(RopeParams, inv_freq) == 40);
};

// ---------------------------------------------------------------------------------------------
// Launch heuristics

/// Threads per block of the grid-stride element kernels.
pub const ELEMENT_THREADS: u32 = 256;
/// Enough blocks per SM to hide latency; more only adds scheduling.
const BLOCKS_PER_SM: u64 = 8;
/// Elements per thread per pass of `add_assign` and `silu_mul` (one float4).
const ELEMENT_VEC: u64 = 4;

/// Grid of a 1-D grid-stride kernel over `n` elements, `per_thread` elements per thread per pass.
pub fn element_grid(n: u64, per_thread: u64, sm_count: u32) -> u32 {
    let wanted = n.div_ceil(u64::from(ELEMENT_THREADS) * per_thread.max(1));
    let cap = u64::from(sm_count.max(1)) * BLOCKS_PER_SM;
    // At least one block; at most `cap`, which fits in u32 for any real SM count.
    wanted.clamp(1, cap) as u32
}

/// `NORM_THREADS` of elementwise.cu: the block of the one-block-per-row rms_norm (its
/// `block_sum` is sized for exactly this many threads).
pub const NORM_THREADS: u32 = 256;
/// `NORM_ROWS_PER_BLOCK` of elementwise.cu: warps (rows) per block of the warp-per-row variant.
pub const NORM_ROWS_PER_BLOCK: u32 = 4;
/// Rows of at most this many columns take a warp each (at most 32 elements, 8 float4, per lane
/// with 32-lane warps); longer rows take a block of `NORM_THREADS`.
pub const NORM_WARP_MAX_COLS: usize = 1024;

/// Which rms_norm kernel and grid: `(warp_per_row, cfg)`.
pub fn rms_norm_launch(rows: usize, cols: usize, info: &DeviceInfo) -> Result<(bool, LaunchCfg)> {
    let op = "rms_norm";
    let max_blocks = info.max_grid[0] as usize;
    if cols <= NORM_WARP_MAX_COLS {
        let blocks = rows.div_ceil(NORM_ROWS_PER_BLOCK as usize).min(max_blocks);
        let threads = NORM_ROWS_PER_BLOCK
            .checked_mul(info.warp_size)
            .ok_or_else(|| Error::Argument { op, msg: format!("warp of {} threads", info.warp_size) })?;
        Ok((true, LaunchCfg::linear(dim(op, "blocks", blocks)?, threads, 0)))
    } else {
        Ok((false, LaunchCfg::linear(dim(op, "blocks", rows.min(max_blocks))?, NORM_THREADS, 0)))
    }
}

/// `ROPE_THREADS` of elementwise.cu: the most threads of a rope block.
pub const ROPE_THREADS: u32 = 256;

/// A rope launch: the grid and the heads each block handles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeLaunch {
    pub cfg: LaunchCfg,
    pub heads_per_block: u32,
}

/// The rope grid: block x covers the `half` pairs (rounded up to a warp), block y as many rows as
/// fit in `ROPE_THREADS`; grid y splits the heads into chunks until there are about two blocks per
/// SM (each thread computes its angle once per row and chunk, so chunks only cost trig).
pub fn rope_launch(d: RopeDims, info: &DeviceInfo) -> Result<RopeLaunch> {
    let op = "rope";
    let half = d.head_dim / 2;
    if half == 0 || half > ROPE_MAX_HALF {
        return Err(Error::Argument {
            op,
            msg: format!("head_dim {} (the kernel takes 2..={})", d.head_dim, 2 * ROPE_MAX_HALF),
        });
    }
    let warp = info.warp_size.max(1) as usize;
    let tx = half.div_ceil(warp) * warp;
    let ty = (ROPE_THREADS as usize / tx).max(1);
    let row_blocks = d.rows.div_ceil(ty);
    let target = 2 * info.sm_count.max(1) as usize;
    let splits = target.div_ceil(row_blocks).clamp(1, d.heads);
    let max_y = (info.max_grid[1] as usize).max(1);
    let heads_per_block = d.heads.div_ceil(splits).max(d.heads.div_ceil(max_y));
    let grid_y = d.heads.div_ceil(heads_per_block);
    let grid_x = row_blocks.min(info.max_grid[0] as usize);
    Ok(RopeLaunch {
        cfg: LaunchCfg {
            grid: [dim(op, "row blocks", grid_x)?, dim(op, "head chunks", grid_y)?, 1],
            block: [dim(op, "pairs", tx)?, dim(op, "rows per block", ty)?, 1],
            shared_bytes: 0,
        },
        heads_per_block: dim(op, "heads per block", heads_per_block)?,
    })
}

/// The rms_norm kernel for a weight dtype.
fn rms_norm_kernel(weight: DType, warp: bool) -> Option<&'static str> {
    Some(match (weight, warp) {
        (DType::F32, false) => "rms_norm_f32_f32",
        (DType::F16, false) => "rms_norm_f32_f16",
        (DType::BF16, false) => "rms_norm_f32_bf16",
        (DType::F8E4M3Fn, false) => "rms_norm_f32_e4m3fn",
        (DType::F8E4M3Fnuz, false) => "rms_norm_f32_e4m3fnuz",
        (DType::F8E5M2, false) => "rms_norm_f32_e5m2",
        (DType::F8E5M2Fnuz, false) => "rms_norm_f32_e5m2fnuz",
        (DType::F32, true) => "rms_norm_f32_f32_warp",
        (DType::F16, true) => "rms_norm_f32_f16_warp",
        (DType::BF16, true) => "rms_norm_f32_bf16_warp",
        (DType::F8E4M3Fn, true) => "rms_norm_f32_e4m3fn_warp",
        (DType::F8E4M3Fnuz, true) => "rms_norm_f32_e4m3fnuz_warp",
        (DType::F8E5M2, true) => "rms_norm_f32_e5m2_warp",
        (DType::F8E5M2Fnuz, true) => "rms_norm_f32_e5m2fnuz_warp",
        (DType::U32, _) => return None,
    })
}

/// Every kernel name these launchers may use.
pub fn kernel_names() -> Vec<&'static str> {
    let mut names = vec!["add_assign_f32", "silu_mul_f32", "rope_f32"];
    for w in DType::FLOATS {
        names.extend([false, true].into_iter().filter_map(|warp| rms_norm_kernel(w, warp)));
    }
    names
}

// ---------------------------------------------------------------------------------------------
// Launchers

pub(crate) fn add_assign<D: Device>(g: &Gpu<D>, d: RowsDims, x: &mut T<D>, y: &T<D>) -> Result<()> {
    let n = d.rows as u64 * d.cols as u64;
    let p = AddAssignParams { x: addr::<D>(x), y: addr::<D>(y), n };
    let grid = element_grid(n, ELEMENT_VEC, g.device().info().sm_count);
    let cfg = LaunchCfg::linear(grid, ELEMENT_THREADS, 0);
    // SAFETY: x and y are f32 tensors of rows x cols elements (checked by `check_same_f32`), so
    // the n elements the kernel touches lie inside both buffers; x is borrowed mutably.
    unsafe { g.launch("add_assign_f32", cfg, &p) }
}

pub(crate) fn silu_mul<D: Device>(
    g: &Gpu<D>,
    d: RowsDims,
    gate: &T<D>,
    up: &T<D>,
    out: &mut T<D>,
) -> Result<()> {
    let n = d.rows as u64 * d.cols as u64;
    let p = SiluMulParams { out: addr::<D>(out), gate: addr::<D>(gate), up: addr::<D>(up), n };
    let grid = element_grid(n, ELEMENT_VEC, g.device().info().sm_count);
    let cfg = LaunchCfg::linear(grid, ELEMENT_THREADS, 0);
    // SAFETY: gate, up and out are f32 tensors of rows x cols elements (`check_same_f32`), so the
    // n elements the kernel touches lie inside all three; out is borrowed mutably, so it is
    // neither of the inputs.
    unsafe { g.launch("silu_mul_f32", cfg, &p) }
}

pub(crate) fn rms_norm<D: Device>(
    g: &Gpu<D>,
    d: RowsDims,
    x: &T<D>,
    weight: &T<D>,
    eps: f32,
    y: &mut T<D>,
) -> Result<()> {
    let (warp, cfg) = rms_norm_launch(d.rows, d.cols, g.device().info())?;
    let name =
        rms_norm_kernel(weight.dtype(), warp).ok_or_else(|| super::unsupported("rms_norm", g.name()))?;
    let p = RmsNormParams {
        y: addr::<D>(y),
        x: addr::<D>(x),
        weight: addr::<D>(weight),
        rows: d.rows as u64,
        cols: d.cols as u64,
        eps,
        pad: 0,
    };
    // SAFETY: x and y are f32 [rows, cols] and weight [cols] of the kernel's dtype
    // (`check_rms_norm`), so every row the kernel reads and writes lies inside its buffer; y is
    // borrowed mutably; the block has the kernel's expected size (`rms_norm_launch`).
    unsafe { g.launch(name, cfg, &p) }
}

pub(crate) fn rope<D: Device>(
    g: &Gpu<D>,
    d: RopeDims,
    x: &mut T<D>,
    positions: &T<D>,
    rope: &Rope,
) -> Result<()> {
    let half = d.head_dim / 2;
    if half > ROPE_MAX_HALF {
        return Err(Error::Unsupported {
            backend: g.name(),
            op: "rope",
            reason: format!("head_dim {} (the kernel takes at most {})", d.head_dim, 2 * ROPE_MAX_HALF),
        });
    }
    let launch = rope_launch(d, g.device().info())?;
    let mut inv_freq = [0f64; ROPE_MAX_HALF];
    // `rope_launch` checked half <= ROPE_MAX_HALF; check_rope that head_dim = rope.head_dim.
    for (slot, f) in inv_freq.iter_mut().zip(rope.inv_freq()) {
        *slot = f;
    }
    let p = RopeParams {
        x: addr::<D>(x),
        positions: addr::<D>(positions),
        rows: d.rows as u64,
        heads: dim("rope", "heads", d.heads)?,
        half: dim("rope", "head_dim / 2", half)?,
        heads_per_block: launch.heads_per_block,
        pad: 0,
        inv_freq,
    };
    // SAFETY: x is f32 [rows, heads, head_dim] and positions u32 [rows] (`check_rope`), so every
    // element the kernel touches lies inside them; x is borrowed mutably; the block has at most
    // ROPE_THREADS threads (`rope_launch`).
    unsafe { g.launch("rope_f32", launch.cfg, &p) }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::super::test_h200 as h200;

    #[test]
    fn element_grid_covers_small_and_caps_large() {
        assert_eq!(element_grid(1, 1, 132), 1);
        assert_eq!(element_grid(256, 1, 132), 1);
        assert_eq!(element_grid(257, 1, 132), 2);
        assert_eq!(element_grid(1024, 4, 132), 1);
        assert_eq!(element_grid(1025, 4, 132), 2);
        assert_eq!(element_grid(1 << 40, 1, 132), 132 * 8);
        assert_eq!(element_grid(1 << 40, 4, 0), 8);
    }

    #[test]
    fn rms_norm_takes_a_warp_per_short_row_and_a_block_per_long_one() {
        let info = h200();
        let (warp, cfg) = rms_norm_launch(5, 1024, &info).unwrap();
        assert!(warp);
        assert_eq!((cfg.grid, cfg.block), ([2, 1, 1], [128, 1, 1]));
        let (warp, cfg) = rms_norm_launch(1, 4096, &info).unwrap();
        assert!(!warp);
        assert_eq!((cfg.grid, cfg.block), ([1, 1, 1], [NORM_THREADS, 1, 1]));
        let (_, cfg) = rms_norm_launch(usize::MAX / 2, 16384, &info).unwrap();
        assert_eq!(cfg.grid[0], info.max_grid[0]);
        let wide = DeviceInfo { warp_size: 64, ..h200() };
        assert_eq!(rms_norm_launch(3, 17, &wide).unwrap().1.block, [256, 1, 1]);
    }

    #[test]
    fn rope_splits_heads_until_the_gpu_is_busy() {
        let info = h200();
        // Decode: one row of 32 heads of 128: 64 pairs, four rows per block; 32 chunks of a head.
        let l = rope_launch(RopeDims { rows: 1, heads: 32, head_dim: 128 }, &info).unwrap();
        assert_eq!(l.cfg.block, [64, 4, 1]);
        assert_eq!(l.cfg.grid, [1, 32, 1]);
        assert_eq!(l.heads_per_block, 1);
        // Prefill: plenty of row blocks, all heads in one chunk.
        let l = rope_launch(RopeDims { rows: 8192, heads: 32, head_dim: 128 }, &info).unwrap();
        assert_eq!(l.cfg.grid, [2048, 1, 1]);
        assert_eq!(l.heads_per_block, 32);
        // Odd sizes: 3 pairs take one warp; the chunks cover every head.
        let l = rope_launch(RopeDims { rows: 3, heads: 7, head_dim: 6 }, &info).unwrap();
        assert_eq!(l.cfg.block, [32, 8, 1]);
        assert!(l.cfg.grid[1] * l.heads_per_block >= 7);
        // The longest head, and one too long.
        let l = rope_launch(RopeDims { rows: 2, heads: 1, head_dim: 512 }, &info).unwrap();
        assert_eq!(l.cfg.block, [256, 1, 1]);
        assert!(matches!(
            rope_launch(RopeDims { rows: 2, heads: 1, head_dim: 514 }, &info),
            Err(Error::Argument { .. })
        ));
    }

    #[test]
    fn every_float_weight_has_both_rms_norm_kernels() {
        for w in DType::FLOATS {
            let block = rms_norm_kernel(w, false).unwrap();
            assert_eq!(block, format!("rms_norm_f32_{}", w.name()));
            assert_eq!(rms_norm_kernel(w, true).unwrap(), format!("{block}_warp"));
        }
        assert_eq!(rms_norm_kernel(DType::U32, false), None);
        assert_eq!(kernel_names().len(), 3 + 14);
    }
}
