//! The launchers, one module per kernel family of `kernels-cuda/`: each holds the `#[repr(C)]`
//! mirror of its params structs (`kernels-cuda/params/<family>.h`), the launch heuristics as pure
//! functions of (dims, dtypes, device info), and the typed launcher with the one `unsafe` call.
//!
//! Every mirror is listed in [`params_layouts`], one `params_layout!` line per struct; the
//! freshness test (`tests/simt.rs`) compares that table with the `MW_LAYOUT` entries the C++
//! compiler registered in the emulated image, field by field, and fails on a struct that exists
//! on one side only.

pub mod attention;
pub mod elementwise;
pub mod experts;
pub mod gemm;
pub mod linear;
pub mod rows;
pub mod select;
pub mod stream;

use super::{Device, GpuStorage};
use crate::{Error, Tensor};

/// The device address of a tensor's first element.
pub(crate) fn addr<D: Device>(t: &Tensor<GpuStorage<D::Buffer>>) -> u64 {
    D::address(&t.storage().buf)
}

/// `Unsupported` for an op this device does not run yet.
pub(crate) fn unsupported(op: &'static str, backend: &'static str) -> Error {
    Error::Unsupported { backend, op, reason: "no kernel for this op yet".into() }
}

/// One params struct as Rust lays it out (`params_layout!`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamsLayout {
    /// The struct's name, as in the C header.
    pub name: &'static str,
    pub size: usize,
    /// `(field, offset, size)` in declaration order.
    pub fields: Vec<(&'static str, usize, usize)>,
}

impl ParamsLayout {
    /// A layout from the tokens `params_layout!` saw: a path (`elementwise::AddAssignParams`) is
    /// named by its last segment, a raw field name (`r#in`) without its `r#`.
    #[doc(hidden)]
    pub fn from_tokens(path: &'static str, size: usize, fields: Vec<(&'static str, usize, usize)>) -> Self {
        let name = path.rsplit("::").next().unwrap_or(path).trim();
        let fields = fields.into_iter().map(|(f, o, s)| (f.trim_start_matches("r#"), o, s)).collect();
        ParamsLayout { name, size, fields }
    }
}

/// Every kernel some launcher of this module can launch (each module's `kernel_names`), the list
/// the build tests look up in every compiled image.
pub fn kernel_names() -> Vec<&'static str> {
    let mut names = elementwise::kernel_names();
    names.extend(rows::kernel_names());
    names.extend(attention::kernel_names());
    names.extend(linear::kernel_names());
    names.extend(experts::kernel_names());
    names.extend(select::kernel_names());
    names.extend(stream::kernel_names());
    names
}

/// The size of the field a projection `|s: &S| &s.f` reaches.
#[doc(hidden)]
pub fn field_size<S, F>(_: fn(&S) -> &F) -> usize {
    std::mem::size_of::<F>()
}

/// The [`ParamsLayout`] of a `#[repr(C)]` params mirror: `params_layout!(AddAssignParams { x, y, n })`
/// with every field, in declaration order.
#[macro_export]
macro_rules! params_layout {
    ($S:ty { $($f:ident),* $(,)? }) => {
        $crate::gpu::ops::ParamsLayout::from_tokens(
            stringify!($S),
            ::std::mem::size_of::<$S>(),
            vec![$((
                stringify!($f),
                ::std::mem::offset_of!($S, $f),
                $crate::gpu::ops::field_size(|s: &$S| &s.$f),
            )),*],
        )
    };
}

