//! The GPU backends a test runs its cases on, and moving host tensors onto them.
//!
//! - `emulated()`: `Gpu<EmuDevice>` under each thread schedule (forward, reverse, seeded random),
//!   so a missing barrier shows up as a wrong result under at least one of them, and the HIP build
//!   of the kernels at warp 64 (feature `emulate`; empty without it).
//! - `cuda()`: `Gpu<CudaDevice>` on device 0 (feature `cuda`), and `hip()`: `Gpu<HipDevice>` on
//!   AMD GPU 0 (feature `hip`). Tests that use them are `#[ignore = "needs a CUDA device"]` or
//!   `#[ignore = "needs a ROCm device"]`; when run, a missing device skips the test with a
//!   message, unless `MEMWALL_REQUIRE_GPU=1`, which makes it fail.
//! - `device_tests!`: writes a suite's device tests once, for both.

use memwall_runtime::{Backend, HostTensor, Linear, Tensor};

#[cfg(feature = "emulate")]
pub fn emulated() -> Vec<(String, memwall::runtime::gpu::Gpu<memwall::runtime::gpu::emu::EmuDevice>)> {
    use memwall::runtime::gpu::emu::Schedule;
    let cuda = [Schedule::Forward, Schedule::Reverse, Schedule::Random(0x5eed)]
        .into_iter()
        .map(|s| (format!("emu {s:?}"), memwall::emulated_backend(s).expect("emulated backend")));
    // The HIP build at warp 64 (kernels-hip/hip.h over the SIMT layer), under one schedule: the
    // kernels' logic is the same, what differs is the wave width and the vendor header.
    let hip = std::iter::once(Schedule::Random(0x41d))
        .map(|s| (format!("hip-emu {s:?}"), memwall::emulated_hip_backend(s).expect("emulated HIP backend")));
    cuda.chain(hip).collect()
}

/// Whether a GPU run demands a device (`MEMWALL_REQUIRE_GPU=1`).
pub fn gpu_required() -> bool {
    std::env::var("MEMWALL_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

#[cfg(feature = "cuda")]
pub fn cuda() -> Option<memwall::runtime::gpu::Gpu<memwall::runtime::gpu::cuda::CudaDevice>> {
    match memwall::cuda_backend(0) {
        Ok(b) => Some(b),
        Err(e) if gpu_required() => panic!("MEMWALL_REQUIRE_GPU=1 but no CUDA backend: {e}"),
        Err(e) => {
            eprintln!("skipping: {e}");
            None
        }
    }
}

#[cfg(feature = "hip")]
pub fn hip() -> Option<memwall::runtime::gpu::Gpu<memwall::runtime::gpu::hip::HipDevice>> {
    match memwall::hip_backend(0) {
        Ok(b) => Some(b),
        Err(e) if gpu_required() => panic!("MEMWALL_REQUIRE_GPU=1 but no HIP backend: {e}"),
        Err(e) => {
            eprintln!("skipping: {e}");
            None
        }
    }
}

/// A suite's tests on the real GPUs, written once: each `fn name(b, who) { body }` becomes
/// `cuda::name` (feature `cuda`, `#[ignore = "needs a CUDA device"]`) and `hip::name` (feature
/// `hip`, `#[ignore = "needs a ROCm device"]`), whose body runs with `b` the device's backend and
/// `who` its name ("cuda", "hip"), or skips (fails under `MEMWALL_REQUIRE_GPU=1`) without one.
/// Leading `const` items are copied into both modules.
#[macro_export]
macro_rules! device_tests {
    ($(const $c:ident: $t:ty = $v:expr;)* $(fn $name:ident($b:ident, $who:ident) $body:block)*) => {
        $crate::device_tests!(@on cuda, "cuda", "needs a CUDA device";
            $(const $c: $t = $v;)* $(fn $name($b, $who) $body)*);
        $crate::device_tests!(@on hip, "hip", "needs a ROCm device";
            $(const $c: $t = $v;)* $(fn $name($b, $who) $body)*);
    };
    (@on $device:ident, $feature:literal, $reason:literal;
        $(const $c:ident: $t:ty = $v:expr;)* $(fn $name:ident($b:ident, $who:ident) $body:block)*) => {
        #[cfg(feature = $feature)]
        mod $device {
            #[allow(unused_imports)]
            use super::*;
            $(const $c: $t = $v;)*
            $(
                #[test]
                #[ignore = $reason]
                #[allow(unused_variables)]
                fn $name() {
                    let Some($b) = $crate::common::gpu::$device() else { return };
                    let $who = $feature;
                    $body
                }
            )*
        }
    };
}

/// A copy of a host tensor on backend `b` (same dtype, shape and bytes).
pub fn to_backend<B: Backend>(b: &B, t: &HostTensor) -> Tensor<B::Storage> {
    b.upload(t.dtype(), t.shape(), &t.storage().bytes()[..t.nbytes()])
        .unwrap_or_else(|e| panic!("{}: upload of {} {:?}: {e}", b.name(), t.dtype(), t.shape()))
}

/// A copy of a host weight (and its scale) on backend `b`.
pub fn linear_to_backend<B: Backend>(b: &B, w: &Linear<memwall_runtime::HostStorage>) -> Linear<B::Storage> {
    w.upload_to(b).unwrap_or_else(|e| {
        panic!("{}: upload of a {} weight {:?}: {e}", b.name(), w.weight.dtype(), w.weight.shape())
    })
}
