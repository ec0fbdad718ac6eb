//! `gemm`: the matrix product for prefill and large batches. `linear::linear` hands it the shapes
//! GEMV does not take (more than `GEMV_MAX_ROWS` rows); [`gemm_path`] picks the kernel: the
//! tensor-core GEMM of `kernels-cuda/gemm_tc.cu` where its preconditions and accuracy contract hold,
//! or, on AMD matrix cores, its twin on MFMA (`kernels-cuda/gemm_mfma.cu`), else the CUDA-core GEMM
//! of `kernels-cuda/gemm.cu` (f32 weights, odd k, odd block scales, GPUs before sm_80 or without
//! MFMA); [`gemm_kernel`] sends gemm_tc.cu's shapes to the wgmma GEMM of `kernels-cuda/gemm_wg.cu`
//! on sm_90 where [`Gpu::set_gemm_warpgroup`] asks for it.

use super::super::{Device, DeviceInfo, Gpu, GpuStorage, LaunchCfg, Vendor, dim};
use super::linear::launch_linear;
use crate::ops::{Linear, LinearDims};
use crate::{DType, Result, Tensor};

type T<D> = Tensor<GpuStorage<<D as Device>::Buffer>>;

/// `TILE_M`, `TILE_N` and `GEMM_THREADS` of gemm.cu.
pub const TILE_M: usize = 64;
pub const TILE_N: usize = 64;
pub const GEMM_THREADS: u32 = 256;

/// `TILE_M`, `TILE_N`, `TILE_K` and `WARPS_M * WARPS_N` of gemm_tc.cu.
pub const TC_TILE_M: usize = 64;
pub const TC_TILE_N: usize = 64;
pub const TC_TILE_K: usize = 32;
pub const TC_WARPS: u32 = 4;

/// `TILE_M`, `TILE_N`, `THREADS` and `TILE_K` of gemm_wg.cu (two warpgroups of 64 rows, one
/// m64n128 accumulator set each).
pub const WG_TILE_M: usize = 128;
pub const WG_TILE_N: usize = 128;
pub const WG_THREADS: u32 = 256;
pub const WG_TILE_K: usize = 32;

/// `TILE_M`, `TILE_N` and `THREADS` of gemm_mfma.cu (four wavefronts of 64 lanes).
pub const MFMA_TILE_M: usize = 64;
pub const MFMA_TILE_N: usize = 128;
pub const MFMA_THREADS: u32 = 256;

/// The AMD gfx targets whose matrix cores run gemm_mfma.cu (`v_mfma_f32_16x16x16_bf16`: CDNA2,
/// CDNA3, CDNA3+; mfma.cuh compiles the instruction for exactly these).
pub const MFMA_TARGETS: &[&str] = &["gfx90a", "gfx940", "gfx941", "gfx942", "gfx950"];

/// `SHARED_BYTES<W>` of gemm_wg.cu: two buffers of the weight tile's bf16 parts (two for f16
/// weights, else one) and x's three, TILE_K columns each.
pub fn wg_shared_bytes(weight: DType) -> u32 {
    let parts = if weight == DType::F16 { 2 } else { 1 };
    (2 * (parts * WG_TILE_N + 3 * WG_TILE_M) * WG_TILE_K * 2) as u32
}

/// Which GEMM kernel runs a `linear` of more than `GEMV_MAX_ROWS` rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmPath {
    /// `gemm_<w>[_block_<s>]` of gemm.cu: f32 FMAs, any shape and dtype.
    CudaCore,
    /// `gemm_tc_<w>[_block_<s>]` of gemm_tc.cu: mma.sync on bf16 parts, f32 accuracy.
    TensorCore,
    /// `gemm_wg_<w>[_block_<s>]` of gemm_wg.cu: gemm_tc.cu's contract on wgmma (sm_90a), where
    /// [`Gpu::set_gemm_warpgroup`] turned it on.
    Warpgroup,
    /// `gemm_mfma_<w>[_block_<s>]` of gemm_mfma.cu: gemm_tc.cu's contract on AMD's MFMA.
    MatrixCore,
}

