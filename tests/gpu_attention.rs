//! `kv_store` and `attention` of the GPU backends against `cpu::Reference`.
//!
//! Every case stores the same random keys and values through the reference and through the GPU
//! (the caches must come out byte-identical: one round-to-nearest-even on both sides), then runs
//! attention on the GPU with the plan the launcher picks and with forced plans (one split; many
//! small splits, so some lane groups and splits see no position; the prefill kernel beside the
//! decode kernel; the `even` decode kernel where the fast one would run), each into an output
//! poisoned with NaN first. Emulated (feature `emulate`) under every thread schedule; on a GPU
//! (feature `cuda` or `hip`) with `cargo test --features cuda --test gpu_attention -- --ignored`
//! (`MEMWALL_REQUIRE_GPU=1` makes a missing device fail).
//!
//! Tolerance (per element, derived in `bounds`): the fast CPU backend's derivation (tests/ops.rs)
//! with the GPU's differences: scores in log2 units (q times a rounded scale x log2 e), exp2
//! within 2 ulps, a rescale per step whose exp error is not shared by later terms, and two merges
//! (lane groups of a block, splits of a row) that each weight a partial sum by one more exp.

// Without a GPU feature the cases below have no backend to run on.
#![cfg_attr(
    not(any(feature = "emulate", feature = "cuda", feature = "hip")),
    allow(dead_code, unused_imports)
)]

mod common;

use std::sync::LazyLock;

use common::{Rng, *};
use memwall::runtime::gpu::ops::attention::{self as attn, AttnPlan, DecodeVariant};
use memwall::runtime::gpu::{Device, Gpu};
use memwall_runtime::cpu::Reference;
use memwall_runtime::{Backend, DType, Error, KvCacheLayer};

static REF: LazyLock<Reference> = LazyLock::new(Reference::default);
const CACHE_TYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

#[derive(Clone, Debug)]
struct Case {
    kv_heads: usize,
    ratio: usize,
    head_dim: usize,
    k_dt: DType,
    v_dt: DType,
    slots: usize,
    capacity: usize,
    /// Cache entries written before this step: (slot, position).
    history: Vec<(u32, u32)>,
    /// This step's query rows: (slot, position); their k, v are stored first.
    rows: Vec<(u32, u32)>,
    /// The cache's blocks and block table.
    paging: Paging,
    scale: f32,
    seed: u64,
}

impl Case {
    /// The same case over a random block table of `block_size` positions per block.
    fn paged(mut self, block_size: usize) -> Case {
        let mut rng = Rng::new(self.seed ^ 0xb10c);
        let mut used = vec![0; self.slots];
        for &(s, p) in self.history.iter().chain(&self.rows) {
            used[s as usize] = used[s as usize].max(p as usize + 1);
        }
        self.paging = Paging::random(&mut rng, block_size, self.capacity, &used);
        self
    }
}

/// Sequences `(start, len)`: sequence i lives in its own slot (slots shuffled, one spare slot left
/// unwritten), has `start` cached positions and query rows at `start..start + len` (len 1: a
/// decode row). Rows are the sequences' rows in order, or shuffled.
#[allow(clippy::too_many_arguments)]
fn case(
    kv_heads: usize,
    ratio: usize,
    head_dim: usize,
    (k_dt, v_dt): (DType, DType),
    seqs: &[(usize, usize)],
    shuffle: bool,
    seed: u64,
) -> Case {
    let mut rng = Rng::new(seed ^ 0x6a77);
    let slots = seqs.len() + 1;
    let mut order: Vec<u32> = (0..slots as u32).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let longest = seqs.iter().map(|&(s, l)| s + l).max().expect("a sequence");
    // Room to spare: the capacity is no multiple of any tile.
    let capacity = longest + rng.range(0, 2);
    let (mut history, mut rows) = (Vec::new(), Vec::new());
    for (i, &(start, len)) in seqs.iter().enumerate() {
        history.extend((0..start).map(|p| (order[i], p as u32)));
        rows.extend((start..start + len).map(|p| (order[i], p as u32)));
    }
    if shuffle {
        for i in (1..rows.len()).rev() {
            rows.swap(i, rng.below(i + 1));
        }
    }
    // The usual 1 / sqrt(head_dim), any scale in (0, 1), and a large one whose scores overflow
    // exp unless the running max is subtracted.
    let scale = match rng.below(4) {
        0 | 1 => 1.0 / (head_dim as f32).sqrt(),
        2 => rng.open01() as f32,
        _ => 64.0,
    };
    let paging = Paging::contiguous(slots, capacity);
    let c =
        Case { kv_heads, ratio, head_dim, k_dt, v_dt, slots, capacity, history, rows, paging, scale, seed };
    // Block sizes 1, 16, odd ones, or the contiguous layout.
    let block_size = Paging::pick_block_size(&mut rng, capacity);
    c.paged(block_size)
}

