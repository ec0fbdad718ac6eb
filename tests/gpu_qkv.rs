//! `qkv` on the GPU backend: attention's q, k and v projections in one launch (`qkv_*_r1` of
//! `kernels-cuda/gemv.cu`, one row, weights of one dtype whose scales pick one kernel), else
//! three `linear`.
//!
//! The fused kernel runs the gemv algorithm for each product over its own run of blocks, and a
//! gemv output depends only on its row (one warp, the same chunks in the same order whatever the
//! grid), so `qkv` must equal three `linear` calls on the same backend bit for bit, y dtypes
//! included; `linear` itself is held to `cpu::Reference` by tests/gpu_linear.rs with derived
//! bounds. Here each product is also checked against the reference directly (f32 y), within
//! gamma(k + 9) sum |x w s|: gemv.cu's bound gamma(k + 8) sum |x w s| and one rounding of the
//! reference's f64 result to f32 (the sum itself computed by the reference, 0.1% added for its
//! own rounding). And the
//! launch count shows which path ran: one launch for the fused cases, three (or more) otherwise.
//!
//! Every weight dtype, scale kind (none, per tensor with different values per product, per channel
//! f32, 8x16 blocks of bf16 scales), m in {1, 3, 16, 17} (17: the GEMM path of each linear),
//! k in {1, 17, 64, 4097}, products of unequal widths (q wider than k and v, as in GQA), and wide
//! enough that each product's run of blocks grid-strides. Outputs
//! are poisoned first.

#![cfg(any(feature = "emulate", feature = "cuda", feature = "hip"))]

mod common;

use common::gpu::linear_to_backend;
use common::*;
use memwall_runtime::cpu::Reference;
use memwall_runtime::gpu::{Device, Gpu};
use memwall_runtime::{Backend, DType, HostStorage, Linear, WeightScale};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Scale {
    None,
    PerTensor,
    PerChannel,
    Block,
}

/// A random `[n, k]` weight of `dtype` on the reference backend, scaled as `kind`.
fn weight(rng: &mut Rng, dtype: DType, kind: Scale, n: usize, k: usize) -> Linear<HostStorage> {
    let w = upload(&Reference, dtype, &[n, k], &random_values(rng, dtype, n * k));
    let scale = match kind {
        Scale::None => WeightScale::None,
        Scale::PerTensor => WeightScale::PerTensor(random_positive(rng, DType::F32, 1)[0] * 4.0),
        Scale::PerChannel => WeightScale::PerChannel(upload(
            &Reference,
            DType::F32,
            &[n],
            &random_positive(rng, DType::F32, n),
        )),
        Scale::Block => {
            let (br, bc) = (8, 16);
            let grid = [n.div_ceil(br), k.div_ceil(bc)];
            let s = random_positive(rng, DType::BF16, grid[0] * grid[1]);
            WeightScale::Block {
                block_rows: br,
                block_cols: bc,
                scales: upload(&Reference, DType::BF16, &grid, &s),
            }
        }
    };
    Linear { weight: w, scale }
}

/// |w| with the same scale (all scales are positive): for the reference's sum |x w s|.
fn abs_weight(w: &Linear<HostStorage>) -> Linear<HostStorage> {
    let values: Vec<f32> = read_f32(&Reference, &w.weight).iter().map(|v| v.abs()).collect();
    let scale = match &w.scale {
        WeightScale::None => WeightScale::None,
        WeightScale::PerTensor(s) => WeightScale::PerTensor(*s),
        WeightScale::PerChannel(s) => {
            WeightScale::PerChannel(upload(&Reference, s.dtype(), s.shape(), &read_f32(&Reference, s)))
        }
        WeightScale::Block { block_rows, block_cols, scales } => WeightScale::Block {
            block_rows: *block_rows,
            block_cols: *block_cols,
            scales: upload(&Reference, scales.dtype(), scales.shape(), &read_f32(&Reference, scales)),
        },
    };
    Linear { weight: upload(&Reference, w.weight.dtype(), w.weight.shape(), &values), scale }
}

struct Case {
    m: usize,
    k: usize,
    widths: [usize; 3],
    dtypes: [DType; 3],
    scales: [Scale; 3],
    y: [DType; 3],
    seed: u64,
}

