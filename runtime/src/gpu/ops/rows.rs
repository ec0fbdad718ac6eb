//! Row gathers and scatters: `embedding`, `gather_rows`, `scatter_add_rows` (`kernels-cuda/rows.cu`).

use super::super::{Device, DeviceInfo, Gpu, GpuStorage, LaunchCfg, dim};
use super::addr;
use crate::ops::{GatherDims, Linear, WeightScale};
use crate::{Backend, DType, Result, Tensor};

type T<D> = Tensor<GpuStorage<<D as Device>::Buffer>>;

/// `EmbeddingParams` of `kernels-cuda/params/rows.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct EmbeddingParams {
    pub out: u64,
    pub table: u64,
    pub ids: u64,
    pub scales: u64,
    pub status: u64,
    pub picked: u64,
    pub vocab: u64,
    pub cols: u64,
    pub block_rows: u32,
    pub block_cols: u32,
    pub scale: f32,
    pub pad: u32,
}

/// `GatherRowsParams` of `kernels-cuda/params/rows.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct GatherRowsParams {
    pub out: u64,
    pub src: u64,
    pub idx: u64,
    pub status: u64,
    pub picked: u64,
    pub rows: u64,
    pub cols: u64,
}

/// `ScatterAddRowsParams` of `kernels-cuda/params/rows.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ScatterAddRowsParams {
    pub dst: u64,
    pub idx: u64,
    pub src: u64,
    pub weights: u64,
    pub status: u64,
    pub rows: u64,
    pub picked: u64,
    pub cols: u64,
    pub rows_per_group: u64,
}

const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<EmbeddingParams>() == 80);
    assert!(offset_of!(EmbeddingParams, block_rows) == 64 && offset_of!(EmbeddingParams, scale) == 72);
    assert!(size_of::<GatherRowsParams>() == 56 && offset_of!(GatherRowsParams, cols) == 48);
    assert!(size_of::<ScatterAddRowsParams>() == 72);
    assert!(offset_of!(ScatterAddRowsParams, rows_per_group) == 64);
};

// ---------------------------------------------------------------------------------------------
// Launch heuristics

/// `ROW_THREADS` of rows.cu: the most threads of an embedding or gather block.
pub const ROW_THREADS: u32 = 256;
/// `SCATTER_THREADS` of rows.cu: the threads of a scatter_add_rows block.
pub const SCATTER_THREADS: u32 = 256;

/// The gather grid (embedding, gather_rows): one block per output row (grid-stride beyond the
/// grid limit), its threads one per 16-byte group of the row (one per element when the row is
/// not a whole number of groups), at least a warp and at most `ROW_THREADS`.
pub fn gather_launch(picked: usize, cols: usize, elem_bytes: usize, info: &DeviceInfo) -> Result<LaunchCfg> {
    let op = "gather";
    let per = (16 / elem_bytes.max(1)).max(1);
    let units = if cols.is_multiple_of(per) { cols / per } else { cols };
    let warp = info.warp_size.max(1) as usize;
    let threads = (units.div_ceil(warp) * warp).clamp(warp, ROW_THREADS as usize);
    let blocks = picked.min(info.max_grid[0] as usize);
    Ok(LaunchCfg::linear(dim(op, "blocks", blocks)?, dim(op, "threads", threads)?, 0))
}

/// A scatter_add_rows launch: the grid and the destination rows of each row group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScatterLaunch {
    pub cfg: LaunchCfg,
    pub rows_per_group: u64,
}

/// The scatter grid: x covers the columns (float4 groups when cols % 4 == 0) with
/// `SCATTER_THREADS` per block; y splits the destination rows into groups until there are about
/// two blocks per SM. Each block scans all of idx, so no more groups than that.
pub fn scatter_launch(rows: usize, cols: usize, info: &DeviceInfo) -> Result<ScatterLaunch> {
    let op = "scatter_add_rows";
    let units = if cols.is_multiple_of(4) { cols / 4 } else { cols };
    let col_blocks = units.div_ceil(SCATTER_THREADS as usize).clamp(1, info.max_grid[0] as usize);
    let target = 2 * info.sm_count.max(1) as usize;
    let groups = target.div_ceil(col_blocks).clamp(1, rows.max(1));
    let max_y = (info.max_grid[1] as usize).max(1);
    let rows_per_group = rows.div_ceil(groups).max(rows.div_ceil(max_y)).max(1);
    let grid_y = rows.div_ceil(rows_per_group).max(1);
    Ok(ScatterLaunch {
        cfg: LaunchCfg {
            grid: [dim(op, "column blocks", col_blocks)?, dim(op, "row groups", grid_y)?, 1],
            block: [SCATTER_THREADS, 1, 1],
            shared_bytes: 0,
        },
        rows_per_group: rows_per_group as u64,
    })
}