/// Stores `entries` with random k, v through the reference and the GPU, and records the values
/// the caches hold (the cache dtypes' roundings) in `k_all`, `v_all`, indexed like the caches.
#[allow(clippy::too_many_arguments)]
fn store<D: Device>(
    g: &Gpu<D>,
    c: &Case,
    rng: &mut Rng,
    c_ref: &mut KvCacheLayer<memwall_runtime::HostStorage>,
    c_gpu: &mut KvCacheLayer<<Gpu<D> as Backend>::Storage>,
    entries: &[(u32, u32)],
    k_all: &mut [f64],
    v_all: &mut [f64],
) {
    if entries.is_empty() {
        return;
    }
    let r = &*REF;
    let width = c.kv_heads * c.head_dim;
    let n = entries.len();
    let shape = [n, c.kv_heads, c.head_dim];
    let kv = random_values(rng, DType::F32, n * width);
    let vv = random_values(rng, DType::F32, n * width);
    let slots: Vec<u32> = entries.iter().map(|e| e.0).collect();
    let positions: Vec<u32> = entries.iter().map(|e| e.1).collect();
    REF.kv_store(
        &upload(r, DType::F32, &shape, &kv),
        &upload(r, DType::F32, &shape, &vv),
        c_ref,
        &c.paging.upload(r),
        &upload_u32(r, &[n], &slots),
        &upload_u32(r, &[n], &positions),
    )
    .unwrap_or_else(|e| panic!("reference kv_store {c:?}: {e}"));
    g.kv_store(
        &upload(g, DType::F32, &shape, &kv),
        &upload(g, DType::F32, &shape, &vv),
        c_gpu,
        &c.paging.upload(g),
        &upload_u32(g, &[n], &slots),
        &upload_u32(g, &[n], &positions),
    )
    .unwrap_or_else(|e| panic!("{} kv_store {c:?}: {e}", g.name()));
    for (i, &(s, p)) in entries.iter().enumerate() {
        let at = c.paging.row(s, p) * width;
        for e in 0..width {
            k_all[at + e] = round_to(c.k_dt, kv[i * width + e]) as f64;
            v_all[at + e] = round_to(c.v_dt, vv[i * width + e]) as f64;
        }
    }
}

