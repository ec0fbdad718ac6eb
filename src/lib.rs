//! memwall: hand-written LLM inference kernels and a thin runtime that run at the memory wall.
//!
//! Engines link this crate as a backend: [`runtime`] has the `Backend` trait, the tensors and the
//! CPU backends; [`model`] runs Hugging Face checkpoints on any backend; [`kernels`] holds the
//! kernel images this build embedded; [`wall`] computes the memory wall of a model on a device;
//! [`engine`] is the continuous-batching scheduler and [`scenario`] the MLPerf scenarios measured
//! through it; [`synth`] writes random checkpoints of a model's shape.

pub use memwall_model as model;
pub use memwall_runtime as runtime;

pub mod bytes;
pub mod engine;
pub mod peak;
pub mod peak_gpu;
pub mod scenario;
pub mod synth;
pub mod wall;

pub mod kernels {
    //! What `build.rs` embedded: the kernel sources (for NVRTC at first use), the fatbins nvcc
    //! compiled when it was found, the HIP code objects clang compiled when it was found, and, under the `emulate` feature, the kernels compiled as host
    //! C++ against the SIMT layer.

    pub use memwall_runtime::gpu::{KernelImage, KernelSource};

    include!(concat!(env!("OUT_DIR"), "/kernel_sources.rs"));
    include!(concat!(env!("OUT_DIR"), "/cuda_fatbins.rs"));
    // HIP_CODE_OBJECTS: one AMD GPU code object (ELF) per kernel file and target (`targets` holds
    // that one gfx target), compiled by build/hip.rs where a HIP-capable clang was found.
    include!(concat!(env!("OUT_DIR"), "/hip_code_objects.rs"));
    #[cfg(feature = "emulate")]
    include!(concat!(env!("OUT_DIR"), "/simt_build.rs"));

    /// The kernels of `kernels-cuda/` compiled as host C++ against the SIMT layer (`simt/`,
    /// warp 32), for `runtime::gpu::emu::EmuDevice`.
    #[cfg(feature = "emulate")]
    pub fn simt_cuda() -> memwall_runtime::gpu::emu::SimtImage {
        use simt_ffi::*;
        memwall_runtime::gpu::emu::SimtImage {
            label: "cuda",
            launch: memwall_simt_cuda_launch,
            warp_size: memwall_simt_cuda_warp_size,
            kernel_count: memwall_simt_cuda_kernel_count,
            kernel_name: memwall_simt_cuda_kernel_name,
            layout_count: memwall_simt_cuda_layout_count,
            layout: memwall_simt_cuda_layout,
        }
    }

    /// The HIP build of the kernels (`kernels-hip/hip.h` over the SIMT layer at warp 64, the files
    /// `build/hip.rs` compiles for AMD), for `runtime::gpu::emu::EmuDevice`: stands for an AMD
    /// CDNA3 GPU (no mma.sync, e4m3fnuz native).
    #[cfg(feature = "emulate")]
    pub fn simt_hip() -> memwall_runtime::gpu::emu::SimtImage {
        use simt_ffi::*;
        memwall_runtime::gpu::emu::SimtImage {
            label: "hip",
            launch: memwall_simt_hip_launch,
            warp_size: memwall_simt_hip_warp_size,
            kernel_count: memwall_simt_hip_kernel_count,
            kernel_name: memwall_simt_hip_kernel_name,
            layout_count: memwall_simt_hip_layout_count,
            layout: memwall_simt_hip_layout,
        }
    }

    /// The SIMT layer at warp 64 with only `kernels-cuda/selftest.cu`: tests its wave64 paths.
    #[cfg(feature = "emulate")]
    #[doc(hidden)]
    pub fn simt_selftest64() -> memwall_runtime::gpu::emu::SimtImage {
        use simt_ffi::*;
        memwall_runtime::gpu::emu::SimtImage {
            label: "selftest64",
            launch: memwall_simt_selftest64_launch,
            warp_size: memwall_simt_selftest64_warp_size,
            kernel_count: memwall_simt_selftest64_kernel_count,
            kernel_name: memwall_simt_selftest64_kernel_name,
            layout_count: memwall_simt_selftest64_layout_count,
            layout: memwall_simt_selftest64_layout,
        }
    }

    /// The C ABI of the images `build/simt.rs` linked (`simt/simt.cpp`, one prefix per image).
    #[cfg(feature = "emulate")]
    mod simt_ffi {
        use std::ffi::{c_char, c_void};

