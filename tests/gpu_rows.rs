//! The rows family of the GPU backend (`kernels-cuda/rows.cu`): embedding, gather_rows,
//! scatter_add_rows, each against `cpu::Reference` over proptest shapes, plus the data-dependent
//! errors (an id or index beyond its table) and tensors run at fewer rows than allocated.
//!
//! Every op runs on each emulated backend (`--features memwall/emulate`: the kernels compiled as
//! host C++ under three thread schedules) and, ignored unless asked for, on a CUDA or ROCm device
//! (`--features memwall/cuda` or `memwall/hip`, `-- --ignored`; `MEMWALL_REQUIRE_GPU=1` makes a missing device fail).
//! Inputs are made on the host and uploaded to both backends; outputs are poisoned (NaN) first;
//! each tolerance is derived in a comment next to it (u = 2^-24, gamma(n) = n u / (1 - n u)).

#![cfg_attr(
    not(any(feature = "emulate", feature = "cuda", feature = "hip")),
    allow(dead_code, unused_imports)
)]

mod common;

use std::fmt::Debug;

use common::gpu::linear_to_backend;
use common::spare::{f32_pair, pair, same};
use common::{Rng, *};
use memwall_runtime::cpu::Reference;
use memwall_runtime::{Backend, DType, Error, HostStorage, Linear, WeightScale};
use proptest::prelude::*;
use proptest::sample::select;

static REF: Reference = Reference;

const PICKED: [usize; 5] = [1, 2, 3, 5, 17];

/// The seed of this suite's proptest cases (`common::run_cases`).
const SEED: u64 = 0x6770_7572_6f77_7321;

// ---------------------------------------------------------------------------------------------
// embedding

#[derive(Clone, Copy, Debug, PartialEq)]
enum ScaleKind {
    None,
    PerTensor,
    /// `[n]`
    PerChannel,
    /// `[n, 1]`
    PerChannelColumn,
    Block(usize, usize),
}

fn scale_kind() -> impl Strategy<Value = ScaleKind> {
    prop_oneof![
        select(vec![
            ScaleKind::None,
            ScaleKind::PerTensor,
            ScaleKind::PerChannel,
            ScaleKind::PerChannelColumn,
            ScaleKind::Block(128, 128),
        ]),
        (1..=9usize, 1..=9usize).prop_map(|(r, c)| ScaleKind::Block(r, c)),
    ]
}

/// A host scale of `kind` for a `[n, k]` table, and the scale of every element, row-major.
fn make_scale(
    rng: &mut Rng,
    kind: ScaleKind,
    dtype: DType,
    n: usize,
    k: usize,
) -> (WeightScale<HostStorage>, Vec<f64>) {
    match kind {
        ScaleKind::None => (WeightScale::None, vec![1.0; n * k]),
        ScaleKind::PerTensor => {
            let s = random_positive(rng, DType::F32, 1)[0];
            (WeightScale::PerTensor(s), vec![s as f64; n * k])
        }
        ScaleKind::PerChannel | ScaleKind::PerChannelColumn => {
            let s = random_positive(rng, dtype, n);
            let shape: &[usize] = if kind == ScaleKind::PerChannel { &[n] } else { &[n, 1] };
            let per_elem = (0..n * k).map(|i| s[i / k] as f64).collect();
            (WeightScale::PerChannel(upload(&REF, dtype, shape, &s)), per_elem)
        }
        ScaleKind::Block(br, bc) => {
            let (nb, kb) = (n.div_ceil(br), k.div_ceil(bc));
            let s = random_positive(rng, dtype, nb * kb);
            let per_elem = (0..n * k).map(|i| s[(i / k / br) * kb + (i % k) / bc] as f64).collect();
            let scales = upload(&REF, dtype, &[nb, kb], &s);
            (WeightScale::Block { block_rows: br, block_cols: bc, scales }, per_elem)
        }
    }
}

