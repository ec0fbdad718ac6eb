//! `experts` routed on the device: Mixtral's sparse MLP as launches that read nothing back, so a
//! decode step of a Mixtral model records as a graph like a dense one, and a prefill step pays no
//! round trip per layer.
//!
//! 1. `experts_route` (rows.cu, one block): the router's picks sorted by expert (counting, stable
//!    in pair order): the x row of each sorted pair, its weight, each expert's first sorted pair,
//!    the list of experts with pairs, and where each row's picks landed.
//! 2. `gather_rows_f32`: x's rows in sorted order, so each expert's rows are contiguous.
//! 3. Gate and up, each active expert's on its rows. Up to 4 rows, `experts_gate_up_<w>[_block_<s>]_r<R>`
//!    (gemv.cu, R = 1 or 4): the fused gate/up GEMV. At 5 to 16 rows `experts_gemv_..._r16` for
//!    gate and for up, then `silu_mul_f32` (as `gate_up_silu` composes above its fused tiles).
//!    Where `Gpu::set_gemv_tensor_core_rows` sends this many rows to the matrix units and every
//!    matrix fits them ([`gemv_tc_applies`]), `gemv_tc_experts_*_r<R>` (gemv_tc.cu, R = 8 or 16)
//!    or `gemv_mfma_experts_*_r16` (gemv_mfma.cu) for gate and for up, then `silu_mul_f32`: one
//!    block per 128 output features of each expert that can be active, one run of k.
//!    Above 16 rows (prefill) the grouped GEMM of the path `linear` would take for one expert
//!    ([`gemm_path`]: `gemm_tc_experts_*` of gemm_tc.cu on mma.sync, `gemm_mfma_experts_*` of
//!    gemm_mfma.cu on AMD's MFMA, `gemm_experts_*` of gemm.cu otherwise) for gate and for up, then
//!    `silu_mul_f32`.
//! 4. The down projection likewise: `experts_gemv_<w>[_block_<s>]_r<R>`, the matrix units'
//!    grouped GEMV or the grouped GEMM.
//! 5. `experts_combine_f32`: each row's expert outputs times their weights, added in order of
//!    expert from zero, one fma each: scatter_add_rows' order and rounding into a zeroed out.
//!
//! Five launches up to 4 rows (seven on the matrix units), seven above. The GEMV grids hold `blocks_per_expert` blocks for each
//! expert that can be active (at most rows x k of them), sized so the active experts' blocks fill
//! the device as one GEMV's would; blocks past the experts the route found return at once. The
//! grouped GEMM's grid holds the row tiles of every split of the sorted rows among the experts
//! (`ceil(pairs / TILE_M) + active - 1` rows of tiles); each block finds its expert's tile from the
//! route's offsets, and blocks past the last tile return at once. Each expert's matrices reach the
//! kernels in their params (at most [`MAX_EXPERTS`]). Every weight byte of a picked expert is read
//! once for all its rows by a GEMV, once per 64 of its rows by a GEMM; experts no row picked are
//! not read. More experts, or experts of mixed dtypes or scale layouts, take [`experts_composed`],
//! routed on the host. Where `Gpu::set_gemm_warpgroup` sends dense GEMMs to wgmma, the experts'
//! GEMMs stay on mma.sync (no grouped wgmma kernel yet).
//!
//! Memory: the sorted rows, the products and each pick's output live in the caller's
//! [`ExpertsScratch`] (the session's), which a GPU allocates at rows x k rows of each width
//! (`scratch_rows`); only the route's small arrays (a few words per pick) are the launcher's own
//! scratch. At a 512-row prefill chunk of Mixtral 8x7B (k = 2) that is 1024 x (2 x 4096 + 3 x
//! 14336) f32, 210 MB, held once.

use super::super::{Device, DeviceInfo, Gpu, GpuStorage, LaunchCfg, dim};
use super::addr;
use super::gemm::{GemmPath, experts_gemm_launch, gemm_path};
use super::linear::{
    GATE_UP_ROW_TILES, GEMV_ROW_TILES, GEMV_TC_FEATURES, GemvMatrix, LinearParams, gemv_launch,
    gemv_tc_applies, kernel_name, row_tile, weight_params,
};
use super::rows::{GatherRowsParams, gather_launch};
use crate::backend::experts_composed;
use crate::ops::{Expert, ExpertsDims, ExpertsScratch, Linear, LinearDims};
use crate::{Backend, DType, Result, Tensor};

