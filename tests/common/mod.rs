//! The shared test kit (STYLE.md "Tests" 11-14).
//!
//! - Inputs: seeded, uniform in [-1, 1], never exactly 0 or ±1 (and exactly representable in the
//!   dtype they are uploaded as, so every backend reads the very values the test reasons about);
//!   index-revealing values for layout tests.
//! - Outputs are poisoned with a NaN pattern before every run, so an element a kernel forgets to
//!   write can never pass.
//! - One `assert_close` that checks every element against its own bound and fails hard, reporting
//!   max abs error, max rel error, NMSE and the first mismatching indices.

#![allow(dead_code)]

pub mod cli;
pub mod gpu;
pub mod spare;

use memwall_runtime::{Backend, DType, Float, Tensor, with_float_type};
use proptest::prelude::{ProptestConfig, Strategy};
use proptest::test_runner::{RngSeed, TestRunner};

/// Runs `test` on `cases` cases of `strategy` from `seed` (a fixed seed per suite and no failure
/// files: every run checks the same cases), failing with `who` (the backend's name) and the case.
pub fn run_cases<S: Strategy>(seed: u64, who: &str, cases: u32, strategy: S, test: impl Fn(S::Value))
where
    S::Value: std::fmt::Debug,
{
    let config = ProptestConfig {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        max_shrink_iters: 50,
        ..ProptestConfig::default()
    };
    let mut runner = TestRunner::new(config);
    if let Err(e) = runner.run(&strategy, |v| {
        test(v);
        Ok(())
    }) {
        panic!("{who}: {e}");
    }
}

// ---------------------------------------------------------------------------------------------
// Random inputs

/// splitmix64: small, seeded, the same numbers on every machine.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        assert!(n > 0, "Rng::below(0)");
        // 128-bit multiply-high: unbiased enough for tests, and never out of range.
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    /// Uniform in the open interval (0, 1), as f64.
    pub fn open01(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in (-1, 1) on the grid of odd multiples of 2^-24: never 0, never ±1, exact in f32.
    pub fn unit(&mut self) -> f32 {
        let k = (self.next_u64() >> 40) as i64; // 0 ..= 2^24 - 1
        ((2 * k + 1 - (1 << 24)) as f64 / (1u64 << 24) as f64) as f32
    }
}

/// `v` rounded to `dtype` and widened back: the value a tensor of `dtype` stores for `v`.
pub fn round_to(dtype: DType, v: f32) -> f32 {
    with_float_type!(dtype, T => T::from_f32(v).to_f32(), else => panic!("round_to({dtype}) is not a float type"))
}

/// `n` values uniform in [-1, 1], each exactly representable in `dtype`, none 0 or ±1.
pub fn random_values(rng: &mut Rng, dtype: DType, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            loop {
                let v = round_to(dtype, rng.unit());
                if v != 0.0 && v.abs() < 1.0 {
                    break v;
                }
            }
        })
        .collect()
}

/// `n` values in (0, 1), exact in `dtype`, none 0 or 1 (for scales).
pub fn random_positive(rng: &mut Rng, dtype: DType, n: usize) -> Vec<f32> {
    random_values(rng, dtype, n).into_iter().map(f32::abs).collect()
}

/// `n` values on a coarse grid (multiples of 1/`steps` in (-`spread`, `spread`), never 0): many
/// exact ties, and distinct values far enough apart that no f32 rounding can reorder them.
pub fn grid_values(rng: &mut Rng, n: usize, steps: usize, spread: usize) -> Vec<f32> {
    let top = steps * spread - 1;
    (0..n)
        .map(|_| {
            let k = rng.range(1, top) as f32 / steps as f32;
            if rng.next_u64() & 1 == 0 { k } else { -k }
        })
        .collect()
}

/// Index-revealing values: element `i` holds `i + 0.5` (exact in f32 below 2^23; never 0 or 1),
/// so a value out of place names the index it came from.
pub fn index_values(n: usize) -> Vec<f32> {
    (0..n).map(|i| i as f32 + 0.5).collect()
}

/// `n` indices in `0..len`.
pub fn random_indices(rng: &mut Rng, n: usize, len: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(len) as u32).collect()
}