#[derive(Clone, Debug)]
struct EmbeddingCase {
    vocab: usize,
    cols: usize,
    picked: usize,
    table: DType,
    scale: ScaleKind,
    scale_dtype: DType,
    seed: u64,
}

fn embedding_case() -> impl Strategy<Value = EmbeddingCase> {
    (
        prop_oneof![
            (select(vec![1usize, 3, 17, 257]), select(vec![1usize, 3, 16, 17, 130, 4096, 4097])),
            (Just(4097usize), select(vec![1usize, 3, 17])),
        ],
        select(PICKED.to_vec()),
        select(DType::FLOATS.to_vec()),
        scale_kind(),
        select(vec![DType::F32, DType::BF16]),
        any::<u64>(),
    )
        .prop_map(|((vocab, cols), picked, table, scale, scale_dtype, seed)| EmbeddingCase {
            vocab,
            cols,
            picked,
            table,
            scale,
            scale_dtype,
            seed,
        })
}

/// A random table of the case's dtype and scale, on the host, with its ids.
fn embedding_inputs(c: &EmbeddingCase) -> (Linear<HostStorage>, Vec<u32>) {
    let mut rng = Rng::new(c.seed);
    let w = upload(&REF, c.table, &[c.vocab, c.cols], &random_values(&mut rng, c.table, c.vocab * c.cols));
    let (scale, _) = make_scale(&mut rng, c.scale, c.scale_dtype, c.vocab, c.cols);
    (Linear { weight: w, scale }, random_indices(&mut rng, c.picked, c.vocab))
}

fn embedding_case_run<B: Backend>(b: &B, c: &EmbeddingCase) {
    let who = b.name();
    let (table_ref, idv) = embedding_inputs(c);
    let ids_ref = upload_u32(&REF, &[c.picked], &idv);
    let mut o_ref = poisoned(&REF, DType::F32, &[c.picked, c.cols]);
    REF.embedding(&table_ref, &ids_ref, &mut o_ref).unwrap_or_else(|e| panic!("reference embedding: {e}"));
    let want = read_f32(&REF, &o_ref);

    let table = linear_to_backend(b, &table_ref);
    let ids = upload_u32(b, &[c.picked], &idv);
    let mut o = poisoned(b, DType::F32, &[c.picked, c.cols]);
    b.embedding(&table, &ids, &mut o).unwrap_or_else(|e| panic!("{who} embedding: {e}"));
    // Unscaled: a copy (the widening is exact). Scaled: the stored value and its scale are f32
    // values whose product the reference forms exactly in f64 and rounds once to f32; the GPU's
    // one f32 product is that same correctly rounded value. Bit-identical: bound 0.
    let zero = vec![0.0; c.picked * c.cols];
    assert_close(&format!("{who} embedding {c:?} ids {idv:?}"), &read_f32(b, &o), &want, &zero);
}

/// Every code of every 8- and 16-bit table dtype through `embedding` (one row of 256 codes per id;
/// the 16-bit tables hold all 65536), against the reference's decode: the same f32 bits, or NaN
/// for NaN (payloads and NaN signs are not part of the contract). So the special codes (NaN, inf,
/// -0, subnormals) that random tables rarely hold go through each backend's decoders too.
fn embedding_every_code<B: Backend>(b: &B) {
    let who = b.name();
    for dtype in DType::FLOATS.into_iter().filter(|d| d.size() < 4) {
        let codes: usize = 1 << (8 * dtype.size());
        let bytes: Vec<u8> = if dtype.size() == 1 {
            (0..codes).map(|c| c as u8).collect()
        } else {
            (0..codes).flat_map(|c| (c as u16).to_le_bytes()).collect()
        };
        let (rows, cols) = (codes / 256, 256);
        let ids: Vec<u32> = (0..rows as u32).rev().collect();
        let want = embed_codes(&REF, dtype, rows, &bytes, &ids);
        let got = embed_codes(b, dtype, rows, &bytes, &ids);
        let poison = u32::from_le_bytes(poison_bytes(DType::F32, 1)[..4].try_into().unwrap());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let code = (rows - 1 - i / cols) * cols + i % cols;
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan() && g.to_bits() != poison),
                "{who} {dtype} code {code:#x}: {g:e} ({:#010x}), reference {w:e} ({:#010x})",
                g.to_bits(),
                w.to_bits()
            );
        }
    }
}