/// The exact outputs (f64, rounded to f32 once), and per element the bound of the reference's
/// error and of the GPU's, both against the exact value.
fn bounds(c: &Case, qv: &[f32], k_all: &[f64], v_all: &[f64]) -> (Vec<f32>, Vec<f64>, Vec<f64>) {
    let (kvh, hd, heads) = (c.kv_heads, c.head_dim, c.kv_heads * c.ratio);
    let total = c.rows.len() * heads * hd;
    let (mut exact, mut bound_ref, mut bound_gpu) = (vec![0f32; total], vec![0f64; total], vec![0f64; total]);
    let scale = c.scale as f64;
    for (row, &(slot, pos)) in c.rows.iter().enumerate() {
        let t_len = pos as usize + 1;
        for h in 0..heads {
            let g = h / c.ratio;
            let qh = &qv[(row * heads + h) * hd..][..hd];
            let at = |p: usize| c.paging.row(slot, p as u32) * kvh * hd + g * hd;
            // Scores s_t and A_max = max_t scale sum |q k| (>= |s_t|).
            let mut s = vec![0f64; t_len];
            let mut a_max = 0f64;
            for (p, s_p) in s.iter_mut().enumerate() {
                let kk = &k_all[at(p)..][..hd];
                *s_p = scale * qh.iter().zip(kk).map(|(&q, &k)| q as f64 * k).sum::<f64>();
                a_max =
                    a_max.max(scale * qh.iter().zip(kk).map(|(&q, &k)| (q as f64 * k).abs()).sum::<f64>());
            }
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|&x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            // GPU, f32. Logits: q is multiplied by c = fl(scale log2 e) (one rounding for c, one
            // per product), then hd products and sums: gamma(hd + 2) relative to the absolute
            // sum, i.e. gamma(hd + 2) A_max log2 e in log2 units; subtracting the running max
            // adds u |s - m| <= 2u A_max log2 e. exp2 of an argument off by x log2 e is off by a
            // factor e^x, so the weights are off by factors within e^(+-2 delta) with
            // delta = (gamma(hd + 2) + 2u) A_max. exp2 within 2 ulps (4u) per weight, counted as
            // 8u as for the CPU, on numerator and denominator terms: 16u. Sums: every term
            // passes through at most t_len accumulations within its lane group, GROUPS <= 16
            // when the block merges its groups and splits <= 128 when the row merges its splits:
            // gamma(t_len + 144) on numerator and denominator. Each online-softmax step (at most
            // one per position) multiplies the earlier terms of both by corr = exp2(m_old -
            // m_new), off by 8u, plus one rounding each: 10u per position. Each merge (groups,
            // splits) weights a partial numerator and denominator by one exp2 (8u, not shared
            // with the other partials: 16u) and rounds both products (2u). The final division u.
            // Relative to sum_t p_t |v_t|.
            let delta = (gamma(hd + 2) + 2.0 * U32) * a_max;
            let rel = (2.0 * delta).exp_m1()
                + 2.0 * gamma(t_len + 144)
                + 10.0 * U32 * t_len as f64
                + 16.0 * U32
                + 2.0 * 18.0 * U32
                + U32;
            for d in 0..hd {
                let (mut o, mut pv_abs) = (0f64, 0f64);
                for p in 0..t_len {
                    let v = v_all[at(p) + d];
                    o += e[p] / z * v;
                    pv_abs += e[p] / z * v.abs();
                }
                let idx = (row * heads + h) * hd + d;
                exact[idx] = o as f32;
                // Reference: f64 throughout (far below 1e-12 relative) and one rounding to f32
                // (u |ref|); plus u |ref| for our own `as f32`.
                bound_ref[idx] = 2.0 * U32 * o.abs() + 1e-12 * pv_abs;
                bound_gpu[idx] = rel * pv_abs;
                if !o.is_finite() {
                    // An unwritten (NaN) cache entry in the row's range: the output must be NaN,
                    // which assert_close checks whatever the bound.
                    bound_ref[idx] = 0.0;
                    bound_gpu[idx] = 0.0;
                }
            }
        }
    }
    (exact, bound_ref, bound_gpu)
}

/// The plans forced on a case besides the launcher's own.
fn forced_plans(c: &Case) -> Vec<AttnPlan> {
    let same = c.k_dt == c.v_dt;
    let mut decodes = vec![(DecodeVariant::Even, 4)];
    if same && (c.head_dim == 64 || c.head_dim == 128) {
        decodes.push((DecodeVariant::Fast, 4));
        decodes.push((DecodeVariant::Fast, 8));
    }
    let mut plans = Vec::new();
    for (decode, heads_per_block) in decodes {
        let p = AttnPlan { decode, heads_per_block, splits: 1, min_split: attn::MIN_SPLIT, prefill: false };
        plans.push(p);
        // Splits of a few positions: rows split unevenly, some groups see nothing.
        plans.push(AttnPlan { splits: 5, min_split: 1, ..p });
        if same {
            plans.push(AttnPlan { splits: 3, min_split: 2, prefill: true, ..p });
        }
    }
    plans
}

