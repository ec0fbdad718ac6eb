//! The `memwall` command, run by the CLI tests.

use std::process::Command;

/// Runs `memwall args`: (success, stdout, stderr).
pub fn memwall(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_memwall")).args(args).output().expect("run memwall");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// The GPU backends this machine has no device for, each with what a command on it must say:
/// the backend's no-device error where the build has it, else how to build it. A backend whose
/// device is present is left out (the GPU suites run it).
pub fn gpus_without_a_device() -> Vec<(&'static str, String)> {
    let mut absent = Vec::new();
    #[cfg(feature = "cuda")]
    let cuda_present = memwall::runtime::gpu::cuda::device_count().is_ok_and(|n| n > 0);
    #[cfg(not(feature = "cuda"))]
    let cuda_present = false;
    if !cuda_present {
        let want = if cfg!(feature = "cuda") { "no CUDA device" } else { "--features cuda" };
        absent.push(("cuda", want.to_string()));
    }
    #[cfg(feature = "hip")]
    let hip_present = memwall::runtime::gpu::hip::device_count().is_ok_and(|n| n > 0);
    #[cfg(not(feature = "hip"))]
    let hip_present = false;
    if !hip_present {
        let want = if cfg!(feature = "hip") { "no ROCm device" } else { "--features hip" };
        absent.push(("hip", want.to_string()));
    }
    absent
}
