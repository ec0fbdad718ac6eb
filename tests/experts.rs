//! `experts` (Mixtral's sparse MLP) on every backend against an f64 reference of the whole op:
//! `out[r] = sum over s of w[r][s] * down_e(silu(x[r] . gate_e^T) * (x[r] . up_e^T))`, `e =
//! ids[r][s]`, with each weight's real values (stored value times its scale) in f64.
//!
//! The bound, per output element, follows the op's three stages. Gate and up: each GEMV within
//! gamma(h + 9) sum |x w s| (gemv.cu's gamma(h + 8) bound, and the CPU backends' f32 sums, plus
//! one for the real weight's own rounding), so |dg|, |du| <= those. The SiLU product: |silu'| <=
//! 1.1 everywhere, so |silu(g + dg)(u + du) - silu(g) u| <= 1.1 |dg| (|u| + |du|) + |silu(g)| |du|,
//! and computing it (an expf within 2 ulps, a division, an addition, a multiply) adds at most 8u of
//! its magnitude. Down: gamma(i + 9) sum |a'| |d s| over the computed a' (|a'| <= |a| + da), plus
//! sum da |d s| from a's own error. The combine: sum over s of w_s dy_s, and gamma(k + 1) of sum
//! w_s (|y_s| + dy_s) for the k fmas; then the f32 rounding of the reference's value.
//!
//! The grouped GEMMs the GPU runs above 16 rows (gemm_tc.cu's and gemm_mfma.cu's contract: f32 sums
//! of X_PARTS W_PARTS h exact bf16 products, at most 6 h, with x split to within 2^-24 |x|, and
//! the block scales' ceil(h / bc) + 1 roundings; gemm.cu's f32 fmas are within it) take gamma(6 h
//! + h / 16 + 12) (1 + 2^-7) in place of gamma(h + 9), for gate and up and for down alike.
//!
//! The GPU backend routes on the device up to 16 experts, at any number of rows: five launches up
//! to 4 rows, seven above (gate and up apart, then silu_mul; grouped GEMMs above 16 rows), nothing
//! read back; with the decode GEMVs on the matrix units (`Gpu::set_gemv_tensor_core_rows`: the
//! grouped gemv_tc.cu / gemv_mfma.cu kernels, held to the GEMMs' bound) seven at every row count; more experts take the host-routed path, as the CPU backends do; the launch count
//! shows which ran. Every weight dtype and scale kind (none, per tensor, per channel f32, 8 x 16
//! blocks of bf16), rows in {1, 3, 4, 5, 16, 17, 40, 150} (150 rows of top 2 among 4 experts put
//! more than one 64-row tile in each expert), hidden and inter sizes off the 16-byte words (17, 20,
//! 24) and on them (so the GEMMs run on the tensor cores for some cases and on gemm.cu for the
//! others), outputs poisoned first. A pick beyond the experts is `IndexOutOfRange` and a row
//! naming one expert twice an `Argument` error, on every backend (the GPU's at the next
//! synchronize).

mod common;

use common::*;
use memwall_runtime::cpu::{Fast, Reference};
use memwall_runtime::{
    Backend, DType, Error, Expert, ExpertsDims, ExpertsScratch, Linear, Tensor, WeightScale,
};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Scale {
    None,
    PerTensor,
    PerChannel,
    /// bf16 scales of blocks of (rows, columns).
    Block(usize, usize),
}

/// Blocks of the block-scaled weights (off the matrix-unit GEMV's 64-column steps).
const BLOCK: Scale = Scale::Block(8, 16);

/// A weight's stored values and scales, from which its real values follow.
struct HostWeight {
    dtype: DType,
    shape: [usize; 2],
    values: Vec<f32>,
    kind: Scale,
    scales: Vec<f32>,
}

impl HostWeight {
    fn random(rng: &mut Rng, dtype: DType, kind: Scale, n: usize, k: usize) -> Self {
        let values = random_values(rng, dtype, n * k);
        let scales = match kind {
            Scale::None => Vec::new(),
            Scale::PerTensor => vec![random_positive(rng, DType::F32, 1)[0] * 4.0],
            Scale::PerChannel => random_positive(rng, DType::F32, n),
            Scale::Block(br, bc) => random_positive(rng, DType::BF16, n.div_ceil(br) * k.div_ceil(bc)),
        };
        HostWeight { dtype, shape: [n, k], values, kind, scales }
    }

