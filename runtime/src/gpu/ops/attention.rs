//! `kv_store` and `attention` (causal prefill and flash-decoding), `kernels-cuda/attention.cu`.
//!
//! An attention call is one or two launches, chosen by [`plan`] from shapes, dtypes and the
//! device's SM count (never from the data: slots and positions stay on the device):
//! - the decode kernel (flash-decoding: a block per row, split of the row's positions, kv head and
//!   chunk of its query heads; with more than one split the last block of each row merges the
//!   splits through scratch), which serves every row the prefill kernel does not own;
//! - beside it, from [`PREFILL_MIN_ROWS`] rows on, the prefill kernel: a block per tile of
//!   consecutive rows that all name one slot (the kernel checks), so K/V tiles in shared memory
//!   serve all the tile's query rows.
//!
//! The cache is paged (`ops::KvCacheLayer`): the kernels look up each key position's block in the
//! block table, so any block size works (no multiple of a tile needed; a power of two saves a
//! division, [`block_shift`]).

use super::super::{Device, DeviceInfo, Gpu, GpuStorage, LaunchCfg, dim};
use super::addr;
use crate::ops::{AttnDims, KvCacheLayer};
use crate::{Backend, DType, Error, Result, Tensor};

type T<D> = Tensor<GpuStorage<<D as Device>::Buffer>>;

/// `KvStoreParams` of `kernels-cuda/params/attention.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct KvStoreParams {
    pub k: u64,
    pub v: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub block_table: u64,
    pub slots: u64,
    pub positions: u64,
    pub status: u64,
    pub rows: u64,
    pub width: u64,
    pub n_slots: u32,
    pub capacity: u32,
    pub block_size: u32,
    pub num_blocks: u32,
    pub max_blocks: u32,
    pub reserved: u32,
}

/// `AttentionParams` of `kernels-cuda/params/attention.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct AttentionParams {
    pub q: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub block_table: u64,
    pub slots: u64,
    pub positions: u64,
    pub out: u64,
    pub partial_acc: u64,
    pub partial_ml: u64,
    pub arrivals: u64,
    pub status: u64,
    pub rows: u64,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub n_slots: u32,
    pub capacity: u32,
    pub block_size: u32,
    pub block_shift: u32,
    pub num_blocks: u32,
    pub max_blocks: u32,
    pub head_chunk: u32,
    pub head_chunks: u32,
    pub splits: u32,
    pub min_split: u32,
    pub prefill_rows: u32,
    pub scale_log2: f32,
    pub reserved: u32,
}

const _: () = assert!(std::mem::size_of::<KvStoreParams>() == 104);
const _: () = assert!(std::mem::offset_of!(KvStoreParams, n_slots) == 80);
const _: () = assert!(std::mem::size_of::<AttentionParams>() == 160);
const _: () = assert!(std::mem::offset_of!(AttentionParams, rows) == 88);
const _: () = assert!(std::mem::offset_of!(AttentionParams, scale_log2) == 152);

// ---------------------------------------------------------------------------------------------
// Kernel names and their configurations (mirroring `DecodeCfg` and `PrefillCfg` in the .cu)

/// Threads per block of every attention kernel.
pub const THREADS: u32 = 128;
/// The cache dtypes, in the order of the name tables.
const CACHE_TYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