        macro_rules! simt_image_abi {
            ($launch:ident, $warp:ident, $count:ident, $name:ident, $lcount:ident, $layout:ident) => {
                unsafe extern "C" {
                    pub fn $launch(
                        name: *const c_char,
                        name_len: usize,
                        grid: *const u32,
                        block: *const u32,
                        dynamic_shared_bytes: u32,
                        params: *const c_void,
                        params_size: usize,
                        schedule: u64,
                        err: *mut c_char,
                        err_cap: usize,
                    ) -> i32;
                    pub fn $warp() -> u32;
                    pub fn $count() -> usize;
                    pub fn $name(i: usize) -> *const c_char;
                    pub fn $lcount() -> usize;
                    pub fn $layout(
                        i: usize,
                        strct: *mut *const c_char,
                        field: *mut *const c_char,
                        offset: *mut usize,
                        size: *mut usize,
                        struct_size: *mut usize,
                    ) -> i32;
                }
            };
        }
        simt_image_abi!(
            memwall_simt_cuda_launch,
            memwall_simt_cuda_warp_size,
            memwall_simt_cuda_kernel_count,
            memwall_simt_cuda_kernel_name,
            memwall_simt_cuda_layout_count,
            memwall_simt_cuda_layout
        );
        simt_image_abi!(
            memwall_simt_hip_launch,
            memwall_simt_hip_warp_size,
            memwall_simt_hip_kernel_count,
            memwall_simt_hip_kernel_name,
            memwall_simt_hip_layout_count,
            memwall_simt_hip_layout
        );
        simt_image_abi!(
            memwall_simt_selftest64_launch,
            memwall_simt_selftest64_warp_size,
            memwall_simt_selftest64_kernel_count,
            memwall_simt_selftest64_kernel_name,
            memwall_simt_selftest64_layout_count,
            memwall_simt_selftest64_layout
        );
    }
}

/// The backend used when none is named: the fast CPU backend.
pub fn default_backend() -> runtime::cpu::Fast {
    runtime::cpu::Fast::default()
}

/// The kernels of `kernels-cuda/` run on the CPU by the SIMT layer, under thread schedule
/// `schedule`.
#[cfg(feature = "emulate")]
pub fn emulated_backend(
    schedule: runtime::gpu::emu::Schedule,
) -> runtime::Result<runtime::gpu::Gpu<runtime::gpu::emu::EmuDevice>> {
    runtime::gpu::Gpu::new(runtime::gpu::emu::EmuDevice::new(kernels::simt_cuda(), schedule))
}

/// The HIP build of the kernels (warp 64, through `kernels-hip/hip.h`) run on the CPU by the SIMT
/// layer, under thread schedule `schedule`: the AMD path's logic without an AMD GPU.
#[cfg(feature = "emulate")]
pub fn emulated_hip_backend(
    schedule: runtime::gpu::emu::Schedule,
) -> runtime::Result<runtime::gpu::Gpu<runtime::gpu::emu::EmuDevice>> {
    runtime::gpu::Gpu::new(runtime::gpu::emu::EmuDevice::new(kernels::simt_hip(), schedule))
}

/// The HIP backend on AMD GPU `ordinal`, with the code objects `build.rs` compiled for its target:
/// an error (never a panic) where no device exists or the build has no code objects for it.
#[cfg(feature = "hip")]
pub fn hip_backend(ordinal: usize) -> runtime::Result<runtime::gpu::Gpu<runtime::gpu::hip::HipDevice>> {
    gemv_settings(runtime::gpu::Gpu::new(runtime::gpu::hip::HipDevice::new(
        ordinal,
        kernels::HIP_CODE_OBJECTS,
    )?)?)
}

