//! `gemm`: the tiled matrix product of `kernels-cuda/gemm.cu` for prefill and large batches.
//! `linear::linear` hands it the shapes GEMV does not take (more than `GEMV_MAX_ROWS` rows).

use super::super::{Device, DeviceInfo, Gpu, GpuStorage, LaunchCfg, dim};
use super::addr;
use super::linear::{LinearParams, kernel_name, weight_params, with_f32_x};
use crate::ops::{Linear, LinearDims};
use crate::{Backend, DType, Result, Tensor};

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
    let op = "linear";
    let (scale_dtype, scales, block_rows, block_cols, scale) = weight_params::<D>(d, w)?;
    let name = kernel_name("gemm", w.weight.dtype(), scale_dtype, None)
        .ok_or_else(|| super::unsupported(op, g.name()))?;
    let cfg = gemm_launch(d.m, d.n, g.device().info())?;
    let y_addr = addr::<D>(y);
    let y_dtype = match y.dtype() {
        DType::BF16 => 1,
        DType::F16 => 2,
        _ => 0,
    };
    with_f32_x(g, d, x, |x_addr| {
        let p = LinearParams {
            y: y_addr,
            x: x_addr,
            weight: addr::<D>(&w.weight),
            scales,
            m: d.m as u64,
            n: d.n as u64,
            k: d.k as u64,
            block_rows,
            block_cols,
            scale,
            y_dtype,
        };
        // SAFETY: as for the GEMV: the checks of `check_linear` bound every element the kernel
        // touches (it bounds-checks each tile against m, n and k); y is borrowed mutably.
        unsafe { g.launch(name, cfg, &p) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_covers_every_output() {
        let info = DeviceInfo {
            name: "test".into(),
            arch: (9, 0),
            warp_size: 32,
            sm_count: 132,
            max_shared_per_block: 227 * 1024,
            max_threads_per_block: 1024,
            max_grid: [i32::MAX as u32, 65535, 65535],
            total_memory: 1 << 40,
        };
        assert_eq!(gemm_launch(17, 3, &info).unwrap().grid, [1, 1, 1]);
        assert_eq!(gemm_launch(512, 4096, &info).unwrap().grid, [64, 8, 1]);
        assert_eq!(gemm_launch(65, 129, &info).unwrap().grid, [3, 2, 1]);
        assert!(gemm_launch(65536 * 64 + 1, 1, &info).is_err());
    }
}