const KV_STORE: [[&str; 3]; 3] = [
    ["kv_store_f32_f32", "kv_store_f32_bf16", "kv_store_f32_f16"],
    ["kv_store_bf16_f32", "kv_store_bf16_bf16", "kv_store_bf16_f16"],
    ["kv_store_f16_f32", "kv_store_f16_bf16", "kv_store_f16_f16"],
];
const DECODE_EVEN: [[&str; 3]; 3] = [
    ["attention_decode_f32_f32_even", "attention_decode_f32_bf16_even", "attention_decode_f32_f16_even"],
    ["attention_decode_bf16_f32_even", "attention_decode_bf16_bf16_even", "attention_decode_bf16_f16_even"],
    ["attention_decode_f16_f32_even", "attention_decode_f16_bf16_even", "attention_decode_f16_f16_even"],
];
/// `[dtype][head_dim 64, 128][g 4, 8]`.
const DECODE_FAST: [[[&str; 2]; 2]; 3] = [
    [
        ["attention_decode_f32_hd64_g4", "attention_decode_f32_hd64_g8"],
        ["attention_decode_f32_hd128_g4", "attention_decode_f32_hd128_g8"],
    ],
    [
        ["attention_decode_bf16_hd64_g4", "attention_decode_bf16_hd64_g8"],
        ["attention_decode_bf16_hd128_g4", "attention_decode_bf16_hd128_g8"],
    ],
    [
        ["attention_decode_f16_hd64_g4", "attention_decode_f16_hd64_g8"],
        ["attention_decode_f16_hd128_g4", "attention_decode_f16_hd128_g8"],
    ],
];
/// `[dtype][head_dim <= 64, 128, 256]`.
const PREFILL: [[&str; 3]; 3] = [
    ["attention_prefill_f32_hd64", "attention_prefill_f32_hd128", "attention_prefill_f32_hd256"],
    ["attention_prefill_bf16_hd64", "attention_prefill_bf16_hd128", "attention_prefill_bf16_hd256"],
    ["attention_prefill_f16_hd64", "attention_prefill_f16_hd128", "attention_prefill_f16_hd256"],
];

/// Every kernel this module may launch.
pub fn kernel_names() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = KV_STORE.iter().flatten().copied().collect();
    names.extend(DECODE_EVEN.iter().flatten());
    names.extend(DECODE_FAST.iter().flatten().flatten());
    names.extend(PREFILL.iter().flatten());
    names
}

fn type_index(op: &'static str, tensor: &'static str, t: DType) -> Result<usize> {
    CACHE_TYPES.iter().position(|&c| c == t).ok_or_else(|| Error::DType {
        op,
        tensor,
        got: t,
        allowed: CACHE_TYPES.to_vec(),
    })
}

/// The largest head_dim the kernels take.
pub const MAX_HEAD_DIM: usize = 256;
/// The most splits of one row (`DecodeCfg::MAX_SPLITS`: the merge keeps a weight per split in
/// shared memory).
pub const MAX_SPLITS: usize = 128;
/// Fewest positions per split by default: below this a block's fixed costs (loading q, merging)
/// outweigh the 64 positions x 2 x head_dim elements it streams.
pub const MIN_SPLIT: usize = 64;
/// Decode blocks aimed for per SM: two resident blocks of 4 warps each keep ~2 x 128 x 256 bytes
/// of K/V loads in flight per SM, above the ~25 KB an H200 SM needs (4.8 TB/s x ~0.7 us / 132).
pub const DECODE_BLOCKS_PER_SM: usize = 2;
/// Rows from which the prefill kernel runs beside the decode kernel (fewer rows: the decode
/// kernel alone, its splits filling the GPU).
pub const PREFILL_MIN_ROWS: usize = 8;

/// Which decode kernel: `Fast` (k and v of one dtype, head_dim exactly 64 or 128) or `Even` (any
/// dtypes, any even head_dim up to 256).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeVariant {
    Fast,
    Even,
}

/// How one attention call runs. [`plan`] chooses it; [`attention_planned`] takes any valid one
/// (tests force splits and kernels with it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnPlan {
    pub decode: DecodeVariant,
    /// Query heads per decode block: 4 or 8 (`Fast`), 4 (`Even`).
    pub heads_per_block: usize,
    /// Splits of each row's positions (grid.y of the decode kernel), 1..=MAX_SPLITS.
    pub splits: usize,
    /// Fewest positions per split (>= 1).
    pub min_split: usize,
    /// Whether the prefill kernel runs beside the decode kernel.
    pub prefill: bool,
}

/// The decode kernel's name, threads per key row (`LANES`) and head_dim it is built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeKernel {
    pub name: &'static str,
    pub lanes: usize,
    pub hd_max: usize,
    pub heads_per_block: usize,
}

impl DecodeKernel {
    /// Dynamic shared memory: per group of lanes and head, an output row and (max, sum)
    /// (`DecodeCfg::SMEM`).
    pub fn shared_bytes(&self) -> usize {
        let groups = THREADS as usize / self.lanes;
        groups * self.heads_per_block * (self.hd_max + 2) * 4
    }
}

