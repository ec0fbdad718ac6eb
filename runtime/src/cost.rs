//! Bytes each op moves through memory, from shapes and element sizes only: the one place benches,
//! the memory-wall report and the model's op list (`OpCost`) count them. Decimal GB/s figures
//! divide these.
//!
//! The count is the minimum traffic an op needs: every input byte read once and every output byte
//! written once. A kernel that reads a weight twice moves more, and shows as a lower GB/s.

use crate::{DType, Error, Result, Storage, WeightScale};

/// How a weight's scales are stored, as far as bytes go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleLayout {
    /// No scale.
    None,
    /// One scale passed by value with the op: no memory traffic.
    PerTensor,
    /// One scale of `dtype` per output row.
    PerChannel(DType),
    /// One scale of `dtype` per `block_rows x block_cols` block.
    Block { block_rows: usize, block_cols: usize, dtype: DType },
}

impl ScaleLayout {
    /// The layout of a weight's scale.
    pub fn of<S: Storage>(scale: &WeightScale<S>) -> ScaleLayout {
        match scale {
            WeightScale::None => ScaleLayout::None,
            WeightScale::PerTensor(_) => ScaleLayout::PerTensor,
            WeightScale::PerChannel(s) => ScaleLayout::PerChannel(s.dtype()),
            WeightScale::Block { block_rows, block_cols, scales } => {
                ScaleLayout::Block { block_rows: *block_rows, block_cols: *block_cols, dtype: scales.dtype() }
            }
        }
    }

    /// Bytes of the scales of an `[n, k]` weight; `None` on overflow or a zero-sized block.
    pub fn bytes(self, n: usize, k: usize) -> Option<u64> {
        let (count, dtype) = match self {
            ScaleLayout::None | ScaleLayout::PerTensor => return Some(0),
            ScaleLayout::PerChannel(dtype) => (n as u64, dtype),
            ScaleLayout::Block { block_rows, block_cols, dtype } => {
                if block_rows == 0 || block_cols == 0 {
                    return None;
                }
                ((n.div_ceil(block_rows) as u64).checked_mul(k.div_ceil(block_cols) as u64)?, dtype)
            }
        };
        count.checked_mul(dtype.size() as u64)
    }
}

/// The traffic of a linear layer `y[m, n] = x[m, k] . W[n, k]^T`, by operand: the weight and its
/// scales read once, `x` read once, `y` written once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinearBytes {
    pub weight: u64,
    pub scales: u64,
    pub x: u64,
    pub y: u64,
}

impl LinearBytes {
    /// Bytes read: weight, scales and `x` (what the model's `OpCost::bytes_read` counts).
    pub fn read(&self) -> u64 {
        self.weight + self.scales + self.x
    }

    /// Bytes read and written (what a GEMV bench divides by its time).
    pub fn total(&self) -> u64 {
        self.read() + self.y
    }

    /// `self` if `total()` fits in `u64` (so neither it nor `read()` can overflow).
    fn checked(self) -> Option<LinearBytes> {
        self.weight.checked_add(self.scales)?.checked_add(self.x)?.checked_add(self.y)?;
        Some(self)
    }
}

/// The traffic of a linear layer `y[m, n] = x[m, k] . W[n, k]^T` with a weight of `weight`
/// elements scaled as `scale`, and `x`, `y` of dtype `act`. An error if a count overflows `u64`
/// (so `read()` and `total()` cannot overflow either) or a block scale is zero-sized.
pub fn linear_traffic(
    m: usize,
    n: usize,
    k: usize,
    weight: DType,
    scale: ScaleLayout,
    act: DType,
) -> Result<LinearBytes> {
    traffic(m, n, k, weight, scale, act, act).ok_or_else(|| Error::ShapeOverflow { shape: vec![m, n, k] })
}

/// `linear_traffic` with `x` of dtype `x_dtype` and `y` of `y_dtype`; `None` on overflow.
fn traffic(
    m: usize,
    n: usize,
    k: usize,
    weight: DType,
    scale: ScaleLayout,
    x_dtype: DType,
    y_dtype: DType,
) -> Option<LinearBytes> {
    let (m64, n64, k64) = (m as u64, n as u64, k as u64);
    LinearBytes {
        weight: n64.checked_mul(k64)?.checked_mul(weight.size() as u64)?,
        scales: scale.bytes(n, k)?,
        x: m64.checked_mul(k64)?.checked_mul(x_dtype.size() as u64)?,
        y: m64.checked_mul(n64)?.checked_mul(y_dtype.size() as u64)?,
    }
    .checked()
}