// ---------------------------------------------------------------------------------------------
// Uploads and reads (test helpers: a failure here is a test failure, so they panic)

pub fn upload<B: Backend>(b: &B, dtype: DType, shape: &[usize], values: &[f32]) -> Tensor<B::Storage> {
    b.upload_f32(dtype, shape, values)
        .unwrap_or_else(|e| panic!("{}: upload of {dtype} {shape:?}: {e}", b.name()))
}

pub fn upload_u32<B: Backend>(b: &B, shape: &[usize], values: &[u32]) -> Tensor<B::Storage> {
    b.upload_u32(shape, values).unwrap_or_else(|e| panic!("{}: upload of u32 {shape:?}: {e}", b.name()))
}

/// A random tensor of `dtype` (values as `random_values`) and the values it holds.
pub fn random_tensor<B: Backend>(
    b: &B,
    rng: &mut Rng,
    dtype: DType,
    shape: &[usize],
) -> (Tensor<B::Storage>, Vec<f32>) {
    let values = random_values(rng, dtype, shape.iter().product());
    (upload(b, dtype, shape, &values), values)
}

pub fn read_f32<B: Backend>(b: &B, t: &Tensor<B::Storage>) -> Vec<f32> {
    b.read_f32(t).unwrap_or_else(|e| panic!("{}: read_f32: {e}", b.name()))
}

pub fn read_u32<B: Backend>(b: &B, t: &Tensor<B::Storage>) -> Vec<u32> {
    b.read_u32(t).unwrap_or_else(|e| panic!("{}: read_u32: {e}", b.name()))
}

pub fn read_bytes<B: Backend>(b: &B, t: &Tensor<B::Storage>) -> Vec<u8> {
    b.read(t).unwrap_or_else(|e| panic!("{}: read: {e}", b.name()))
}

// ---------------------------------------------------------------------------------------------
// Poison

/// One element of the poison pattern of `dtype`: a quiet NaN with a recognisable payload for the
/// wide floats, the NaN code of each fp8 flavour, and `0xFFFFFFFF` for u32.
pub fn poison_element(dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => 0x7fc5_a5a5u32.to_le_bytes().to_vec(),
        DType::BF16 => 0x7fc5u16.to_le_bytes().to_vec(),
        DType::F16 => 0x7e5au16.to_le_bytes().to_vec(),
        DType::F8E4M3Fn => vec![0x7f],
        DType::F8E4M3Fnuz | DType::F8E5M2Fnuz => vec![0x80],
        DType::F8E5M2 => vec![0x7e],
        DType::U32 => u32::MAX.to_le_bytes().to_vec(),
    }
}

pub fn poison_bytes(dtype: DType, numel: usize) -> Vec<u8> {
    poison_element(dtype).repeat(numel)
}

/// Overwrites `t` with the poison pattern.
pub fn poison<B: Backend>(b: &B, t: &mut Tensor<B::Storage>) {
    let bytes = poison_bytes(t.dtype(), t.numel());
    b.write(t, &bytes).unwrap_or_else(|e| panic!("{}: poison write: {e}", b.name()));
}

/// A fresh output tensor full of poison.
pub fn poisoned<B: Backend>(b: &B, dtype: DType, shape: &[usize]) -> Tensor<B::Storage> {
    let mut t =
        b.alloc(dtype, shape).unwrap_or_else(|e| panic!("{}: alloc {dtype} {shape:?}: {e}", b.name()));
    poison(b, &mut t);
    t
}

/// Fails unless every byte of `t` is still the poison pattern (nothing was written).
pub fn assert_poisoned<B: Backend>(b: &B, name: &str, t: &Tensor<B::Storage>) {
    let got = read_bytes(b, t);
    let want = poison_bytes(t.dtype(), t.numel());
    if let Some(i) = got.iter().zip(&want).position(|(g, w)| g != w) {
        panic!("{name} ({}): byte {i} of the poisoned output was written ({:#04x})", b.name(), got[i]);
    }
}

// ---------------------------------------------------------------------------------------------
// Tolerances

