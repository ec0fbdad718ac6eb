//! `linear`: GEMV for decode (`kernels-cuda/gemv.cu`, at most [`GEMV_MAX_ROWS`] rows; or, where
//! [`Gpu::set_gemv_tensor_core_rows`] asks, the batched GEMV on matrix units, [`GemvMatrix`]:
//! `kernels-cuda/gemv_tc.cu` on NVIDIA, `kernels-cuda/gemv_mfma.cu` on AMD) and the
//! GEMMs for prefill ([`super::gemm`]: tensor cores, `kernels-cuda/gemm_tc.cu`, or CUDA cores,
//! `kernels-cuda/gemm.cu`); all take the params struct and the weight/scale plumbing of this module
//! (`kernels-cuda/params/linear.h`). Also `gate_up_silu`: the fused gate/up GEMV of `gemv.cu` for
//! decode rows, composed from `linear` and `silu_mul` above them.

use super::super::{Device, DeviceInfo, Gpu, GpuStorage, LaunchCfg, dim};
use super::addr;
use crate::ops::{Linear, LinearDims, WeightScale};
use crate::{Backend, DType, Error, Result, Tensor};

type T<D> = Tensor<GpuStorage<<D as Device>::Buffer>>;

/// The most rows (tokens) one GEMV launch takes; more go to GEMM.
pub const GEMV_MAX_ROWS: usize = 16;
/// The row tiles the GEMV kernels are compiled for (`_r<R>`).
pub const GEMV_ROW_TILES: [usize; 3] = [1, 4, 16];
/// The row tiles the fused `gate_up_silu` kernels are compiled for. Above 4 rows the composed path
/// runs (two GEMVs and silu_mul: the same weight bytes): the GEMV's 16-row tile is bound by issue,
/// not memory (gemv.cu), so fusing saves nothing there, and its two-matrix form spilled registers
/// inside the chunk loop.
pub const GATE_UP_ROW_TILES: [usize; 2] = [1, 4];
/// The row tiles the fused `qkv` kernels are compiled for (one: batch-1 decode).
pub const QKV_ROW_TILES: [usize; 1] = [1];
/// The row tiles of `gemv_j4` (four output features per warp; [`Gpu::set_gemv_warp_rows`]).
pub const GEMV_J4_ROW_TILES: [usize; 1] = [4];
/// Output features per warp of `gemv_j4` (`J4` of gemv.cu).
pub const GEMV_J4_FEATURES: usize = 4;
/// The row tiles of `gemv_tc` (gemv_tc.cu: one or two n8 fragments of tokens).
pub const GEMV_TC_ROW_TILES: [usize; 2] = [8, 16];
/// The row tiles of `gemv_mfma` (gemv_mfma.cu: the MFMA's 16 columns of tokens).
pub const GEMV_MFMA_ROW_TILES: [usize; 1] = [16];
/// `FEATURES`, `TILE_K` and `STEP_K` of gemv_tc.cu and of gemv_mfma.cu alike (output features
/// per block, columns of x per shared tile, columns per warp step for fp8 weights: four lanes'
/// 16-byte words), so [`gemv_tc_plan`] cuts k for both the same way; `THREADS` of each.
pub const GEMV_TC_FEATURES: usize = 128;
pub const GEMV_TC_THREADS: u32 = 128;
pub const GEMV_MFMA_THREADS: u32 = 256;
pub const GEMV_TC_TILE_K: usize = 128;
pub const GEMV_TC_STEP_K: usize = 64;
/// The most of the weight traffic `gemv_tc`'s split-K partials may add (written and read back:
/// 8 splits m / (k sizeof(w)) of it).
const GEMV_TC_PARTIAL_SHARE: f64 = 0.25;
/// Blocks per SM `gemv_tc_plan` aims the grid at (a first guess: benches/gpu measures).
const GEMV_TC_BLOCKS_PER_SM: usize = 2;
/// `GEMV_WARPS` of gemv.cu: warps (output features) per block.
pub const GEMV_WARPS: u32 = 4;
/// Blocks per SM beyond which a grid-stride GEMV gains nothing.
const GEMV_BLOCKS_PER_SM: usize = 32;

/// `LinearParams` of `kernels-cuda/params/linear.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct LinearParams {
    pub y: u64,
    pub x: u64,
    pub weight: u64,
    pub scales: u64,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub block_rows: u32,
    pub block_cols: u32,
    pub scale: f32,
    pub y_dtype: u32,
}

/// `WidenParams` of `kernels-cuda/params/linear.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct WidenParams {
    pub out: u64,
    pub x: u64,
    pub n: u64,
}

/// `GateUpParams` of `kernels-cuda/params/linear.h`: the gate projection's `LinearParams` (its `y`
/// the f32 out) and the up weight, scaled alike.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct GateUpParams {
    pub gate: LinearParams,
    pub up: u64,
    pub up_scales: u64,
    pub up_scale: f32,
    pub pad: u32,
}