    /// The real value of element (j, l).
    fn real(&self, j: usize, l: usize) -> f64 {
        let [_, k] = self.shape;
        let w = f64::from(self.values[j * k + l]);
        w * match self.kind {
            Scale::None => 1.0,
            Scale::PerTensor => f64::from(self.scales[0]),
            Scale::PerChannel => f64::from(self.scales[j]),
            Scale::Block(br, bc) => f64::from(self.scales[(j / br) * k.div_ceil(bc) + l / bc]),
        }
    }

    fn on<B: Backend>(&self, b: &B) -> Linear<B::Storage> {
        let [n, k] = self.shape;
        let scale = match self.kind {
            Scale::None => WeightScale::None,
            Scale::PerTensor => WeightScale::PerTensor(self.scales[0]),
            Scale::PerChannel => WeightScale::PerChannel(upload(b, DType::F32, &[n], &self.scales)),
            Scale::Block(br, bc) => WeightScale::Block {
                block_rows: br,
                block_cols: bc,
                scales: upload(b, DType::BF16, &[n.div_ceil(br), k.div_ceil(bc)], &self.scales),
            },
        };
        Linear { weight: upload(b, self.dtype, &self.shape, &self.values), scale }
    }
}

#[derive(Clone, Copy, Debug)]
struct Case {
    rows: usize,
    k: usize,
    experts: usize,
    hidden: usize,
    inter: usize,
    dtype: DType,
    scale: Scale,
    seed: u64,
}

/// A case's inputs: each expert's gate, up and down, x, the picks (distinct per row) and their
/// weights.
struct Inputs {
    experts: Vec<[HostWeight; 3]>,
    x: Vec<f32>,
    ids: Vec<u32>,
    weights: Vec<f32>,
}

fn inputs(c: &Case) -> Inputs {
    let mut rng = Rng::new(c.seed);
    let experts = (0..c.experts)
        .map(|_| {
            [
                HostWeight::random(&mut rng, c.dtype, c.scale, c.inter, c.hidden),
                HostWeight::random(&mut rng, c.dtype, c.scale, c.inter, c.hidden),
                HostWeight::random(&mut rng, c.dtype, c.scale, c.hidden, c.inter),
            ]
        })
        .collect();
    let x = random_values(&mut rng, DType::F32, c.rows * c.hidden);
    let mut ids = Vec::with_capacity(c.rows * c.k);
    for _ in 0..c.rows {
        let mut pool: Vec<u32> = (0..c.experts as u32).collect();
        for _ in 0..c.k {
            ids.push(pool.swap_remove(rng.below(pool.len())));
        }
    }
    let weights = random_positive(&mut rng, DType::F32, c.rows * c.k);
    Inputs { experts, x, ids, weights }
}

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// The op in f64 (rounded to f32) and the bound of the header, per element of out, for the GEMVs'
/// products or (`gemm`) the grouped GEMMs'.
fn reference(c: &Case, inp: &Inputs, gemm: bool) -> (Vec<f32>, Vec<f64>) {
    let (h, i) = (c.hidden, c.inter);
    let u = 2f64.powi(-24);
    let products =
        |k: usize| if gemm { gamma(6 * k + k / 16 + 12) * (1.0 + 2f64.powi(-7)) } else { gamma(k + 9) };
    let (mut want, mut bound) = (Vec::new(), Vec::new());
    for r in 0..c.rows {
        let x = &inp.x[r * h..][..h];
        let (mut out, mut err, mut mag) = (vec![0f64; h], vec![0f64; h], vec![0f64; h]);
        for s in 0..c.k {
            let [gate, up, down] = &inp.experts[inp.ids[r * c.k + s] as usize];
            let omega = f64::from(inp.weights[r * c.k + s]);
            let (mut a, mut da) = (vec![0f64; i], vec![0f64; i]);
            for j in 0..i {
                let dot = |w: &HostWeight| -> (f64, f64) {
                    (0..h).fold((0.0, 0.0), |(v, m), l| {
                        let t = f64::from(x[l]) * w.real(j, l);
                        (v + t, m + t.abs())
                    })
                };
                let ((g, ga), (uv, ua)) = (dot(gate), dot(up));
                let (dg, du) = (products(h) * ga, products(h) * ua);
                let (s_mag, u_mag) = (silu(g).abs() + 1.1 * dg, uv.abs() + du);
                a[j] = silu(g) * uv;
                da[j] = 1.1 * dg * u_mag + silu(g).abs() * du + 8.0 * u * s_mag * u_mag;
            }
            for col in 0..h {
                let (mut y, mut over_a, mut from_da) = (0f64, 0f64, 0f64);
                for j in 0..i {
                    let d = down.real(col, j);
                    y += a[j] * d;
                    over_a += (a[j].abs() + da[j]) * d.abs();
                    from_da += da[j] * d.abs();
                }
                let dy = products(i) * over_a + from_da;
                out[col] += omega * y;
                err[col] += omega * dy;
                mag[col] += omega * (y.abs() + dy);
            }
        }
        for col in 0..h {
            want.push(out[col] as f32);
            bound.push(err[col] + gamma(c.k + 1) * mag[col] + u * out[col].abs() + 2f64.powi(-140));
        }
    }
    (want, bound)
}