/// Unit roundoff of f32, 2^-24.
pub const U32: f64 = 1.0 / (1u64 << 24) as f64;
/// Unit roundoff of f64, 2^-53.
pub const U64: f64 = 1.0 / (1u64 << 53) as f64;

/// gamma_n = n u / (1 - n u) for f32: the bound on the relative error of a sum or dot product of
/// n terms accumulated in f32 in any order (Higham, Accuracy and Stability, 3.1).
pub fn gamma(n: usize) -> f64 {
    let nu = n as f64 * U32;
    assert!(nu < 0.5, "gamma({n}) is not meaningful in f32");
    nu / (1.0 - nu)
}

/// gamma_n for f64 accumulation (the reference's own error).
pub fn gamma64(n: usize) -> f64 {
    let nu = n as f64 * U64;
    nu / (1.0 - nu)
}

/// Unit roundoff of an output dtype.
pub fn unit_roundoff(dtype: DType) -> f64 {
    dtype.unit_roundoff().expect("a float dtype")
}

/// Half the spacing of the subnormals of `dtype`: the absolute error of rounding a tiny value.
pub fn underflow_abs(dtype: DType) -> f64 {
    match dtype {
        DType::F32 | DType::BF16 => 2f64.powi(-150),
        DType::F16 => 2f64.powi(-25),
        _ => panic!("underflow_abs({dtype}): not an output dtype"),
    }
}

// ---------------------------------------------------------------------------------------------
// Checks

/// Checks every `got[i]` against `want[i]` within `bound[i]` (absolute, per element) and fails
/// hard on any miss. A NaN in `got` where `want` is finite is a miss; where `want` is NaN or
/// infinite, `got` must be NaN or the same infinity.
pub fn assert_close(name: &str, got: &[f32], want: &[f32], bound: &[f64]) {
    assert_eq!(got.len(), want.len(), "{name}: got {} values, want {}", got.len(), want.len());
    assert_eq!(bound.len(), want.len(), "{name}: {} bounds for {} values", bound.len(), want.len());
    let (mut max_abs, mut max_rel, mut err2, mut ref2) = (0f64, 0f64, 0f64, 0f64);
    let mut misses = Vec::new();
    let mut n_miss = 0usize;
    let mut n_nonfinite = 0usize;
    for i in 0..want.len() {
        let (g, w, b) = (got[i] as f64, want[i] as f64, bound[i]);
        assert!(b >= 0.0, "{name}: bound {b} at {i} is not a bound");
        let ok = if w.is_nan() {
            g.is_nan()
        } else if w.is_infinite() {
            g == w
        } else {
            g.is_finite() && (g - w).abs() <= b
        };
        if g.is_finite() && w.is_finite() {
            let d = (g - w).abs();
            max_abs = max_abs.max(d);
            if w != 0.0 {
                max_rel = max_rel.max(d / w.abs());
            }
            err2 += d * d;
            ref2 += w * w;
        } else if !g.is_finite() {
            n_nonfinite += 1;
        }
        if !ok {
            n_miss += 1;
            if misses.len() < 8 {
                misses.push(i);
            }
        }
    }
    if n_miss > 0 {
        let nmse = if ref2 > 0.0 { err2 / ref2 } else { err2 };
        let mut report = format!(
            "{name}: {n_miss} of {} elements out of bounds ({n_nonfinite} non-finite in got); max abs \
             err {max_abs:.3e}, max rel err {max_rel:.3e}, NMSE {nmse:.3e}; first misses:",
            want.len()
        );
        for i in misses {
            report.push_str(&format!(
                "\n  [{i}] got {:e} want {:e} |diff| {:.3e} bound {:.3e}",
                got[i],
                want[i],
                (got[i] as f64 - want[i] as f64).abs(),
                bound[i]
            ));
        }
        panic!("{report}");
    }
}