/// Whether the device runs mma.sync m16n8k16 on bf16: NVIDIA sm_80 and newer, or the SIMT
/// emulator at warp 32, which emulates it exactly. Never an AMD GPU (gemm_tc.cu is not in the HIP
/// images: build/hip.rs) nor the warp-64 emulator that stands for one.
pub fn has_mma_bf16(info: &DeviceInfo) -> bool {
    match info.vendor {
        Vendor::Nvidia => info.warp_size == 32 && info.arch >= (8, 0),
        Vendor::Simt => info.warp_size == 32,
        Vendor::Amd => false,
    }
}

/// Whether the device runs wgmma (gemm_wg.cu): NVIDIA sm_90 (its sm_90a code; the `a` features do
/// not carry to later architectures), or the SIMT emulator at warp 32 (wgmma.cuh emulates it).
pub fn has_wgmma(info: &DeviceInfo) -> bool {
    match info.vendor {
        Vendor::Nvidia => info.warp_size == 32 && info.arch == (9, 0),
        Vendor::Simt => info.warp_size == 32,
        Vendor::Amd => false,
    }
}

/// Whether the device runs `v_mfma_f32_16x16x16_bf16` (gemm_mfma.cu): an AMD GPU at wave 64 whose
/// gfx target, the last parenthesised word of its name as the HIP backend writes it
/// (`AMD Instinct MI300X (gfx942)`, [`DeviceInfo::name`]), is one of [`MFMA_TARGETS`] (the arch
/// numbers cannot tell gfx90a from gfx906, which has no bf16 MFMA); or the SIMT emulator at warp 64,
/// which emulates it (mfma.cuh). Never NVIDIA.
pub fn has_mfma(info: &DeviceInfo) -> bool {
    match info.vendor {
        Vendor::Amd => {
            let target = info.name.rsplit_once('(').and_then(|(_, t)| t.strip_suffix(')'));
            info.warp_size == 64 && target.is_some_and(|t| MFMA_TARGETS.contains(&t))
        }
        Vendor::Simt => info.warp_size == 64,
        Vendor::Nvidia => false,
    }
}

/// The GEMM kernel `linear` runs for `d` on `info` with the warpgroup path `warpgroup` on or off
/// ([`Gpu::set_gemm_warpgroup`]): [`gemm_path`]'s, with gemm_tc.cu's shapes on wgmma where the
/// device has it.
pub fn gemm_kernel(
    d: LinearDims,
    weight: DType,
    blocks: Option<(usize, usize)>,
    info: &DeviceInfo,
    warpgroup: bool,
) -> GemmPath {
    match gemm_path(d, weight, blocks, info) {
        GemmPath::TensorCore if warpgroup && has_wgmma(info) => GemmPath::Warpgroup,
        path => path,
    }
}

/// The GEMM kernel for `d` with a `weight` of this dtype and `blocks` = (block_rows, block_cols)
/// of its block or per-channel scale (None for unscaled or per-tensor). The tensor-core path needs
/// a 16-bit or fp8 weight (f32 weights would need splitting too: left to gemm.cu), k a multiple of
/// a 16-byte word of the weight (8 of 16-bit, 16 of fp8), block scales whose k-blocks are whole
/// `TC_TILE_K` tiles (or span k), and mma hardware ([`GemmPath::TensorCore`]) or AMD matrix cores
/// ([`GemmPath::MatrixCore`], the same contract and k tile).
pub fn gemm_path(
    d: LinearDims,
    weight: DType,
    blocks: Option<(usize, usize)>,
    info: &DeviceInfo,
) -> GemmPath {
    let scales = blocks.is_none_or(|(_, bc)| bc >= d.k || bc.is_multiple_of(TC_TILE_K));
    if !(tc_words(d, weight) && scales) {
        GemmPath::CudaCore
    } else if has_mma_bf16(info) {
        GemmPath::TensorCore
    } else if has_mfma(info) {
        GemmPath::MatrixCore
    } else {
        GemmPath::CudaCore
    }
}

/// Whether the tensor-core kernels (gemm_tc.cu, gemv_tc.cu) take a `weight` of this dtype at `d`:
/// 16-bit or fp8 (f32 weights would need splitting too), k > 0 a multiple of a 16-byte word of it
/// (8 of 16-bit, 16 of fp8).
pub fn tc_words(d: LinearDims, weight: DType) -> bool {
    weight != DType::F32
        && DType::FLOATS.contains(&weight)
        && d.k > 0
        && d.k.is_multiple_of(16 / weight.size())
}

