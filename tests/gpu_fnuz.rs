//! The e4m3fn -> e4m3fnuz conversion an e4m3fnuz device's load makes (`memwall_model::weights`),
//! on the GPU backend: the kernels of `kernels-cuda/` on the SIMT emulator at warp 32 (which reads
//! e4m3fn), against the same emulator wrapped to report e4m3fnuz (`WithNativeE4m3`), which is
//! handed the converted weights.
//!
//! - linear (GEMV at 1 and 3 rows, the CUDA-core and tensor-core GEMMs at 17 and 33) and the
//!   embedding: a random e4m3fn weight with scale `s` and its conversion (codes halved in value,
//!   scale `2 s`) give the same outputs bit for bit, the sign of an exact zero aside (fnuz has no
//!   -0). Exact because both are power-of-two rescalings: each kernel widens the fp8 code exactly
//!   (to f32, or to bf16 for the tensor cores), so every product with x halves exactly, every f32
//!   partial sum of halved terms is the halved partial sum (a factor of 2 commutes with rounding;
//!   the smallest term, 2^-24 * 2^-10 * 2^-16 for the tensor-core GEMM's third bf16 part of x, is
//!   far above f32's normal range), and `(2 s) * (sum / 2)` is the same real number as `s * sum`,
//!   so it rounds the same. The same kernels run in the same order: both weights take the same path
//!   (`gemm_path` looks at the weight's size, not its flavour).
//! - a model: transformers' fp8 fixture loaded through the wrapper matches transformers (the parity
//!   kit's tolerance) and gives exactly the logits of the unconverted load on the emulator.
//!
//! Runs with `--features emulate` only.

#![cfg(feature = "emulate")]

mod common;
#[path = "../runtime/tests/fnuz_kit/mod.rs"]
mod fnuz_kit;
#[path = "../model/tests/parity_kit/mod.rs"]
mod parity_kit;

use common::gpu::linear_to_backend;
use common::*;
use fnuz_kit::{Draw, Scheme, fn_weight, same_bits, to_fnuz};
use memwall::runtime::gpu::Gpu;
use memwall::runtime::gpu::emu::{EmuDevice, Schedule};
use memwall_model::Model;
use memwall_runtime::cpu::Reference;
use memwall_runtime::{Backend, DType, HostStorage, HostTensor, Linear, WithNativeE4m3};

type Emu = Gpu<EmuDevice>;

fn emu() -> Emu {
    // One fixed schedule: the two runs compared must sum in the same order.
    memwall::emulated_backend(Schedule::Forward).expect("emulated backend")
}

fn fnuz(inner: Emu) -> WithNativeE4m3<Emu> {
    WithNativeE4m3::new(inner, DType::F8E4M3Fnuz)
}

#[test]
fn the_warp32_emulator_reads_e4m3fn_and_the_wrapper_fnuz() {
    let b = emu();
    assert_eq!(b.native_e4m3(), DType::F8E4M3Fn);
    assert_eq!(fnuz(b).native_e4m3(), DType::F8E4M3Fnuz);
    assert_eq!(Reference.native_e4m3(), DType::F8E4M3Fn);
}

impl Draw for Rng {
    fn bits(&mut self) -> u64 {
        self.next_u64()
    }
    fn values(&mut self, dtype: DType, n: usize) -> Vec<f32> {
        random_values(self, dtype, n)
    }
}

/// `w` converted as the loader converts it (`fnuz_kit::to_fnuz`), on `b`.
fn fnuz_on<B: Backend>(b: &B, w: &Linear<HostStorage>) -> Linear<B::Storage> {
    linear_to_backend(b, &to_fnuz(w))
}

/// Equal bits, or both an exact zero of either sign.
fn assert_same_bits(what: &str, a: &[f32], b: &[f32]) {
    if let Some(i) = a.iter().position(|x| !x.is_finite()) {
        panic!("{what}: element {i} = {} (unwritten or overflowed)", a[i]);
    }
    let bits = |v: &[f32]| -> Vec<u32> { v.iter().map(|x| x.to_bits()).collect() };
    if let Err(e) = same_bits(&bits(a), &bits(b)) {
        panic!("{what}: {e}");
    }
}