/// Exact equality of integer outputs, reporting the first mismatches.
pub fn assert_same_u32(name: &str, got: &[u32], want: &[u32]) {
    assert_eq!(got.len(), want.len(), "{name}: got {} values, want {}", got.len(), want.len());
    let misses: Vec<usize> = (0..want.len()).filter(|&i| got[i] != want[i]).collect();
    if !misses.is_empty() {
        let mut report = format!("{name}: {} of {} values differ:", misses.len(), want.len());
        for &i in misses.iter().take(8) {
            report.push_str(&format!("\n  [{i}] got {} want {}", got[i], want[i]));
        }
        panic!("{report}");
    }
}

/// Exact equality of raw bytes (caches, copies), reporting the first mismatching elements.
pub fn assert_same_bytes(name: &str, dtype: DType, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{name}: got {} bytes, want {}", got.len(), want.len());
    let size = dtype.size();
    let misses: Vec<usize> = (0..want.len() / size)
        .filter(|&i| got[i * size..(i + 1) * size] != want[i * size..(i + 1) * size])
        .collect();
    if !misses.is_empty() {
        let mut report =
            format!("{name}: {} of {} {dtype} elements differ:", misses.len(), want.len() / size);
        for &i in misses.iter().take(8) {
            report.push_str(&format!(
                "\n  [{i}] got {:02x?} want {:02x?}",
                &got[i * size..(i + 1) * size],
                &want[i * size..(i + 1) * size]
            ));
        }
        panic!("{report}");
    }
}

// ---------------------------------------------------------------------------------------------
// Paged KV caches

/// A block table for tests: `slots` rows of `max_blocks = ceil(capacity / block_size)` entries
/// over `num_blocks` physical blocks, the blocks shuffled (non-contiguous, out of order, some
/// spare blocks never named), and every entry past the last block a slot uses set to `u32::MAX`
/// (the kernels must not read it).
#[derive(Clone, Debug)]
pub struct Paging {
    pub block_size: usize,
    pub num_blocks: usize,
    pub max_blocks: usize,
    /// `[slots, max_blocks]`, row-major.
    pub table: Vec<u32>,
}

impl Paging {
    /// `used[s]`: positions slot s uses (its entries for blocks past them are `u32::MAX`).
    pub fn random(rng: &mut Rng, block_size: usize, capacity: usize, used: &[usize]) -> Paging {
        let max_blocks = capacity.div_ceil(block_size);
        let slots = used.len();
        let spare = rng.range(0, 3);
        let num_blocks = slots * max_blocks + spare;
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.below(i + 1));
        }
        let mut table = vec![u32::MAX; slots * max_blocks];
        for (s, &n) in used.iter().enumerate() {
            for j in 0..n.div_ceil(block_size) {
                table[s * max_blocks + j] = ids[s * max_blocks + j];
            }
        }
        Paging { block_size, num_blocks, max_blocks, table }
    }

    /// The contiguous layout: one block of `capacity` positions per slot, slot s in block s.
    pub fn contiguous(slots: usize, capacity: usize) -> Paging {
        Paging { block_size: capacity, num_blocks: slots, max_blocks: 1, table: (0..slots as u32).collect() }
    }

    /// The cache shape `[num_blocks, block_size, kv_heads, head_dim]`.
    pub fn shape(&self, kv_heads: usize, head_dim: usize) -> [usize; 4] {
        [self.num_blocks, self.block_size, kv_heads, head_dim]
    }

    /// The cache row (position of the `[num_blocks * block_size]` rows) of `(slot, pos)`.
    pub fn row(&self, slot: u32, pos: u32) -> usize {
        let (s, p) = (slot as usize, pos as usize);
        let block = self.table[s * self.max_blocks + p / self.block_size];
        assert!(block != u32::MAX, "slot {slot} position {pos} has no block");
        block as usize * self.block_size + p % self.block_size
    }

    pub fn upload<B: Backend>(&self, b: &B) -> Tensor<B::Storage> {
        upload_u32(b, &[self.table.len() / self.max_blocks, self.max_blocks], &self.table)
    }

    /// Block sizes worth testing for a cache of `capacity` positions: 1, 16, an odd one and the
    /// whole capacity (the contiguous layout), one picked by `rng`.
    pub fn pick_block_size(rng: &mut Rng, capacity: usize) -> usize {
        [1, 16, 3, 5, capacity.max(1)][rng.below(5)]
    }
}
