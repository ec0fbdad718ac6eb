//! The CUDA backend's paths that need no GPU (feature `cuda`):
//! - NVRTC (`runtime::gpu::nvrtc`, used when the build found no nvcc) compiles every embedded
//!   `.cu` file for `sm_90a` (the H200) into a cubin holding every kernel a launcher can pick,
//!   and, where nvcc built fatbins too, every kernel nvcc compiled from the same file;
//! - on a machine without a CUDA driver or device, constructing the backend is an error naming
//!   why, not a panic (cudarc panics on a missing library).
//!
//! NVRTC is a host library: scripts/setup.sh installs the pinned `nvidia-cuda-nvrtc` next to
//! nvcc and scripts/test.sh puts it on the loader path and sets `MEMWALL_REQUIRE_NVRTC=1`, so a
//! missing library fails there; elsewhere the NVRTC test skips, saying so.

#![cfg(feature = "cuda")]

use memwall::kernels::{CUDA_KERNELS, CUDA_NVCC, CUDA_SOURCES};
use memwall::runtime::gpu::{cuda, nvrtc, ops};

fn launcher_kernels() -> Vec<&'static str> {
    ops::kernel_names()
}

/// Whether a cubin's symbol table names `kernel` (symbol names are NUL-separated in the ELF
/// string table, so the match is exact).
fn holds(cubin: &[u8], kernel: &str) -> bool {
    let needle = format!("\0{kernel}\0").into_bytes();
    cubin.windows(needle.len()).any(|w| w == needle.as_slice())
}

#[test]
fn nvrtc_compiles_every_kernel_file_for_sm_90a() {
    if !nvrtc::available() {
        let required = std::env::var("MEMWALL_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "MEMWALL_REQUIRE_NVRTC=1 but libnvrtc.so.13 cannot be loaded (run scripts/setup.sh)"
        );
        eprintln!("skipping: no libnvrtc on the loader path");
        return;
    }
    let target = nvrtc::target((9, 0));
    assert_eq!(target, "sm_90a");
    let files: Vec<_> = nvrtc::kernel_files(CUDA_SOURCES).collect();
    assert!(
        files.len() >= 6,
        "embedded kernel files: {:?}",
        files.iter().map(|f| f.name).collect::<Vec<_>>()
    );
    // One thread per file: the files are independent and gemv.cu dominates.
    let cubins: Vec<(&str, Vec<u8>)> = std::thread::scope(|s| {
        let jobs: Vec<_> = files
            .iter()
            .map(|f| {
                let target = target.clone();
                s.spawn(move || (f.name, nvrtc::compile(CUDA_SOURCES, f.name, &target)))
            })
            .collect();
        jobs.into_iter()
            .map(|j| {
                let (name, cubin) = j.join().expect("compile thread");
                (name, cubin.unwrap_or_else(|e| panic!("{e}")))
            })
            .collect()
    });
    for (name, cubin) in &cubins {
        assert_eq!(&cubin[..4], b"\x7fELF", "{name}: not an ELF cubin");
    }
    for kernel in launcher_kernels() {
        assert!(cubins.iter().any(|(_, c)| holds(c, kernel)), "{kernel} is in no NVRTC cubin");
    }
    if CUDA_NVCC.is_some() {
        for (image, t, kernels) in CUDA_KERNELS.iter().filter(|(_, t, _)| *t == "sm_90a") {
            let (_, cubin) =
                cubins.iter().find(|(n, _)| n == image).unwrap_or_else(|| panic!("no cubin for {image}"));
            for k in kernels.iter() {
                assert!(holds(cubin, k), "{image}: nvcc compiled {k} for {t}, NVRTC did not");
            }
        }
    }
}

#[test]
fn nvrtc_reports_compile_errors_with_the_log() {
    if !nvrtc::available() {
        eprintln!("skipping: no libnvrtc on the loader path");
        return;
    }
    let broken = [memwall::runtime::gpu::KernelSource {
        name: "broken.cu",
        source: "extern \"C\" __global__ void k(int* p) { p[0] = undeclared_name; }\n",
    }];
    let e = nvrtc::compile(&broken, "broken.cu", "sm_90a").expect_err("must not compile").to_string();
    assert!(e.contains("broken.cu") && e.contains("undeclared_name"), "{e}");
}

#[test]
fn without_a_device_the_backend_is_an_error_not_a_panic() {
    match cuda::device_count() {
        Ok(n) if n > 0 => {
            let b = memwall::cuda_backend(0).unwrap_or_else(|e| panic!("{n} CUDA devices but: {e}"));
            let e = memwall::cuda_backend(n).expect_err("an ordinal past the last device");
            assert!(e.to_string().contains(&format!("no CUDA device {n}")), "{e}");
            drop(b);
        }
        count => {
            let e = memwall::cuda_backend(0).expect_err("no device, yet the backend was built");
            assert!(e.to_string().contains("no CUDA device"), "{e} (device_count: {count:?})");
        }
    }
}
