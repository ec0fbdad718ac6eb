//! Mixtral's sparse MLP (`experts`) at the Mixtral 8x7B layer shape (8 experts of gate and up
//! 14336 x 4096 and down 4096 x 14336, top 2), weights bf16 (no scale) and e4m3fn (per-channel f32
//! scales), each expert's matrices from their own seed, batch 1, 4 and 16 and a 512-row prefill
//! chunk: routed on the device (the default: five launches up to 4 rows, seven above, grouped
//! GEMMs above 16 rows; nothing read back) against the host-routed path on the same GPU and
//! weights (`experts_composed`: the picks read back, then per picked expert a gather, the gate/up
//! product, the down product and a scatter), the only peer at hand (cuBLAS has no MoE op). The
//! calls rotate over `PATTERNS` sets of picks (random, distinct per row); decode's bytes are the
//! distinct picked experts' weights and scales plus x and out, averaged over the rotation: one
//! picked expert's weights alone (352 MB in bf16) are several times the L2, so no call finds the
//! last one's in cache. The prefill line is compute-bound and reports TFLOP/s of the products'
//! 2 x 3 x pairs x 4096 x 14336 instead. Each decode line ends with the same calls on the tensor
//! cores (`Gpu::set_gemv_tensor_core_rows(Some(1))`: gemv_tc.cu's grouped kernels for gate, up
//! and down). Before timing, each device-routed output is checked against the host-routed one
//! (tests/experts.rs holds them to an f64 reference with derived bounds).

use memwall::runtime::backend::experts_composed;
use memwall::runtime::cost::{ScaleLayout, linear_traffic};
use memwall::runtime::ops::check_experts;
use memwall::runtime::{Backend, DType, Expert, ExpertsDims, ExpertsScratch, Linear, Tensor, WeightScale};

use super::{Ctx, CudaGpu, Storage, best_rotation, random_bytes, random_unit, splitmix};

const HIDDEN: usize = 4096;
const INTER: usize = 14336;
const EXPERTS: usize = 8;
const TOP_K: usize = 2;
const BATCHES: [usize; 3] = [1, 4, 16];
/// Rows of the prefill line: `memwall run`'s default prefill chunk.
const PREFILL_ROWS: usize = 512;
const WEIGHT_DTYPES: [DType; 2] = [DType::BF16, DType::F8E4M3Fn];
/// Sets of picks the calls rotate over.
const PATTERNS: usize = 8;

fn matrix(gpu: &CudaGpu, dtype: DType, (n, k): (usize, usize), seed: u64) -> Linear<Storage> {
    let weight = gpu.upload(dtype, &[n, k], &random_bytes(dtype, n * k, seed)).expect("upload expert weight");
    let scale = if dtype.is_fp8() {
        let s: Vec<f32> = random_unit(n, seed ^ 3).iter().map(|u| (0.75 + 0.25 * u) / 448.0).collect();
        WeightScale::PerChannel(gpu.upload_f32(DType::F32, &[n], &s).expect("upload scales"))
    } else {
        WeightScale::None
    };
    Linear { weight, scale }
}

/// `PATTERNS` sets of `rows` x `TOP_K` picks, distinct per row, and each set's distinct experts.
fn patterns(rows: usize) -> Vec<(Vec<u32>, usize)> {
    let mut state = 0x3e7a_u64 ^ rows as u64;
    (0..PATTERNS)
        .map(|_| {
            let mut ids = Vec::with_capacity(rows * TOP_K);
            for _ in 0..rows {
                let mut pool: Vec<u32> = (0..EXPERTS as u32).collect();
                for _ in 0..TOP_K {
                    ids.push(pool.swap_remove((splitmix(&mut state) % pool.len() as u64) as usize));
                }
            }
            let mut seen = [false; EXPERTS];
            ids.iter().for_each(|&e| seen[e as usize] = true);
            let distinct = seen.iter().filter(|&&s| s).count();
            (ids, distinct)
        })
        .collect()
}

pub fn run(ctx: &Ctx, lines: &mut Vec<String>) {
    let gpu = &ctx.gpu;
    for dtype in WEIGHT_DTYPES {
        let label = format!("experts {dtype} mixtral 8x7b layer");
        if ctx.out_of_time(&label, lines) {
            continue;
        }
        let mats: Vec<[Linear<Storage>; 3]> = (0..EXPERTS as u64)
            .map(|e| {
                [
                    matrix(gpu, dtype, (INTER, HIDDEN), 0x6a7e ^ e << 8),
                    matrix(gpu, dtype, (INTER, HIDDEN), 0x0b ^ e << 8),
                    matrix(gpu, dtype, (HIDDEN, INTER), 0xd0 ^ e << 8),
                ]
            })
            .collect();
        let experts: Vec<Expert<'_, Storage>> =
            mats.iter().map(|[gate, up, down]| Expert { gate, up, down }).collect();
        let layout = if dtype.is_fp8() { ScaleLayout::PerChannel(DType::F32) } else { ScaleLayout::None };
        // Weight and scale bytes of one expert.
        let matrix_bytes = |n, k| {
            let t = linear_traffic(1, n, k, dtype, layout, DType::F32).expect("bytes");
            t.weight + t.scales
        };
        let expert_bytes = 2 * matrix_bytes(INTER, HIDDEN) + matrix_bytes(HIDDEN, INTER);
        for rows in BATCHES {
            let what = format!("{label} top-{TOP_K} batch {rows}");
            if ctx.out_of_time(&what, lines) {
                continue;
            }
            lines.push(line(ctx, &experts, Some(expert_bytes), rows, &what));
        }
        let what = format!("{label} top-{TOP_K} prefill {PREFILL_ROWS}");
        if !ctx.out_of_time(&what, lines) {
            lines.push(line(ctx, &experts, None, PREFILL_ROWS, &what));
        }
    }
}

