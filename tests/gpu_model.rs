//! The model graph on the GPU backend, unchanged: every parity fixture (transformers' logits and
//! greedy tokens; `tests/parity/make_fixtures.py`) through `Session` on `Gpu<EmuDevice>` (the real
//! kernels of `kernels-cuda/` on the SIMT layer, every thread schedule) and, on a GPU machine, on
//! `Gpu<CudaDevice>` or `Gpu<HipDevice>`.
//!
//! Tolerance: the kit's per-row relative error of 1e-4 (derivation in `parity_kit/mod.rs`: f32
//! rounding along the fixtures' short reductions is ~1e-6). A batch may take other kernels than a
//! single run (batched GEMV or GEMM, other attention splits), changing only the order of f32 sums,
//! so batch and single runs are held to the same 1e-4.

#![cfg(any(feature = "emulate", feature = "cuda", feature = "hip"))]

mod common;
#[path = "../model/tests/parity_kit/mod.rs"]
mod parity_kit;

use parity_kit::{TOLERANCE, check_case_on};

/// The parity fixtures: `CASES`, and one device test per fixture on each real GPU (a failure
/// names its checkpoint).
macro_rules! fixtures {
    ($($case:ident),* $(,)?) => {
        #[cfg_attr(not(feature = "emulate"), allow(dead_code))]
        const CASES: &[&str] = &[$(stringify!($case)),*];

        device_tests! {
            $(fn $case(b, who) {
                check_case_on(b, stringify!($case), TOLERANCE);
            })*
        }
    };
}

fixtures!(
    llama31_gqa_bf16,
    llama_tied_f32,
    llama_mha_f16,
    mixtral_top2_bf16,
    mixtral_top1_f32,
    llama_fp8_channel
);

#[cfg(feature = "emulate")]
#[test]
fn every_fixture_on_the_emulated_gpu() {
    use memwall::runtime::gpu::emu::Schedule;
    for schedule in [Schedule::Forward, Schedule::Reverse, Schedule::Random(0x5eed)] {
        for case in CASES {
            eprintln!("{case} on the emulated GPU, {schedule:?}");
            check_case_on(memwall::emulated_backend(schedule).expect("emulated backend"), case, TOLERANCE);
        }
    }
}