/// Every params mirror of the launchers: one line per struct of `kernels-cuda/params/*.h`.
pub fn params_layouts() -> Vec<ParamsLayout> {
    vec![
        // attention.rs
        params_layout!(attention::KvStoreParams {
            k,
            v,
            k_cache,
            v_cache,
            block_table,
            slots,
            positions,
            status,
            rows,
            width,
            n_slots,
            capacity,
            block_size,
            num_blocks,
            max_blocks,
            reserved
        }),
        params_layout!(attention::AttentionParams {
            q,
            k_cache,
            v_cache,
            block_table,
            slots,
            positions,
            out,
            partial_acc,
            partial_ml,
            arrivals,
            status,
            rows,
            heads,
            kv_heads,
            head_dim,
            n_slots,
            capacity,
            block_size,
            block_shift,
            num_blocks,
            max_blocks,
            head_chunk,
            head_chunks,
            splits,
            min_split,
            prefill_rows,
            scale_log2,
            reserved
        }),
        // elementwise.rs
        params_layout!(elementwise::AddAssignParams { x, y, n }),
        params_layout!(elementwise::SiluMulParams { out, gate, up, n }),
        params_layout!(elementwise::RmsNormParams { y, x, weight, rows, cols, eps, pad }),
        params_layout!(elementwise::RopeParams {
            x,
            positions,
            rows,
            heads,
            half,
            heads_per_block,
            pad,
            inv_freq
        }),
        // linear.rs (GEMV; gemm.rs takes the same params)
        params_layout!(linear::LinearParams {
            y,
            x,
            weight,
            scales,
            m,
            n,
            k,
            block_rows,
            block_cols,
            scale,
            y_dtype
        }),
        params_layout!(linear::WidenParams { out, x, n }),
        params_layout!(linear::GateUpParams { gate, up, up_scales, up_scale, pad }),
        params_layout!(linear::QkvParams { part, blocks }),
        params_layout!(linear::GemvTcParams { lin, partials, arrivals, split_cols, splits }),
        // experts.rs
        params_layout!(experts::ExpertMatrix { weight, scales, scale, pad }),
        params_layout!(experts::ExpertsGemvParams { base, offsets, active, experts, blocks_per_expert, mat }),
        params_layout!(experts::ExpertsGateUpParams {
            base,
            offsets,
            active,
            experts,
            blocks_per_expert,
            gate,
            up
        }),
        params_layout!(experts::ExpertsRouteParams {
            order,
            sorted_w,
            offsets,
            active,
            row_pos,
            ids,
            weights,
            status,
            rows,
            k,
            experts,
            pad
        }),
        params_layout!(experts::ExpertsCombineParams { out, ys, sorted_w, row_pos, rows, cols, k, pad }),
        // rows.rs
        params_layout!(rows::EmbeddingParams {
            out,
            table,
            ids,
            scales,
            status,
            picked,
            vocab,
            cols,
            block_rows,
            block_cols,
            scale,
            pad
        }),
        params_layout!(rows::GatherRowsParams { out, src, idx, status, picked, rows, cols }),
        params_layout!(rows::ScatterAddRowsParams {
            dst,
            idx,
            src,
            weights,
            status,
            rows,
            picked,
            cols,
            rows_per_group
        }),
        // select.rs
        params_layout!(select::ArgmaxParams { logits, out, rows, cols }),
        params_layout!(select::RouterParams { logits, ids, weights, rows, experts, k }),
        params_layout!(select::SampleParams {
            logits,
            seeds,
            steps,
            out,
            rows,
            cols,
            top_k,
            temperature,
            top_p
        }),
        // stream.rs
        params_layout!(stream::StreamParams { dst, src, sum, vecs }),
    ]
}

/// The device the launch heuristics' unit tests plan for: an H200 as the driver reports it.
#[cfg(test)]
pub(crate) fn test_h200() -> super::DeviceInfo {
    super::DeviceInfo {
        name: "H200".into(),
        vendor: super::Vendor::Nvidia,
        arch: (9, 0),
        warp_size: 32,
        sm_count: 132,
        max_shared_per_block: 227 * 1024,
        max_threads_per_block: 1024,
        max_grid: [i32::MAX as u32, 65535, 65535],
        total_memory: 141 << 30,
    }
}
