//! `EmuDevice`: the kernels of `kernels-cuda/` compiled as host C++ against the SIMT layer of
//! `simt/`, run on the calling thread. Device memory is host memory (256-byte aligned, like
//! `cudaMalloc`), launches run to completion before `launch` returns, and a fault the SIMT layer
//! detects (a barrier some threads never reach, a shuffle naming an exited lane, too many threads
//! for the kernel's launch bounds, an unknown kernel) is an error naming the kernel.
//!
//! The root crate links the compiled image under its `emulate` feature and hands it over as a
//! [`SimtImage`] (`memwall::kernels::simt_cuda()`).

use std::alloc::Layout;
use std::ffi::{CStr, c_char, c_void};
use std::sync::Mutex;

use super::{Device, DeviceInfo, LaunchCfg, check_range};
use crate::{Error, Result};

/// The C ABI of one compiled SIMT image (`simt/simt.cpp`, exported with a per-image prefix).
#[derive(Clone, Copy, Debug)]
pub struct SimtImage {
    /// `cuda` or `hip`: which kernel sources the image holds.
    pub label: &'static str,
    /// Runs kernel `name` over the grid; 0 on success, else writes a NUL-terminated message of at
    /// most `err_cap` bytes to `err`.
    pub launch: unsafe extern "C" fn(
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
    ) -> i32,
    pub warp_size: unsafe extern "C" fn() -> u32,
    pub kernel_count: unsafe extern "C" fn() -> usize,
    pub kernel_name: unsafe extern "C" fn(i: usize) -> *const c_char,
    pub layout_count: unsafe extern "C" fn() -> usize,
    pub layout: unsafe extern "C" fn(
        i: usize,
        strct: *mut *const c_char,
        field: *mut *const c_char,
        offset: *mut usize,
        size: *mut usize,
        struct_size: *mut usize,
    ) -> i32,
}

/// One field of a params struct as the compiled C++ lays it out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldLayout {
    pub strct: String,
    pub field: String,
    pub offset: usize,
    pub size: usize,
    pub struct_size: usize,
}

impl SimtImage {
    pub fn warp(&self) -> u32 {
        // SAFETY: a pure function of the image.
        unsafe { (self.warp_size)() }
    }

    /// Every kernel the image holds.
    pub fn kernels(&self) -> Vec<String> {
        // SAFETY: indices below the count name registered kernels, whose names are static
        // NUL-terminated strings.
        unsafe {
            (0..(self.kernel_count)())
                .map(|i| CStr::from_ptr((self.kernel_name)(i)).to_string_lossy().into_owned())
                .collect()
        }
    }

    /// Every field of every params struct the image registered with `MW_LAYOUT`.
    pub fn layouts(&self) -> Vec<FieldLayout> {
        let mut out = Vec::new();
        // SAFETY: indices below the count are valid; the strings are static and NUL-terminated.
        unsafe {
            for i in 0..(self.layout_count)() {
                let (mut s, mut f) = (std::ptr::null(), std::ptr::null());
                let (mut offset, mut size, mut struct_size) = (0, 0, 0);
                if (self.layout)(i, &mut s, &mut f, &mut offset, &mut size, &mut struct_size) == 0 {
                    out.push(FieldLayout {
                        strct: CStr::from_ptr(s).to_string_lossy().into_owned(),
                        field: CStr::from_ptr(f).to_string_lossy().into_owned(),
                        offset,
                        size,
                        struct_size,
                    });
                }
            }
        }
        out
    }
}

/// The order in which the threads of a block run between two synchronisation points.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// Thread 0 first.
    Forward,
    /// The last thread first.
    Reverse,
    /// A permutation drawn from this seed at every synchronisation point.
    Random(u64),
}

impl Schedule {
    /// The encoding of `memwall_simt_*_launch`: 0 forward, 1 reverse, else a random seed.
    fn code(self) -> u64 {
        match self {
            Schedule::Forward => 0,
            Schedule::Reverse => 1,
            Schedule::Random(seed) => seed.max(2),
        }
    }
}

/// Host memory standing in for device memory.
#[derive(Debug)]
pub struct EmuBuffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer owns its allocation; access goes through &/&mut like a Vec<u8>.
unsafe impl Send for EmuBuffer {}
// SAFETY: as above; shared references only read.
unsafe impl Sync for EmuBuffer {}

const EMU_ALIGN: usize = 256;

impl EmuBuffer {
    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len.max(1), EMU_ALIGN).expect("checked in alloc")
    }
}

impl Drop for EmuBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `EmuDevice::alloc` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, Self::layout(self.len)) }
    }
}

/// The emulated device.
#[derive(Debug)]
pub struct EmuDevice {
    image: SimtImage,
    schedule: Schedule,
    info: DeviceInfo,
    /// The graph being recorded, between `begin_capture` and `end_capture`.
    recording: Mutex<Option<EmuGraph>>,
}

impl EmuDevice {
    pub fn new(image: SimtImage, schedule: Schedule) -> Self {
        let warp_size = image.warp();
        let info = DeviceInfo {
            name: format!("simt {} (host emulation, warp {warp_size}, {schedule:?})", image.label),
            vendor: super::Vendor::Simt,
            arch: (0, 0),
            warp_size,
            // Few "SMs", so grid heuristics produce several blocks at test shapes and
            // grid-stride loops take more than one pass.
            sm_count: 2,
            max_shared_per_block: 227 * 1024,
            max_threads_per_block: 1024,
            max_grid: [i32::MAX as u32, 65535, 65535],
            total_memory: 1 << 34,
        };
        EmuDevice { image, schedule, info, recording: Mutex::new(None) }
    }

