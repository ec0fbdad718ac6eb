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
    //! The kernel sources embedded by `build.rs`.

    /// One embedded kernel source file.
    #[derive(Clone, Copy, Debug)]
    pub struct KernelSource {
        pub name: &'static str,
        pub source: &'static str,
    }

    include!(concat!(env!("OUT_DIR"), "/kernel_sources.rs"));
}

/// The backend used when none is named: the fast CPU backend.
pub fn default_backend() -> runtime::cpu::Fast {
    runtime::cpu::Fast::default()
}