/// The prefill kernel's name and tiling (`PrefillCfg`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillKernel {
    pub name: &'static str,
    pub hd_max: usize,
    /// Query vectors (row, head) per block.
    pub query_vectors: usize,
}

impl PrefillKernel {
    /// K and V tiles of 4096 / hd_max positions, f32.
    pub fn shared_bytes(&self) -> usize {
        2 * 4096 * 4
    }
    /// Query heads of a kv group per block, chunks of the group, and rows per tile.
    pub fn tiling(&self, group: usize) -> (usize, usize, usize) {
        let heads = group.min(self.query_vectors);
        (heads, group.div_ceil(heads), self.query_vectors / heads)
    }
}

/// head_dim must be even and at most [`MAX_HEAD_DIM`] (the model's rotary embedding needs an even
/// one anyway).
fn check_head_dim(backend: &'static str, head_dim: usize) -> Result<()> {
    if head_dim == 0 || !head_dim.is_multiple_of(2) || head_dim > MAX_HEAD_DIM {
        return Err(Error::Unsupported {
            backend,
            op: "attention",
            reason: format!("head_dim {head_dim}: the kernels take even head dims up to {MAX_HEAD_DIM}"),
        });
    }
    Ok(())
}

/// The decode kernel of a plan, or an error when the plan does not fit the shapes and dtypes.
pub fn decode_kernel(
    d: AttnDims,
    k: DType,
    v: DType,
    variant: DecodeVariant,
    heads_per_block: usize,
) -> Result<DecodeKernel> {
    let op = "attention";
    let (ki, vi) = (type_index(op, "k_cache", k)?, type_index(op, "v_cache", v)?);
    let bad = |msg: String| Error::Argument { op, msg };
    match variant {
        DecodeVariant::Fast => {
            let hd = match d.head_dim {
                64 => 0,
                128 => 1,
                other => {
                    return Err(bad(format!("the fast decode kernels take head_dim 64 or 128, not {other}")));
                }
            };
            if ki != vi {
                return Err(bad(format!("the fast decode kernels take one cache dtype, not {k} and {v}")));
            }
            let g = match heads_per_block {
                4 => 0,
                8 => 1,
                other => return Err(bad(format!("fast decode blocks hold 4 or 8 heads, not {other}"))),
            };
            // 16-byte chunks, 8 elements per lane and row: head_dim / 8 lanes per row.
            Ok(DecodeKernel {
                name: DECODE_FAST[ki][hd][g],
                lanes: d.head_dim / 8,
                hd_max: d.head_dim,
                heads_per_block,
            })
        }
        DecodeVariant::Even => {
            if heads_per_block != 4 {
                return Err(bad(format!("even decode blocks hold 4 heads, not {heads_per_block}")));
            }
            Ok(DecodeKernel { name: DECODE_EVEN[ki][vi], lanes: 32, hd_max: MAX_HEAD_DIM, heads_per_block })
        }
    }
}

/// The prefill kernel for one cache dtype and head_dim (even, <= 256), if k and v share a dtype.
pub fn prefill_kernel(head_dim: usize, k: DType, v: DType) -> Option<PrefillKernel> {
    let ki = CACHE_TYPES.iter().position(|&c| c == k)?;
    if k != v || head_dim == 0 || !head_dim.is_multiple_of(2) || head_dim > MAX_HEAD_DIM {
        return None;
    }
    let (i, hd_max) = match head_dim {
        0..=64 => (0, 64),
        65..=128 => (1, 128),
        _ => (2, 256),
    };
    // 16 groups of 8 lanes, 256 / hd_max query vectors each.
    Some(PrefillKernel { name: PREFILL[ki][i], hd_max, query_vectors: 16 * (256 / hd_max) })
}

/// Splits of each row's positions: enough decode blocks for [`DECODE_BLOCKS_PER_SM`] per SM,
/// no split shorter than [`MIN_SPLIT`] positions at the longest context the cache holds, and at
/// most [`MAX_SPLITS`]. `blocks` is rows x kv_heads x head chunks (blocks per split).
pub fn decode_splits(max_context: usize, blocks: usize, sm_count: u32) -> usize {
    let target = DECODE_BLOCKS_PER_SM * sm_count.max(1) as usize;
    let wanted = target.div_ceil(blocks.max(1));
    let by_length = max_context.div_ceil(MIN_SPLIT).max(1);
    wanted.min(by_length).clamp(1, MAX_SPLITS)
}