/// The grid of either GEMM: one block per output tile of `tile_m` x `tile_n`.
fn tile_grid(
    m: usize,
    n: usize,
    (tile_m, tile_n): (usize, usize),
    threads: u32,
    info: &DeviceInfo,
) -> Result<LaunchCfg> {
    let op = "linear";
    let (gx, gy) = (n.div_ceil(tile_n), m.div_ceil(tile_m));
    if gx > info.max_grid[0] as usize || gy > info.max_grid[1] as usize {
        return Err(crate::Error::Argument {
            op,
            msg: format!("{m} x {n} outputs need a grid of {gx} x {gy} tiles, beyond {:?}", info.max_grid),
        });
    }
    Ok(LaunchCfg {
        grid: [dim(op, "column tiles", gx)?, dim(op, "row tiles", gy)?, 1],
        block: [threads, 1, 1],
        shared_bytes: 0,
    })
}

/// The CUDA-core GEMM grid: one block per TILE_N x TILE_M output tile.
pub fn gemm_launch(m: usize, n: usize, info: &DeviceInfo) -> Result<LaunchCfg> {
    tile_grid(m, n, (TILE_M, TILE_N), GEMM_THREADS, info)
}

/// The tensor-core GEMM grid: one block of `TC_WARPS` warps per TC_TILE_N x TC_TILE_M tile.
pub fn gemm_tc_launch(m: usize, n: usize, info: &DeviceInfo) -> Result<LaunchCfg> {
    let threads = TC_WARPS.checked_mul(info.warp_size).ok_or_else(|| crate::Error::Argument {
        op: "linear",
        msg: format!("warp of {} threads", info.warp_size),
    })?;
    tile_grid(m, n, (TC_TILE_M, TC_TILE_N), threads, info)
}

/// The MFMA GEMM grid: one block of four wavefronts per MFMA_TILE_N x MFMA_TILE_M tile.
pub fn gemm_mfma_launch(m: usize, n: usize, info: &DeviceInfo) -> Result<LaunchCfg> {
    tile_grid(m, n, (MFMA_TILE_M, MFMA_TILE_N), MFMA_THREADS, info)
}

/// The warpgroup GEMM grid: one block of two warpgroups per WG_TILE_N x WG_TILE_M tile, with
/// its dynamic shared memory for a `weight` of this dtype.
pub fn gemm_wg_launch(m: usize, n: usize, weight: DType, info: &DeviceInfo) -> Result<LaunchCfg> {
    let mut cfg = tile_grid(m, n, (WG_TILE_M, WG_TILE_N), WG_THREADS, info)?;
    cfg.shared_bytes = wg_shared_bytes(weight);
    Ok(cfg)
}

/// The grid of the `experts` op's grouped GEMM on `path` (`gemm_experts_*`, `gemm_tc_experts_*`
/// or `gemm_mfma_experts_*`; the warpgroup path runs gemm_tc.cu's): the path's tiles over `n`
/// output features, and enough rows of tiles for `pairs` sorted rows split among at most `active`
/// experts, each expert's last tile partly empty: sum over e of ceil(rows_e / TILE_M) <=
/// ceil(pairs / TILE_M) + active - 1.
pub fn experts_gemm_launch(
    path: GemmPath,
    pairs: usize,
    active: usize,
    n: usize,
    info: &DeviceInfo,
) -> Result<LaunchCfg> {
    let tile_m = match path {
        GemmPath::CudaCore => TILE_M,
        GemmPath::TensorCore | GemmPath::Warpgroup => TC_TILE_M,
        GemmPath::MatrixCore => MFMA_TILE_M,
    };
    let m = (pairs.div_ceil(tile_m) + active.max(1) - 1) * tile_m;
    match path {
        GemmPath::CudaCore => gemm_launch(m, n, info),
        GemmPath::TensorCore | GemmPath::Warpgroup => gemm_tc_launch(m, n, info),
        GemmPath::MatrixCore => gemm_mfma_launch(m, n, info),
    }
}