/// One batch size: checks the device-routed output against the host-routed one, times both over
/// the rotation, and returns the summary line: GB/s against the copy peak for decode (one
/// expert's weight and scale bytes given), TFLOP/s for prefill (None).
fn line(
    ctx: &Ctx,
    experts: &[Expert<'_, Storage>],
    expert_bytes: Option<u64>,
    rows: usize,
    what: &str,
) -> String {
    let gpu = &ctx.gpu;
    let x = gpu.upload_f32(DType::F32, &[rows, HIDDEN], &random_unit(rows * HIDDEN, 11)).expect("upload x");
    let w: Vec<f32> = random_unit(rows * TOP_K, 13).iter().map(|u| 0.5 + 0.25 * u).collect();
    let w = gpu.upload_f32(DType::F32, &[rows, TOP_K], &w).expect("upload router weights");
    let sets = patterns(rows);
    let ids: Vec<Tensor<Storage>> =
        sets.iter().map(|(p, _)| gpu.upload_u32(&[rows, TOP_K], p).expect("upload picks")).collect();
    let mut scratch = ExpertsScratch::alloc(
        gpu,
        ExpertsDims { rows, k: TOP_K, experts: EXPERTS, hidden: HIDDEN, inter: INTER },
    )
    .expect("scratch");
    let mut out = gpu.alloc(DType::F32, &[rows, HIDDEN]).expect("allocate out");
    let mut host_out = gpu.alloc(DType::F32, &[rows, HIDDEN]).expect("allocate out");
    let d = check_experts(&x, &ids[0], &w, experts, &scratch, &out).expect("experts dims");
    assert!(gpu.experts_on_device(d, experts), "{what}: not routed on the device");

    super::poison(gpu, &mut out);
    gpu.experts(&x, &ids[0], &w, experts, &mut scratch, &mut out).expect("experts");
    experts_composed(gpu, d, &x, &ids[0], &w, experts, &mut scratch, &mut host_out)
        .expect("host-routed experts");
    let (got, want) = (super::read_f32(gpu, &out), super::read_f32(gpu, &host_out));
    let scale = want.iter().fold(0f64, |m, v| m.max(f64::from(v.abs())));
    for (i, (&g, &v)) in got.iter().zip(&want).enumerate() {
        // Both paths add the same products in f32 (their GEMV or GEMM tiles may group them
        // differently):
        // a loose sanity bound; tests/experts.rs derives the tight one.
        let bound = 1e-3 * (f64::from(v.abs()) + 1e-3 * scale);
        super::expect_close(&format!("{what} element {i}"), g, f64::from(v), bound);
    }

    let device =
        best_rotation(gpu, ids.len(), |i| gpu.experts(&x, &ids[i], &w, experts, &mut scratch, &mut out));
    let host = best_rotation(gpu, ids.len(), |i| {
        experts_composed(gpu, d, &x, &ids[i], &w, experts, &mut scratch, &mut host_out)
    });
    let Some(expert_bytes) = expert_bytes else {
        let flops = (2 * 3 * rows * TOP_K * HIDDEN * INTER) as f64;
        return format!(
            "{:<44} {:>7.1} TFLOP/s (compute-bound: FLOPs, not bytes); {:.2}x host-routed ({:.1} TFLOP/s)",
            format!("{what}:"),
            flops / device / 1e12,
            host / device,
            flops / host / 1e12
        );
    };
    let bytes = sets.iter().map(|(_, distinct)| *distinct as u64 * expert_bytes).sum::<u64>() as f64
        / sets.len() as f64
        + (2 * rows * HIDDEN * 4) as f64;
    // The same calls with the GEMVs on the tensor cores (gemv_tc.cu's grouped kernels,
    // `Gpu::set_gemv_tensor_core_rows`), checked against the host-routed output first.
    gpu.set_gemv_tensor_core_rows(Some(1)).expect("GEMVs on the tensor cores");
    super::poison(gpu, &mut out);
    gpu.experts(&x, &ids[0], &w, experts, &mut scratch, &mut out).expect("experts on the tensor cores");
    for (i, (&g, &v)) in super::read_f32(gpu, &out).iter().zip(&want).enumerate() {
        let bound = 1e-3 * (f64::from(v.abs()) + 1e-3 * scale);
        super::expect_close(&format!("{what} tensor cores element {i}"), g, f64::from(v), bound);
    }
    let tc = best_rotation(gpu, ids.len(), |i| gpu.experts(&x, &ids[i], &w, experts, &mut scratch, &mut out));
    gpu.set_gemv_tensor_core_rows(None).expect("back to gemv.cu");
    let gbs = bytes / device / 1e9;
    format!(
        "{:<44} {gbs:>7.1} GB/s = {:>5.1}% of measured copy peak; {:.2}x host-routed ({:.1} GB/s); tensor-core GEMVs {:.1} GB/s = {:.1}%",
        format!("{what}:"),
        100.0 * gbs / ctx.peak_gb_s,
        host / device,
        bytes / host / 1e9,
        bytes / tc / 1e9,
        100.0 * bytes / tc / 1e9 / ctx.peak_gb_s
    )
}