/// The launch plan of an attention call: a pure function of shapes, dtypes and the device.
pub fn plan(d: AttnDims, k: DType, v: DType, info: &DeviceInfo, backend: &'static str) -> Result<AttnPlan> {
    check_head_dim(backend, d.head_dim)?;
    let group = d.heads / d.kv_heads.max(1);
    let (decode, heads_per_block) = if k == v && (d.head_dim == 64 || d.head_dim == 128) {
        (DecodeVariant::Fast, if group <= 4 { 4 } else { 8 })
    } else {
        (DecodeVariant::Even, 4)
    };
    let blocks = d.rows * d.kv_heads * group.div_ceil(heads_per_block);
    let splits = decode_splits(d.capacity, blocks, info.sm_count);
    let prefill = d.rows >= PREFILL_MIN_ROWS && prefill_kernel(d.head_dim, k, v).is_some();
    Ok(AttnPlan { decode, heads_per_block, splits, min_split: MIN_SPLIT, prefill })
}

/// `AttentionParams::block_shift`: log2 of a power-of-two block size (the kernels then shift
/// instead of dividing), else 32.
pub fn block_shift(block_size: usize) -> u32 {
    if block_size.is_power_of_two() { block_size.trailing_zeros() } else { 32 }
}

// ---------------------------------------------------------------------------------------------
// Launchers