/// The embedding kernel for a table dtype, with a block scale of dtype `scale` (`None`: one
/// uniform scale).
fn embedding_kernel(table: DType, scale: Option<DType>) -> Option<&'static str> {
    use DType::*;
    Some(match (table, scale) {
        (F32, None) => "embedding_f32",
        (F16, None) => "embedding_f16",
        (BF16, None) => "embedding_bf16",
        (F8E4M3Fn, None) => "embedding_e4m3fn",
        (F8E4M3Fnuz, None) => "embedding_e4m3fnuz",
        (F8E5M2, None) => "embedding_e5m2",
        (F8E5M2Fnuz, None) => "embedding_e5m2fnuz",
        (F32, Some(F32)) => "embedding_f32_block_f32",
        (F16, Some(F32)) => "embedding_f16_block_f32",
        (BF16, Some(F32)) => "embedding_bf16_block_f32",
        (F8E4M3Fn, Some(F32)) => "embedding_e4m3fn_block_f32",
        (F8E4M3Fnuz, Some(F32)) => "embedding_e4m3fnuz_block_f32",
        (F8E5M2, Some(F32)) => "embedding_e5m2_block_f32",
        (F8E5M2Fnuz, Some(F32)) => "embedding_e5m2fnuz_block_f32",
        (F32, Some(BF16)) => "embedding_f32_block_bf16",
        (F16, Some(BF16)) => "embedding_f16_block_bf16",
        (BF16, Some(BF16)) => "embedding_bf16_block_bf16",
        (F8E4M3Fn, Some(BF16)) => "embedding_e4m3fn_block_bf16",
        (F8E4M3Fnuz, Some(BF16)) => "embedding_e4m3fnuz_block_bf16",
        (F8E5M2, Some(BF16)) => "embedding_e5m2_block_bf16",
        (F8E5M2Fnuz, Some(BF16)) => "embedding_e5m2fnuz_block_bf16",
        _ => return None,
    })
}

/// Every kernel name these launchers may use.
pub fn kernel_names() -> Vec<&'static str> {
    let mut names = vec!["gather_rows_f32", "scatter_add_rows_f32"];
    for w in DType::FLOATS {
        names.extend(
            [None, Some(DType::F32), Some(DType::BF16)].into_iter().filter_map(|s| embedding_kernel(w, s)),
        );
    }
    names
}

// ---------------------------------------------------------------------------------------------
// Launchers

pub(crate) fn embedding<D: Device>(
    g: &Gpu<D>,
    d: GatherDims,
    table: &Linear<GpuStorage<D::Buffer>>,
    ids: &T<D>,
    out: &mut T<D>,
) -> Result<()> {
    let op = "embedding";
    let w = table.weight.dtype();
    // Block edges beyond the table act like the table's own size (every index divides to 0), so
    // clamping them keeps the math and makes them fit the kernel's u32 fields.
    let (scale_dtype, scales, block_rows, block_cols, scale) = match &table.scale {
        WeightScale::None => (None, 0, 0, 0, 1.0),
        WeightScale::PerTensor(s) => (None, 0, 0, 0, *s),
        // One scale per token: the block scale of 1 x cols blocks (`[n]` and `[n, 1]` hold the
        // same n values).
        WeightScale::PerChannel(s) => (Some(s.dtype()), addr::<D>(s), 1, d.cols, 1.0),
        WeightScale::Block { block_rows, block_cols, scales } => (
            Some(scales.dtype()),
            addr::<D>(scales),
            (*block_rows).min(d.rows),
            (*block_cols).min(d.cols),
            1.0,
        ),
    };
    let name = embedding_kernel(w, scale_dtype).ok_or_else(|| super::unsupported(op, g.name()))?;
    let cfg = gather_launch(d.picked, d.cols, w.size(), g.device().info())?;
    let p = EmbeddingParams {
        out: addr::<D>(out),
        table: addr::<D>(&table.weight),
        ids: addr::<D>(ids),
        scales,
        status: g.status_address(),
        picked: d.picked as u64,
        vocab: d.rows as u64,
        cols: d.cols as u64,
        block_rows: dim(op, "block rows", block_rows)?,
        block_cols: dim(op, "block cols", block_cols)?,
        scale,
        pad: 0,
    };
    // SAFETY: the table is [vocab, cols] of the kernel's dtype, ids u32 [picked], out f32
    // [picked, cols], the scales (when the kernel reads them) [ceil(vocab / block_rows),
    // ceil(cols / block_cols)] of its scale dtype (`check_embedding`); the kernel reads only
    // table rows below vocab (it skips and reports larger ids) and writes only out; out is
    // borrowed mutably; status is the backend's live status word.
    unsafe { g.launch(name, cfg, &p) }
}