fn linear_out<B: Backend>(b: &B, x: &HostTensor, w: &Linear<B::Storage>, m: usize, n: usize) -> Vec<f32> {
    let x = common::gpu::to_backend(b, x);
    let mut y = poisoned(b, DType::F32, &[m, n]);
    b.linear(&x, w, &mut y).unwrap_or_else(|e| panic!("linear {m}x{n}: {e}"));
    read_f32(b, &y)
}

fn embedding_out<B: Backend>(b: &B, w: &Linear<B::Storage>, ids: &[u32], k: usize) -> Vec<f32> {
    let ids_t = upload_u32(b, &[ids.len()], ids);
    let mut out = poisoned(b, DType::F32, &[ids.len(), k]);
    b.embedding(w, &ids_t, &mut out).unwrap_or_else(|e| panic!("embedding: {e}"));
    read_f32(b, &out)
}

#[test]
fn converted_weights_give_the_same_products_on_the_emulator() {
    let plain = emu();
    let wrapped = fnuz(emu());
    let mut rng = Rng::new(0xf0_0d);
    // (n, k, rows, schemes): GEMV at 1 and 3 rows over odd shapes; the CUDA-core GEMM at odd k;
    // the tensor-core GEMM at k a multiple of 16 with blocks of whole 32-wide k tiles.
    let all = |blocks: &[(usize, usize)]| {
        let mut s = vec![
            Scheme::None,
            Scheme::PerTensor,
            Scheme::PerChannel(DType::F32),
            Scheme::PerChannel(DType::BF16),
        ];
        for &(r, c) in blocks {
            s.push(Scheme::Block(DType::F32, r, c));
            s.push(Scheme::Block(DType::BF16, r, c));
        }
        s
    };
    let cases: Vec<(usize, usize, usize, Vec<Scheme>)> = vec![
        (1, 1, 1, all(&[(1, 1)])),
        (3, 17, 3, all(&[(3, 5), (128, 128)])),
        (17, 4097, 1, all(&[(128, 128), (16, 7)])),
        (19, 65, 17, all(&[(3, 5), (128, 128)])),
        (37, 256, 33, all(&[(128, 128), (16, 64)])),
    ];
    for (n, k, m, schemes) in cases {
        for scheme in schemes {
            let what = format!("{m}x{n}x{k} {scheme:?}");
            let w = fn_weight(&mut rng, n, k, scheme);
            let (wf, wu) = (linear_to_backend(&plain, &w), fnuz_on(&wrapped, &w));
            assert_eq!((wf.weight.dtype(), wu.weight.dtype()), (DType::F8E4M3Fn, DType::F8E4M3Fnuz));
            let x = upload(&Reference, DType::F32, &[m, k], &random_values(&mut rng, DType::F32, m * k));
            let a = linear_out(&plain, &x, &wf, m, n);
            let b = linear_out(&wrapped, &x, &wu, m, n);
            assert_same_bits(&format!("linear {what}"), &a, &b);
            let ids = random_indices(&mut rng, m, n);
            let a = embedding_out(&plain, &wf, &ids, k);
            let b = embedding_out(&wrapped, &wu, &ids, k);
            assert_same_bits(&format!("embedding {what}"), &a, &b);
        }
    }
}

#[test]
fn published_fp8_fixture_converted_on_the_emulator() {
    let case = "llama_fp8_channel";
    parity_kit::check_case_on(fnuz(emu()), case, parity_kit::TOLERANCE);
    let dir = parity_kit::fixtures().join(case);
    let plain = Model::load(emu(), &dir, |_, _| {}).expect("plain load");
    let converted = Model::load(fnuz(emu()), &dir, |_, _| {}).expect("converted load");
    assert_eq!(plain.report.stats.converted_tensors, 0);
    assert_eq!(converted.report.stats.converted_tensors, 14, "2 layers x 7 fp8 projections");
    assert_eq!(converted.weights.layers[0].q.weight.dtype(), DType::F8E4M3Fnuz);
    let prompts: [&[u32]; 2] = [&[5, 9, 33, 60, 200], &[1, 63]];
    let (a, b) = (parity_kit::logits(&plain, &prompts), parity_kit::logits(&converted, &prompts));
    assert_same_bits("fixture logits", &a, &b);
}
