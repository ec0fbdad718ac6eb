//! Selection over rows of logits: `router_topk`, `argmax`, `sample` (`kernels-cuda/select.cu`).

use super::super::{Device, DeviceInfo, Gpu, GpuStorage, LaunchCfg, dim};
use super::addr;
use crate::ops::{RowsDims, SamplingParams, TopKDims};
use crate::{Result, Tensor};

type T<D> = Tensor<GpuStorage<<D as Device>::Buffer>>;

/// `ArgmaxParams` of `kernels-cuda/params/select.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ArgmaxParams {
    pub logits: u64,
    pub out: u64,
    pub rows: u64,
    pub cols: u64,
}

/// `RouterParams` of `kernels-cuda/params/select.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RouterParams {
    pub logits: u64,
    pub ids: u64,
    pub weights: u64,
    pub rows: u64,
    pub experts: u64,
    pub k: u64,
}

/// `SampleParams` of `kernels-cuda/params/select.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct SampleParams {
    pub logits: u64,
    pub seeds: u64,
    pub steps: u64,
    pub out: u64,
    pub rows: u64,
    pub cols: u64,
    pub top_k: u64,
    pub temperature: f32,
    pub top_p: f32,
}

const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<ArgmaxParams>() == 32);
    assert!(size_of::<RouterParams>() == 48 && offset_of!(RouterParams, k) == 40);
    assert!(size_of::<SampleParams>() == 64 && offset_of!(SampleParams, top_p) == 60);
};

/// `SELECT_THREADS` of select.cu: the block of argmax and sample (one row per block).
pub const SELECT_THREADS: u32 = 256;
/// Threads (rows) per block of router_topk.
pub const ROUTER_THREADS: u32 = 64;

/// Every kernel name these launchers may use.
pub fn kernel_names() -> Vec<&'static str> {
    vec!["argmax_f32", "router_topk_f32", "sample_f32"]
}

/// One block per row, grid-striding beyond the grid limit.
pub fn row_blocks(rows: usize, info: &DeviceInfo) -> Result<LaunchCfg> {
    let blocks = rows.clamp(1, (info.max_grid[0] as usize).max(1));
    Ok(LaunchCfg::linear(dim("select", "rows", blocks)?, SELECT_THREADS, 0))
}

/// One thread per row.
pub fn router_launch(rows: usize, info: &DeviceInfo) -> Result<LaunchCfg> {
    let blocks = rows.div_ceil(ROUTER_THREADS as usize).max(1);
    if blocks > info.max_grid[0] as usize {
        return Err(crate::Error::Argument {
            op: "router_topk",
            msg: format!("{rows} rows exceed the grid"),
        });
    }
    Ok(LaunchCfg::linear(dim("router_topk", "blocks", blocks)?, ROUTER_THREADS, 0))
}

pub(crate) fn router_topk<D: Device>(
    g: &Gpu<D>,
    d: TopKDims,
    logits: &T<D>,
    ids: &mut T<D>,
    weights: &mut T<D>,
) -> Result<()> {
    let p = RouterParams {
        logits: addr::<D>(logits),
        ids: addr::<D>(ids),
        weights: addr::<D>(weights),
        rows: d.rows as u64,
        experts: d.experts as u64,
        k: d.k as u64,
    };
    let cfg = router_launch(d.rows, g.device().info())?;
    // SAFETY: `check_router_topk` checked logits f32 [rows, experts], ids u32 and weights f32
    // [rows, k] with 1 <= k <= experts; the kernel touches only those; both outputs are &mut.
    unsafe { g.launch("router_topk_f32", cfg, &p) }
}

pub(crate) fn argmax<D: Device>(g: &Gpu<D>, d: RowsDims, logits: &T<D>, out: &mut T<D>) -> Result<()> {
    let p = ArgmaxParams {
        logits: addr::<D>(logits),
        out: addr::<D>(out),
        rows: d.rows as u64,
        cols: d.cols as u64,
    };
    let cfg = row_blocks(d.rows, g.device().info())?;
    // SAFETY: `check_pick` checked logits f32 [rows, cols] and out u32 [rows]; out is &mut.
    unsafe { g.launch("argmax_f32", cfg, &p) }
}

pub(crate) fn sample<D: Device>(
    g: &Gpu<D>,
    d: RowsDims,
    logits: &T<D>,
    params: &SamplingParams,
    seeds: &T<D>,
    steps: &T<D>,
    out: &mut T<D>,
) -> Result<()> {
    let p = SampleParams {
        logits: addr::<D>(logits),
        seeds: addr::<D>(seeds),
        steps: addr::<D>(steps),
        out: addr::<D>(out),
        rows: d.rows as u64,
        cols: d.cols as u64,
        top_k: params.top_k as u64,
        temperature: params.temperature,
        top_p: params.top_p,
    };
    let cfg = row_blocks(d.rows, g.device().info())?;
    // SAFETY: the sample check checked logits f32 [rows, cols], seeds, steps and out u32 [rows],
    // and the sampling params; out is &mut.
    unsafe { g.launch("sample_f32", cfg, &p) }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::super::test_h200 as info;

    #[test]
    fn grids() {
        assert_eq!(row_blocks(1, &info()).unwrap().grid[0], 1);
        assert_eq!(row_blocks(512, &info()).unwrap().grid[0], 512);
        assert_eq!(router_launch(65, &info()).unwrap().grid[0], 2);
        let mut small = info();
        small.max_grid[0] = 7;
        assert_eq!(row_blocks(100, &small).unwrap().grid[0], 7);
        assert!(router_launch(64 * 7 + 1, &small).is_err());
    }
}