pub(crate) fn gather_rows<D: Device>(
    g: &Gpu<D>,
    d: GatherDims,
    src: &T<D>,
    idx: &T<D>,
    out: &mut T<D>,
) -> Result<()> {
    let cfg = gather_launch(d.picked, d.cols, 4, g.device().info())?;
    let p = GatherRowsParams {
        out: addr::<D>(out),
        src: addr::<D>(src),
        idx: addr::<D>(idx),
        status: g.status_address(),
        picked: d.picked as u64,
        rows: d.rows as u64,
        cols: d.cols as u64,
    };
    // SAFETY: src is f32 [rows, cols], idx u32 [picked], out f32 [picked, cols]
    // (`check_gather_rows`); the kernel reads only src rows below rows (it skips and reports
    // larger indices); out is borrowed mutably; status is the backend's live status word.
    unsafe { g.launch("gather_rows_f32", cfg, &p) }
}

pub(crate) fn scatter_add_rows<D: Device>(
    g: &Gpu<D>,
    d: GatherDims,
    dst: &mut T<D>,
    idx: &T<D>,
    src: &T<D>,
    weights: &T<D>,
) -> Result<()> {
    let launch = scatter_launch(d.rows, d.cols, g.device().info())?;
    let p = ScatterAddRowsParams {
        dst: addr::<D>(dst),
        idx: addr::<D>(idx),
        src: addr::<D>(src),
        weights: addr::<D>(weights),
        status: g.status_address(),
        rows: d.rows as u64,
        picked: d.picked as u64,
        cols: d.cols as u64,
        rows_per_group: launch.rows_per_group,
    };
    // SAFETY: dst is f32 [rows, cols], idx u32 [picked], src f32 [picked, cols], weights f32
    // [picked] (`check_scatter_add_rows`); the kernel writes only dst rows below rows (it skips
    // and reports larger indices); dst is borrowed mutably; status is the backend's live status
    // word.
    unsafe { g.launch("scatter_add_rows_f32", launch.cfg, &p) }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::super::test_h200 as h200;

    #[test]
    fn gather_threads_follow_the_row() {
        let info = h200();
        // A Llama 3 token: 4096 bf16 = 512 groups of 16 bytes: the most threads.
        assert_eq!(gather_launch(1, 4096, 2, &info).unwrap(), LaunchCfg::linear(1, 256, 0));
        // 17 f32: not whole groups, one thread per element, rounded up to a warp.
        assert_eq!(gather_launch(5, 17, 4, &info).unwrap(), LaunchCfg::linear(5, 32, 0));
        // 64 fp8: 4 groups, still a warp.
        assert_eq!(gather_launch(3, 64, 1, &info).unwrap(), LaunchCfg::linear(3, 32, 0));
        // Rows beyond the grid limit grid-stride.
        assert_eq!(gather_launch(usize::MAX, 1, 4, &info).unwrap().grid[0], info.max_grid[0]);
    }

    #[test]
    fn scatter_splits_rows_until_the_gpu_is_busy() {
        let info = h200();
        // Mixtral prefill combine: 4096 columns (4 blocks of 256 float4), 4096 tokens.
        let l = scatter_launch(4096, 4096, &info).unwrap();
        assert_eq!(l.cfg.grid, [4, 66, 1]);
        assert_eq!(l.rows_per_group, 63);
        assert!(u64::from(l.cfg.grid[1]) * l.rows_per_group >= 4096);
        // Decode: a handful of rows, one group per row.
        let l = scatter_launch(3, 4096, &info).unwrap();
        assert_eq!((l.cfg.grid, l.rows_per_group), ([4, 3, 1], 1));
        // Odd columns: one thread per element.
        let l = scatter_launch(1, 17, &info).unwrap();
        assert_eq!((l.cfg.grid, l.cfg.block, l.rows_per_group), ([1, 1, 1], [256, 1, 1], 1));
        // Rows beyond the grid's y limit: bigger groups.
        let l = scatter_launch(1 << 20, 1 << 20, &info).unwrap();
        assert!(l.cfg.grid[1] <= 65535);
        assert!(u64::from(l.cfg.grid[1]) * l.rows_per_group >= 1 << 20);
    }

    #[test]
    fn every_table_dtype_has_its_embedding_kernels() {
        for w in DType::FLOATS {
            let plain = embedding_kernel(w, None).unwrap();
            assert_eq!(plain, format!("embedding_{}", w.name()));
            for s in [DType::F32, DType::BF16] {
                assert_eq!(embedding_kernel(w, Some(s)).unwrap(), format!("{plain}_block_{}", s.name()));
            }
            assert_eq!(embedding_kernel(w, Some(DType::F16)), None);
        }
        assert_eq!(kernel_names().len(), 2 + 21);
    }
}