/// `embedding` on `be` of the table [rows, 256] of `dtype` holding `bytes`, rows `ids`, as f32.
fn embed_codes<B: Backend>(be: &B, dtype: DType, rows: usize, bytes: &[u8], ids: &[u32]) -> Vec<f32> {
    let mut weight = be.alloc(dtype, &[rows, 256]).expect("table");
    be.write(&mut weight, bytes).expect("table bytes");
    let table = Linear { weight, scale: WeightScale::None };
    let ids = upload_u32(be, &[ids.len()], ids);
    let mut out = poisoned(be, DType::F32, &[rows, 256]);
    be.embedding(&table, &ids, &mut out).unwrap_or_else(|e| panic!("{} embedding {dtype}: {e}", be.name()));
    read_f32(be, &out)
}

/// An id beyond the vocabulary is `TokenOutOfRange` at the next read, its row is skipped (still
/// poison) and the other rows are right; the read after that is clean.
fn embedding_bad_id<B: Backend>(b: &B) {
    let who = b.name();
    let c = EmbeddingCase {
        vocab: 17,
        cols: 130,
        picked: 5,
        table: DType::BF16,
        scale: ScaleKind::PerChannel,
        scale_dtype: DType::F32,
        seed: 9,
    };
    let (table_ref, mut idv) = embedding_inputs(&c);
    let table = linear_to_backend(b, &table_ref);
    idv[3] = 17;
    let ids = upload_u32(b, &[c.picked], &idv);
    let mut o = poisoned(b, DType::F32, &[c.picked, c.cols]);
    b.embedding(&table, &ids, &mut o).unwrap_or_else(|e| panic!("{who} embedding: {e}"));
    match b.read(&o) {
        Err(Error::TokenOutOfRange { op: "embedding", row: 3, id: 17, vocab: 17 }) => {}
        other => panic!("{who}: embedding with id 17 of 17 gave {:?}", other.map(|v| v.len())),
    }
    let got = read_f32(b, &o);
    // The good rows, against the reference on the good ids alone.
    let good: Vec<u32> = idv.iter().copied().filter(|&id| id < 17).collect();
    let mut o_ref = poisoned(&REF, DType::F32, &[good.len(), c.cols]);
    REF.embedding(&table_ref, &upload_u32(&REF, &[good.len()], &good), &mut o_ref).unwrap();
    let want = read_f32(&REF, &o_ref);
    let mut got_good = got[..3 * c.cols].to_vec();
    got_good.extend_from_slice(&got[4 * c.cols..]);
    assert_close(&format!("{who} embedding good rows"), &got_good, &want, &vec![0.0; want.len()]);
    assert!(got[3 * c.cols..4 * c.cols].iter().all(|v| v.is_nan()), "{who}: the bad row was written");
}

fn embedding_cases<B: Backend>(b: &B, who: &str, cases: u32) {
    run_cases(SEED, who, cases, embedding_case(), |c| embedding_case_run(b, &c));
    embedding_bad_id(b);
}

// ---------------------------------------------------------------------------------------------
// gather_rows

fn gather_rows_case<B: Backend>(b: &B, rows: usize, cols: usize, picked: usize, seed: u64) {
    let who = b.name();
    let mut rng = Rng::new(seed);
    // Index-revealing: element (row, col) holds row * cols + col + 0.5.
    let sv = index_values(rows * cols);
    let iv = random_indices(&mut rng, picked, rows);
    let src = upload(b, DType::F32, &[rows, cols], &sv);
    let idx = upload_u32(b, &[picked], &iv);
    let mut o = poisoned(b, DType::F32, &[picked, cols]);
    b.gather_rows(&src, &idx, &mut o).unwrap_or_else(|e| panic!("{who} gather_rows: {e}"));
    let mut o_ref = poisoned(&REF, DType::F32, &[picked, cols]);
    REF.gather_rows(
        &upload(&REF, DType::F32, &[rows, cols], &sv),
        &upload_u32(&REF, &[picked], &iv),
        &mut o_ref,
    )
    .unwrap_or_else(|e| panic!("reference gather_rows: {e}"));
    // A copy: exact.
    let zero = vec![0.0; picked * cols];
    assert_close(
        &format!("{who} gather_rows {rows}x{cols} idx {iv:?}"),
        &read_f32(b, &o),
        &read_f32(&REF, &o_ref),
        &zero,
    );
}