/// `QkvParams` of `kernels-cuda/params/linear.h`: three GEMVs over one x, the grid cut into runs
/// of blocks (`blocks[0]` for part 0, `blocks[1]` for part 1, the rest for part 2).
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct QkvParams {
    pub part: [LinearParams; 3],
    pub blocks: [u32; 2],
}

/// `GemvTcParams` of `kernels-cuda/params/linear.h`: `lin` on tensor cores, k in `splits` runs of
/// `split_cols` columns, the splits' sums added through `partials` by the last block to arrive
/// (`arrivals`: one counter per block column, zero between launches).
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct GemvTcParams {
    pub lin: LinearParams,
    pub partials: u64,
    pub arrivals: u64,
    pub split_cols: u32,
    pub splits: u32,
}

const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<GemvTcParams>() == 96 && offset_of!(GemvTcParams, split_cols) == 88);
    assert!(size_of::<QkvParams>() == 224 && offset_of!(QkvParams, blocks) == 216);
    assert!(size_of::<GateUpParams>() == 96);
    assert!(offset_of!(GateUpParams, up) == 72 && offset_of!(GateUpParams, up_scale) == 88);
    assert!(size_of::<LinearParams>() == 72);
    assert!(offset_of!(LinearParams, block_rows) == 56 && offset_of!(LinearParams, y_dtype) == 68);
    assert!(size_of::<WidenParams>() == 24);
};

/// The file-name suffix of a float dtype in kernel names.
fn dtype_suffix(d: DType) -> Option<&'static str> {
    Some(match d {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F8E4M3Fn => "e4m3fn",
        DType::F8E4M3Fnuz => "e4m3fnuz",
        DType::F8E5M2 => "e5m2",
        DType::F8E5M2Fnuz => "e5m2fnuz",
        DType::U32 => return None,
    })
}

/// Kernel names come from a fixed set (`kernel_names`), so each is leaked once and reused.
fn intern(name: String) -> &'static str {
    use std::collections::HashSet;
    use std::sync::{Mutex, OnceLock};
    static NAMES: OnceLock<Mutex<HashSet<&'static str>>> = OnceLock::new();
    let mut set = NAMES.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&s) = set.get(name.as_str()) {
        return s;
    }
    let s: &'static str = Box::leak(name.into_boxed_str());
    set.insert(s);
    s
}

/// `gemv_<w>[_block_<s>]_r<rows>` (`family` "gemv"; "gate_up_silu" likewise), or `gemm_<w>[_block_<s>]`,
/// `gemm_tc_<w>[_block_<s>]`, `gemm_wg_<w>[_block_<s>]` and `gemm_mfma_<w>[_block_<s>]` (`family`
/// "gemm" / "gemm_tc" / "gemm_wg" / "gemm_mfma", `rows` None).
pub fn kernel_name(
    family: &str,
    weight: DType,
    block_scale: Option<DType>,
    rows: Option<usize>,
) -> Option<&'static str> {
    let w = dtype_suffix(weight)?;
    let s = match block_scale {
        None => String::new(),
        Some(DType::F32) => "_block_f32".into(),
        Some(DType::BF16) => "_block_bf16".into(),
        Some(_) => return None,
    };
    let r = rows.map_or(String::new(), |r| format!("_r{r}"));
    Some(intern(format!("{family}_{w}{s}{r}")))
}

/// The smallest of `tiles` (ascending row tiles of a kernel family) that holds `m` rows.
pub fn row_tile(tiles: &[usize], m: usize) -> Option<usize> {
    tiles.iter().copied().find(|&r| r >= m)
}

/// The GEMV grid: one warp per output feature, capped where grid-striding takes over.
pub fn gemv_launch(n: usize, info: &DeviceInfo) -> Result<LaunchCfg> {
    let op = "linear";
    let threads = GEMV_WARPS
        .checked_mul(info.warp_size)
        .ok_or_else(|| Error::Argument { op, msg: format!("warp of {} threads", info.warp_size) })?;
    let cap = (info.sm_count.max(1) as usize * GEMV_BLOCKS_PER_SM).min(info.max_grid[0] as usize);
    let blocks = n.div_ceil(GEMV_WARPS as usize).clamp(1, cap.max(1));
    Ok(LaunchCfg::linear(dim(op, "blocks", blocks)?, threads, 0))
}

/// Every kernel name the linear launchers may use.
pub fn kernel_names() -> Vec<&'static str> {
    let mut names = vec!["linear_x_f32_bf16", "linear_x_f32_f16"];
    for w in DType::FLOATS {
        for s in [None, Some(DType::F32), Some(DType::BF16)] {
            names.extend(GEMV_ROW_TILES.iter().filter_map(|&r| kernel_name("gemv", w, s, Some(r))));
            names
                .extend(GATE_UP_ROW_TILES.iter().filter_map(|&r| kernel_name("gate_up_silu", w, s, Some(r))));
            names.extend(QKV_ROW_TILES.iter().filter_map(|&r| kernel_name("qkv", w, s, Some(r))));
            names.extend(GEMV_J4_ROW_TILES.iter().filter_map(|&r| kernel_name("gemv_j4", w, s, Some(r))));
            names.extend(kernel_name("gemm", w, s, None));
            if w != DType::F32 {
                names.extend(kernel_name("gemm_tc", w, s, None));
                names.extend(kernel_name("gemm_wg", w, s, None));
                names.extend(kernel_name("gemm_mfma", w, s, None));
                for kernel in [GemvMatrix::TensorCore, GemvMatrix::MatrixCore] {
                    let tiles = kernel.row_tiles().iter();
                    names.extend(tiles.filter_map(|&r| kernel_name(kernel.family(), w, s, Some(r))));
                }
            }
        }
    }
    names
}