/// Bytes a linear layer `y[m, n] = x[m, k] . W[n, k]^T` moves: the weight (`weight` elements) and
/// its scales read once, `x` read once and `y` written once (both of dtype `act`). For a GEMV
/// (`m = 1`) the weight is nearly all of it.
pub fn linear_bytes(
    m: usize,
    n: usize,
    k: usize,
    weight: DType,
    scale: ScaleLayout,
    act: DType,
) -> Result<u64> {
    linear_traffic(m, n, k, weight, scale, act).map(|b| b.total())
}

/// The traffic of decode attention over a KV cache: the live keys and values read once (the
/// `attended` positions summed over the query rows, each `kv_heads x head_dim` elements of `k`
/// and of `v`), `q` and the rows' slot and position (u32 each) read once, `out` written once (`q`
/// and `out` `[rows, heads, head_dim]` of `act`). The allocated capacity of the cache never counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttentionBytes {
    pub kv: u64,
    pub q: u64,
    /// The rows' slot and position indices.
    pub index: u64,
    pub out: u64,
}

impl AttentionBytes {
    /// Bytes read: keys, values, `q` and the indices (what the model's `OpCost::bytes_read`
    /// counts).
    pub fn read(&self) -> u64 {
        self.kv + self.q + self.index
    }

    /// Bytes read and written (what an attention bench divides by its time).
    pub fn total(&self) -> u64 {
        self.read() + self.out
    }
}

/// The traffic of attention of `rows` query rows of `heads` heads over `attended` cached positions
/// in all (the sum over rows of `position + 1`), `kv_heads` of `head_dim` in the cache, keys of
/// dtype `k` and values of dtype `v`, activations of `act`. An error if a count overflows `u64`.
#[allow(clippy::too_many_arguments)]
pub fn attention_traffic(
    rows: usize,
    attended: u64,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    k: DType,
    v: DType,
    act: DType,
) -> Result<AttentionBytes> {
    let counted = (|| {
        let row_elems = (heads as u64).checked_mul(head_dim as u64)?.checked_mul(rows as u64)?;
        let kv_elems = attended.checked_mul(kv_heads as u64)?.checked_mul(head_dim as u64)?;
        let b = AttentionBytes {
            kv: kv_elems.checked_mul(k.size() as u64 + v.size() as u64)?,
            q: row_elems.checked_mul(act.size() as u64)?,
            index: (rows as u64).checked_mul(8)?,
            out: row_elems.checked_mul(act.size() as u64)?,
        };
        b.kv.checked_add(b.q)?.checked_add(b.index)?.checked_add(b.out)?;
        Some(b)
    })();
    counted.ok_or_else(|| Error::ShapeOverflow { shape: vec![rows, heads, kv_heads, head_dim] })
}