/// Runs `c` on `b`: qkv against three linear (bits), against the reference (f32 y), and the
/// launches it took (`fused`: one).
fn check<D: Device>(b: &Gpu<D>, who: &str, c: &Case) {
    let name = format!(
        "{who} qkv m {} k {} widths {:?} {:?} {:?} y {:?}",
        c.m, c.k, c.widths, c.dtypes, c.scales, c.y
    );
    let mut rng = Rng::new(c.seed);
    let hw: Vec<_> = (0..3).map(|i| weight(&mut rng, c.dtypes[i], c.scales[i], c.widths[i], c.k)).collect();
    let x = random_values(&mut rng, DType::F32, c.m * c.k);
    let w: Vec<_> = hw.iter().map(|w| linear_to_backend(b, w)).collect();
    let xb = upload(b, DType::F32, &[c.m, c.k], &x);
    let mut ys: Vec<_> = (0..3).map(|i| poisoned(b, c.y[i], &[c.m, c.widths[i]])).collect();
    let launches = b.launches();
    {
        let [q, k, v] = &mut ys[..] else { unreachable!() };
        b.qkv(&xb, [&w[0], &w[1], &w[2]], [q, k, v]).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    let launched = b.launches() - launches;
    let fused = c.m == 1 && c.dtypes.iter().all(|&d| d == c.dtypes[0]) && {
        let kind = |s: Scale| matches!(s, Scale::PerChannel | Scale::Block);
        let dtype = |s: Scale| (s == Scale::Block).then_some(DType::BF16).or(kind(s).then_some(DType::F32));
        c.scales.iter().all(|&s| dtype(s) == dtype(c.scales[0]))
    };
    if fused {
        assert_eq!(launched, 1, "{name}: one fused launch");
    } else {
        assert!(launched >= 3, "{name}: {launched} launches for three linears");
    }
    for i in 0..3 {
        let what = format!("{name} product {i}");
        let mut alone = poisoned(b, c.y[i], &[c.m, c.widths[i]]);
        b.linear(&xb, &w[i], &mut alone).unwrap_or_else(|e| panic!("{what}: linear: {e}"));
        assert_same_bytes(&what, c.y[i], &read_bytes(b, &ys[i]), &read_bytes(b, &alone));
        if c.y[i] != DType::F32 {
            continue;
        }
        let xr = upload(&Reference, DType::F32, &[c.m, c.k], &x);
        let mut want = upload(&Reference, DType::F32, &[c.m, c.widths[i]], &vec![0.0; c.m * c.widths[i]]);
        Reference.linear(&xr, &hw[i], &mut want).expect("reference");
        let xa: Vec<f32> = x.iter().map(|v| v.abs()).collect();
        let xa = upload(&Reference, DType::F32, &[c.m, c.k], &xa);
        let mut abs = upload(&Reference, DType::F32, &[c.m, c.widths[i]], &vec![0.0; c.m * c.widths[i]]);
        Reference.linear(&xa, &abs_weight(&hw[i]), &mut abs).expect("reference |x w s|");
        let bound: Vec<f64> = read_f32(&Reference, &abs)
            .iter()
            .map(|&a| gamma(c.k + 9) * f64::from(a) * 1.001 + 2f64.powi(-149))
            .collect();
        if c.m <= 16 {
            assert_close(&what, &read_f32(b, &ys[i]), &read_f32(&Reference, &want), &bound);
        }
    }
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    let mut seed = 1u64;
    let mut push = |m, k, widths, dtypes: [DType; 3], scales: [Scale; 3], y| {
        seed += 1;
        v.push(Case { m, k, widths, dtypes, scales, y, seed });
    };
    let f32s = [DType::F32; 3];
    for &d in &DType::FLOATS {
        for s in [Scale::None, Scale::PerTensor, Scale::PerChannel, Scale::Block] {
            for (m, k) in [(1, 64), (3, 17), (16, 4097), (1, 1)] {
                push(m, k, [12, 5, 5], [d; 3], [s; 3], f32s);
            }
        }
    }
    // GEMM above 16 rows (three linear), mixed y dtypes, one kernel from unlike scales (none and
    // per tensor; per channel and blocks of f32... here bf16 blocks with f32 channels: two kernels).
    // Products of more rows than their runs of blocks have warps (the emulator's 2 SMs cap a run
    // at 64 blocks, 256 warps): each run grid-strides over its own rows.
    push(1, 17, [600, 300, 300], [DType::BF16; 3], [Scale::None; 3], f32s);
    push(3, 17, [600, 300, 300], [DType::BF16; 3], [Scale::None; 3], f32s);
    push(1, 32, [520, 260, 260], [DType::F8E4M3Fn; 3], [Scale::Block; 3], f32s);
    push(17, 64, [12, 5, 5], [DType::BF16; 3], [Scale::PerChannel; 3], f32s);
    push(4, 64, [40, 8, 8], [DType::BF16; 3], [Scale::None; 3], [DType::F32, DType::BF16, DType::F16]);
    push(2, 48, [9, 3, 3], [DType::F8E4M3Fn; 3], [Scale::None, Scale::PerTensor, Scale::PerTensor], f32s);
    push(1, 64, [9, 3, 3], [DType::BF16; 3], [Scale::PerChannel, Scale::Block, Scale::Block], f32s);
    push(1, 64, [9, 3, 3], [DType::BF16, DType::F16, DType::BF16], [Scale::None; 3], f32s);
    v
}

#[cfg(feature = "emulate")]
#[test]
fn qkv_is_three_linears_in_one_launch_on_the_emulated_gpus() {
    for (who, b) in common::gpu::emulated() {
        for c in cases() {
            check(&b, &who, &c);
        }
    }
}

device_tests! {
    fn qkv_is_three_linears_in_one_launch(b, who) {
        for c in cases() {
            check(&b, who, &c);
        }
    }
}