/// An index beyond src is `IndexOutOfRange` at the next synchronize; its row is skipped.
fn gather_rows_bad_index<B: Backend>(b: &B) {
    let who = b.name();
    let (rows, cols) = (4, 17);
    let sv = index_values(rows * cols);
    let src = upload(b, DType::F32, &[rows, cols], &sv);
    let iv = [2u32, 0, 9, 3];
    let idx = upload_u32(b, &[4], &iv);
    let mut o = poisoned(b, DType::F32, &[4, cols]);
    b.gather_rows(&src, &idx, &mut o).unwrap_or_else(|e| panic!("{who} gather_rows: {e}"));
    match b.synchronize() {
        Err(Error::IndexOutOfRange { op: "gather_rows", row: 2, index: 9, len: 4 }) => {}
        other => panic!("{who}: gather_rows with index 9 of 4 gave {other:?}"),
    }
    let got = read_f32(b, &o);
    for (i, &from) in iv.iter().enumerate() {
        let row = &got[i * cols..(i + 1) * cols];
        if from as usize >= rows {
            assert!(row.iter().all(|v| v.is_nan()), "{who}: the bad row was written");
        } else {
            assert_eq!(row, &sv[from as usize * cols..][..cols], "{who}: gathered row {i}");
        }
    }
}

fn gather_rows_cases<B: Backend>(b: &B, who: &str, cases: u32) {
    let shapes = (
        select(vec![1usize, 3, 17, 257]),
        select(vec![1usize, 3, 16, 17, 130, 4097]),
        select(PICKED.to_vec()),
        any::<u64>(),
    );
    run_cases(SEED, who, cases, shapes, |(rows, cols, picked, seed)| {
        gather_rows_case(b, rows, cols, picked, seed)
    });
    gather_rows_bad_index(b);
}

// ---------------------------------------------------------------------------------------------
// scatter_add_rows