type T<D> = Tensor<GpuStorage<<D as Device>::Buffer>>;
type E<'a, D> = Expert<'a, GpuStorage<<D as Device>::Buffer>>;

/// `MW_MAX_EXPERTS` of common.cuh: the most experts the device-routed kernels take.
pub const MAX_EXPERTS: usize = 16;
/// `ROUTE_THREADS` of rows.cu: the one block of `experts_route`, each thread counting and placing
/// a run of ceil(pairs / ROUTE_THREADS) pairs.
pub const ROUTE_THREADS: u32 = 256;
/// `SCATTER_THREADS` of rows.cu, the block of `experts_combine_f32`.
const COMBINE_THREADS: u32 = 256;
/// Blocks per SM beyond which the grid-stride combine gains nothing.
const COMBINE_BLOCKS_PER_SM: usize = 8;

/// `ExpertMatrix` of `kernels-cuda/params/linear.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ExpertMatrix {
    pub weight: u64,
    pub scales: u64,
    pub scale: f32,
    pub pad: u32,
}

/// `ExpertsGemvParams` of `kernels-cuda/params/linear.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ExpertsGemvParams {
    pub base: LinearParams,
    pub offsets: u64,
    pub active: u64,
    pub experts: u32,
    pub blocks_per_expert: u32,
    pub mat: [ExpertMatrix; MAX_EXPERTS],
}

/// `ExpertsGateUpParams` of `kernels-cuda/params/linear.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ExpertsGateUpParams {
    pub base: LinearParams,
    pub offsets: u64,
    pub active: u64,
    pub experts: u32,
    pub blocks_per_expert: u32,
    pub gate: [ExpertMatrix; MAX_EXPERTS],
    pub up: [ExpertMatrix; MAX_EXPERTS],
}

/// `ExpertsRouteParams` of `kernels-cuda/params/rows.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ExpertsRouteParams {
    pub order: u64,
    pub sorted_w: u64,
    pub offsets: u64,
    pub active: u64,
    pub row_pos: u64,
    pub ids: u64,
    pub weights: u64,
    pub status: u64,
    pub rows: u32,
    pub k: u32,
    pub experts: u32,
    pub pad: u32,
}

/// `ExpertsCombineParams` of `kernels-cuda/params/rows.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ExpertsCombineParams {
    pub out: u64,
    pub ys: u64,
    pub sorted_w: u64,
    pub row_pos: u64,
    pub rows: u64,
    pub cols: u64,
    pub k: u32,
    pub pad: u32,
}

const _: () = {
    use std::mem::size_of;
    assert!(size_of::<ExpertMatrix>() == 24);
    assert!(size_of::<ExpertsGemvParams>() == 96 + 24 * MAX_EXPERTS);
    assert!(size_of::<ExpertsGateUpParams>() == 96 + 48 * MAX_EXPERTS);
    assert!(size_of::<ExpertsRouteParams>() == 80);
    assert!(size_of::<ExpertsCombineParams>() == 56);
};

/// Every kernel name the experts launcher may use.
pub fn kernel_names() -> Vec<&'static str> {
    let mut names = vec!["experts_route", "experts_combine_f32"];
    for w in DType::FLOATS {
        for s in [None, Some(DType::F32), Some(DType::BF16)] {
            names.extend(GEMV_ROW_TILES.iter().filter_map(|&r| kernel_name("experts_gemv", w, s, Some(r))));
            names.extend(
                GATE_UP_ROW_TILES.iter().filter_map(|&r| kernel_name("experts_gate_up", w, s, Some(r))),
            );
            names.extend(kernel_name("gemm_experts", w, s, None));
            if w != DType::F32 {
                names.extend(kernel_name("gemm_tc_experts", w, s, None));
                names.extend(kernel_name("gemm_mfma_experts", w, s, None));
                for kernel in [GemvMatrix::TensorCore, GemvMatrix::MatrixCore] {
                    let tiles = kernel.row_tiles().iter();
                    names.extend(tiles.filter_map(|&r| kernel_name(matrix_family(kernel), w, s, Some(r))));
                }
            }
        }
    }
    names
}