/// The GEMV and GEMM choices of a device backend from the environment, for the command line and
/// engines that do not set them: `MEMWALL_GEMV_WARP_ROWS` (1 or 4: [`Gpu::set_gemv_warp_rows`]),
/// `MEMWALL_GEMV_TC_ROWS` (1 to 16, or `off`: [`Gpu::set_gemv_tensor_core_rows`]) and
/// `MEMWALL_GEMM_WGMMA` (`on` or `off`: [`Gpu::set_gemm_warpgroup`]). Unset keeps the defaults; a
/// value out of range is an error naming the variable.
///
/// [`Gpu::set_gemv_warp_rows`]: runtime::gpu::Gpu::set_gemv_warp_rows
/// [`Gpu::set_gemv_tensor_core_rows`]: runtime::gpu::Gpu::set_gemv_tensor_core_rows
/// [`Gpu::set_gemm_warpgroup`]: runtime::gpu::Gpu::set_gemm_warpgroup
#[cfg(any(feature = "cuda", feature = "hip"))]
fn gemv_settings<D: runtime::gpu::Device>(g: runtime::gpu::Gpu<D>) -> runtime::Result<runtime::gpu::Gpu<D>> {
    let read = |name: &'static str| rows_setting(name, std::env::var(name).ok().as_deref());
    if let Some(rows) = read("MEMWALL_GEMV_WARP_ROWS")? {
        g.set_gemv_warp_rows(rows.unwrap_or(1))
            .map_err(|e| runtime::Error::Argument { op: "MEMWALL_GEMV_WARP_ROWS", msg: e.to_string() })?;
    }
    if let Some(rows) = read("MEMWALL_GEMV_TC_ROWS")? {
        g.set_gemv_tensor_core_rows(rows)
            .map_err(|e| runtime::Error::Argument { op: "MEMWALL_GEMV_TC_ROWS", msg: e.to_string() })?;
    }
    let name = "MEMWALL_GEMM_WGMMA";
    if let Some(on) = switch_setting(name, std::env::var(name).ok().as_deref())? {
        g.set_gemm_warpgroup(on);
    }
    Ok(g)
}

/// An on/off setting of the environment (`value` of variable `name`): None where unset,
/// Some(true) for `on` or `1`, Some(false) for `off` or `0`; anything else an error naming the
/// variable.
#[cfg_attr(not(any(feature = "cuda", feature = "hip")), allow(dead_code))]
fn switch_setting(name: &'static str, value: Option<&str>) -> runtime::Result<Option<bool>> {
    match value.map(str::trim) {
        None => Ok(None),
        Some("on" | "1") => Ok(Some(true)),
        Some("off" | "0") => Ok(Some(false)),
        Some(v) => {
            Err(runtime::Error::Argument { op: name, msg: format!("{v:?} is neither `on` nor `off`") })
        }
    }
}

/// A rows setting of the environment (`value` of variable `name`): None where unset, Some(None)
/// for `off`, Some(Some(rows)) for a number; anything else an error naming the variable.
#[cfg_attr(not(any(feature = "cuda", feature = "hip")), allow(dead_code))]
fn rows_setting(name: &'static str, value: Option<&str>) -> runtime::Result<Option<Option<usize>>> {
    match value {
        None => Ok(None),
        Some("off") => Ok(Some(None)),
        Some(v) => v.trim().parse::<usize>().map(|n| Some(Some(n))).map_err(|_| runtime::Error::Argument {
            op: name,
            msg: format!("{v:?} is not a number of rows (or `off`)"),
        }),
    }
}

/// The CUDA backend on device `ordinal`: an error (never a panic) where no driver or no device
/// exists. Its GEMV and GEMM choices come from the environment where set: `MEMWALL_GEMV_WARP_ROWS`
/// (1 or 4), `MEMWALL_GEMV_TC_ROWS` (1 to 16 or `off`; see `Gpu::set_gemv_tensor_core_rows`) and
/// `MEMWALL_GEMM_WGMMA` (`on` or `off`; see `Gpu::set_gemm_warpgroup`).
#[cfg(feature = "cuda")]
pub fn cuda_backend(ordinal: usize) -> runtime::Result<runtime::gpu::Gpu<runtime::gpu::cuda::CudaDevice>> {
    let device = runtime::gpu::cuda::CudaDevice::new(ordinal, kernels::CUDA_FATBINS, kernels::CUDA_SOURCES)?;
    gemv_settings(runtime::gpu::Gpu::new(device)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_settings_of_the_environment() {
        let v = |s| rows_setting("MEMWALL_GEMV_TC_ROWS", s);
        assert_eq!(v(None).unwrap(), None);
        assert_eq!(v(Some("off")).unwrap(), Some(None));
        assert_eq!(v(Some("5")).unwrap(), Some(Some(5)));
        let e = v(Some("five")).unwrap_err().to_string();
        assert!(e.contains("MEMWALL_GEMV_TC_ROWS") && e.contains("five"), "{e}");
    }

    #[test]
    fn switch_settings_of_the_environment() {
        let v = |s| switch_setting("MEMWALL_GEMM_WGMMA", s);
        assert_eq!(v(None).unwrap(), None);
        assert_eq!(v(Some("on")).unwrap(), Some(true));
        assert_eq!(v(Some(" 1")).unwrap(), Some(true));
        assert_eq!(v(Some("off")).unwrap(), Some(false));
        assert_eq!(v(Some("0")).unwrap(), Some(false));
        let e = v(Some("yes")).unwrap_err().to_string();
        assert!(e.contains("MEMWALL_GEMM_WGMMA") && e.contains("yes"), "{e}");
    }
}