/// The case's tensors on `b`: experts, x, ids, weights, scratch and a poisoned out.
struct OnBackend<S> {
    weights: Vec<[Linear<S>; 3]>,
    x: Tensor<S>,
    ids: Tensor<S>,
    pick_w: Tensor<S>,
    scratch: ExpertsScratch<S>,
    out: Tensor<S>,
}

fn on_backend<B: Backend>(b: &B, c: &Case, inp: &Inputs, ids: &[u32]) -> OnBackend<B::Storage> {
    OnBackend {
        weights: inp.experts.iter().map(|[g, u, d]| [g.on(b), u.on(b), d.on(b)]).collect(),
        x: upload(b, DType::F32, &[c.rows, c.hidden], &inp.x),
        ids: upload_u32(b, &[c.rows, c.k], ids),
        pick_w: upload(b, DType::F32, &[c.rows, c.k], &inp.weights),
        scratch: ExpertsScratch::alloc(
            b,
            ExpertsDims { rows: c.rows, k: c.k, experts: c.experts, hidden: c.hidden, inter: c.inter },
        )
        .expect("scratch"),
        out: poisoned(b, DType::F32, &[c.rows, c.hidden]),
    }
}

/// Runs `experts` on `b` with `ids`, then synchronizes (a device reports data errors there).
fn run<B: Backend>(b: &B, t: &mut OnBackend<B::Storage>) -> Result<(), Error> {
    let experts: Vec<Expert<'_, B::Storage>> =
        t.weights.iter().map(|[gate, up, down]| Expert { gate, up, down }).collect();
    b.experts(&t.x, &t.ids, &t.pick_w, &experts, &mut t.scratch, &mut t.out)?;
    b.synchronize()
}

/// `c` on `b` against the reference, with the grouped GEMMs' bound where `gemm`.
fn check<B: Backend>(b: &B, who: &str, c: &Case, gemm: bool) {
    let name = format!("{who} {c:?}");
    let inp = inputs(c);
    let (want, bound) = reference(c, &inp, gemm);
    let mut t = on_backend(b, c, &inp, &inp.ids);
    run(b, &mut t).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_close(&name, &read_f32(b, &t.out), &want, &bound);
}

/// A small bf16 case of `rows` rows, top 2 of 4 experts, for the error checks.
fn small_case(rows: usize, scale: Scale, seed: u64) -> Case {
    Case { rows, k: 2, experts: 4, hidden: 32, inter: 24, dtype: DType::BF16, scale, seed }
}