/// The weight side of `LinearParams`: `(block scale dtype, scales, block_rows, block_cols, scale)`.
/// A per-channel scale is the block scale of 1 x k blocks; block edges beyond the matrix act like
/// the matrix's size, so they are clamped to fit the u32 fields. The block-scale kernels index
/// their scale grid with 32-bit row and column numbers (`Blocks` of linear.cuh), so n and k must
/// fit in 32 bits there.
pub(crate) fn weight_params<D: Device>(
    d: LinearDims,
    w: &Linear<GpuStorage<D::Buffer>>,
) -> Result<WeightParams> {
    let op = "linear";
    let blocks = |scales: &T<D>, rows: usize, cols: usize| -> Result<_> {
        dim(op, "n (block-scaled)", d.n)?;
        dim(op, "k (block-scaled)", d.k)?;
        Ok((
            Some(scales.dtype()),
            addr::<D>(scales),
            dim(op, "block rows", rows)?,
            dim(op, "block cols", cols)?,
            1.0,
        ))
    };
    match &w.scale {
        WeightScale::None => Ok((None, 0, 0, 0, 1.0)),
        WeightScale::PerTensor(s) => Ok((None, 0, 0, 0, *s)),
        WeightScale::PerChannel(s) => blocks(s, 1, d.k),
        WeightScale::Block { block_rows, block_cols, scales } => {
            blocks(scales, (*block_rows).min(d.n), (*block_cols).min(d.k))
        }
    }
}

/// `weight_params`' tuple: `(block scale dtype, scales, block_rows, block_cols, scale)`.
type WeightParams = (Option<DType>, u64, u32, u32, f32);

impl LinearParams {
    /// The params of `d` over device addresses `x` (f32) and `weight`, the weight side `ws`
    /// (`weight_params`), and y at `y` in `MW_Y_*` dtype `y_dtype`.
    fn new(d: LinearDims, x: u64, weight: u64, ws: WeightParams, (y, y_dtype): (u64, u32)) -> Self {
        let (_, scales, block_rows, block_cols, scale) = ws;
        LinearParams {
            y,
            x,
            weight,
            scales,
            m: d.m as u64,
            n: d.n as u64,
            k: d.k as u64,
            block_rows,
            block_cols,
            scale,
            y_dtype,
        }
    }
}

/// The tensor-core kernels read x and the weight in 16-byte words: an error naming `what` where
/// either address is not 16-byte aligned (device buffers are 256-byte aligned, so this only
/// guards the contract).
fn words_aligned(what: &str, x: u64, weight: u64) -> Result<()> {
    if x.is_multiple_of(16) && weight.is_multiple_of(16) {
        return Ok(());
    }
    Err(Error::Argument {
        op: "linear",
        msg: format!("{what} needs 16-byte aligned x ({x:#x}) and weight ({weight:#x})"),
    })
}

/// The kernel that widens 16-bit `x` to f32 (`linear_x_f32_<t>`), None for f32 x.
fn widen_kernel(x: DType) -> Result<Option<&'static str>> {
    match x {
        DType::F32 => Ok(None),
        DType::BF16 => Ok(Some("linear_x_f32_bf16")),
        DType::F16 => Ok(Some("linear_x_f32_f16")),
        other => {
            Err(Error::DType { op: "linear", tensor: "x", got: other, allowed: DType::ACTIVATIONS.to_vec() })
        }
    }
}

/// `MW_Y_*` of params/linear.h.
fn y_code(y: DType) -> u32 {
    match y {
        DType::BF16 => 1,
        DType::F16 => 2,
        _ => 0,
    }
}

/// Runs `f` with the device address of `x` as f32: `x` itself, or a scratch copy widened from
/// bf16 / f16 by `linear_x_f32_<t>`.
pub(crate) fn with_f32_x<D: Device, R>(
    g: &Gpu<D>,
    d: LinearDims,
    x: &T<D>,
    f: impl FnOnce(u64) -> Result<R>,
) -> Result<R> {
    let Some(name) = widen_kernel(x.dtype())? else { return f(addr::<D>(x)) };
    g.with_scratch("linear_x", &[d.m * d.k * 4], |at| {
        widen_x(g, d, x, name, at[0])?;
        f(at[0])
    })
}

