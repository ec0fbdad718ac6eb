//! The hash that makes the random data here (contexts filled for benchmarks, `Session::fill_context`)
//! and in `memwall::synth` (random checkpoints): element i of a stream is a function of its key
//! and i alone, so any thread makes any part of it, the same on every machine.

/// A 64-bit mix (splitmix64's step and finaliser): distinct inputs give unrelated outputs.
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Uniform in [-1, 1) on a grid of 2^-23, from the top 24 bits of `mix64(key ^ i)`.
pub fn unit(key: u64, i: u64) -> f32 {
    let h = mix64(key ^ i);
    (h >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_spans_its_range() {
        let v: Vec<f32> = (0..10_000).map(|i| unit(7, i)).collect();
        assert!(v.iter().all(|&x| (-1.0..1.0).contains(&x)));
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        // Uniform on [-1, 1): standard deviation 1/sqrt(3), so the mean of 10^4 within 0.03 (5 sigma).
        assert!(mean.abs() < 0.03, "mean {mean}");
        assert!(v.iter().any(|&x| x < -0.99) && v.iter().any(|&x| x > 0.99));
        assert_ne!(unit(7, 0), unit(8, 0));
    }
}