/// Runs scatter_add_rows on `b` and on the reference and compares them. `skip` lists the i whose
/// index is out of range: the reference runs without them.
fn scatter_compare<B: Backend>(b: &B, rows: usize, cols: usize, iv: &[u32], seed: u64, skip: &[usize]) {
    let who = b.name();
    let picked = iv.len();
    let mut rng = Rng::new(seed);
    let dv = random_values(&mut rng, DType::F32, rows * cols);
    let sv = random_values(&mut rng, DType::F32, picked * cols);
    let wv = random_values(&mut rng, DType::F32, picked);

    let mut d = upload(b, DType::F32, &[rows, cols], &dv);
    let idx = upload_u32(b, &[picked], iv);
    let src = upload(b, DType::F32, &[picked, cols], &sv);
    let weights = upload(b, DType::F32, &[picked], &wv);
    b.scatter_add_rows(&mut d, &idx, &src, &weights)
        .unwrap_or_else(|e| panic!("{who} scatter_add_rows: {e}"));
    let got = match (b.read_f32(&d), skip.first()) {
        (Ok(v), None) => v,
        (Err(Error::IndexOutOfRange { op: "scatter_add_rows", row, index, len }), Some(&first))
            if row == first && index == iv[first] && len == rows =>
        {
            read_f32(b, &d)
        }
        (other, _) => panic!("{who}: scatter_add_rows with idx {iv:?} gave {:?}", other.map(|v| v.len())),
    };

    // The reference on the in-range contributions, in their order.
    let keep: Vec<usize> = (0..picked).filter(|i| !skip.contains(i)).collect();
    let kiv: Vec<u32> = keep.iter().map(|&i| iv[i]).collect();
    let ksv: Vec<f32> = keep.iter().flat_map(|&i| sv[i * cols..(i + 1) * cols].iter().copied()).collect();
    let kwv: Vec<f32> = keep.iter().map(|&i| wv[i]).collect();
    let mut d_ref = upload(&REF, DType::F32, &[rows, cols], &dv);
    if !keep.is_empty() {
        REF.scatter_add_rows(
            &mut d_ref,
            &upload_u32(&REF, &[keep.len()], &kiv),
            &upload(&REF, DType::F32, &[keep.len(), cols], &ksv),
            &upload(&REF, DType::F32, &[keep.len()], &kwv),
        )
        .unwrap_or_else(|e| panic!("reference scatter_add_rows: {e}"));
    }
    let want = read_f32(&REF, &d_ref);

    let mut exact: Vec<f64> = dv.iter().map(|&v| v as f64).collect();
    let mut abs: Vec<f64> = exact.iter().map(|v| v.abs()).collect();
    let mut count = vec![0usize; rows];
    for (k, &row) in kiv.iter().enumerate() {
        count[row as usize] += 1;
        for c in 0..cols {
            let t = kwv[k] as f64 * ksv[k * cols + c] as f64;
            exact[row as usize * cols + c] += t;
            abs[row as usize * cols + c] += t.abs();
        }
    }
    // Per element of a row with n contributions: the GPU adds them in order of i into the f32
    // destination, one fma (one rounding) each: within gamma(n) (|d0| + sum |w src|) of the
    // exact value (Higham 4.2, n additions); the reference accumulates in f64 and rounds once:
    // within u |exact| (its f64 error, gamma64(2n), is far below that). Rows with no
    // contribution must be untouched: bound 0.
    let bound: Vec<f64> = (0..rows * cols)
        .map(|e| {
            let n = count[e / cols];
            if n == 0 { 0.0 } else { gamma(n) * abs[e] + U32 * exact[e].abs() }
        })
        .collect();
    assert_close(&format!("{who} scatter_add_rows {rows}x{cols} idx {iv:?}"), &got, &want, &bound);
}

fn scatter_add_rows_cases<B: Backend>(b: &B, who: &str, cases: u32) {
    let shapes = (
        select(vec![1usize, 3, 17, 257]),
        select(vec![1usize, 3, 16, 17, 130, 4097]),
        select(PICKED.to_vec()),
        any::<u64>(),
    );
    run_cases(SEED, who, cases, shapes, |(rows, cols, picked, seed)| {
        // Few distinct rows, so several contributions land on one row.
        let iv = random_indices(&mut Rng::new(seed ^ 1), picked, rows.min(1 + picked / 2));
        scatter_compare(b, rows, cols, &iv, seed, &[]);
    });
    // Mixtral's combine at a prefill of 40 tokens: two experts per token, each token's two rows
    // far apart in i (the expert-sorted order); more rows than one row group.
    let tokens = 40;
    let iv: Vec<u32> = (0..2 * tokens).map(|i| ((i * 7) % tokens) as u32).collect();
    scatter_compare(b, tokens, 256, &iv, 5, &[]);
    // Many contributions to one row: the order of i decides the rounding.
    scatter_compare(b, 2, 1028, &[1; 33], 6, &[]);
    // Bad indices: the first is reported, and nothing is written for either.
    scatter_compare(b, 3, 17, &[0, 5, 2, 0, 3, 1], 7, &[1, 4]);
    scatter_compare(b, 3, 64, &[0, 5, 2, 0, 3, 1], 8, &[1, 4]);
}

// ---------------------------------------------------------------------------------------------
// set_rows