/// Widens the 16-bit `x` [m, k] into f32 at `out` (scratch of at least m k f32 the caller holds)
/// with `linear_x_f32_<t>` (`name`).
fn widen_x<D: Device>(g: &Gpu<D>, d: LinearDims, x: &T<D>, name: &'static str, out: u64) -> Result<()> {
    let n = d.m * d.k;
    let p = WidenParams { out, x: addr::<D>(x), n: n as u64 };
    let blocks = super::elementwise::element_grid(n as u64, 1, g.device().info().sm_count);
    let cfg = LaunchCfg::linear(blocks, super::elementwise::ELEMENT_THREADS, 0);
    // SAFETY: x holds m * k elements of its 16-bit dtype (checked by `check_linear`); the caller
    // holds n f32 at `out` until the launches it queues after this one have run.
    unsafe { g.launch(name, cfg, &p) }
}

/// The batched-decode GEMV on a device's matrix units ([`Gpu::set_gemv_tensor_core_rows`]): one
/// contract, accuracy bound and split-K plan ([`gemv_tc_plan`]), one kernel per vendor's fragments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvMatrix {
    /// `gemv_tc_<w>[_block_<s>]_r<R>` of gemv_tc.cu: mma.sync m16n8k16 (NVIDIA sm_80 and newer,
    /// the warp-32 emulator).
    TensorCore,
    /// `gemv_mfma_<w>[_block_<s>]_r16` of gemv_mfma.cu: v_mfma_f32_16x16x16_bf16 (AMD CDNA, the
    /// warp-64 emulator).
    MatrixCore,
}

impl GemvMatrix {
    /// The kernel `info`'s matrix units run, if any ([`super::gemm::has_mma_bf16`],
    /// [`super::gemm::has_mfma`]).
    pub fn of(info: &DeviceInfo) -> Option<Self> {
        if super::gemm::has_mma_bf16(info) {
            Some(Self::TensorCore)
        } else if super::gemm::has_mfma(info) {
            Some(Self::MatrixCore)
        } else {
            None
        }
    }

    /// The kernel names' family.
    pub fn family(self) -> &'static str {
        match self {
            Self::TensorCore => "gemv_tc",
            Self::MatrixCore => "gemv_mfma",
        }
    }

    /// The row tiles (`_r<R>`) it is compiled for.
    pub fn row_tiles(self) -> &'static [usize] {
        match self {
            Self::TensorCore => &GEMV_TC_ROW_TILES,
            Self::MatrixCore => &GEMV_MFMA_ROW_TILES,
        }
    }

    /// Threads per block.
    pub fn threads(self) -> u32 {
        match self {
            Self::TensorCore => GEMV_TC_THREADS,
            Self::MatrixCore => GEMV_MFMA_THREADS,
        }
    }
}

/// Whether the batched GEMV on matrix units ([`GemvMatrix`]: gemv_tc.cu or gemv_mfma.cu) can run
/// `d` (at most `GEMV_MAX_ROWS` rows) with a `weight` of this dtype and `blocks` = (block_rows,
/// block_cols) of its block or per-channel scale (None for unscaled or per-tensor): a 16-bit or
/// fp8 weight, k a multiple of a 16-byte word of it, block scales whose k-blocks are whole
/// `GEMV_TC_STEP_K` steps (or span k), n and k below 2^32, and a device with such units
/// ([`GemvMatrix::of`]).
pub fn gemv_tc_applies(
    d: LinearDims,
    weight: DType,
    blocks: Option<(usize, usize)>,
    info: &DeviceInfo,
) -> bool {
    let words = super::gemm::tc_words(d, weight);
    let scales = blocks.is_none_or(|(_, bc)| bc >= d.k || bc.is_multiple_of(GEMV_TC_STEP_K));
    let fits = u32::try_from(d.n).is_ok() && u32::try_from(d.k).is_ok();
    (1..=GEMV_MAX_ROWS).contains(&d.m) && GemvMatrix::of(info).is_some() && words && scales && fits
}

