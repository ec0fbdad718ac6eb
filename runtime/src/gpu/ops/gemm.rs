//! `gemm`: the tiled matrix product of `kernels-cuda/gemm.cu` for prefill and large batches.
//! `linear::linear` hands it the shapes GEMV does not take (more than `GEMV_MAX_ROWS` rows).

use super::super::{Device, DeviceInfo, Gpu, GpuStorage, LaunchCfg, dim};
use super::linear::launch_linear;
use crate::ops::{Linear, LinearDims};
use crate::{Result, Tensor};

type T<D> = Tensor<GpuStorage<<D as Device>::Buffer>>;

/// `TILE_M`, `TILE_N` and `GEMM_THREADS` of gemm.cu.
pub const TILE_M: usize = 64;
pub const TILE_N: usize = 64;
pub const GEMM_THREADS: u32 = 256;

/// The GEMM grid: one block per TILE_N x TILE_M output tile.
pub fn gemm_launch(m: usize, n: usize, info: &DeviceInfo) -> Result<LaunchCfg> {
    let op = "linear";
    let (gx, gy) = (n.div_ceil(TILE_N), m.div_ceil(TILE_M));
    if gx > info.max_grid[0] as usize || gy > info.max_grid[1] as usize {
        return Err(crate::Error::Argument {
            op,
            msg: format!("{m} x {n} outputs need a grid of {gx} x {gy} tiles, beyond {:?}", info.max_grid),
        });
    }
    Ok(LaunchCfg {
        grid: [dim(op, "column tiles", gx)?, dim(op, "row tiles", gy)?, 1],
        block: [GEMM_THREADS, 1, 1],
        shared_bytes: 0,
    })
}

pub(crate) fn gemm<D: Device>(
    g: &Gpu<D>,
    d: LinearDims,
    x: &T<D>,
    w: &Linear<GpuStorage<D::Buffer>>,
    y: &mut T<D>,
) -> Result<()> {
    let cfg = gemm_launch(d.m, d.n, g.device().info())?;
    launch_linear(g, d, x, w, y, ("gemm", None), cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_covers_every_output() {
        let info = super::super::test_h200();
        assert_eq!(gemm_launch(17, 3, &info).unwrap().grid, [1, 1, 1]);
        assert_eq!(gemm_launch(512, 4096, &info).unwrap().grid, [64, 8, 1]);
        assert_eq!(gemm_launch(65, 129, &info).unwrap().grid, [3, 2, 1]);
        assert!(gemm_launch(65536 * 64 + 1, 1, &info).is_err());
    }
}
