//! What the benches share beside their references: the random stream their data comes from, the
//! permutations that scatter a paged cache, and the rounding-error bound their checks are built on.

/// The next 64 random bits of splitmix64 from `state`.
pub fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A permutation of `0..n` (Fisher-Yates on splitmix), as a block table that scatters a cache.
pub fn shuffled(n: usize, seed: u64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n as u32).collect();
    let mut s = seed;
    for i in (1..n).rev() {
        let j = (splitmix(&mut s) % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

/// `gamma(n) = n u / (1 - n u)`: the bound of an `n`-term sum's error relative to the sum of the
/// terms' magnitudes, for unit roundoff `u` (f32: 2^-24 rounding to nearest, 2^-23 truncating).
pub fn gamma(n: usize, u: f64) -> f64 {
    n as f64 * u / (1.0 - n as f64 * u)
}
