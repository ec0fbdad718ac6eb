//! memwall: hand-written LLM inference kernels and a thin runtime that run at the memory wall.
//!
//! Engines link this crate as a backend: [`runtime`] has the `Backend` trait, the tensors and the
//! CPU backends; [`model`] runs Hugging Face checkpoints on any backend; [`kernels`] holds the
//! kernel images this build embedded; [`wall`] computes the memory wall of a model on a device.

pub use memwall_model as model;
pub use memwall_runtime as runtime;

pub mod bytes;
pub mod peak;
pub mod wall;

pub mod kernels {
    //! What `build.rs` embedded: the kernel sources (for NVRTC at first use), the fatbins nvcc
    //! compiled when it was found, and, under the `emulate` feature, the kernels compiled as host
    //! C++ against the SIMT layer.

    pub use memwall_runtime::gpu::{KernelImage, KernelSource};

    include!(concat!(env!("OUT_DIR"), "/kernel_sources.rs"));
    include!(concat!(env!("OUT_DIR"), "/cuda_fatbins.rs"));
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

/// The CUDA backend on device `ordinal`: an error (never a panic) where no driver or no device
/// exists.
#[cfg(feature = "cuda")]
pub fn cuda_backend(ordinal: usize) -> runtime::Result<runtime::gpu::Gpu<runtime::gpu::cuda::CudaDevice>> {
    let device = runtime::gpu::cuda::CudaDevice::new(ordinal, kernels::CUDA_FATBINS, kernels::CUDA_SOURCES)?;
    runtime::gpu::Gpu::new(device)
}
