//! Decode attention (`Backend::attention`: flash-decoding over the paged KV cache) at the Llama 3.1
//! 8B heads, 32 query and 8 KV heads of head_dim 128, bf16 keys and values, f32 q and out: batch 1,
//! 4 and 16 sequences, each at position `CONTEXT - 1` (so each reads `CONTEXT` positions), the
//! cache in blocks of the session's default size scattered by a random block table, as a decode
//! step meets them. Each batch rotates over enough copies of its cache to fill 1 GiB (one copy
//! stands for one layer). Bytes are `memwall_runtime::cost::attention_traffic` (the live keys and
//! values, q, the rows' indices, out); the figure is against the copy peak. No cuBLAS peer:
//! attention is not a BLAS op.
//!
//! Checked before timing: heads 0, 5 and 31 (KV heads 0, 1 and 7) of the first and last rows
//! against an f64 softmax, within the bound tests/gpu_attention.rs derives for these kernels.

use criterion::{Criterion, SamplingMode, Throughput};
use memwall::model::session::DEFAULT_BLOCK_SIZE;
use memwall::runtime::cost::attention_traffic;
use memwall::runtime::{Backend, DType, KvCacheLayer, Tensor};

#[path = "../shared/attention_ref.rs"]
mod attention_ref;
use attention_ref::{Paged, head_reference, head_rows};

use super::{
    Ctx, CudaGpu, Storage, WORKING_SET, best_rotation, gamma, random_bytes, random_unit, shuffled,
    timed_calls,
};

/// Positions each sequence attends over.
pub const CONTEXT: usize = 8192;
const BATCHES: [usize; 3] = [1, 4, 16];
const HEADS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const BLOCK: usize = DEFAULT_BLOCK_SIZE;
/// f32 unit roundoff.
const U: f64 = 1.0 / (1u64 << 24) as f64;

struct Batch {
    rows: usize,
    caches: Vec<KvCacheLayer<Storage>>,
    table: Tensor<Storage>,
    slots: Tensor<Storage>,
    positions: Tensor<Storage>,
    q: Tensor<Storage>,
    out: Tensor<Storage>,
    scale: f32,
    bytes_per_call: u64,
}

impl Batch {
    fn call(&mut self, gpu: &CudaGpu, i: usize) -> memwall::runtime::Result<()> {
        let Batch { caches, table, slots, positions, q, out, scale, .. } = self;
        gpu.attention(q, &caches[i], table, slots, positions, *scale, out)
    }
}

fn setup(gpu: &CudaGpu, rows: usize) -> Batch {
    let per_seq = CONTEXT.div_ceil(BLOCK);
    let num_blocks = rows * per_seq;
    let shape = [num_blocks, BLOCK, KV_HEADS, HEAD_DIM];
    let elems = num_blocks * BLOCK * KV_HEADS * HEAD_DIM;
    let k_host = random_bytes(DType::BF16, elems, 0xa77e ^ rows as u64);
    let v_host = random_bytes(DType::BF16, elems, 0x7a1e ^ rows as u64);
    let copies = WORKING_SET.div_ceil(2 * k_host.len()).max(2);
    let caches = (0..copies)
        .map(|_| KvCacheLayer {
            k: gpu.upload(DType::BF16, &shape, &k_host).expect("upload k cache"),
            v: gpu.upload(DType::BF16, &shape, &v_host).expect("upload v cache"),
        })
        .collect();
    let table_host = shuffled(num_blocks, 0x7ab1e ^ rows as u64);
    let table = gpu.upload_u32(&[rows, per_seq], &table_host).expect("upload block table");
    let slots = gpu.upload_u32(&[rows], &(0..rows as u32).collect::<Vec<_>>()).expect("upload slots");
    let positions = gpu.upload_u32(&[rows], &vec![CONTEXT as u32 - 1; rows]).expect("upload positions");
    let q_host = random_unit(rows * HEADS * HEAD_DIM, 0x9 ^ rows as u64);
    let q = gpu.upload_f32(DType::F32, &[rows, HEADS, HEAD_DIM], &q_host).expect("upload q");
    let out = gpu.alloc(DType::F32, &[rows, HEADS, HEAD_DIM]).expect("allocate out");
    let bytes = attention_traffic(
        rows,
        (rows * CONTEXT) as u64,
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        DType::BF16,
        DType::BF16,
        DType::F32,
    )
    .expect("bytes");
    let mut b = Batch {
        rows,
        caches,
        table,
        slots,
        positions,
        q,
        out,
        scale: 1.0 / (HEAD_DIM as f32).sqrt(),
        bytes_per_call: bytes.total(),
    };
    check(gpu, &mut b, &k_host, &v_host, &table_host, &q_host);
    b
}