/// One matrix kind (gate, up or down) of every expert, for one kernel: its dtype, block-scale
/// dtype and block shape (the same for all, or None), and each expert's [`ExpertMatrix`].
struct Matrices {
    dtype: DType,
    scale_dtype: Option<DType>,
    block: (u32, u32),
    mat: [ExpertMatrix; MAX_EXPERTS],
    /// Whether every expert's weight starts on a 16-byte word (the tensor-core GEMMs read words).
    aligned: bool,
}

impl Matrices {
    /// `pick(e)` of every expert as one kernel reads them at `d`, or None where the experts differ
    /// in dtype, scale dtype or block shape, or there are more than [`MAX_EXPERTS`].
    fn of<'a, D: Device>(
        d: LinearDims,
        experts: &[E<'a, D>],
        pick: impl Fn(&E<'a, D>) -> &'a Linear<GpuStorage<D::Buffer>>,
    ) -> Result<Option<Matrices>> {
        let (Some(first), true) = (experts.first(), experts.len() <= MAX_EXPERTS) else { return Ok(None) };
        let dtype = pick(first).weight.dtype();
        let (scale_dtype, _, block_rows, block_cols, _) = weight_params::<D>(d, pick(first))?;
        let mut mat = [ExpertMatrix::default(); MAX_EXPERTS];
        let mut aligned = true;
        for (e, x) in experts.iter().enumerate() {
            let w = pick(x);
            let (s_dtype, scales, rows, cols, scale) = weight_params::<D>(d, w)?;
            if w.weight.dtype() != dtype || (s_dtype, rows, cols) != (scale_dtype, block_rows, block_cols) {
                return Ok(None);
            }
            mat[e] = ExpertMatrix { weight: addr::<D>(&w.weight), scales, scale, pad: 0 };
            aligned &= mat[e].weight.is_multiple_of(16);
        }
        Ok(Some(Matrices { dtype, scale_dtype, block: (block_rows, block_cols), mat, aligned }))
    }

    /// The kernel of `family` for these matrices at row tile `rows` (None for a GEMM).
    fn kernel(&self, family: &str, rows: Option<usize>) -> Option<&'static str> {
        kernel_name(family, self.dtype, self.scale_dtype, rows)
    }

    /// `(block_rows, block_cols)` of the block or per-channel scales; None for none or per tensor.
    fn blocks(&self) -> Option<(usize, usize)> {
        self.scale_dtype.map(|_| (self.block.0 as usize, self.block.1 as usize))
    }

    /// Whether the matrix units' grouped GEMV takes these matrices at `d`: `gemv_tc_applies`, with
    /// every weight on a 16-byte word.
    fn matrix_gemv_applies(&self, d: LinearDims, info: &DeviceInfo) -> bool {
        self.aligned && gemv_tc_applies(d, self.dtype, self.blocks(), info)
    }

    /// The grouped GEMM's path at `d` on `info`: `linear`'s for one expert's matrix, but the
    /// CUDA-core GEMM where a weight is not on a 16-byte word.
    fn gemm_path(&self, d: LinearDims, info: &DeviceInfo) -> GemmPath {
        match gemm_path(d, self.dtype, self.blocks(), info) {
            GemmPath::CudaCore => GemmPath::CudaCore,
            _ if !self.aligned => GemmPath::CudaCore,
            path => path,
        }
    }
}