fn set_rows_respected<B: Backend>(b: &B) {
    let mut rng = Rng::new(0x5e7_0006);
    let (vocab, cols) = (11, 20);
    let table = Linear::plain(upload(
        b,
        DType::BF16,
        &[vocab, cols],
        &random_values(&mut rng, DType::BF16, vocab * cols),
    ));
    let ids = [4u32, 10, 0];
    let (ie, mut is) = pair(b, DType::U32, &[], bytemuck::cast_slice(&ids));
    let (mut oe, mut os) = f32_pair(b, &mut rng, &[cols]);
    b.embedding(&table, &ie, &mut oe).unwrap();
    b.embedding(&table, &is, &mut os).unwrap();
    same(b, "embedding out", &oe, &mut os);
    same(b, "embedding ids", &ie, &mut is);

    // gather_rows and scatter_add_rows: the picked rows (idx, out, src, weights) and the table
    // (src of the gather, dst of the scatter) all at ROWS of MAX.
    let (te, mut ts) = f32_pair(b, &mut rng, &[cols]);
    let (xe, mut xs) = pair(b, DType::U32, &[], bytemuck::cast_slice(&[2u32, 0, 2]));
    let (mut ge, mut gs) = f32_pair(b, &mut rng, &[cols]);
    b.gather_rows(&te, &xe, &mut ge).unwrap();
    b.gather_rows(&ts, &xs, &mut gs).unwrap();
    same(b, "gather_rows out", &ge, &mut gs);
    same(b, "gather_rows src", &te, &mut ts);

    let (we, mut ws) = f32_pair(b, &mut rng, &[]);
    let (mut de, mut ds) = f32_pair(b, &mut rng, &[cols]);
    b.scatter_add_rows(&mut de, &xe, &ge, &we).unwrap();
    b.scatter_add_rows(&mut ds, &xs, &gs, &ws).unwrap();
    same(b, "scatter_add_rows dst", &de, &mut ds);
    same(b, "scatter_add_rows idx", &xe, &mut xs);
    same(b, "scatter_add_rows weights", &we, &mut ws);
}

// ---------------------------------------------------------------------------------------------
// Backends

#[cfg(feature = "emulate")]
mod emulated {
    use super::*;

    /// Cases per op and schedule: emulation runs every GPU thread as a fiber on one core.
    const EMU_CASES: u32 = 48;

    /// Every kernel the launchers of this family may launch is in the image.
    #[test]
    fn every_kernel_is_in_the_image() {
        let have = memwall::kernels::simt_cuda().kernels();
        for name in memwall::runtime::gpu::ops::rows::kernel_names() {
            assert!(have.iter().any(|k| k == name), "{name} is not in the SIMT image");
        }
    }

    #[test]
    fn embedding_matches_reference() {
        for (name, b) in gpu::emulated() {
            embedding_cases(&b, &name, EMU_CASES);
        }
    }

    #[test]
    fn embedding_decodes_every_code() {
        for (_, b) in gpu::emulated() {
            embedding_every_code(&b);
        }
    }

    #[test]
    fn gather_rows_matches_reference() {
        for (name, b) in gpu::emulated() {
            gather_rows_cases(&b, &name, EMU_CASES);
        }
    }

    #[test]
    fn scatter_add_rows_matches_reference() {
        for (name, b) in gpu::emulated() {
            scatter_add_rows_cases(&b, &name, EMU_CASES);
        }
    }

    #[test]
    fn set_rows_is_respected() {
        for (_, b) in gpu::emulated() {
            set_rows_respected(&b);
        }
    }
}

device_tests! {
    const CASES: u32 = 64;

    fn embedding_matches_reference(b, who) {
        embedding_cases(&b, who, CASES);
    }

    fn embedding_decodes_every_code(b, who) {
        embedding_every_code(&b);
    }

    fn gather_rows_matches_reference(b, who) {
        gather_rows_cases(&b, who, CASES);
    }

    fn scatter_add_rows_matches_reference(b, who) {
        scatter_add_rows_cases(&b, who, CASES);
    }

    fn set_rows_is_respected(b, who) {
        set_rows_respected(&b);
    }
}