/// The traffic of `gate_up_silu`, `out[m, n] = silu(x . W_gate^T) * (x . W_up^T)`: both `[n, k]`
/// weights (of `weight` elements, each scaled as `scale`) and their scales read once, `x` (of
/// `act`) read once, the f32 `out` written once; the fused kernel's minimum (a composed
/// `linear`, `linear`, `silu_mul` also moves x a second time and the two products through memory).
pub fn gate_up_silu_traffic(
    m: usize,
    n: usize,
    k: usize,
    weight: DType,
    scale: ScaleLayout,
    act: DType,
) -> Result<LinearBytes> {
    // The gate and up products as two linears writing f32; fused, they share the one read of x
    // and the one write of out.
    let counted = (|| {
        let gate = traffic(m, n, k, weight, scale, act, DType::F32)?;
        let up = gate; // the same shapes
        LinearBytes {
            weight: gate.weight.checked_add(up.weight)?,
            scales: gate.scales.checked_add(up.scales)?,
            ..gate
        }
        .checked()
    })();
    counted.ok_or_else(|| Error::ShapeOverflow { shape: vec![m, n, k] })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemv_bytes_at_llama_shapes() {
        // bf16 4096x4096, f32 x and y: 32 MiB of weight + 16 KiB + 16 KiB.
        let b = linear_bytes(1, 4096, 4096, DType::BF16, ScaleLayout::None, DType::F32);
        assert_eq!(b, Ok(4096 * 4096 * 2 + 4096 * 4 + 4096 * 4));
        // fp8 28672x4096 with per-channel f32 scales.
        let b =
            linear_bytes(1, 28672, 4096, DType::F8E4M3Fn, ScaleLayout::PerChannel(DType::F32), DType::F32);
        assert_eq!(b, Ok(28672 * 4096 + 28672 * 4 + 4096 * 4 + 28672 * 4));
        // The down projection is wide: x is the long side.
        let b = linear_bytes(1, 4096, 14336, DType::BF16, ScaleLayout::PerTensor, DType::BF16);
        assert_eq!(b, Ok(4096 * 14336 * 2 + 14336 * 2 + 4096 * 2));
    }

    #[test]
    fn gate_up_silu_reads_x_once() {
        // Llama 3.1 8B: bf16 14336x4096 gate and up, one f32 row in, one out.
        let b = gate_up_silu_traffic(1, 14336, 4096, DType::BF16, ScaleLayout::None, DType::F32).unwrap();
        assert_eq!(b.total(), 2 * 14336 * 4096 * 2 + 4096 * 4 + 14336 * 4);
        let b =
            gate_up_silu_traffic(2, 8, 4, DType::F8E4M3Fn, ScaleLayout::PerChannel(DType::BF16), DType::BF16);
        assert_eq!(b, Ok(LinearBytes { weight: 2 * 32, scales: 2 * 16, x: 2 * 4 * 2, y: 2 * 8 * 4 }));
        assert!(gate_up_silu_traffic(usize::MAX, 3, 3, DType::F32, ScaleLayout::None, DType::F32).is_err());
    }

    #[test]
    fn batched_rows_read_the_weight_once() {
        let one = linear_bytes(1, 100, 30, DType::F16, ScaleLayout::None, DType::F32).expect("fits");
        let eight = linear_bytes(8, 100, 30, DType::F16, ScaleLayout::None, DType::F32).expect("fits");
        assert_eq!(eight - one, 7 * (30 + 100) * 4);
    }

    #[test]
    fn block_scales_round_up() {
        let s = ScaleLayout::Block { block_rows: 128, block_cols: 128, dtype: DType::F32 };
        assert_eq!(s.bytes(129, 256), Some(2 * 2 * 4));
        let s = ScaleLayout::Block { block_rows: 0, block_cols: 128, dtype: DType::F32 };
        assert_eq!(s.bytes(129, 256), None);
        assert!(linear_bytes(1, 129, 256, DType::F8E4M3Fn, s, DType::F32).is_err());
        assert_eq!(ScaleLayout::PerChannel(DType::BF16).bytes(10, 3), Some(20));
        assert_eq!(ScaleLayout::PerTensor.bytes(10, 3), Some(0));
    }

    #[test]
    fn overflow_is_an_error() {
        let r = linear_bytes(1, usize::MAX, usize::MAX, DType::F32, ScaleLayout::None, DType::F32);
        assert!(matches!(r, Err(Error::ShapeOverflow { .. })));
    }

    #[test]
    fn layout_of_a_weight_scale() {
        use crate::HostStorage;
        assert_eq!(ScaleLayout::of::<HostStorage>(&WeightScale::None), ScaleLayout::None);
        assert_eq!(ScaleLayout::of::<HostStorage>(&WeightScale::PerTensor(0.5)), ScaleLayout::PerTensor);
    }

    #[test]
    fn read_is_total_less_the_output() {
        let b = linear_traffic(3, 10, 7, DType::BF16, ScaleLayout::PerChannel(DType::F32), DType::F32)
            .expect("fits");
        assert_eq!(b, LinearBytes { weight: 140, scales: 40, x: 84, y: 120 });
        assert_eq!(b.read(), 264);
        assert_eq!(b.total(), 384);
    }

    #[test]
    fn attention_counts_the_live_positions() {
        // Llama 3.1 8B, one sequence at 8192 positions, bf16 cache, f32 q and out: 32 MiB of
        // keys and values per layer.
        let b = attention_traffic(1, 8192, 32, 8, 128, DType::BF16, DType::BF16, DType::F32).expect("fits");
        assert_eq!(b.kv, 8192 * 8 * 128 * 4);
        assert_eq!((b.q, b.out, b.index), (32 * 128 * 4, 32 * 128 * 4, 8));
        assert_eq!(b.read(), b.kv + b.q + 8);
        assert_eq!(b.total(), b.read() + b.out);
        // Two rows at positions 9 and 4 attend over 10 + 5 positions; k f32 and v f16.
        let b = attention_traffic(2, 15, 4, 2, 8, DType::F32, DType::F16, DType::F32).expect("fits");
        assert_eq!(b, AttentionBytes { kv: 15 * 2 * 8 * 6, q: 2 * 4 * 8 * 4, index: 16, out: 2 * 4 * 8 * 4 });
        let r = attention_traffic(1, u64::MAX, 32, 8, 128, DType::F32, DType::F32, DType::F32);
        assert!(matches!(r, Err(Error::ShapeOverflow { .. })));
    }
}