/// How a device-routed `experts` runs its products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Products {
    /// Up to [`GEMV_MAX_ROWS`](super::linear::GEMV_MAX_ROWS) rows: gemv.cu's experts kernels at row tile `rows` (the down
    /// projection's, and gate's and up's where not fused), the fused gate/up at tile `fused`.
    Gemv { rows: usize, fused: Option<usize> },
    /// More rows: the grouped GEMMs of these paths for gate and up, and for down.
    Gemm { up: GemmPath, down: GemmPath },
    /// Where [`Gpu::set_gemv_tensor_core_rows`](super::super::Gpu::set_gemv_tensor_core_rows)
    /// sends this many rows to the matrix units and every product can take them
    /// ([`gemv_tc_applies`]): `<family>_experts_*` of gemv_tc.cu or gemv_mfma.cu at row tile
    /// `rows` for gate, up and down (silu_mul between).
    GemvMatrix { kernel: GemvMatrix, rows: usize },
}

/// The three matrix kinds of a device-routed `experts` at `d`, or None where it takes the host.
struct Plan {
    gate: Matrices,
    up: Matrices,
    down: Matrices,
    products: Products,
}

impl Plan {
    /// The kernel `products` runs for matrix kind `m` (`down` or not), None where the build has
    /// none (a dtype no kernel takes).
    fn kernel(&self, m: &Matrices, down: bool) -> Option<&'static str> {
        match self.products {
            Products::Gemv { rows, .. } => m.kernel("experts_gemv", Some(rows)),
            Products::Gemm { up, down: path } => m.kernel(gemm_family(if down { path } else { up }), None),
            Products::GemvMatrix { kernel, rows } => m.kernel(matrix_family(kernel), Some(rows)),
        }
    }
}

/// The grouped matrix-unit GEMV kernel family of a [`GemvMatrix`].
fn matrix_family(kernel: GemvMatrix) -> &'static str {
    match kernel {
        GemvMatrix::TensorCore => "gemv_tc_experts",
        GemvMatrix::MatrixCore => "gemv_mfma_experts",
    }
}

/// The grouped GEMM kernel family of a [`GemmPath`] (the warpgroup path has none: mma.sync's).
fn gemm_family(path: GemmPath) -> &'static str {
    match path {
        GemmPath::CudaCore => "gemm_experts",
        GemmPath::TensorCore | GemmPath::Warpgroup => "gemm_tc_experts",
        GemmPath::MatrixCore => "gemm_mfma_experts",
    }
}