    pub fn schedule(&self) -> Schedule {
        self.schedule
    }

    pub fn image(&self) -> &SimtImage {
        &self.image
    }
}

impl Device for EmuDevice {
    type Buffer = EmuBuffer;

    fn name(&self) -> &'static str {
        if self.info.warp_size == 64 { "hip-emu" } else { "cuda-emu" }
    }

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn alloc(&self, bytes: usize) -> Result<EmuBuffer> {
        let oom = |reason: String| Error::OutOfMemory { device: self.name().into(), bytes, reason };
        let layout = Layout::from_size_align(bytes.max(1), EMU_ALIGN).map_err(|e| oom(e.to_string()))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(oom("allocation failed".into()));
        }
        Ok(EmuBuffer { ptr, len: bytes })
    }

    fn len(buf: &EmuBuffer) -> usize {
        buf.len
    }

    fn address(buf: &EmuBuffer) -> u64 {
        buf.ptr as u64
    }

    fn write(&self, dst: &mut EmuBuffer, offset: usize, bytes: &[u8]) -> Result<()> {
        check_range(self.name(), "write", offset, bytes.len(), dst.len)?;
        // SAFETY: offset + len is inside the allocation (checked); `dst` is borrowed mutably.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst.ptr.add(offset), bytes.len()) };
        Ok(())
    }

    fn zero(&self, dst: &mut EmuBuffer, offset: usize, len: usize) -> Result<()> {
        check_range(self.name(), "zero", offset, len, dst.len)?;
        // SAFETY: offset + len is inside the allocation (checked); `dst` is borrowed mutably.
        unsafe { std::ptr::write_bytes(dst.ptr.add(offset), 0, len) };
        Ok(())
    }

    fn read(&self, src: &EmuBuffer, offset: usize, out: &mut [u8]) -> Result<()> {
        check_range(self.name(), "read", offset, out.len(), src.len)?;
        // SAFETY: offset + len is inside the allocation (checked); launches are synchronous, so
        // no kernel writes it now.
        unsafe { std::ptr::copy_nonoverlapping(src.ptr.add(offset), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    unsafe fn launch(&self, name: &'static str, cfg: LaunchCfg, params: &[u8]) -> Result<()> {
        let mut recording = self.recording.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(graph) = recording.as_mut() {
            graph.launches.push((name, cfg, params.to_vec()));
            return Ok(());
        }
        drop(recording);
        // SAFETY: forwarded from the caller.
        unsafe { self.run(name, cfg, params) }
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    type Graph = EmuGraph;

    fn begin_capture(&self) -> Result<()> {
        let mut recording = self.recording.lock().unwrap_or_else(|e| e.into_inner());
        if recording.is_some() {
            return Err(self.error("a graph capture is already recording".into()));
        }
        *recording = Some(EmuGraph { launches: Vec::new() });
        Ok(())
    }

    fn end_capture(&self) -> Result<EmuGraph> {
        match self.recording.lock().unwrap_or_else(|e| e.into_inner()).take() {
            None => Err(self.error("ending a graph capture that was not started".into())),
            Some(g) if g.launches.is_empty() => Err(self.error("the graph capture recorded no work".into())),
            Some(g) => Ok(g),
        }
    }

    fn replay(&self, graph: &EmuGraph) -> Result<()> {
        for (name, cfg, params) in &graph.launches {
            // SAFETY: recorded by `launch`, whose caller vouched for the params; a graph's
            // buffers must still be live when it is replayed (`Backend::replay`).
            unsafe { self.run(name, *cfg, params)? };
        }
        Ok(())
    }
}

/// The launches an [`EmuDevice`] recorded: kernel, geometry, params bytes, in order.
#[derive(Debug)]
pub struct EmuGraph {
    launches: Vec<(&'static str, LaunchCfg, Vec<u8>)>,
}

impl EmuDevice {
    fn error(&self, msg: String) -> Error {
        Error::Device { device: self.info.name.clone(), msg }
    }

    /// Runs kernel `name` now.
    ///
    /// # Safety
    /// As [`Device::launch`].
    unsafe fn run(&self, name: &'static str, cfg: LaunchCfg, params: &[u8]) -> Result<()> {
        let mut err = [0 as c_char; 512];
        // SAFETY: the caller guarantees params match the kernel and point into live buffers;
        // the name is passed with its length; err has err.len() bytes.
        let rc = unsafe {
            (self.image.launch)(
                name.as_ptr().cast(),
                name.len(),
                cfg.grid.as_ptr(),
                cfg.block.as_ptr(),
                cfg.shared_bytes,
                params.as_ptr().cast(),
                params.len(),
                self.schedule.code(),
                err.as_mut_ptr(),
                err.len(),
            )
        };
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: the image wrote a NUL-terminated message into err (its last byte stays 0).
        err[err.len() - 1] = 0;
        let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
        Err(self.error(format!("kernel {name}: {msg}")))
    }
}