/// A pick beyond the experts and a repeated pick: typed errors, on `b`.
fn check_errors<B: Backend>(b: &B, who: &str, rows: usize) {
    let c = small_case(rows, Scale::None, 99);
    let inp = inputs(&c);
    let mut beyond = inp.ids.clone();
    beyond[2 * rows - 1] = 4;
    match run(b, &mut on_backend(b, &c, &inp, &beyond)) {
        Err(Error::IndexOutOfRange { op: "experts", row, index: 4, len: 4 }) if row == rows - 1 => {}
        other => panic!("{who} rows {rows}: expert 4 of 4: {other:?}"),
    }
    let mut twice = inp.ids.clone();
    twice[1] = twice[0];
    match run(b, &mut on_backend(b, &c, &inp, &twice)) {
        Err(Error::Argument { op: "experts", msg }) if msg.contains("row 0") => {}
        other => panic!("{who} rows {rows}: a row picking one expert twice: {other:?}"),
    }
}

fn cases() -> Vec<Case> {
    let shapes = [
        // rows, k, experts, hidden, inter
        (1, 2, 8, 64, 48),
        (3, 2, 8, 32, 40),
        (4, 1, 4, 17, 24),
        (5, 2, 8, 64, 20),
        (16, 2, 8, 32, 24),
        (17, 2, 4, 32, 24),
        (2, 2, 17, 32, 16),
        (40, 2, 8, 64, 48),
        (150, 2, 4, 32, 40),
    ];
    let mut v = Vec::new();
    let mut seed = 7u64;
    for (d, &dtype) in DType::FLOATS.iter().enumerate() {
        for (s, scale) in [Scale::None, Scale::PerTensor, Scale::PerChannel, BLOCK].into_iter().enumerate() {
            for pick in [d + s, d + s + 3] {
                let (rows, k, experts, hidden, inter) = shapes[pick % shapes.len()];
                seed += 1;
                v.push(Case { rows, k, experts, hidden, inter, dtype, scale, seed });
            }
        }
    }
    v
}

#[test]
fn experts_match_the_f64_reference_on_the_cpu() {
    for c in cases() {
        check(&Reference, "cpu-ref", &c, false);
        check(&Fast::new(), "cpu", &c, false);
    }
    for rows in [1, 5] {
        check_errors(&Reference, "cpu-ref", rows);
        check_errors(&Fast::new(), "cpu", rows);
    }
    // The host-routed form gathers one expert's rows at a time: the CPUs hold no more.
    let dims = ExpertsDims { rows: 7, k: 2, experts: 8, hidden: 16, inter: 8 };
    assert_eq!(ExpertsScratch::alloc(&Fast::new(), dims).expect("scratch").held_rows(), 7);
    assert_eq!(ExpertsScratch::alloc(&Reference, dims).expect("scratch").held_rows(), 7);
}

/// The launches of one `experts` call on a GPU: five routed on the device at up to 4 rows, seven
/// above (gate and up apart, then silu_mul), and the host-routed path's more above 16 experts.
#[cfg(any(feature = "emulate", feature = "cuda", feature = "hip"))]
fn check_gpu<D: memwall_runtime::gpu::Device>(b: &memwall_runtime::gpu::Gpu<D>, who: &str) {
    let mut gemm_cases = 0;
    for c in cases() {
        let before = b.launches();
        let device = c.experts <= 16;
        let gemm = device && c.rows > 16;
        gemm_cases += usize::from(gemm);
        check(b, who, &c, gemm);
        let launched = b.launches() - before;
        let want = if c.rows <= 4 { 5 } else { 7 };
        if device {
            assert_eq!(launched, want, "{who} {c:?}: routed on the device");
        } else {
            assert!(launched > want, "{who} {c:?}: {launched} launches on the host-routed path");
        }
    }
    assert!(gemm_cases >= 8, "{who}: {gemm_cases} cases on the grouped GEMMs");
    for rows in [1, 5, 17, 40] {
        check_errors(b, who, rows);
    }
    for rows in [3, 40] {
        check_scratch(b, who, rows);
    }
    check_matrix_gemv(b, who);
}