/// The device-routed plan of `d` on `info` (None: the host-routed path), with `tc_rows` the
/// fewest rows sent to the matrix units ([`Gpu::gemv_tensor_core_rows`](super::super::Gpu::gemv_tensor_core_rows)).
fn plan<D: Device>(
    d: ExpertsDims,
    experts: &[E<'_, D>],
    info: &DeviceInfo,
    tc_rows: Option<usize>,
) -> Result<Option<Plan>> {
    if d.experts > MAX_EXPERTS || u32::try_from(d.rows * d.k).is_err() {
        return Ok(None);
    }
    let up_dims = LinearDims { m: d.rows, n: d.inter, k: d.hidden };
    let down_dims = LinearDims { m: d.rows, n: d.hidden, k: d.inter };
    let (Some(gate), Some(up), Some(down)) = (
        Matrices::of::<D>(up_dims, experts, |e| e.gate)?,
        Matrices::of::<D>(up_dims, experts, |e| e.up)?,
        Matrices::of::<D>(down_dims, experts, |e| e.down)?,
    ) else {
        return Ok(None);
    };
    if (up.dtype, up.scale_dtype, up.block) != (gate.dtype, gate.scale_dtype, gate.block) {
        return Ok(None);
    }
    // The matrix units' grouped GEMV where the setting asks for this many rows and every matrix
    // fits it (checked only then: `plan` runs on every call).
    let matrix = |kernel: GemvMatrix| -> Option<Products> {
        let rows = row_tile(kernel.row_tiles(), d.rows)?;
        let all = gate.matrix_gemv_applies(up_dims, info)
            && up.matrix_gemv_applies(up_dims, info)
            && down.matrix_gemv_applies(down_dims, info);
        all.then_some(Products::GemvMatrix { kernel, rows })
    };
    let products = match row_tile(&GEMV_ROW_TILES, d.rows) {
        Some(rows) => GemvMatrix::of(info)
            .filter(|_| tc_rows.is_some_and(|r| d.rows >= r))
            .and_then(matrix)
            .unwrap_or(Products::Gemv { rows, fused: row_tile(&GATE_UP_ROW_TILES, d.rows) }),
        None => {
            let up_path = match (gate.gemm_path(up_dims, info), up.gemm_path(up_dims, info)) {
                (a, b) if a == b => a,
                _ => GemmPath::CudaCore,
            };
            Products::Gemm { up: up_path, down: down.gemm_path(down_dims, info) }
        }
    };
    let plan = Plan { gate, up, down, products };
    let gate_up = match products {
        Products::Gemv { fused: Some(r), .. } => plan.gate.kernel("experts_gate_up", Some(r)),
        _ => plan.kernel(&plan.gate, false),
    };
    let kernels_exist = gate_up.is_some() && plan.kernel(&plan.down, true).is_some();
    Ok(kernels_exist.then_some(plan))
}

/// Whether [`experts`] routes `d` on the device (else it takes [`experts_composed`]).
/// The same whichever GEMV the matrix-unit setting picks: every dtype the matrix-unit kernels
/// take, gemv.cu's take too.
pub(crate) fn on_device<D: Device>(d: ExpertsDims, experts: &[E<'_, D>], info: &DeviceInfo) -> bool {
    plan::<D>(d, experts, info, None).is_ok_and(|p| p.is_some())
}

/// Rows of an [`ExpertsScratch`]'s per-row buffers for steps of `d` (`Backend::experts_scratch_rows`):
/// every pick's row (`rows * k`) where the layer can route on the device (at most [`MAX_EXPERTS`]
/// experts, pairs within 32 bits), else the host-routed form's `rows`.
pub(crate) fn scratch_rows(d: ExpertsDims) -> usize {
    match d.rows.checked_mul(d.k) {
        Some(pairs) if d.experts <= MAX_EXPERTS && u32::try_from(pairs).is_ok() => pairs.max(d.rows),
        _ => d.rows,
    }
}

/// The grouped matrix-unit GEMV's launch over `n` output features with at most `active` experts
/// active: `(cfg, blocks_per_expert)`, one block per `GEMV_TC_FEATURES` features of each (the
/// experts' blocks fill the device, so k is not split).
pub fn matrix_gemv_launch(
    kernel: GemvMatrix,
    n: usize,
    active: usize,
    info: &DeviceInfo,
) -> Result<(LaunchCfg, u32)> {
    let op = "experts";
    let per = n.div_ceil(GEMV_TC_FEATURES).max(1);
    let blocks = per.checked_mul(active.max(1)).filter(|&b| b <= info.max_grid[0] as usize);
    let blocks = blocks.ok_or_else(|| crate::Error::Argument {
        op,
        msg: format!("{per} x {active} matrix-unit GEMV blocks beyond the grid's {}", info.max_grid[0]),
    })?;
    Ok((
        LaunchCfg::linear(dim(op, "blocks", blocks)?, kernel.threads(), 0),
        dim(op, "blocks per expert", per)?,
    ))
}

/// Blocks per expert of a grouped GEMV over `n` output features with at most `active` experts
/// active: together about one GEMV grid of `n`.
pub fn blocks_per_expert(n: usize, active: usize, info: &DeviceInfo) -> Result<u32> {
    let grid = gemv_launch(n, info)?.grid[0] as usize;
    dim("experts", "blocks per expert", grid.div_ceil(active.max(1)).max(1))
}

/// `experts` (`ops::check_experts` made `d`): on the device where [`plan`] finds kernels, else
/// [`experts_composed`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn experts<D: Device>(
    g: &Gpu<D>,
    d: ExpertsDims,
    x: &T<D>,
    ids: &T<D>,
    weights: &T<D>,
    experts: &[E<'_, D>],
    scratch: &mut ExpertsScratch<GpuStorage<D::Buffer>>,
    out: &mut T<D>,
) -> Result<()> {
    let info = g.device().info();
    let Some(plan) = plan::<D>(d, experts, info, g.gemv_tensor_core_rows())? else {
        return experts_composed(g, d, x, ids, weights, experts, scratch, out);
    };
    let op = "experts";
    let pairs = d.rows * d.k;
    let active_max = d.experts.min(pairs);
    if scratch.held_rows() < pairs {
        return Err(crate::Error::Argument {
            op,
            msg: format!(
                "scratch of {} rows for {pairs} picks: allocate it with ExpertsScratch::alloc on this backend",
                scratch.held_rows()
            ),
        });
    }
    let fused = match plan.products {
        Products::Gemv { fused, .. } => fused,
        Products::Gemm { .. } | Products::GemvMatrix { .. } => None,
    };
    // The session's scratch (held_rows >= pairs rows of each width, f32): x's rows in sorted
    // order, the gate and up products (unfused), their silu product, each sorted pick's output.
    let (xs, gate, up, act, ys) = (
        addr::<D>(&scratch.x),
        addr::<D>(&scratch.gate),
        addr::<D>(&scratch.up),
        addr::<D>(&scratch.act),
        addr::<D>(&scratch.out),
    );
    let words = |n: usize| n * 4;
    let sizes = [
        words(pairs),           // 0 order
        words(pairs),           // 1 sorted_w
        words(d.experts + 1),   // 2 offsets
        words(MAX_EXPERTS + 1), // 3 active
        words(pairs),           // 4 row_pos
    ];
    let status = g.status_address();
    let (x_addr, out_addr) = (addr::<D>(x), addr::<D>(out));
    g.with_scratch(op, &sizes, |at| {
        let [order, sorted_w, offsets, active, row_pos] = [at[0], at[1], at[2], at[3], at[4]];
        let route = ExpertsRouteParams {
            order,
            sorted_w,
            offsets,
            active,
            row_pos,
            ids: addr::<D>(ids),
            weights: addr::<D>(weights),
            status,
            rows: dim(op, "rows", d.rows)?,
            k: dim(op, "k", d.k)?,
            experts: dim(op, "experts", d.experts)?,
            pad: 0,
        };
        // SAFETY: ids u32 and weights f32 hold rows x k = pairs elements (`check_experts`; pairs
        // fits in 32 bits, `plan`); the kernel writes pairs entries of order, sorted_w and row_pos,
        // experts + 1 of offsets and at most MAX_EXPERTS + 1 of active, all inside the scratch,
        // and routes an id beyond the experts (reported) to the last expert.
        unsafe { g.launch("experts_route", LaunchCfg::linear(1, ROUTE_THREADS, 0), &route)? };
        let gather = GatherRowsParams {
            out: xs,
            src: x_addr,
            idx: order,
            status,
            picked: pairs as u64,
            rows: d.rows as u64,
            cols: d.hidden as u64,
        };
        // SAFETY: x is f32 [rows, hidden]; order holds pairs row numbers below rows (the route
        // writes each pair's row); xs holds pairs x hidden f32.
        unsafe { g.launch("gather_rows_f32", gather_launch(pairs, d.hidden, 4, info)?, &gather)? };

        let grouped = |y: u64, x: u64, n: usize, k: usize, m: &Matrices| -> LinearParams {
            LinearParams {
                y,
                x,
                weight: 0,
                scales: 0,
                m: 0,
                n: n as u64,
                k: k as u64,
                block_rows: m.block.0,
                block_cols: m.block.1,
                scale: 1.0,
                y_dtype: 0,
            }
        };
        let threads = gemv_launch(1, info)?.block[0];
        let grid = |per: u32| -> Result<LaunchCfg> {
            Ok(LaunchCfg::linear(dim(op, "blocks", per as usize * active_max)?, threads, 0))
        };
        // Each active expert's product of matrix kind `m` (`down` or not) on its sorted rows of x
        // (pairs x k f32) into y (pairs x n f32): a grouped GEMV or GEMM as the plan says.
        let product = |y: u64, x: u64, n: usize, k: usize, m: &Matrices, down: bool| -> Result<()> {
            let name = plan.kernel(m, down).ok_or_else(|| super::unsupported(op, g.name()))?;
            let (cfg, per) = match plan.products {
                Products::Gemv { .. } => {
                    let per = blocks_per_expert(n, active_max, info)?;
                    (grid(per)?, per)
                }
                Products::Gemm { up, down: down_path } => {
                    (experts_gemm_launch(if down { down_path } else { up }, pairs, active_max, n, info)?, 1)
                }
                Products::GemvMatrix { kernel, .. } => matrix_gemv_launch(kernel, n, active_max, info)?,
            };
            let p = ExpertsGemvParams {
                base: grouped(y, x, n, k, m),
                offsets,
                active,
                experts: d.experts as u32,
                blocks_per_expert: per,
                mat: m.mat,
            };
            // SAFETY: x holds pairs x k f32 and y pairs x n f32 (held_rows); each expert's weight is
            // [n, k] of the kernel's dtype with scales of its scale dtype and block shape (`plan`
            // compared them, `check_experts` checked each; the tensor-core GEMMs and GEMVs only
            // where k is a multiple of a weight word and every weight on a word,
            // `Matrices::gemm_path`, `gemv_tc_applies`, so each expert's first row of x, at
            // first x k f32, is on a word too); the route's offsets split the pairs among the
            // experts, and each block bounds its rows by them (and by R for a GEMV: more only
            // where a bad pick was reported), its outputs by n and its reads by k.
            unsafe { g.launch(name, cfg, &p) }
        };
        match fused {
            Some(r) => {
                let per = blocks_per_expert(d.inter, active_max, info)?;
                let p = ExpertsGateUpParams {
                    base: grouped(act, xs, d.inter, d.hidden, &plan.gate),
                    offsets,
                    active,
                    experts: d.experts as u32,
                    blocks_per_expert: per,
                    gate: plan.gate.mat,
                    up: plan.up.mat,
                };
                let name = plan
                    .gate
                    .kernel("experts_gate_up", Some(r))
                    .ok_or_else(|| super::unsupported(op, g.name()))?;
                // SAFETY: as for `product` above, with gate and up of one dtype and block shape.
                unsafe { g.launch(name, grid(per)?, &p)? };
            }
            None => {
                product(gate, xs, d.inter, d.hidden, &plan.gate, false)?;
                product(up, xs, d.inter, d.hidden, &plan.up, false)?;
                let n = (pairs * d.inter) as u64;
                let p = super::elementwise::SiluMulParams { out: act, gate, up, n };
                let blocks = super::elementwise::element_grid(n, 4, info.sm_count);
                let cfg = LaunchCfg::linear(blocks, super::elementwise::ELEMENT_THREADS, 0);
                // SAFETY: gate, up and act each hold pairs x inter f32 (held_rows).
                unsafe { g.launch("silu_mul_f32", cfg, &p)? };
            }
        }
        product(ys, act, d.hidden, d.inter, &plan.down, true)?;

        let n = d.rows * d.hidden;
        let blocks = n
            .div_ceil(COMBINE_THREADS as usize)
            .clamp(1, info.sm_count.max(1) as usize * COMBINE_BLOCKS_PER_SM);
        let combine = ExpertsCombineParams {
            out: out_addr,
            ys,
            sorted_w,
            row_pos,
            rows: d.rows as u64,
            cols: d.hidden as u64,
            k: d.k as u32,
            pad: 0,
        };
        // SAFETY: out is f32 [rows, hidden], borrowed mutably; row_pos holds rows x k sorted
        // indices below pairs (the route's), sorted_w pairs weights and ys pairs x hidden f32.
        unsafe {
            g.launch(
                "experts_combine_f32",
                LaunchCfg::linear(dim(op, "blocks", blocks)?, COMBINE_THREADS, 0),
                &combine,
            )
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_fill_one_gemv_grid() {
        let info = super::super::test_h200();
        let one = gemv_launch(14336, &info).unwrap().grid[0];
        // Batch 1 of Mixtral: two experts share one GEMV's grid.
        assert_eq!(blocks_per_expert(14336, 2, &info).unwrap(), one.div_ceil(2));
        assert_eq!(blocks_per_expert(14336, 1, &info).unwrap(), one);
        assert!(blocks_per_expert(4, 8, &info).unwrap() >= 1);
    }
}
