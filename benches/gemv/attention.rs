//! Decode attention (`Backend::attention` over the paged KV cache) on the default backend, at
//! the Llama 3.1 8B heads: 32 query and 8 KV heads of head_dim 128, f32 q and out; and at heads
//! of 64 (Llama 3.2 1B's, and the decode bench's model's). Each of
//! `rows` sequences sits at position `CONTEXT - 1`, so a call reads `CONTEXT` cached keys and
//! values per sequence and KV head; the cache is in blocks of the session's default size,
//! scattered by a random block table as a decode step meets them. Each case rotates over enough
//! copies of its cache (one copy stands for one layer) to fill the working set, so every call
//! reads its cache from memory. Bytes are `memwall_runtime::cost::attention_traffic` (the live
//! keys and values, q, the rows' indices, out).
//!
//! Checked before timing: heads 0, 5 and 31 (KV heads 0, 1 and 7) of the first and last rows
//! against an f64 softmax, within the bound tests/ops.rs derives for the fast backend.

use std::time::{Duration, Instant};

use criterion::{Criterion, SamplingMode, Throughput};
use memwall::model::session::DEFAULT_BLOCK_SIZE;
use memwall::runtime::cost::attention_traffic;
use memwall::runtime::dtype::decode_f32;
use memwall::runtime::{Backend, DType, HostStorage, HostTensor, KvCacheLayer};
use rayon::prelude::*;

#[path = "../shared/attention_ref.rs"]
mod attention_ref;
use attention_ref::{Paged, head_reference, head_rows};

use super::common::{gamma, shuffled, splitmix};
use super::{FILL_CHUNK, Rotated, bf16_unit_bits, print_setup, random_unit_f32};

/// Positions each sequence attends over.
pub const CONTEXT: usize = 8192;
/// `(cache dtype, sequences, head_dim)`: the GPU bench's bf16 cache at batch 1, 4 and 16, the
/// session's default f32 cache at batch 1, and a bf16 cache of heads of 64 at batch 1.
pub const CASES: [(DType, usize, usize); 5] = [
    (DType::BF16, 1, 128),
    (DType::BF16, 4, 128),
    (DType::BF16, 16, 128),
    (DType::F32, 1, 128),
    (DType::BF16, 1, 64),
];
const HEADS: usize = 32;
const KV_HEADS: usize = 8;
const BLOCK: usize = DEFAULT_BLOCK_SIZE;
/// f32 unit roundoff.
const U: f64 = 1.0 / (1u64 << 24) as f64;

/// What the summary needs from one case.
pub struct AttentionRun {
    pub cache: DType,
    pub rows: usize,
    pub head_dim: usize,
    pub timed: Rotated,
}

impl AttentionRun {
    pub fn label(&self) -> String {
        format!(
            "attention {} cache batch {} heads of {} context {CONTEXT}",
            self.cache.name(),
            self.rows,
            self.head_dim
        )
    }
}

struct Setup {
    caches: Vec<KvCacheLayer<HostStorage>>,
    table: HostTensor,
    slots: HostTensor,
    positions: HostTensor,
    q: HostTensor,
    out: HostTensor,
    next: usize,
}

pub fn bench_attention<B: Backend<Storage = HostStorage>>(
    c: &mut Criterion,
    backend: &B,
    (cache, rows, hd): (DType, usize, usize),
    working_set: u64,
) -> AttentionRun {
    let per_seq = CONTEXT.div_ceil(BLOCK);
    let num_blocks = rows * per_seq;
    let shape = [num_blocks, BLOCK, KV_HEADS, hd];
    let elems = num_blocks * BLOCK * KV_HEADS * hd;
    // Keys and values of one copy.
    let copy_bytes = (2 * elems * cache.size()) as u64;
    let copies = usize::try_from(working_set.div_ceil(copy_bytes).max(2)).expect("copies fit usize");
    let bytes_per_call =
        attention_traffic(rows, (rows * CONTEXT) as u64, HEADS, KV_HEADS, hd, cache, cache, DType::F32)
            .expect("bytes of a llama shape")
            .total();
    let scale = 1.0 / (hd as f32).sqrt();
    let seed = (rows as u64) | (hd as u64) << 8;

    let mut group = c.benchmark_group(format!("attention_decode_{}", cache.name()));
    group.sampling_mode(SamplingMode::Flat).throughput(Throughput::BytesDecimal(bytes_per_call));
    let mut timed = Rotated { bytes_per_call, copies, calls: Vec::new() };
    // Built on the first call, as the GEMV's: a case filtered out costs nothing.
    let mut setup: Option<Setup> = None;
    let mut setup_time = Duration::ZERO;
    group.bench_function(format!("batch{rows}/context{CONTEXT}/hd{hd}"), |b| {
        let s = setup.get_or_insert_with(|| {
            let start = Instant::now();
            let k_host = random_cache(cache, elems, 0xa77e ^ seed);
            let v_host = random_cache(cache, elems, 0x7a1e ^ seed);
            let caches: Vec<_> = (0..copies)
                .map(|_| KvCacheLayer {
                    k: backend.upload(cache, &shape, &k_host).expect("upload k cache"),
                    v: backend.upload(cache, &shape, &v_host).expect("upload v cache"),
                })
                .collect();
            let table_host = shuffled(num_blocks, 0x7ab1e ^ seed);
            let table = backend.upload_u32(&[rows, per_seq], &table_host).expect("upload block table");
            let slots =
                backend.upload_u32(&[rows], &(0..rows as u32).collect::<Vec<_>>()).expect("upload slots");
            let positions =
                backend.upload_u32(&[rows], &vec![CONTEXT as u32 - 1; rows]).expect("upload positions");
            let q_host = random_unit_f32(rows * HEADS * hd, 0x9 ^ seed);
            let q = backend.upload_f32(DType::F32, &[rows, HEADS, hd], &q_host).expect("upload q");
            let mut out = backend.alloc(DType::F32, &[rows, HEADS, hd]).expect("allocate out");
            // Poisoned, so an unwritten element fails the check.
            let nan = vec![f32::NAN; rows * HEADS * hd];
            backend.write(&mut out, bytemuck::cast_slice(&nan)).expect("poison out");
            backend
                .attention(&q, &caches[0], &table, &slots, &positions, scale, &mut out)
                .expect("attention");
            backend.synchronize().expect("synchronize");
            let keys = decode_f32(cache, &k_host).expect("decode keys");
            let values = decode_f32(cache, &v_host).expect("decode values");
            check(
                (rows, hd),
                &keys,
                &values,
                &table_host,
                &q_host,
                scale,
                &backend.read_f32(&out).expect("read out"),
            );
            setup_time = start.elapsed();
            Setup { caches, table, slots, positions, q, out, next: 0 }
        });
        let Setup { caches, table, slots, positions, q, out, next } = s;
        timed.time(b, next, |i| {
            backend.attention(q, &caches[i], table, slots, positions, scale, out).expect("attention");
            backend.synchronize().expect("synchronize");
        });
    });
    group.finish();
    print_setup(&timed, copy_bytes, setup_time);
    AttentionRun { cache, rows, head_dim: hd, timed }
}