#[allow(clippy::too_many_arguments)]
pub(crate) fn kv_store<D: Device>(
    g: &Gpu<D>,
    d: AttnDims,
    k: &T<D>,
    v: &T<D>,
    cache: &mut KvCacheLayer<GpuStorage<D::Buffer>>,
    table: &T<D>,
    slots: &T<D>,
    positions: &T<D>,
) -> Result<()> {
    let op = "kv_store";
    let name =
        KV_STORE[type_index(op, "k_cache", cache.k.dtype())?][type_index(op, "v_cache", cache.v.dtype())?];
    let p = KvStoreParams {
        k: addr::<D>(k),
        v: addr::<D>(v),
        k_cache: addr::<D>(&cache.k),
        v_cache: addr::<D>(&cache.v),
        block_table: addr::<D>(table),
        slots: addr::<D>(slots),
        positions: addr::<D>(positions),
        status: g.status_address(),
        rows: d.rows as u64,
        width: (d.kv_heads * d.head_dim) as u64,
        n_slots: dim(op, "slots", d.slots)?,
        capacity: dim(op, "capacity", d.capacity)?,
        block_size: dim(op, "block_size", d.block_size)?,
        num_blocks: dim(op, "num_blocks", d.num_blocks)?,
        max_blocks: dim(op, "max_blocks", d.max_blocks)?,
        reserved: 0,
    };
    let cfg = LaunchCfg::linear(dim(op, "rows", d.rows)?, THREADS, 0);
    // SAFETY: check_kv_store gave k, v [rows, kv_heads, head_dim] f32, the caches [num_blocks,
    // block_size, kv_heads, head_dim] of the dtypes the kernel name says, the block table u32
    // [n_slots, max_blocks], slots and positions u32 [rows]; the kernel reads a table entry only
    // at a slot and position it checked against n_slots and capacity, and writes a cache block
    // only after checking its id against num_blocks; the caches are borrowed mutably.
    unsafe { g.launch(name, cfg, &p) }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn attention<D: Device>(
    g: &Gpu<D>,
    d: AttnDims,
    q: &T<D>,
    cache: &KvCacheLayer<GpuStorage<D::Buffer>>,
    table: &T<D>,
    slots: &T<D>,
    positions: &T<D>,
    scale: f32,
    out: &mut T<D>,
) -> Result<()> {
    let plan = plan(d, cache.k.dtype(), cache.v.dtype(), g.device().info(), g.name())?;
    launch_attention(g, d, q, cache, table, slots, positions, scale, out, &plan)
}

/// `Backend::attention` with an explicit plan instead of [`plan`]'s: the same checks, then the
/// plan is checked against the shapes and dtypes.
#[allow(clippy::too_many_arguments)]
pub fn attention_planned<D: Device>(
    g: &Gpu<D>,
    q: &T<D>,
    cache: &KvCacheLayer<GpuStorage<D::Buffer>>,
    table: &T<D>,
    slots: &T<D>,
    positions: &T<D>,
    scale: f32,
    out: &mut T<D>,
    plan: &AttnPlan,
) -> Result<()> {
    let d = crate::ops::check_attention(q, cache, table, slots, positions, scale, out)?;
    launch_attention(g, d, q, cache, table, slots, positions, scale, out, plan)
}

#[allow(clippy::too_many_arguments)]
fn launch_attention<D: Device>(
    g: &Gpu<D>,
    d: AttnDims,
    q: &T<D>,
    cache: &KvCacheLayer<GpuStorage<D::Buffer>>,
    table: &T<D>,
    slots: &T<D>,
    positions: &T<D>,
    scale: f32,
    out: &mut T<D>,
    plan: &AttnPlan,
) -> Result<()> {
    let op = "attention";
    let bad = |msg: String| Error::Argument { op, msg };
    check_head_dim(g.name(), d.head_dim)?;
    let (kt, vt) = (cache.k.dtype(), cache.v.dtype());
    let dec = decode_kernel(d, kt, vt, plan.decode, plan.heads_per_block)?;
    if !(1..=MAX_SPLITS).contains(&plan.splits) || plan.min_split == 0 {
        return Err(bad(format!("{} splits of at least {} positions", plan.splits, plan.min_split)));
    }
    let pre = match (plan.prefill, prefill_kernel(d.head_dim, kt, vt)) {
        (false, _) => None,
        (true, Some(k)) => Some(k),
        (true, None) => {
            return Err(bad(format!("no prefill kernel for {kt}/{vt} caches, head_dim {}", d.head_dim)));
        }
    };
    // Positions, capacities and their sums stay below 2^31 in the kernels' u32 arithmetic.
    if d.capacity > i32::MAX as usize {
        return Err(bad(format!("capacity {} exceeds {}", d.capacity, i32::MAX)));
    }
    let group = d.heads / d.kv_heads;
    let head_chunks = group.div_ceil(dec.heads_per_block);
    let scale_log2 = (f64::from(scale) * std::f64::consts::LOG2_E) as f32;
    let base = AttentionParams {
        q: addr::<D>(q),
        k_cache: addr::<D>(&cache.k),
        v_cache: addr::<D>(&cache.v),
        block_table: addr::<D>(table),
        slots: addr::<D>(slots),
        positions: addr::<D>(positions),
        out: addr::<D>(out),
        partial_acc: 0,
        partial_ml: 0,
        arrivals: 0,
        status: g.status_address(),
        rows: d.rows as u64,
        heads: dim(op, "heads", d.heads)?,
        kv_heads: dim(op, "kv_heads", d.kv_heads)?,
        head_dim: dim(op, "head_dim", d.head_dim)?,
        n_slots: dim(op, "slots", d.slots)?,
        capacity: dim(op, "capacity", d.capacity)?,
        block_size: dim(op, "block_size", d.block_size)?,
        block_shift: block_shift(d.block_size),
        num_blocks: dim(op, "num_blocks", d.num_blocks)?,
        max_blocks: dim(op, "max_blocks", d.max_blocks)?,
        head_chunk: 0,
        head_chunks: 0,
        splits: 1,
        min_split: dim(op, "min_split", plan.min_split)?,
        prefill_rows: 0,
        scale_log2,
        reserved: 0,
    };

    let mut prefill_launch = None;
    let mut prefill_rows = 0;
    if let Some(k) = pre {
        let (heads, chunks, rows_per_tile) = k.tiling(group);
        prefill_rows = dim(op, "prefill rows", rows_per_tile)?;
        let p = AttentionParams {
            head_chunk: dim(op, "head chunk", heads)?,
            head_chunks: dim(op, "head chunks", chunks)?,
            prefill_rows,
            ..base
        };
        let grid = [
            dim(op, "prefill tiles", d.rows.div_ceil(rows_per_tile))?,
            dim(op, "kv heads x head chunks", d.kv_heads * chunks)?,
            1,
        ];
        let cfg =
            LaunchCfg { grid, block: [THREADS, 1, 1], shared_bytes: dim(op, "shared", k.shared_bytes())? };
        prefill_launch = Some((k.name, cfg, p));
    }

    let decode = AttentionParams {
        head_chunk: dim(op, "head chunk", dec.heads_per_block)?,
        head_chunks: dim(op, "head chunks", head_chunks)?,
        splits: dim(op, "splits", plan.splits)?,
        prefill_rows,
        ..base
    };
    let decode_cfg = LaunchCfg {
        grid: [
            dim(op, "rows", d.rows)?,
            decode.splits,
            dim(op, "kv heads x head chunks", d.kv_heads * head_chunks)?,
        ],
        block: [THREADS, 1, 1],
        shared_bytes: dim(op, "shared", dec.shared_bytes())?,
    };

    if let Some((name, cfg, p)) = prefill_launch {
        // SAFETY: check_attention gave q and out [rows, heads, head_dim] f32, the caches
        // [num_blocks, block_size, kv_heads, head_dim] of the dtypes the kernel name says (one for
        // both), the block table u32 [n_slots, max_blocks], slots and positions u32 [rows];
        // head_dim is even and <= the kernel's hd_max, the grid covers rows / prefill_rows tiles
        // and kv_heads x head_chunks head groups; the kernel reads table entries only at checked
        // slots and positions, cache blocks only through entries it checked against num_blocks,
        // and writes out rows of its tiles; out is borrowed mutably.
        unsafe { g.launch(name, cfg, &p)? };
    }
    if plan.splits == 1 {
        // SAFETY: as for the prefill kernel; with one split the decode kernel writes only out
        // (the scratch pointers are null and unused), rows the prefill kernel does not own.
        return unsafe { g.launch(dec.name, decode_cfg, &decode) };
    }
    // Scratch: arrival counters (kept zero between launches) and the splits' partials, each
    // (row, head, split) output row padded to a multiple of 4 floats.
    let hd4 = d.head_dim.div_ceil(4) * 4;
    let rhs = d.rows * d.heads * plan.splits;
    let sizes = [d.rows * d.kv_heads * head_chunks * 4, rhs * hd4 * 4, rhs * 2 * 4];
    g.with_scratch(op, &sizes, |at| {
        let p = AttentionParams { arrivals: at[0], partial_acc: at[1], partial_ml: at[2], ..decode };
        // SAFETY: as above; besides out, the kernel writes partial_acc [rows, heads, splits, hd4]
        // and partial_ml [rows, heads, splits, 2] f32 and arrivals [rows, kv_heads x head_chunks]
        // u32, which `with_scratch` sized and holds for this launch, and returns every counter
        // it raised to zero.
        unsafe { g.launch(dec.name, decode_cfg, &p) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(rows: usize, heads: usize, kv_heads: usize, head_dim: usize, capacity: usize) -> AttnDims {
        AttnDims {
            rows,
            heads,
            kv_heads,
            head_dim,
            slots: 4,
            capacity,
            block_size: 16,
            num_blocks: 64,
            max_blocks: capacity.div_ceil(16),
        }
    }

    use super::super::test_h200 as h200;

    #[test]
    fn splits_fill_the_gpu_at_batch_one() {
        // Llama 3.1 8B decode at 8K: 8 kv heads, one block each per split; 2 x 132 blocks.
        assert_eq!(decode_splits(8192, 8, 132), 33);
        assert!(8 * decode_splits(8192, 8, 132) >= 2 * 132);
        // Short contexts: no split under MIN_SPLIT positions.
        assert_eq!(decode_splits(100, 8, 132), 2);
        assert_eq!(decode_splits(1, 8, 132), 1);
        // Large batches fill the GPU without splitting.
        assert_eq!(decode_splits(8192, 64 * 8, 132), 1);
        // Never more than MAX_SPLITS; a zero SM count or block count still gives a valid split.
        assert_eq!(decode_splits(1 << 20, 1, 132), MAX_SPLITS);
        assert_eq!(decode_splits(8192, 0, 0), 2);
    }

    #[test]
    fn plan_picks_fast_kernels_and_prefill() {
        let info = h200();
        let p = plan(dims(1, 32, 8, 128, 8192), DType::BF16, DType::BF16, &info, "cuda").unwrap();
        assert_eq!(
            p,
            AttnPlan {
                decode: DecodeVariant::Fast,
                heads_per_block: 4,
                splits: 33,
                min_split: 64,
                prefill: false
            }
        );
        // 70B: 8 query heads per kv head in one block.
        let p = plan(dims(1, 64, 8, 128, 8192), DType::BF16, DType::BF16, &info, "cuda").unwrap();
        assert_eq!((p.decode, p.heads_per_block), (DecodeVariant::Fast, 8));
        // Mixed cache dtypes or other head dims: the even kernel.
        let p = plan(dims(1, 32, 8, 128, 8192), DType::BF16, DType::F16, &info, "cuda").unwrap();
        assert_eq!((p.decode, p.heads_per_block, p.prefill), (DecodeVariant::Even, 4, false));
        let p = plan(dims(512, 32, 8, 96, 8192), DType::F16, DType::F16, &info, "cuda").unwrap();
        assert_eq!((p.decode, p.splits, p.prefill), (DecodeVariant::Even, 1, true));
        // Below PREFILL_MIN_ROWS rows the decode kernel alone.
        let p = plan(dims(7, 32, 8, 128, 8192), DType::F32, DType::F32, &info, "cuda").unwrap();
        assert!(!p.prefill);
        // Odd or too large head dims are unsupported, as a typed error.
        for hd in [3, 258, 0] {
            let e = plan(dims(1, 4, 4, hd, 16), DType::F32, DType::F32, &info, "cuda").unwrap_err();
            assert!(matches!(e, Error::Unsupported { op: "attention", .. }), "{e}");
        }
    }

    #[test]
    fn kernels_fit_the_shared_memory_without_opt_in() {
        let d = dims(1, 8, 1, 128, 16);
        for t in CACHE_TYPES {
            for (hd, g) in [(64, 4), (64, 8), (128, 4), (128, 8)] {
                let k = decode_kernel(AttnDims { head_dim: hd, ..d }, t, t, DecodeVariant::Fast, g).unwrap();
                assert!(k.shared_bytes() <= 48 * 1024, "{k:?}");
                assert!(g * MAX_SPLITS <= k.shared_bytes() / 4, "the merge weights fit");
            }
            let k = decode_kernel(d, t, DType::F32, DecodeVariant::Even, 4).unwrap();
            assert_eq!(k.shared_bytes(), 4 * 4 * 258 * 4);
            for hd in [2, 64, 66, 128, 130, 256] {
                let k = prefill_kernel(hd, t, t).unwrap();
                assert!(k.hd_max >= hd && k.shared_bytes() <= 48 * 1024);
            }
        }
        assert!(
            decode_kernel(dims(1, 8, 1, 96, 16), DType::F32, DType::F32, DecodeVariant::Fast, 4).is_err()
        );
        assert!(decode_kernel(d, DType::F32, DType::BF16, DecodeVariant::Fast, 4).is_err());
        assert!(decode_kernel(d, DType::F32, DType::F32, DecodeVariant::Fast, 2).is_err());
        assert!(decode_kernel(d, DType::U32, DType::F32, DecodeVariant::Even, 4).is_err());
        assert!(prefill_kernel(128, DType::F32, DType::BF16).is_none());
    }

    #[test]
    fn prefill_tiling_covers_the_group() {
        let k = prefill_kernel(128, DType::BF16, DType::BF16).unwrap();
        assert_eq!(k.query_vectors, 32);
        assert_eq!(k.tiling(4), (4, 1, 8));
        assert_eq!(k.tiling(1), (1, 1, 32));
        assert_eq!(k.tiling(3), (3, 1, 10));
        assert_eq!(k.tiling(64), (32, 2, 1));
        let k = prefill_kernel(256, DType::F32, DType::F32).unwrap();
        assert_eq!(k.tiling(8), (8, 1, 2));
    }

    #[test]
    fn kernel_names_are_distinct() {
        let mut names = kernel_names();
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n);
        assert_eq!(n, 9 + 9 + 12 + 9);
    }

    #[test]
    fn params_layout() {
        assert_eq!(std::mem::offset_of!(AttentionParams, heads), 96);
        assert_eq!(std::mem::offset_of!(AttentionParams, prefill_rows), 148);
        assert_eq!(std::mem::offset_of!(KvStoreParams, capacity), 84);
    }
}
