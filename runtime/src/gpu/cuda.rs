//! `CudaDevice`: an NVIDIA GPU through cudarc. (Placeholder until the cudarc backend lands: every
//! constructor reports that no CUDA device is available.)

use super::{Device, DeviceInfo, KernelImage, KernelSource, LaunchCfg};
use crate::{Error, Result};

/// Device memory on a CUDA device.
#[derive(Debug)]
pub struct CudaBuffer {
    len: usize,
}

/// An NVIDIA GPU.
#[derive(Debug)]
pub struct CudaDevice {
    info: DeviceInfo,
}

fn no_device() -> Error {
    Error::Device { device: "cuda".into(), msg: "no CUDA device: the cudarc backend is not built yet".into() }
}

impl CudaDevice {
    pub fn new(_ordinal: usize, _images: &[KernelImage], _sources: &[KernelSource]) -> Result<Self> {
        Err(no_device())
    }
}

impl Device for CudaDevice {
    type Buffer = CudaBuffer;
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn info(&self) -> &DeviceInfo {
        &self.info
    }
    fn alloc(&self, _bytes: usize) -> Result<CudaBuffer> {
        Err(no_device())
    }
    fn len(buf: &CudaBuffer) -> usize {
        buf.len
    }
    fn address(_buf: &CudaBuffer) -> u64 {
        0
    }
    fn write(&self, _dst: &mut CudaBuffer, _offset: usize, _bytes: &[u8]) -> Result<()> {
        Err(no_device())
    }
    fn read(&self, _src: &CudaBuffer, _offset: usize, _out: &mut [u8]) -> Result<()> {
        Err(no_device())
    }
    unsafe fn launch(&self, _name: &'static str, _cfg: LaunchCfg, _params: &[u8]) -> Result<()> {
        Err(no_device())
    }
    fn synchronize(&self) -> Result<()> {
        Err(no_device())
    }
}