/// Decode rows on the matrix units (`Gpu::set_gemv_tensor_core_rows`): the grouped
/// gemv_tc.cu / gemv_mfma.cu kernels for gate, up and down (seven launches at any row count,
/// where gemv.cu's fused gate/up makes five up to 4 rows), within the matrix units' bound (the
/// GEMMs': the same bf16 parts and f32 sums); f32 weights, which they do not take, stay on gemv.cu.
/// Every weight dtype and scale kind (blocks of 4 x 64: whole 64-column steps), 1 to 16 rows (both
/// row tiles and rows short of them), hidden and inter on 64-column steps.
#[cfg(any(feature = "emulate", feature = "cuda", feature = "hip"))]
fn check_matrix_gemv<D: memwall_runtime::gpu::Device>(b: &memwall_runtime::gpu::Gpu<D>, who: &str) {
    use memwall_runtime::gpu::ops::linear::GemvMatrix;
    b.set_gemv_tensor_core_rows(Some(1)).expect("every decode GEMV on the matrix units");
    let units = GemvMatrix::of(b.device().info()).is_some();
    let shapes =
        [(1, 2, 8, 64, 128), (3, 2, 4, 128, 64), (5, 2, 8, 64, 64), (9, 2, 8, 128, 64), (16, 2, 4, 64, 128)];
    let (mut matrix_cases, mut seed) = (0, 0x3e11u64);
    for (d, &dtype) in DType::FLOATS.iter().enumerate() {
        for (s, scale) in
            [Scale::None, Scale::PerTensor, Scale::PerChannel, Scale::Block(4, 64)].into_iter().enumerate()
        {
            let (rows, k, experts, hidden, inter) = shapes[(d + s) % shapes.len()];
            seed += 1;
            let c = Case { rows, k, experts, hidden, inter, dtype, scale, seed };
            let matrix = units && dtype != DType::F32;
            matrix_cases += usize::from(matrix);
            let before = b.launches();
            check(b, who, &c, matrix);
            let launched = b.launches() - before;
            let want = if matrix || rows > 4 { 7 } else { 5 };
            assert_eq!(launched, want, "{who} {c:?}: launches (matrix units: {matrix})");
        }
    }
    if units {
        assert!(matrix_cases >= 20, "{who}: {matrix_cases} cases on the matrix units");
    }
    b.set_gemv_tensor_core_rows(None).expect("back to gemv.cu");
}

/// The device-routed path works in the caller's scratch, which holds every pick's row on a GPU
/// (rows x k), while one sized for the host-routed path (allocated for more than 16 experts, so
/// `rows` rows) is a typed error before anything runs, not a write past its end.
#[cfg(any(feature = "emulate", feature = "cuda", feature = "hip"))]
fn check_scratch<D: memwall_runtime::gpu::Device>(b: &memwall_runtime::gpu::Gpu<D>, who: &str, rows: usize) {
    let c = small_case(rows, Scale::PerChannel, 41);
    let inp = inputs(&c);
    let mut t = on_backend(b, &c, &inp, &inp.ids);
    assert_eq!(t.scratch.held_rows(), rows * 2, "{who}: a device-routed scratch holds every pick");
    let dims = ExpertsDims { rows, k: 2, experts: 17, hidden: c.hidden, inter: c.inter };
    t.scratch = ExpertsScratch::alloc(b, dims).expect("scratch");
    assert_eq!(t.scratch.held_rows(), rows, "{who}: a host-routed scratch holds the rows");
    let before = b.launches();
    match run(b, &mut t) {
        Err(Error::Argument { op: "experts", msg })
            if msg.contains(&format!("scratch of {rows} rows for {} picks", 2 * rows)) => {}
        other => panic!("{who} rows {rows}: a scratch of too few rows: {other:?}"),
    }
    assert_eq!(b.launches(), before, "{who}: launches before the scratch check");
    assert_poisoned(b, "experts output after a scratch error", &t.out);
}

#[cfg(feature = "emulate")]
#[test]
fn experts_match_the_f64_reference_on_the_emulated_gpus() {
    for (who, b) in common::gpu::emulated() {
        check_gpu(&b, &who);
    }
}

device_tests! {
    fn experts_match_the_f64_reference(b, who) {
        check_gpu(&b, who);
    }
}