/// Heads 0, 5 and 31 of the first and last rows against an f64 softmax over the host's cache.
fn check(gpu: &CudaGpu, b: &mut Batch, k: &[u8], v: &[u8], table: &[u32], q: &[f32]) {
    super::poison(gpu, &mut b.out);
    b.call(gpu, 0).expect("attention");
    let out = super::read_f32(gpu, &b.out);
    let bf16 = |bytes: &[u8], e: usize| half::bf16::from_le_bytes([bytes[2 * e], bytes[2 * e + 1]]).to_f32();
    let per_seq = CONTEXT.div_ceil(BLOCK);
    let scale = f64::from(b.scale);
    for row in [0, b.rows - 1] {
        for h in [0, 5, HEADS - 1] {
            let g = h / (HEADS / KV_HEADS);
            let qh = &q[(row * HEADS + h) * HEAD_DIM..][..HEAD_DIM];
            let layout = Paged { block: BLOCK, kv_heads: KV_HEADS, head_dim: HEAD_DIM };
            let table_row = &table[row * per_seq..][..per_seq];
            let head = |bytes: &[u8]| head_rows(layout, table_row, g, CONTEXT, |e| bf16(bytes, e));
            let exact = head_reference(qh, &head(k), &head(v), scale);
            // tests/gpu_attention.rs `bounds`: logits off by delta in f32 (head_dim products, the
            // log2 e scale, the running max), exp2 within 2 ulps, sums over the positions of a
            // lane group, its block and the splits, a rescale per position and two merges; all
            // relative to sum_t p_t |v_t|, plus our own rounding of the exact value.
            let delta = (gamma(HEAD_DIM + 2, U) + 2.0 * U) * exact.a_max;
            let rel = (2.0 * delta).exp_m1()
                + 2.0 * gamma(CONTEXT + 144, U)
                + 10.0 * U * CONTEXT as f64
                + 16.0 * U
                + 36.0 * U
                + U;
            for (d, (&o, &pv_abs)) in exact.out.iter().zip(&exact.pv_abs).enumerate() {
                let got = out[(row * HEADS + h) * HEAD_DIM + d];
                let what = format!("attention batch {} row {row} head {h} dim {d}", b.rows);
                super::expect_close(&what, got, o, rel * pv_abs + U * o.abs());
            }
        }
    }
}

pub fn run(ctx: &Ctx, c: &mut Criterion, lines: &mut Vec<String>) {
    let gpu = &ctx.gpu;
    let mut group = c.benchmark_group("gpu_attention_decode_bf16");
    group.sampling_mode(SamplingMode::Flat);
    for rows in BATCHES {
        let label = format!("attention bf16 batch {rows} context {CONTEXT}");
        if ctx.out_of_time(&label, lines) {
            continue;
        }
        let mut b = setup(gpu, rows);
        let copies = b.caches.len();
        group.throughput(Throughput::Bytes(b.bytes_per_call));
        let mut next = 0usize;
        group.bench_function(format!("batch{rows}/context{CONTEXT}"), |bench| {
            bench.iter_custom(|iters| timed_calls(gpu, iters, copies, &mut next, |i| b.call(gpu, i)))
        });
        let per_call = best_rotation(gpu, copies, |i| b.call(gpu, i));
        let gbs = b.bytes_per_call as f64 / per_call / 1e9;
        lines.push(format!(
            "{:<44} {gbs:>7.1} GB/s = {:>5.1}% of measured copy peak; no cuBLAS peer ({HEADS} q / {KV_HEADS} kv \
             heads x {HEAD_DIM}, {:.0} MB per call)",
            format!("{label}:"),
            100.0 * gbs / ctx.peak_gb_s,
            b.bytes_per_call as f64 / 1e6
        ));
    }
    group.finish();
}
