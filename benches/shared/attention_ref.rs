//! The exact (f64) attention of one query head, which the CPU and GPU attention benches check a
//! backend against before timing it, each with its own bound, and the gather of a head's rows
//! from a paged cache that it takes.

/// One head's exact result over its positions.
pub struct HeadRef {
    /// `softmax(scale q . K^T) V`, per dimension.
    pub out: Vec<f64>,
    /// `sum_t p_t |v_t|` per dimension: what the bounds are relative to.
    pub pv_abs: Vec<f64>,
    /// `max_t scale sum_e |q_e k_te|`: the largest a logit's rounding can scale with.
    pub a_max: f64,
}

/// Query head `q` (`head_dim` values) against `keys` and `values`, the head's cached rows
/// (`[positions, head_dim]` each, widened to f32).
pub fn head_reference(q: &[f32], keys: &[f32], values: &[f32], scale: f64) -> HeadRef {
    let hd = q.len();
    let s: Vec<f64> = keys.chunks_exact(hd).map(|k| scale * dot(q, k)).collect();
    let a_max = keys
        .chunks_exact(hd)
        .map(|k| scale * q.iter().zip(k).map(|(&a, &b)| (f64::from(a) * f64::from(b)).abs()).sum::<f64>())
        .fold(0.0, f64::max);
    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = s.iter().map(|&x| (x - m).exp()).collect();
    let z: f64 = w.iter().sum();
    let (mut out, mut pv_abs) = (vec![0f64; hd], vec![0f64; hd]);
    for (&wp, v) in w.iter().zip(values.chunks_exact(hd)) {
        for ((o, a), &val) in out.iter_mut().zip(pv_abs.iter_mut()).zip(v) {
            *o += wp / z * f64::from(val);
            *a += wp / z * f64::from(val).abs();
        }
    }
    HeadRef { out, pv_abs, a_max }
}

/// Where a paged cache keeps its rows: blocks of `block` positions, each position
/// `[kv_heads, head_dim]`, a sequence's blocks named by its row of the block table.
#[derive(Clone, Copy)]
pub struct Paged {
    pub block: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// KV head `g`'s cached rows for positions `0..context` of the sequence whose block-table row is
/// `table_row`, position by position (`[context, head_dim]`), as `elem` reads the cache's element
/// at an index (so any cache dtype).
pub fn head_rows(
    layout: Paged,
    table_row: &[u32],
    g: usize,
    context: usize,
    elem: impl Fn(usize) -> f32,
) -> Vec<f32> {
    let Paged { block, kv_heads, head_dim } = layout;
    let mut rows = Vec::with_capacity(context * head_dim);
    for p in 0..context {
        let at = ((table_row[p / block] as usize * block + p % block) * kv_heads + g) * head_dim;
        rows.extend((at..at + head_dim).map(&elem));
    }
    rows
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| f64::from(x) * f64::from(y)).sum()
}