/// `elems` random cache elements of `dtype` (bf16 or f32) in (-1, 1), never zero, as bytes.
fn random_cache(dtype: DType, elems: usize, seed: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; elems * dtype.size()];
    let chunk = FILL_CHUNK * dtype.size();
    bytes.par_chunks_mut(chunk).enumerate().for_each(|(i, chunk)| {
        let mut state = seed ^ ((i as u64) << 20);
        match dtype {
            DType::BF16 => {
                for quad in chunk.chunks_mut(8) {
                    let r = splitmix(&mut state);
                    for (j, e) in quad.chunks_exact_mut(2).enumerate() {
                        e.copy_from_slice(&bf16_unit_bits((r >> (16 * j)) as u16).to_le_bytes());
                    }
                }
            }
            DType::F32 => {
                for pair in chunk.chunks_mut(8) {
                    let r = splitmix(&mut state);
                    for (j, e) in pair.chunks_exact_mut(4).enumerate() {
                        e.copy_from_slice(&f32_unit_bits((r >> (32 * j)) as u32).to_le_bytes());
                    }
                }
            }
            other => panic!("the bench fills bf16 and f32 caches, not {other}"),
        }
    });
    bytes
}

/// An f32 in (-1, 1) from 32 random bits: 23 mantissa bits, a sign, and an exponent below 2^0
/// from the leading zeros of the top byte (capped at 7), so the magnitude lies in [2^-8, 1).
fn f32_unit_bits(r: u32) -> u32 {
    let mantissa = r & 0x7f_ffff;
    let sign = (r >> 23) & 1;
    let below = ((r >> 24) as u8).leading_zeros().min(7);
    (sign << 31) | ((126 - below) << 23) | mantissa
}

/// Heads 0, 5 and 31 of the first and last rows against an f64 softmax over the host's cache,
/// within tests/ops.rs's bound for the fast backend: every logit off by at most delta =
/// (gamma(hd + 1) + 2u) A_max, so the weights by e^(+-2 delta); 2 gamma(t) for the sums, 2u per
/// position of rescaling, 17u for exp and the division; relative to sum_t p_t |v_t|, plus u of
/// the exact value for the rounding to f32.
fn check(
    (rows, hd): (usize, usize),
    k: &[f32],
    v: &[f32],
    table: &[u32],
    q: &[f32],
    scale: f32,
    out: &[f32],
) {
    let per_seq = CONTEXT.div_ceil(BLOCK);
    let scale = f64::from(scale);
    for row in [0, rows - 1] {
        for h in [0, 5, HEADS - 1] {
            let g = h / (HEADS / KV_HEADS);
            let qh = &q[(row * HEADS + h) * hd..][..hd];
            let layout = Paged { block: BLOCK, kv_heads: KV_HEADS, head_dim: hd };
            let table_row = &table[row * per_seq..][..per_seq];
            let head = |cache: &[f32]| head_rows(layout, table_row, g, CONTEXT, |i| cache[i]);
            let exact = head_reference(qh, &head(k), &head(v), scale);
            let delta = (gamma(hd + 1, U) + 2.0 * U) * exact.a_max;
            let rel = (2.0 * delta).exp_m1() + 2.0 * gamma(CONTEXT, U) + 2.0 * U * CONTEXT as f64 + 17.0 * U;
            for (d, (&o, &pv_abs)) in exact.out.iter().zip(&exact.pv_abs).enumerate() {
                let got = f64::from(out[(row * HEADS + h) * hd + d]);
                let tol = rel * pv_abs + U * o.abs();
                assert!(
                    (got - o).abs() <= tol,
                    "attention batch {rows} row {row} head {h} dim {d}: backend gave {got}, f64 softmax {o} \
                     (tol {tol:e})"
                );
            }
        }
    }
}