/// The batched matrix-unit GEMV's launch for `d` (where [`gemv_tc_applies`]; gemv_tc.cu or
/// gemv_mfma.cu, [`GemvMatrix::of`]): `(cfg, split_cols, splits)`. The grid
/// is ceil(n / GEMV_TC_FEATURES) blocks of features by `splits` runs of k, as many as bring it
/// to about `GEMV_TC_BLOCKS_PER_SM` blocks per SM, no more than k has tiles, and no more than
/// keep the partials' traffic (8 splits m / (k sizeof(w)) of the weight's) within
/// `GEMV_TC_PARTIAL_SHARE`. Each run is whole tiles of `GEMV_TC_TILE_K` columns, and whole
/// k-blocks of `block_cols` where that is below k.
pub fn gemv_tc_plan(
    d: LinearDims,
    weight: DType,
    block_cols: Option<usize>,
    info: &DeviceInfo,
) -> Result<(LaunchCfg, u32, u32)> {
    let op = "linear";
    let kernel = GemvMatrix::of(info).ok_or_else(|| Error::Argument {
        op,
        msg: format!("{} has neither mma.sync nor MFMA units", info.name),
    })?;
    let features = d.n.div_ceil(GEMV_TC_FEATURES).max(1);
    let tiles = d.k.div_ceil(GEMV_TC_TILE_K).max(1);
    let want = (info.sm_count.max(1) as usize * GEMV_TC_BLOCKS_PER_SM).div_ceil(features);
    let traffic_cap = GEMV_TC_PARTIAL_SHARE * (d.k * weight.size()) as f64 / (8 * d.m.max(1)) as f64;
    let splits = want.min(tiles).min(traffic_cap as usize).max(1);
    // Tiles per run: a multiple of the tiles of one k-block (bc a multiple of the 64-column step,
    // so lcm(TILE_K, bc) / TILE_K tiles) where blocks are narrower than k.
    let mut per_run = tiles.div_ceil(splits);
    if let Some(bc) = block_cols.filter(|&bc| bc < d.k) {
        let unit = bc / gcd(bc, GEMV_TC_TILE_K);
        per_run = per_run.div_ceil(unit) * unit;
    }
    let splits = tiles.div_ceil(per_run);
    let cfg = LaunchCfg {
        grid: [dim(op, "feature blocks", features)?, dim(op, "k splits", splits)?, 1],
        block: [kernel.threads(), 1, 1],
        shared_bytes: 0,
    };
    if cfg.grid[0] > info.max_grid[0] || cfg.grid[1] > info.max_grid[1] {
        return Err(Error::Argument {
            op,
            msg: format!("tensor-core GEMV grid {:?} beyond {:?}", cfg.grid, info.max_grid),
        });
    }
    Ok((cfg, dim(op, "split columns", per_run * GEMV_TC_TILE_K)?, cfg.grid[1]))
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// `(block_rows, block_cols)` of a block or per-channel scale; None for none or per tensor.
pub(crate) fn scale_blocks<B>(d: LinearDims, scale: &WeightScale<B>) -> Option<(usize, usize)> {
    match scale {
        WeightScale::None | WeightScale::PerTensor(_) => None,
        WeightScale::PerChannel(_) => Some((1, d.k)),
        WeightScale::Block { block_rows, block_cols, .. } => Some((*block_rows, *block_cols)),
    }
}

/// `linear` on `gemv_tc_<w>[_block_<s>]_r<R>` or `gemv_mfma_<w>[_block_<s>]_r16` (where
/// [`gemv_tc_applies`]; [`GemvMatrix::of`] the device): one scratch holds the arrival counters,
/// the splits' partials and x widened to f32 where it is 16-bit.
fn gemv_tc<D: Device>(
    g: &Gpu<D>,
    d: LinearDims,
    x: &T<D>,
    w: &Linear<GpuStorage<D::Buffer>>,
    y: &mut T<D>,
) -> Result<()> {
    let op = "linear";
    let kernel = GemvMatrix::of(g.device().info()).ok_or_else(|| super::unsupported(op, g.name()))?;
    let rows = row_tile(kernel.row_tiles(), d.m).ok_or_else(|| super::unsupported(op, g.name()))?;
    let ws = weight_params::<D>(d, w)?;
    let name = kernel_name(kernel.family(), w.weight.dtype(), ws.0, Some(rows))
        .ok_or_else(|| super::unsupported(op, g.name()))?;
    let blocks = scale_blocks(d, &w.scale).map(|(_, bc)| bc);
    let (cfg, split_cols, splits) = gemv_tc_plan(d, w.weight.dtype(), blocks, g.device().info())?;
    let widen = widen_kernel(x.dtype())?;
    let split = splits > 1;
    let sizes = [
        if split { cfg.grid[0] as usize * 4 } else { 0 },
        if split { splits as usize * d.m * d.n * 4 } else { 0 },
        if widen.is_some() { d.m * d.k * 4 } else { 0 },
    ];
    let (y_addr, y_dtype, w_addr) = (addr::<D>(y), y_code(y.dtype()), addr::<D>(&w.weight));
    g.with_scratch("gemv_tc", &sizes, |at| {
        let x_addr = match widen {
            Some(name) => {
                widen_x(g, d, x, name, at[2])?;
                at[2]
            }
            None => addr::<D>(x),
        };
        words_aligned("tensor-core GEMV", x_addr, w_addr)?;
        let lin = LinearParams::new(d, x_addr, w_addr, ws, (y_addr, y_dtype));
        let (arrivals, partials) = if split { (at[0], at[1]) } else { (0, 0) };
        let p = GemvTcParams { lin, partials, arrivals, split_cols, splits };
        // SAFETY: `check_linear` and `check_float_weight` checked x [m, k] (f32 here), the weight
        // [n, k] of the kernel's dtype, its scales' shape and dtype, and y [m, n] of y_dtype;
        // `gemv_tc_applies` made k a multiple of a weight word's elements (the kernel reads whole
        // 16-byte words, aligned as checked above, each inside or outside the matrix) and the
        // kernel bounds every access by m <= R, n and k. With splits, it writes partials
        // [splits, m, n] f32 and one counter per block column, which `with_scratch` sized and
        // holds for this launch and whose counters the kernel returns to zero; y is borrowed
        // mutably.
        unsafe { g.launch(name, cfg, &p) }
    })
}

pub(crate) fn linear<D: Device>(
    g: &Gpu<D>,
    d: LinearDims,
    x: &T<D>,
    w: &Linear<GpuStorage<D::Buffer>>,
    y: &mut T<D>,
) -> Result<()> {
    if d.m > GEMV_MAX_ROWS {
        return super::gemm::gemm(g, d, x, w, y);
    }
    let info = g.device().info();
    if g.gemv_tensor_core_rows().is_some_and(|r| d.m >= r)
        && gemv_tc_applies(d, w.weight.dtype(), scale_blocks(d, &w.scale), info)
    {
        return gemv_tc(g, d, x, w, y);
    }
    let rows = row_tile(&GEMV_ROW_TILES, d.m).ok_or_else(|| super::unsupported("linear", g.name()))?;
    if g.gemv_warp_rows() == GEMV_J4_FEATURES && GEMV_J4_ROW_TILES.contains(&rows) {
        // One warp per group of four output features.
        let cfg = gemv_launch(d.n.div_ceil(GEMV_J4_FEATURES), info)?;
        return launch_linear(g, d, x, w, y, ("gemv_j4", Some(rows)), cfg);
    }
    launch_linear(g, d, x, w, y, ("gemv", Some(rows)), gemv_launch(d.n, info)?)
}

/// Launches kernel family `kernel` (`gemv` with its row tile, or `gemm` without) of the weight's
/// dtype and scale kind over `cfg`, with x widened to f32 first where it is 16-bit.
pub(crate) fn launch_linear<D: Device>(
    g: &Gpu<D>,
    d: LinearDims,
    x: &T<D>,
    w: &Linear<GpuStorage<D::Buffer>>,
    y: &mut T<D>,
    (family, rows): (&str, Option<usize>),
    cfg: LaunchCfg,
) -> Result<()> {
    let ws = weight_params::<D>(d, w)?;
    let name = kernel_name(family, w.weight.dtype(), ws.0, rows)
        .ok_or_else(|| super::unsupported("linear", g.name()))?;
    let y_addr = addr::<D>(y);
    let y_dtype = y_code(y.dtype());
    let w_addr = addr::<D>(&w.weight);
    with_f32_x(g, d, x, |x_addr| {
        if matches!(family, "gemm_tc" | "gemm_wg" | "gemm_mfma") {
            words_aligned("tensor-core GEMM", x_addr, w_addr)?;
        }
        let p = LinearParams::new(d, x_addr, w_addr, ws, (y_addr, y_dtype));
        // SAFETY: `check_linear` and `check_float_weight` checked x [m, k] (f32 here), the weight
        // [n, k] of the kernel's dtype, its scales' shape and dtype, and y [m, n] of y_dtype; both
        // kernels bound every element they touch by m, n and k, so each access is inside its
        // buffer (gemm_tc, gemm_wg, gemm_mfma: in 16-byte words, whole because `gemm_path` only picks them where k is a
        // multiple of a word's elements, and aligned as checked above); y is borrowed mutably.
        unsafe { g.launch(name, cfg, &p) }
    })
}

/// `gate_up_silu`: for at most 4 rows ([`GATE_UP_ROW_TILES`]) one `gate_up_silu_<w>[_block_<s>]_r<R>`
/// launch (gemv.cu: both weights and x read once, no intermediates); above, the composed path
/// (two `linear` into the scratch, then `silu_mul`), whose GEMMs read each weight once per 64 rows
/// anyway. `check_gate_up_silu` made gate and up the same shape and dtype and scaled alike, so one
/// kernel and one block shape serve both.
pub(crate) fn gate_up_silu<D: Device>(
    g: &Gpu<D>,
    d: LinearDims,
    x: &T<D>,
    w_gate: &Linear<GpuStorage<D::Buffer>>,
    w_up: &Linear<GpuStorage<D::Buffer>>,
    scratch: (&mut T<D>, &mut T<D>),
    out: &mut T<D>,
) -> Result<()> {
    let op = "gate_up_silu";
    let Some(rows) = row_tile(&GATE_UP_ROW_TILES, d.m) else {
        return crate::backend::gate_up_silu_composed(g, d, x, w_gate, w_up, scratch, out);
    };
    let gate_ws = weight_params::<D>(d, w_gate)?;
    let (scale_dtype, _, block_rows, block_cols, _) = gate_ws;
    let (up_dtype, up_scales, up_rows, up_cols, up_scale) = weight_params::<D>(d, w_up)?;
    if (up_dtype, up_rows, up_cols) != (scale_dtype, block_rows, block_cols) {
        return Err(Error::Argument { op, msg: "gate and up are not scaled alike".into() });
    }
    let name = kernel_name(op, w_gate.weight.dtype(), scale_dtype, Some(rows))
        .ok_or_else(|| super::unsupported(op, g.name()))?;
    let cfg = gemv_launch(d.n, g.device().info())?;
    let (gate_addr, up_addr, out_addr) = (addr::<D>(&w_gate.weight), addr::<D>(&w_up.weight), addr::<D>(out));
    with_f32_x(g, d, x, |x_addr| {
        let gate = LinearParams::new(d, x_addr, gate_addr, gate_ws, (out_addr, y_code(DType::F32)));
        let p = GateUpParams { gate, up: up_addr, up_scales, up_scale, pad: 0 };
        // SAFETY: `check_gate_up_silu` checked x [m, k] (f32 here), gate and up [n, k] of the
        // kernel's dtype with scales of one kind, dtype and block shape (compared again above),
        // and out f32 [m, n]; the kernel bounds every access by m <= R, n and k as gemv does, so
        // each is inside its buffer; out is borrowed mutably.
        unsafe { g.launch(name, cfg, &p) }
    })
}

/// `qkv`: for one row (batch-1 decode) and weights of one dtype whose scales pick one kernel
/// (none or per tensor; or per channel / blocks of one scale dtype), one `qkv_<w>[_block_<s>]_r1`
/// launch whose grid is the three products' GEMV grids end to end, x widened once; each product
/// computed exactly as `linear` computes it. Otherwise three `linear` (the kernel's r4 / r16 forms
/// spilled registers, so more rows take three GEMV launches: [`QKV_ROW_TILES`]).
pub(crate) fn qkv<D: Device>(
    g: &Gpu<D>,
    d: [LinearDims; 3],
    x: &T<D>,
    w: [&Linear<GpuStorage<D::Buffer>>; 3],
    y: [&mut T<D>; 3],
) -> Result<()> {
    let op = "qkv";
    let scales =
        [weight_params::<D>(d[0], w[0])?, weight_params::<D>(d[1], w[1])?, weight_params::<D>(d[2], w[2])?];
    let one_kernel = w.iter().all(|wi| wi.weight.dtype() == w[0].weight.dtype())
        && scales.iter().all(|s| s.0 == scales[0].0);
    let rows = row_tile(&QKV_ROW_TILES, d[0].m).filter(|_| one_kernel);
    let name = rows.and_then(|r| kernel_name(op, w[0].weight.dtype(), scales[0].0, Some(r)));
    let Some(name) = name else {
        let [q, k, v] = y;
        linear(g, d[0], x, w[0], q)?;
        linear(g, d[1], x, w[1], k)?;
        return linear(g, d[2], x, w[2], v);
    };
    let info = g.device().info();
    let grids = [gemv_launch(d[0].n, info)?, gemv_launch(d[1].n, info)?, gemv_launch(d[2].n, info)?];
    let blocks: u64 = grids.iter().map(|c| u64::from(c.grid[0])).sum();
    let cfg = LaunchCfg { grid: [dim(op, "blocks", blocks as usize)?, 1, 1], ..grids[0] };
    with_f32_x(g, d[0], x, |x_addr| {
        let part = |i: usize| {
            let y_i = (addr::<D>(&*y[i]), y_code(y[i].dtype()));
            LinearParams::new(d[i], x_addr, addr::<D>(&w[i].weight), scales[i], y_i)
        };
        let p = QkvParams { part: [part(0), part(1), part(2)], blocks: [grids[0].grid[0], grids[1].grid[0]] };
        // SAFETY: `check_qkv` checked each product as `check_linear` does (x [m, k], f32 here and
        // shared; weight [n_i, k] of the kernel's dtype, scales of the kernel's scale dtype and
        // their shapes; y_i [m, n_i] of its y_dtype); each run of blocks is that product's GEMV
        // grid-striding over its n_i rows, bounded by m, n_i and k as gemv is, so every access
        // is inside its buffer; the three y are borrowed mutably (distinct tensors).
        unsafe { g.launch(name, cfg, &p) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(sm: u32) -> DeviceInfo {
        DeviceInfo { sm_count: sm, ..super::super::test_h200() }
    }

    #[test]
    fn row_tiles() {
        let gemv = |m| row_tile(&GEMV_ROW_TILES, m);
        assert_eq!(
            [gemv(1), gemv(2), gemv(4), gemv(5), gemv(16), gemv(17)],
            [Some(1), Some(4), Some(4), Some(16), Some(16), None]
        );
        assert_eq!(row_tile(&GATE_UP_ROW_TILES, 4), Some(4));
        assert_eq!(row_tile(&GATE_UP_ROW_TILES, 5), None);
        assert_eq!(row_tile(&QKV_ROW_TILES, 1), Some(1));
        assert_eq!(row_tile(&QKV_ROW_TILES, 2), None);
    }

    #[test]
    fn gemv_grid() {
        let cfg = gemv_launch(4096, &info(132)).unwrap();
        assert_eq!((cfg.grid[0], cfg.block[0]), (1024, 128));
        // lm_head: 128256 rows, capped at 32 blocks per SM and grid-strided.
        assert_eq!(gemv_launch(128_256, &info(132)).unwrap().grid[0], 132 * 32);
        assert_eq!(gemv_launch(1, &info(132)).unwrap().grid[0], 1);
        let mut wave64 = info(4);
        wave64.warp_size = 64;
        assert_eq!(gemv_launch(9, &wave64).unwrap().block[0], 256);
    }

    #[test]
    fn gemv_tc_runs_of_k() {
        let h200 = info(132);
        let plan = |m, n, k, w, bc| {
            let (cfg, cols, splits) = gemv_tc_plan(LinearDims { m, n, k }, w, bc, &h200).unwrap();
            assert_eq!((cfg.grid[1], cfg.block[0]), (splits, GEMV_TC_THREADS));
            (cfg.grid[0], cols, splits)
        };
        // The 8B's gate/up at 16 rows: 224 feature blocks, 2 runs bring it to 2 blocks per SM.
        assert_eq!(plan(16, 28672, 4096, DType::F8E4M3Fn, None), (224, 2048, 2));
        // 4096 x 4096: 32 feature blocks; 9 runs wanted, the partials' share allows 8 (fp8).
        assert_eq!(plan(16, 4096, 4096, DType::F8E4M3Fn, None), (32, 512, 8));
        // bf16 allows 16, 9 wanted: runs of 4 tiles, so 8.
        assert_eq!(plan(16, 4096, 4096, DType::BF16, Some(4096)), (32, 512, 8));
        // 640-column blocks: runs of whole blocks (5 tiles), a short last run.
        assert_eq!(plan(5, 19, 4096, DType::F8E4M3Fn, Some(640)), (1, 640, 7));
        // One tile of k, or a batch of 1 on a big matrix: one run.
        assert_eq!(plan(8, 70, 128, DType::BF16, None), (1, 128, 1));
        assert_eq!(plan(1, 128_256, 4096, DType::BF16, None), (1002, 4096, 1));
        let d = |m, k| LinearDims { m, n: 64, k };
        assert!(gemv_tc_applies(d(16, 4096), DType::F8E4M3Fn, Some((128, 128)), &h200));
        assert!(gemv_tc_applies(d(1, 40), DType::BF16, None, &h200));
        assert!(!gemv_tc_applies(d(1, 40), DType::F8E4M3Fn, None, &h200), "k not a multiple of 16 fp8");
        assert!(!gemv_tc_applies(d(4, 4096), DType::F32, None, &h200));
        assert!(!gemv_tc_applies(d(17, 4096), DType::BF16, None, &h200));
        assert!(!gemv_tc_applies(d(4, 4096), DType::BF16, Some((1, 48)), &h200));
        let mut amd = h200.clone();
        amd.vendor = super::super::super::Vendor::Amd;
        assert!(!gemv_tc_applies(d(16, 4096), DType::BF16, None, &amd), "no gfx target named");
        assert!(gemv_tc_plan(d(16, 4096), DType::BF16, None, &amd).is_err());
        // An MI300X: gemv_mfma.cu, 256 threads, k cut as on NVIDIA (304 CUs: 6 runs of 768 columns).
        let mi300x = DeviceInfo {
            name: "AMD Instinct MI300X (gfx942)".into(),
            warp_size: 64,
            sm_count: 304,
            ..amd.clone()
        };
        assert_eq!(GemvMatrix::of(&mi300x), Some(GemvMatrix::MatrixCore));
        assert_eq!(GemvMatrix::of(&h200), Some(GemvMatrix::TensorCore));
        assert!(gemv_tc_applies(d(16, 4096), DType::F8E4M3Fnuz, Some((128, 128)), &mi300x));
        let (cfg, cols, splits) =
            gemv_tc_plan(LinearDims { m: 16, n: 14336, k: 4096 }, DType::BF16, None, &mi300x).unwrap();
        assert_eq!((cfg.grid, cfg.block[0], cols, splits), ([112, 6, 1], 256, 768, 6));
    }

    #[test]
    fn names() {
        assert_eq!(kernel_name("gemv", DType::BF16, None, Some(1)), Some("gemv_bf16_r1"));
        assert_eq!(
            kernel_name("gemv", DType::F8E4M3Fn, Some(DType::BF16), Some(16)),
            Some("gemv_e4m3fn_block_bf16_r16")
        );
        assert_eq!(kernel_name("gemm", DType::F16, Some(DType::F32), None), Some("gemm_f16_block_f32"));
        assert_eq!(kernel_name("gemm", DType::U32, None, None), None);
        assert_eq!(kernel_name("gemm_tc", DType::F8E5M2, None, None), Some("gemm_tc_e5m2"));
        assert_eq!(
            kernel_name("gate_up_silu", DType::F8E4M3Fnuz, Some(DType::F32), Some(4)),
            Some("gate_up_silu_e4m3fnuz_block_f32_r4")
        );
        assert_eq!(kernel_names().len(), 2 + 7 * 3 * (3 + 2 + 1 + 1 + 1) + 6 * 3 * (1 + 2 + 1 + 1 + 1));
        assert_eq!(
            kernel_name("gemv_j4", DType::BF16, Some(DType::F32), Some(4)),
            Some("gemv_j4_bf16_block_f32_r4")
        );
    }
}
