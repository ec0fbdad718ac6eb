//! memwall runtime: element types (`DType`, the fp8 codecs), tensors on a device, the `Backend`
//! trait with the ops of the Llama 3.1 and Mixtral graphs, and the CPU backends: `cpu::Reference`
//! (obvious loops, f64 accumulation, the oracle) and `cpu::Fast` (threads and SIMD, the default).

pub mod backend;
pub mod cost;
pub mod cpu;
pub mod dtype;
pub mod error;
pub mod fp8;
pub mod gpu;
pub mod ops;
pub mod tensor;

pub use backend::{Backend, Hook, NativeE4m3, Recorded, WithNativeE4m3, Wrapped};
pub use dtype::{DType, F8E4M3Fn, F8E4M3Fnuz, F8E5M2, F8E5M2Fnuz, Float};
pub use error::{Error, Result};
pub use ops::{
    Expert, ExpertsDims, ExpertsScratch, KvCacheLayer, Linear, Llama3RopeScaling, Rope, SamplingParams,
    WeightScale,
};
pub use tensor::{HostStorage, HostTensor, Storage, Tensor};

/// Re-exported so `with_float_type!` works in dependent crates.
pub use half;