fn run_case<D: Device>(name: &str, g: &Gpu<D>, c: &Case, forced: bool) {
    let r = &*REF;
    let (kvh, hd, heads) = (c.kv_heads, c.head_dim, c.kv_heads * c.ratio);
    let mut rng = Rng::new(c.seed);
    let shape = c.paging.shape(kvh, hd);
    let mut c_ref = KvCacheLayer { k: poisoned(r, c.k_dt, &shape), v: poisoned(r, c.v_dt, &shape) };
    let mut c_gpu = KvCacheLayer { k: poisoned(g, c.k_dt, &shape), v: poisoned(g, c.v_dt, &shape) };
    let cells = shape.iter().product();
    let (mut k_all, mut v_all) = (vec![f64::NAN; cells], vec![f64::NAN; cells]);
    store(g, c, &mut rng, &mut c_ref, &mut c_gpu, &c.history, &mut k_all, &mut v_all);
    store(g, c, &mut rng, &mut c_ref, &mut c_gpu, &c.rows, &mut k_all, &mut v_all);
    // One RNE rounding on both sides; poison where nothing was stored.
    assert_same_bytes(
        &format!("kv_store k cache, {name} vs reference {c:?}"),
        c.k_dt,
        &read_bytes(g, &c_gpu.k),
        &read_bytes(r, &c_ref.k),
    );
    assert_same_bytes(
        &format!("kv_store v cache, {name} vs reference {c:?}"),
        c.v_dt,
        &read_bytes(g, &c_gpu.v),
        &read_bytes(r, &c_ref.v),
    );

    let n = c.rows.len();
    let qv = random_values(&mut rng, DType::F32, n * heads * hd);
    let slots: Vec<u32> = c.rows.iter().map(|e| e.0).collect();
    let positions: Vec<u32> = c.rows.iter().map(|e| e.1).collect();
    let mut o_ref = poisoned(r, DType::F32, &[n, heads, hd]);
    REF.attention(
        &upload(r, DType::F32, &[n, heads, hd], &qv),
        &c_ref,
        &c.paging.upload(r),
        &upload_u32(r, &[n], &slots),
        &upload_u32(r, &[n], &positions),
        c.scale,
        &mut o_ref,
    )
    .unwrap_or_else(|e| panic!("reference attention {c:?}: {e}"));
    let want = read_f32(r, &o_ref);
    let (exact, bound_ref, bound_gpu) = bounds(c, &qv, &k_all, &v_all);
    assert_close(&format!("attention reference vs f64 definition {c:?}"), &want, &exact, &bound_ref);
    // GPU vs reference: each is within its bound of the exact value.
    let bound: Vec<f64> = bound_gpu.iter().zip(&bound_ref).map(|(a, b)| a + b).collect();

    let q = upload(g, DType::F32, &[n, heads, hd], &qv);
    let (slots, positions) = (upload_u32(g, &[n], &slots), upload_u32(g, &[n], &positions));
    let table = c.paging.upload(g);
    let mut out = poisoned(g, DType::F32, &[n, heads, hd]);
    g.attention(&q, &c_gpu, &table, &slots, &positions, c.scale, &mut out)
        .unwrap_or_else(|e| panic!("{name} attention {c:?}: {e}"));
    assert_close(
        &format!("attention {name}, launcher's plan, vs reference {c:?}"),
        &read_f32(g, &out),
        &want,
        &bound,
    );
    if forced {
        for plan in forced_plans(c) {
            let mut out = poisoned(g, DType::F32, &[n, heads, hd]);
            attn::attention_planned(g, &q, &c_gpu, &table, &slots, &positions, c.scale, &mut out, &plan)
                .unwrap_or_else(|e| panic!("{name} attention {plan:?} {c:?}: {e}"));
            assert_close(
                &format!("attention {name} {plan:?} vs reference {c:?}"),
                &read_f32(g, &out),
                &want,
                &bound,
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The cases

/// Every cache dtype (and mixed k/v dtypes), GQA ratio and kernel family at small contexts.
fn grid_cases() -> Vec<Case> {
    let dtypes = [
        (DType::F32, DType::F32),
        (DType::BF16, DType::BF16),
        (DType::F16, DType::F16),
        (DType::BF16, DType::F16),
        (DType::F32, DType::BF16),
    ];
    let mut cases = Vec::new();
    let mut seed = 1000;
    for (i, &dt) in dtypes.iter().enumerate() {
        for (j, ratio) in [1usize, 2, 4, 8].into_iter().enumerate() {
            seed += 1;
            let hd = [64, 128, 6, 2][(i + j) % 4];
            // A decode batch: contexts 1, 3 and 17 in shuffled slots.
            cases.push(case(2, ratio, hd, dt, &[(0, 1), (2, 1), (16, 1)], false, seed));
            // A prefill of one sequence after 3 cached positions, 9 rows.
            cases.push(case(1, ratio, hd, dt, &[(3, 9)], false, seed + 100));
        }
    }
    cases
}

/// Longer contexts (130; 700, several splits), prefill rows of one and of two sequences, mixed
/// prefill and decode rows, rows in any order, head dims up to 256.
fn long_cases() -> Vec<Case> {
    let bf = (DType::BF16, DType::BF16);
    vec![
        case(1, 4, 128, bf, &[(129, 1)], false, 1),
        case(2, 2, 64, (DType::F16, DType::F16), &[(699, 1)], false, 2),
        case(1, 1, 6, (DType::F32, DType::BF16), &[(699, 1)], false, 3),
        case(1, 4, 128, bf, &[(120, 10)], false, 4),
        case(1, 2, 64, (DType::F32, DType::F32), &[(0, 17), (5, 12)], false, 5),
        case(1, 4, 128, bf, &[(0, 17), (5, 12)], true, 6),
        case(2, 1, 6, (DType::F16, DType::F16), &[(10, 9), (4, 1), (30, 1), (0, 1)], true, 7),
        case(1, 8, 64, bf, &[(100, 20), (60, 1)], false, 8),
        // The widest tiles: head_dim 130 (no multiple of 4) and 256.
        case(1, 2, 130, (DType::F16, DType::F16), &[(20, 9), (70, 1)], false, 9),
        case(1, 1, 256, (DType::F32, DType::F32), &[(40, 1), (0, 8)], true, 10),
    ]
}

// ---------------------------------------------------------------------------------------------
// kv_store: the last row wins; data-dependent errors

fn kv_store_later_row_wins<D: Device>(name: &str, g: &Gpu<D>) {
    let r = &*REF;
    // Index-revealing values; rows naming the same place, near and far (beyond one block's
    // stride of 128 rows) apart.
    let (kvh, hd) = (2, 5);
    let mut slots_v: Vec<u32> = vec![0, 1, 0, 0, 1, 0, 2, 0];
    let mut pos_v: Vec<u32> = vec![3, 3, 3, 0, 3, 3, 1, 0];
    let mut rng = Rng::new(77);
    for _ in 0..300 {
        slots_v.push(rng.below(3) as u32);
        pos_v.push(rng.below(4) as u32);
    }
    let n = slots_v.len();
    let kv = index_values(n * kvh * hd);
    let vv: Vec<f32> = kv.iter().map(|v| -v).collect();
    for k_dt in CACHE_TYPES {
        for v_dt in CACHE_TYPES {
            // Blocks of 2 positions, the slots' blocks scrambled, one spare.
            let shape = [7, 2, kvh, hd];
            let table_v = [5u32, 2, 0, 6, 3, 1];
            let mut c_ref = KvCacheLayer { k: poisoned(r, k_dt, &shape), v: poisoned(r, v_dt, &shape) };
            REF.kv_store(
                &upload(r, DType::F32, &[n, kvh, hd], &kv),
                &upload(r, DType::F32, &[n, kvh, hd], &vv),
                &mut c_ref,
                &upload_u32(r, &[3, 2], &table_v),
                &upload_u32(r, &[n], &slots_v),
                &upload_u32(r, &[n], &pos_v),
            )
            .unwrap_or_else(|e| panic!("reference kv_store: {e}"));
            let mut c = KvCacheLayer { k: poisoned(g, k_dt, &shape), v: poisoned(g, v_dt, &shape) };
            g.kv_store(
                &upload(g, DType::F32, &[n, kvh, hd], &kv),
                &upload(g, DType::F32, &[n, kvh, hd], &vv),
                &mut c,
                &upload_u32(g, &[3, 2], &table_v),
                &upload_u32(g, &[n], &slots_v),
                &upload_u32(g, &[n], &pos_v),
            )
            .unwrap_or_else(|e| panic!("{name} kv_store: {e}"));
            let what = format!("kv_store {k_dt}/{v_dt}, repeated rows, {name}");
            assert_same_bytes(&format!("{what}: k"), k_dt, &read_bytes(g, &c.k), &read_bytes(r, &c_ref.k));
            assert_same_bytes(&format!("{what}: v"), v_dt, &read_bytes(g, &c.v), &read_bytes(r, &c_ref.v));
        }
    }
}

/// The reference's error for the same call (checked before anything runs) and the GPU's (reported
/// by the kernel, returned at the next read) are the same typed error.
fn data_errors<D: Device>(name: &str, g: &Gpu<D>) {
    let r = &*REF;
    // Blocks of 4 positions, 5 per slot (capacity 20), 15 blocks; slot 1's third entry names
    // block 15 (none) and slot 2's first u32::MAX.
    let (kvh, hd, slots_n, bs) = (2, 64, 3, 4);
    let shape = [15, bs, kvh, hd];
    let mut table_v: Vec<u32> = (0..15).map(|i| (4 * i + 1) % 15).collect();
    table_v[5 + 2] = 15;
    table_v[10] = u32::MAX;
    let table_r = upload_u32(r, &[slots_n, 5], &table_v);
    let table_g = upload_u32(g, &[slots_n, 5], &table_v);
    let mut rng = Rng::new(5);
    // (slots, positions): exactly one bad row, so the first report is the reference's error.
    let kv_cases: Vec<(Vec<u32>, Vec<u32>)> = vec![
        (vec![0, 3, 1], vec![0, 1, 2]),
        (vec![0, 1, 0], vec![4, 20, 2]),
        (vec![7], vec![0]),
        (vec![0, 1, 0], vec![3, 9, 19]),
        (vec![1, 2], vec![19, 1]),
    ];
    for (slots_v, pos_v) in &kv_cases {
        let n = slots_v.len();
        let kv = random_values(&mut rng, DType::F32, n * kvh * hd);
        let mut c_ref =
            KvCacheLayer { k: poisoned(r, DType::BF16, &shape), v: poisoned(r, DType::BF16, &shape) };
        let want = REF
            .kv_store(
                &upload(r, DType::F32, &[n, kvh, hd], &kv),
                &upload(r, DType::F32, &[n, kvh, hd], &kv),
                &mut c_ref,
                &table_r,
                &upload_u32(r, &[n], slots_v),
                &upload_u32(r, &[n], pos_v),
            )
            .expect_err("reference kv_store of a bad row");
        let mut c = KvCacheLayer { k: poisoned(g, DType::BF16, &shape), v: poisoned(g, DType::BF16, &shape) };
        g.kv_store(
            &upload(g, DType::F32, &[n, kvh, hd], &kv),
            &upload(g, DType::F32, &[n, kvh, hd], &kv),
            &mut c,
            &table_g,
            &upload_u32(g, &[n], slots_v),
            &upload_u32(g, &[n], pos_v),
        )
        .unwrap_or_else(|e| panic!("{name}: kv_store launch: {e}"));
        let got = g.read(&c.k).expect_err("the kernel's report at the next read");
        assert_eq!(got, want, "{name}: kv_store slots {slots_v:?} positions {pos_v:?}");
        g.synchronize().unwrap_or_else(|e| panic!("{name}: the status word is cleared after a report: {e}"));
    }

    // attention: decode rows, and prefill tiles (8+ rows of one slot, so the prefill kernel owns
    // them), with a bad position or a bad slot.
    let cache = KvCacheLayer { k: poisoned(g, DType::BF16, &shape), v: poisoned(g, DType::BF16, &shape) };
    let c_ref = KvCacheLayer { k: poisoned(r, DType::BF16, &shape), v: poisoned(r, DType::BF16, &shape) };
    let prefill_pos: Vec<u32> = (0..10).collect();
    let mut bad_pos = prefill_pos.clone();
    bad_pos[6] = 25;
    // Slot 1 reads its bad third block from position 8 on; slot 2 its bad first from 0.
    let mut bad_block_pos = prefill_pos.clone();
    bad_block_pos[9] = 12;
    let att_cases: Vec<(Vec<u32>, Vec<u32>)> = vec![
        (vec![0, 1, 3], vec![0, 0, 0]),
        (vec![0, 1], vec![3, 20]),
        (vec![0; 10], bad_pos),
        (vec![3; 10], prefill_pos.clone()),
        (vec![0, 1, 0], vec![19, 8, 2]),
        (vec![0, 2], vec![5, 0]),
        (vec![1; 10], bad_block_pos),
        (vec![2; 10], prefill_pos),
    ];
    for (slots_v, pos_v) in &att_cases {
        let n = slots_v.len();
        let heads = kvh * 4;
        let qv = random_values(&mut rng, DType::F32, n * heads * hd);
        let mut o_ref = poisoned(r, DType::F32, &[n, heads, hd]);
        let want = REF
            .attention(
                &upload(r, DType::F32, &[n, heads, hd], &qv),
                &c_ref,
                &table_r,
                &upload_u32(r, &[n], slots_v),
                &upload_u32(r, &[n], pos_v),
                0.125,
                &mut o_ref,
            )
            .expect_err("reference attention with a bad row");
        let mut out = poisoned(g, DType::F32, &[n, heads, hd]);
        g.attention(
            &upload(g, DType::F32, &[n, heads, hd], &qv),
            &cache,
            &table_g,
            &upload_u32(g, &[n], slots_v),
            &upload_u32(g, &[n], pos_v),
            0.125,
            &mut out,
        )
        .unwrap_or_else(|e| panic!("{name}: attention launch: {e}"));
        let got = g.read(&out).expect_err("the kernel's report at the next read");
        assert_eq!(got, want, "{name}: attention slots {slots_v:?} positions {pos_v:?}");
        g.synchronize().unwrap_or_else(|e| panic!("{name}: the status word is cleared after a report: {e}"));
    }
}

/// Unsupported shapes are typed errors at the launch, never a wrong answer.
fn unsupported_head_dims<D: Device>(name: &str, g: &Gpu<D>) {
    for hd in [3, 258] {
        let shape = [1, 4, 1, hd];
        let cache = KvCacheLayer { k: poisoned(g, DType::F32, &shape), v: poisoned(g, DType::F32, &shape) };
        let mut out = poisoned(g, DType::F32, &[1, 1, hd]);
        let e = g
            .attention(
                &poisoned(g, DType::F32, &[1, 1, hd]),
                &cache,
                &upload_u32(g, &[1, 1], &[0]),
                &upload_u32(g, &[1], &[0]),
                &upload_u32(g, &[1], &[0]),
                1.0,
                &mut out,
            )
            .expect_err("odd or oversized head_dim");
        assert!(matches!(e, Error::Unsupported { op: "attention", .. }), "{name}: head_dim {hd}: {e}");
    }
}

// ---------------------------------------------------------------------------------------------
// Emulated

#[cfg(feature = "emulate")]
mod emulated {
    use proptest::prelude::*;
    use proptest::sample::select;
    use proptest::test_runner::RngSeed;

    use super::*;

    fn config(cases: u32) -> ProptestConfig {
        ProptestConfig {
            cases,
            rng_seed: RngSeed::Fixed(0x6770_7561_7474_6e21),
            failure_persistence: None,
            max_shrink_iters: 50,
            ..ProptestConfig::default()
        }
    }

    fn attn_strategy() -> impl Strategy<Value = Case> {
        (
            1..=2usize,
            select(vec![1usize, 2, 4]),
            select(vec![2usize, 6, 64, 128, 34]),
            select(CACHE_TYPES.to_vec()),
            select(CACHE_TYPES.to_vec()),
            prop::collection::vec((0..40usize, 1..6usize), 1..=3),
            any::<bool>(),
            any::<u64>(),
        )
            .prop_map(|(kvh, ratio, hd, k, v, seqs, shuffle, seed)| {
                case(kvh, ratio, hd, (k, v), &seqs, shuffle, seed)
            })
    }

    #[test]
    fn every_kernel_the_launcher_names_is_in_the_image() {
        let have = memwall::kernels::simt_cuda().kernels();
        for name in attn::kernel_names() {
            assert!(have.iter().any(|k| k == name), "{name} is not in the emulated image");
        }
    }

    #[test]
    fn grid_of_dtypes_ratios_and_kernels() {
        for (name, g) in common::gpu::emulated() {
            for c in grid_cases() {
                run_case(&name, &g, &c, true);
            }
        }
    }

    #[test]
    fn long_contexts_prefill_and_mixed_batches() {
        for (name, g) in common::gpu::emulated() {
            for c in long_cases() {
                run_case(&name, &g, &c, true);
            }
        }
    }

    #[test]
    fn unwritten_positions_between_rows_only_poison_the_rows_that_read_them() {
        // Rows of one slot at positions 0 and 9, nothing cached in between: row 9 reads NaN (so
        // must give NaN), row 0 must not (the prefill tile holds positions 0..=9 for both).
        let mut c = case(1, 4, 64, (DType::BF16, DType::BF16), &[(0, 1)], false, 9);
        c.rows = vec![(c.rows[0].0, 0); 8];
        c.rows[3].1 = 9;
        c.capacity = 12;
        // Blocks of 5: the tile straddles two blocks, the second only partly written.
        let c = c.paged(5);
        for (name, g) in common::gpu::emulated() {
            run_case(&name, &g, &c, true);
        }
    }

    #[test]
    fn kv_store_last_row_wins() {
        for (name, g) in common::gpu::emulated() {
            kv_store_later_row_wins(&name, &g);
        }
    }

    #[test]
    fn bad_slots_and_positions_are_typed_errors_at_the_next_read() {
        for (name, g) in common::gpu::emulated() {
            data_errors(&name, &g);
            unsupported_head_dims(&name, &g);
        }
    }

    proptest! {
        #![proptest_config(config(8))]
        #[test]
        fn random_shapes_match_reference(c in attn_strategy()) {
            // One schedule per case (the grid tests run all three).
            let all = common::gpu::emulated();
            let (name, g) = &all[c.seed as usize % all.len()];
            run_case(name, g, &c, false);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// CUDA

device_tests! {
    fn matches_reference(g, who) {
        for c in grid_cases().into_iter().chain(long_cases()) {
            run_case(who, &g, &c, true);
        }
        // An 8K decode across many splits and a long prefill.
        let bf = (DType::BF16, DType::BF16);
        run_case(who, &g, &case(8, 4, 128, bf, &[(8191, 1)], false, 11), true);
        run_case(who, &g, &case(2, 4, 128, bf, &[(300, 200), (0, 50)], true, 12), true);
        kv_store_later_row_wins(who, &g);
        data_errors(who, &g);
        unsupported_head_dims(who, &g);
    }
}
