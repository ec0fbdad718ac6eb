//! Tensors in storage for more rows than they run at (`Tensor::set_rows`): an op must read and
//! write only the current rows. Each spare tensor's rows past the current ones hold the poison
//! pattern, and `same` checks both its rows against an exactly sized tensor's and that the poison
//! is intact.

use memwall_runtime::{Backend, DType, Tensor};

use super::{Rng, assert_same_bytes, poison_bytes, poisoned, random_values, read_bytes};

/// Rows the spare tensors are allocated with.
pub const MAX: usize = 9;
/// Rows the ops run on.
pub const ROWS: usize = 3;

/// `[ROWS, row..]` holding `bytes` exactly sized, and the same in storage for `MAX` rows whose
/// spare rows are poison.
pub fn pair<B: Backend>(
    b: &B,
    dtype: DType,
    row: &[usize],
    bytes: &[u8],
) -> (Tensor<B::Storage>, Tensor<B::Storage>) {
    pair_at(b, dtype, ROWS, row, bytes)
}

/// [`pair`] at `rows` rows (up to `MAX`).
pub fn pair_at<B: Backend>(
    b: &B,
    dtype: DType,
    rows: usize,
    row: &[usize],
    bytes: &[u8],
) -> (Tensor<B::Storage>, Tensor<B::Storage>) {
    let shape = |r: usize| [&[r][..], row].concat();
    let exact = b.upload(dtype, &shape(rows), bytes).unwrap_or_else(|e| panic!("{}: upload: {e}", b.name()));
    let mut spare = poisoned(b, dtype, &shape(MAX));
    spare.set_rows(rows).unwrap_or_else(|e| panic!("{}: set_rows: {e}", b.name()));
    b.write(&mut spare, bytes).unwrap_or_else(|e| panic!("{}: write: {e}", b.name()));
    (exact, spare)
}

/// A pair of random f32 rows.
pub fn f32_pair<B: Backend>(b: &B, rng: &mut Rng, row: &[usize]) -> (Tensor<B::Storage>, Tensor<B::Storage>) {
    let n = ROWS * row.iter().product::<usize>();
    pair(b, DType::F32, row, bytemuck::cast_slice(&random_values(rng, DType::F32, n)))
}

/// The spare tensor equals the exact one over its rows, and its spare rows are still poison.
pub fn same<B: Backend>(b: &B, name: &str, exact: &Tensor<B::Storage>, spare: &mut Tensor<B::Storage>) {
    let want = read_bytes(b, exact);
    spare.set_rows(MAX).unwrap_or_else(|e| panic!("{}: set_rows: {e}", b.name()));
    let all = read_bytes(b, spare);
    spare.set_rows(ROWS).unwrap_or_else(|e| panic!("{}: set_rows: {e}", b.name()));
    let (head, tail) = all.split_at(want.len());
    assert_same_bytes(&format!("{} {name}: rows", b.name()), spare.dtype(), head, &want);
    let poison = poison_bytes(spare.dtype(), tail.len() / spare.dtype().size());
    if let Some(i) = tail.iter().zip(&poison).position(|(g, w)| g != w) {
        panic!("{} {name}: spare byte {i} past the {} current bytes was written", b.name(), want.len());
    }
}