pub(crate) fn gemm<D: Device>(
    g: &Gpu<D>,
    d: LinearDims,
    x: &T<D>,
    w: &Linear<GpuStorage<D::Buffer>>,
    y: &mut T<D>,
) -> Result<()> {
    let info = g.device().info();
    let (weight, blocks) = (w.weight.dtype(), super::linear::scale_blocks(d, &w.scale));
    match gemm_kernel(d, weight, blocks, info, g.gemm_warpgroup()) {
        GemmPath::Warpgroup => {
            launch_linear(g, d, x, w, y, ("gemm_wg", None), gemm_wg_launch(d.m, d.n, weight, info)?)
        }
        GemmPath::TensorCore => {
            launch_linear(g, d, x, w, y, ("gemm_tc", None), gemm_tc_launch(d.m, d.n, info)?)
        }
        GemmPath::MatrixCore => {
            launch_linear(g, d, x, w, y, ("gemm_mfma", None), gemm_mfma_launch(d.m, d.n, info)?)
        }
        GemmPath::CudaCore => launch_linear(g, d, x, w, y, ("gemm", None), gemm_launch(d.m, d.n, info)?),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(m: usize, n: usize, k: usize) -> LinearDims {
        LinearDims { m, n, k }
    }

    #[test]
    fn grid_covers_every_output() {
        let info = super::super::test_h200();
        assert_eq!(gemm_launch(17, 3, &info).unwrap().grid, [1, 1, 1]);
        assert_eq!(gemm_launch(512, 4096, &info).unwrap().grid, [64, 8, 1]);
        assert_eq!(gemm_launch(65, 129, &info).unwrap().grid, [3, 2, 1]);
        assert!(gemm_launch(65536 * 64 + 1, 1, &info).is_err());
        let tc = gemm_tc_launch(512, 14336, &info).unwrap();
        assert_eq!((tc.grid, tc.block), ([224, 8, 1], [128, 1, 1]));
        assert_eq!(gemm_tc_launch(17, 70, &info).unwrap().grid, [2, 1, 1]);
        assert!(gemm_tc_launch(65536 * 64 + 1, 1, &info).is_err());
    }

    #[test]
    fn experts_grid_holds_every_split_of_the_rows() {
        let info = super::super::test_h200();
        // 1024 pairs (512 rows, top 2) among 8 experts: 16 tiles of 64 rows, plus one partial
        // tile for each expert but one.
        let tc = experts_gemm_launch(GemmPath::TensorCore, 1024, 8, 14336, &info).unwrap();
        assert_eq!((tc.grid, tc.block), ([224, 23, 1], [128, 1, 1]));
        assert_eq!(experts_gemm_launch(GemmPath::Warpgroup, 1024, 8, 14336, &info).unwrap().grid, tc.grid);
        assert_eq!(experts_gemm_launch(GemmPath::CudaCore, 34, 2, 24, &info).unwrap().grid, [1, 2, 1]);
        let mf = experts_gemm_launch(GemmPath::MatrixCore, 65, 1, 4096, &info).unwrap();
        assert_eq!(mf.grid, [32, 2, 1]);
        // The bound is reached: 3 experts of 65, 65 and 62 rows take 2 + 2 + 1 tiles.
        assert_eq!(
            experts_gemm_launch(GemmPath::TensorCore, 65 + 65 + 62, 3, 64, &info).unwrap().grid[1],
            2 + 2 + 1
        );
    }

    #[test]
    fn warpgroup_only_on_sm_90_where_asked() {
        use GemmPath::{CudaCore, MatrixCore, TensorCore, Warpgroup};
        let h200 = super::super::test_h200();
        assert_eq!(h200.arch, (9, 0));
        let d = dims(512, 14336, 4096);
        assert_eq!(gemm_kernel(d, DType::BF16, None, &h200, true), Warpgroup);
        assert_eq!(gemm_kernel(d, DType::F8E4M3Fn, Some((128, 128)), &h200, true), Warpgroup);
        assert_eq!(gemm_kernel(d, DType::BF16, None, &h200, false), TensorCore);
        // Shapes gemm_tc.cu does not take stay on gemm.cu.
        assert_eq!(gemm_kernel(d, DType::F32, None, &h200, true), CudaCore);
        assert_eq!(gemm_kernel(dims(64, 64, 17), DType::BF16, None, &h200, true), CudaCore);
        assert_eq!(gemm_kernel(d, DType::BF16, Some((3, 5)), &h200, true), CudaCore);
        // sm_90a code runs on sm_90 only: not on Ampere, Ada or Blackwell.
        for arch in [(8, 0), (8, 9), (10, 0), (12, 0)] {
            let other = DeviceInfo { arch, ..h200.clone() };
            assert_eq!(gemm_kernel(d, DType::BF16, None, &other, true), TensorCore, "{arch:?}");
        }
        let emu = DeviceInfo { arch: (0, 0), vendor: Vendor::Simt, ..h200.clone() };
        assert_eq!(gemm_kernel(d, DType::BF16, None, &emu, true), Warpgroup);
        let wave64 = DeviceInfo { warp_size: 64, ..emu };
        assert_eq!(gemm_kernel(d, DType::BF16, None, &wave64, true), MatrixCore);
        let mi250 = DeviceInfo {
            name: "AMD Instinct MI250X (gfx90a)".into(),
            vendor: Vendor::Amd,
            arch: (9, 0),
            warp_size: 64,
            ..h200.clone()
        };
        assert_eq!(gemm_kernel(d, DType::BF16, None, &mi250, true), MatrixCore);
        // Grid and shared memory: 128 x 128 tiles, two warpgroups, 64 KB (80 KB for f16).
        let wg = gemm_wg_launch(512, 14336, DType::BF16, &h200).unwrap();
        assert_eq!((wg.grid, wg.block, wg.shared_bytes), ([112, 4, 1], [256, 1, 1], 64 * 1024));
        assert_eq!(gemm_wg_launch(17, 129, DType::F16, &h200).unwrap().shared_bytes, 80 * 1024);
        assert_eq!(gemm_wg_launch(129, 1, DType::F8E4M3Fn, &h200).unwrap().grid, [1, 2, 1]);
        assert!(gemm_wg_launch(65536 * 128 + 1, 1, DType::BF16, &h200).is_err());
    }

    #[test]
    fn tensor_cores_only_where_the_contract_holds() {
        use GemmPath::{CudaCore, TensorCore};
        let h200 = super::super::test_h200();
        let d = dims(512, 14336, 4096);
        for w in
            [DType::BF16, DType::F16, DType::F8E4M3Fn, DType::F8E4M3Fnuz, DType::F8E5M2, DType::F8E5M2Fnuz]
        {
            assert_eq!(gemm_path(d, w, None, &h200), TensorCore, "{w}");
            // 128 x 128 blocks and per-channel scales (1 x k).
            assert_eq!(gemm_path(d, w, Some((128, 128)), &h200), TensorCore, "{w}");
            assert_eq!(gemm_path(d, w, Some((1, 4096)), &h200), TensorCore, "{w}");
        }
        // f32 weights stay on CUDA cores.
        assert_eq!(gemm_path(d, DType::F32, None, &h200), CudaCore);
        // k not a multiple of a 16-byte word of the weight.
        for k in [1, 3, 17, 4097] {
            assert_eq!(gemm_path(dims(64, 64, k), DType::BF16, None, &h200), CudaCore, "k {k}");
        }
        assert_eq!(gemm_path(dims(64, 64, 40), DType::BF16, None, &h200), TensorCore);
        assert_eq!(gemm_path(dims(64, 64, 40), DType::F8E4M3Fn, None, &h200), CudaCore);
        assert_eq!(gemm_path(dims(64, 64, 48), DType::F8E4M3Fn, None, &h200), TensorCore);
        // Block scales whose k-blocks are not whole k tiles.
        assert_eq!(gemm_path(d, DType::BF16, Some((3, 5)), &h200), CudaCore);
        assert_eq!(gemm_path(d, DType::BF16, Some((1, 16)), &h200), CudaCore);
        assert_eq!(gemm_path(d, DType::BF16, Some((2, 32)), &h200), TensorCore);
        assert_eq!(gemm_path(dims(64, 64, 80), DType::BF16, Some((4, 96)), &h200), TensorCore);
        // No mma before sm_80, nor on a warp-64 device; the SIMT emulator (arch 0.0) has it.
        let turing = DeviceInfo { arch: (7, 5), ..h200.clone() };
        assert_eq!(gemm_path(d, DType::BF16, None, &turing), CudaCore);
        let ampere = DeviceInfo { arch: (8, 0), ..h200.clone() };
        assert_eq!(gemm_path(d, DType::BF16, None, &ampere), TensorCore);
        let emu = DeviceInfo { arch: (0, 0), vendor: Vendor::Simt, ..h200.clone() };
        assert_eq!(gemm_path(d, DType::BF16, None, &emu), TensorCore);
        let wave64 = DeviceInfo { warp_size: 64, ..emu };
        assert_eq!(gemm_path(d, DType::BF16, None, &wave64), GemmPath::MatrixCore);
        // An AMD GPU never takes mma.sync, whatever its arch numbers or wave size.
        let mi300 = DeviceInfo { vendor: Vendor::Amd, arch: (9, 4), warp_size: 64, ..h200.clone() };
        assert_eq!(gemm_path(d, DType::BF16, None, &mi300), CudaCore);
        let amd32 = DeviceInfo { warp_size: 32, ..mi300 };
        assert_eq!(gemm_path(d, DType::BF16, None, &amd32), CudaCore);
    }

    #[test]
    fn matrix_cores_on_mfma_targets_only() {
        use GemmPath::{CudaCore, MatrixCore};
        let h200 = super::super::test_h200();
        let amd = |name: &str, arch| DeviceInfo {
            name: name.into(),
            vendor: Vendor::Amd,
            arch,
            warp_size: 64,
            ..h200.clone()
        };
        let d = dims(512, 14336, 4096);
        for (name, arch) in [
            ("AMD Instinct MI300X (gfx942)", (9, 4)),
            ("AMD Instinct MI250X (gfx90a)", (9, 0)),
            ("AMD Instinct MI355X (gfx950)", (9, 5)),
        ] {
            let gpu = amd(name, arch);
            assert!(has_mfma(&gpu), "{name}");
            for w in [DType::BF16, DType::F16, DType::F8E4M3Fnuz, DType::F8E5M2] {
                assert_eq!(gemm_path(d, w, None, &gpu), MatrixCore, "{name} {w}");
                assert_eq!(gemm_path(d, w, Some((128, 128)), &gpu), MatrixCore, "{name} {w}");
            }
            // gemm_tc.cu's contract: f32 weights, odd k and odd blocks stay on gemm.cu.
            assert_eq!(gemm_path(d, DType::F32, None, &gpu), CudaCore);
            assert_eq!(gemm_path(dims(64, 64, 17), DType::BF16, None, &gpu), CudaCore);
            assert_eq!(gemm_path(d, DType::BF16, Some((3, 5)), &gpu), CudaCore);
        }
        // gfx906 reports arch (9, 0) like gfx90a but has no bf16 MFMA; RDNA is wave 32 and has WMMA,
        // not MFMA; a name without a target is not trusted.
        for gpu in [
            amd("AMD Instinct MI50 (gfx906)", (9, 0)),
            DeviceInfo { warp_size: 32, ..amd("AMD Radeon RX 7900 XTX (gfx1100)", (11, 0)) },
            amd("AMD Instinct MI300X", (9, 4)),
            amd("AMD Instinct MI300X (gfx942", (9, 4)),
        ] {
            assert!(!has_mfma(&gpu), "{}", gpu.name);
            assert_eq!(gemm_path(d, DType::BF16, None, &gpu), CudaCore, "{}", gpu.name);
        }
        assert!(!has_mfma(&h200));
        let wave64 = DeviceInfo { arch: (0, 0), vendor: Vendor::Simt, warp_size: 64, ..h200.clone() };
        assert!(has_mfma(&wave64));
        // Grid: 64-row, 128-column tiles of four wavefronts.
        let mf = gemm_mfma_launch(512, 14336, &wave64).unwrap();
        assert_eq!((mf.grid, mf.block, mf.shared_bytes), ([112, 8, 1], [256, 1, 1], 0));
        assert_eq!(gemm_mfma_launch(65, 129, &wave64).unwrap().grid, [2, 2, 1]);
        assert!(gemm_mfma_launch(65536 * 64 + 1, 1, &wave64).is_err());
    }
}
