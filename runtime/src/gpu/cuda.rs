//! `CudaDevice`: an NVIDIA GPU through cudarc's driver API, loaded at run time (feature `cuda`:
//! the crate builds without CUDA, and a machine without a driver or a device gets an error, never
//! a panic: cudarc panics on a missing library, so it is probed first).
//!
//! - Kernels: the fatbins the root crate's `build.rs` compiled with nvcc (SASS for `sm_80` and
//!   `sm_90a`, PTX for `compute_90`), one module per `.cu` file; a build without nvcc hands over
//!   no fatbins, and the embedded sources are compiled here with NVRTC for the device's exact
//!   target (`nvrtc.rs`). A kernel is found by name in whichever module holds it, once.
//! - Launches check, on the host, that the params bytes are exactly what the kernel takes
//!   (`cuFuncGetParamInfo`), and raise a kernel's dynamic shared memory limit when a launch asks
//!   for more than the default 48 KiB. All work goes to one stream, in order.
//! - Memory: `cuMemAlloc` (256-byte aligned), zero-filled on the stream; out of memory is
//!   [`Error::OutOfMemory`] with the size asked for and the free memory left.
//! - Graphs: `begin_capture` / `end_capture` record the stream's launches as a CUDA graph
//!   (thread-local capture mode), `replay` launches it again (the decode step: see
//!   `Backend::capture`);
//! - [`CudaDevice::time`] measures work on the stream with CUDA events (the benches).

use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::sync::{Arc, Mutex};

/// The cudarc this backend is built on, for code that calls CUDA libraries beside it (the
/// benches' cuBLAS peer) on [`CudaDevice::cu_stream`].
pub use cudarc;
use cudarc::driver::{CudaContext, CudaStream, DriverError, result, sys};

use super::{Device, DeviceInfo, KernelImage, KernelSource, LaunchCfg, check_range, nvrtc};
use crate::{Error, Result};

/// The dynamic shared memory a kernel may use without opting in.
const DEFAULT_SHARED: u32 = 48 * 1024;

fn device_err(msg: impl Into<String>) -> Error {
    Error::Device { device: "cuda".into(), msg: msg.into() }
}

fn driver(what: &str, e: DriverError) -> Error {
    let name =
        e.error_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    device_err(format!("{what}: {name} ({text})"))
}

/// Device memory on a CUDA device; freed on drop.
#[derive(Debug)]
pub struct CudaBuffer {
    ptr: sys::CUdeviceptr,
    len: usize,
    ctx: Arc<CudaContext>,
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        // Waits for the work using it (cuMemFree synchronises); an error here has nowhere to go,
        // and the context records it for its next check.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by cuMemAlloc in this context, freed once.
            self.ctx.record_err(unsafe { result::free_sync(self.ptr) });
        }
    }
}

struct Module {
    file: String,
    module: sys::CUmodule,
}

/// A kernel found in a module: its handle, its params size, its dynamic shared memory limit.
#[derive(Clone, Copy)]
struct Function {
    f: sys::CUfunction,
    params_bytes: usize,
    shared_limit: u32,
}

// SAFETY: CUDA modules and functions are context-wide handles, usable from any thread that binds
// the context (every method does first).
unsafe impl Send for Module {}
unsafe impl Sync for Module {}
unsafe impl Send for Function {}

/// Where the kernels came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelOrigin {
    /// nvcc's fatbins, built with the crate.
    Fatbin,
    /// The embedded sources, compiled by NVRTC for this target at construction.
    Nvrtc(String),
}

/// An NVIDIA GPU.
pub struct CudaDevice {
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    modules: Vec<Module>,
    origin: KernelOrigin,
    functions: Mutex<HashMap<&'static str, Function>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice").field("info", &self.info).field("origin", &self.origin).finish()
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            for m in &self.modules {
                // SAFETY: loaded in this context, unloaded once, after the functions are gone.
                self.ctx.record_err(unsafe { result::module::unload(m.module) });
            }
        }
    }
}

/// The number of CUDA devices, or an error naming why there are none (no driver library, no
/// device, a driver older than CUDA 13.0).
pub fn device_count() -> Result<usize> {
    // SAFETY: only tries to open the library.
    if !unsafe { sys::is_culib_present() } {
        return Err(device_err("no CUDA device: the driver library (libcuda.so) is not installed"));
    }
    result::init().map_err(|e| driver("no CUDA device: cuInit", e))?;
    let n = result::device::get_count().map_err(|e| driver("no CUDA device: cuDeviceGetCount", e))?;
    Ok(n.max(0) as usize)
}

impl CudaDevice {
    /// Device `ordinal` with the kernels of `images` (nvcc's fatbins), or, when `images` is
    /// empty, of `sources` compiled now by NVRTC.
    pub fn new(ordinal: usize, images: &[KernelImage], sources: &[KernelSource]) -> Result<Self> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(device_err(format!("no CUDA device {ordinal}: {count} present")));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| driver("creating the context", e))?;
        let info = query_info(&ctx)?;
        let stream = ctx.new_stream().map_err(|e| driver("creating a stream", e))?;
        let mut dev = CudaDevice {
            info,
            ctx,
            stream,
            modules: Vec::new(),
            origin: KernelOrigin::Fatbin,
            functions: Mutex::new(HashMap::new()),
        };
        if images.is_empty() {
            let target = nvrtc::target(dev.info.arch);
            let files: Vec<&KernelSource> = nvrtc::kernel_files(sources).collect();
            if files.is_empty() {
                return Err(device_err("no kernels: the build embedded neither fatbins nor sources"));
            }
            for file in files {
                let cubin = nvrtc::compile(sources, file.name, &target)?;
                dev.load(file.name, &cubin)?;
            }
            dev.origin = KernelOrigin::Nvrtc(target);
        } else {
            for image in images {
                dev.load(image.name, image.fatbin).map_err(|e| match e {
                    Error::Device { msg, .. } => device_err(format!(
                        "{msg} (the fatbin has SASS for {:?}; the device is sm_{}{})",
                        image.targets, dev.info.arch.0, dev.info.arch.1
                    )),
                    e => e,
                })?;
            }
        }
        Ok(dev)
    }

    fn load(&mut self, file: &str, image: &[u8]) -> Result<()> {
        // cuModuleLoadData reads a cubin or fatbin from memory; the ELF and fatbin headers carry
        // their sizes, but hand it an 8-byte-aligned copy as the driver expects.
        let mut aligned = vec![0u64; image.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut aligned)[..image.len()].copy_from_slice(image);
        self.ctx.bind_to_thread().map_err(|e| driver("binding the context", e))?;
        // SAFETY: `aligned` holds the whole image for the call.
        let module = unsafe { result::module::load_data(aligned.as_ptr().cast()) }
            .map_err(|e| driver(&format!("loading the kernels of {file}"), e))?;
        self.modules.push(Module { file: file.to_string(), module });
        Ok(())
    }

    /// Where the kernels came from.
    pub fn origin(&self) -> &KernelOrigin {
        &self.origin
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| driver("binding the context", e))
    }

    /// Kernel `name` from whichever module holds it.
    fn function(&self, name: &'static str) -> Result<Function> {
        let mut cache = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = cache.get(name) {
            return Ok(*f);
        }
        let cname =
            CString::new(name).map_err(|_| device_err(format!("kernel name {name:?} holds a NUL")))?;
        let mut found = None;
        for m in &self.modules {
            // SAFETY: a live module of this context.
            match unsafe { result::module::get_function(m.module, cname.clone()) } {
                Ok(f) => {
                    found = Some(f);
                    break;
                }
                Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_FOUND)) => continue,
                Err(e) => return Err(driver(&format!("finding kernel {name} in {}", m.file), e)),
            }
        }
        let files: Vec<&str> = self.modules.iter().map(|m| m.file.as_str()).collect();
        let f = found.ok_or_else(|| device_err(format!("no kernel named {name} in {files:?}")))?;
        let (mut offset, mut size) = (0usize, 0usize);
        // SAFETY: a live function; the outputs are valid for writes.
        unsafe { sys::cuFuncGetParamInfo(f, 0, &mut offset, &mut size) }
            .result()
            .map_err(|e| driver(&format!("reading the params of {name}"), e))?;
        let (mut o1, mut s1) = (0usize, 0usize);
        // SAFETY: as above; a kernel of one params struct has no parameter 1.
        if unsafe { sys::cuFuncGetParamInfo(f, 1, &mut o1, &mut s1) }.result().is_ok() {
            return Err(device_err(format!("kernel {name} takes more than one parameter")));
        }
        let func = Function { f, params_bytes: offset + size, shared_limit: DEFAULT_SHARED };
        cache.insert(name, func);
        Ok(func)
    }

    /// Seconds the work `f` queues takes on the device, from CUDA events recorded around it.
    pub fn time(&self, f: impl FnOnce() -> Result<()>) -> Result<f64> {
        self.bind()?;
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.stream.record_event(flags).map_err(|e| driver("recording an event", e))?;
        f()?;
        let end = self.stream.record_event(flags).map_err(|e| driver("recording an event", e))?;
        end.synchronize().map_err(|e| driver("waiting for an event", e))?;
        let ms = start.elapsed_ms(&end).map_err(|e| driver("timing events", e))?;
        Ok(f64::from(ms) / 1e3)
    }

    /// The stream all of this device's work goes to, for libraries that queue work beside it
    /// (cuBLAS in the benches). Work queued there is ordered with the backend's.
    pub fn cu_stream(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }

    /// Free and total device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.bind()?;
        self.ctx.mem_get_info().map_err(|e| driver("cuMemGetInfo", e))
    }

    /// Copies all of `src` to the start of `dst` on the stream (`cuMemcpyDtoDAsync`): the
    /// device's copy ceiling, as the benches measure it.
    pub fn copy(&self, dst: &mut CudaBuffer, src: &CudaBuffer) -> Result<()> {
        check_range(self.name(), "copy", 0, src.len, dst.len)?;
        self.bind()?;
        // SAFETY: both ranges lie inside live buffers of this context.
        unsafe { sys::cuMemcpyDtoDAsync_v2(dst.ptr, src.ptr, src.len, self.stream.cu_stream()) }
            .result()
            .map_err(|e| driver(&format!("copying {} bytes on the device", src.len), e))
    }
}

/// A recorded sequence of launches ([`Device::end_capture`]): an instantiated CUDA graph.
pub struct CudaGraph {
    graph: cudarc::driver::CudaGraph,
}

// SAFETY: a graph and its executable instance are context-wide handles; cudarc binds the context
// before launching or destroying them, from whichever thread.
unsafe impl Send for CudaGraph {}
unsafe impl Sync for CudaGraph {}

fn query_info(ctx: &Arc<CudaContext>) -> Result<DeviceInfo> {
    use sys::CUdevice_attribute::*;
    let attr = |a| {
        ctx.attribute(a).map(|v| v.max(0) as u32).map_err(|e| driver(&format!("reading attribute {a:?}"), e))
    };
    let (major, minor) = ctx.compute_capability().map_err(|e| driver("reading the compute capability", e))?;
    Ok(DeviceInfo {
        name: ctx.name().map_err(|e| driver("reading the device name", e))?,
        vendor: super::Vendor::Nvidia,
        arch: (major.max(0) as u32, minor.max(0) as u32),
        warp_size: attr(CU_DEVICE_ATTRIBUTE_WARP_SIZE)?,
        sm_count: attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        max_shared_per_block: attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
        max_threads_per_block: attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
        max_grid: [
            attr(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X)?,
            attr(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y)?,
            attr(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z)?,
        ],
        total_memory: ctx.total_mem().map_err(|e| driver("reading the memory size", e))? as u64,
    })
}

impl Device for CudaDevice {
    type Buffer = CudaBuffer;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn alloc(&self, bytes: usize) -> Result<CudaBuffer> {
        self.bind()?;
        let size = bytes.max(1);
        // SAFETY: a plain allocation in the bound context.
        let ptr = match unsafe { result::malloc_sync(size) } {
            Ok(p) => p,
            Err(DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY)) => {
                let free = self.ctx.mem_get_info().map(|(free, _)| free).unwrap_or(0);
                return Err(Error::OutOfMemory {
                    device: format!("cuda ({})", self.info.name),
                    bytes: size,
                    reason: format!("cuMemAlloc: {free} bytes free of {}", self.info.total_memory),
                });
            }
            Err(e) => return Err(driver(&format!("allocating {size} bytes"), e)),
        };
        let buf = CudaBuffer { ptr, len: size, ctx: self.ctx.clone() };
        // SAFETY: `buf` is `size` bytes of this context; the memset is ordered before any later
        // work on the stream.
        unsafe { result::memset_d8_async(ptr, 0, size, self.stream.cu_stream()) }
            .map_err(|e| driver("zero-filling a new buffer", e))?;
        Ok(buf)
    }

    fn len(buf: &CudaBuffer) -> usize {
        buf.len
    }

    fn address(buf: &CudaBuffer) -> u64 {
        buf.ptr
    }

    fn write(&self, dst: &mut CudaBuffer, offset: usize, bytes: &[u8]) -> Result<()> {
        check_range(self.name(), "write", offset, bytes.len(), dst.len)?;
        if bytes.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the range lies inside `dst`. From pageable host memory the copy returns once
        // the bytes are staged, so `bytes` may be reused as soon as it returns.
        unsafe { result::memcpy_htod_async(dst.ptr + offset as u64, bytes, self.stream.cu_stream()) }
            .map_err(|e| driver(&format!("copying {} bytes to the device", bytes.len()), e))
    }

    fn zero(&self, dst: &mut CudaBuffer, offset: usize, len: usize) -> Result<()> {
        check_range(self.name(), "zero", offset, len, dst.len)?;
        if len == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the range lies inside `dst`; the memset is ordered on the stream.
        unsafe { result::memset_d8_async(dst.ptr + offset as u64, 0, len, self.stream.cu_stream()) }
            .map_err(|e| driver(&format!("zero-filling {len} bytes"), e))
    }

    fn read(&self, src: &CudaBuffer, offset: usize, out: &mut [u8]) -> Result<()> {
        check_range(self.name(), "read", offset, out.len(), src.len)?;
        if out.is_empty() {
            return self.synchronize();
        }
        self.bind()?;
        // SAFETY: the range lies inside `src`; the stream is synchronised before `out` is used.
        unsafe { result::memcpy_dtoh_async(out, src.ptr + offset as u64, self.stream.cu_stream()) }
            .map_err(|e| driver(&format!("copying {} bytes from the device", out.len()), e))?;
        self.synchronize()
    }

    unsafe fn launch(&self, name: &'static str, cfg: LaunchCfg, params: &[u8]) -> Result<()> {
        self.bind()?;
        let mut func = self.function(name)?;
        if func.params_bytes != params.len() {
            return Err(device_err(format!(
                "kernel {name} takes {} bytes of params, given {} (the Rust mirror and the C++ struct differ)",
                func.params_bytes,
                params.len()
            )));
        }
        if cfg.shared_bytes > func.shared_limit {
            // SAFETY: a live function; the value is within the device's opt-in limit (checked by
            // Gpu::launch).
            unsafe {
                result::function::set_function_attribute(
                    func.f,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    cfg.shared_bytes as i32,
                )
            }
            .map_err(|e| {
                driver(&format!("allowing {name} {} bytes of shared memory", cfg.shared_bytes), e)
            })?;
            func.shared_limit = cfg.shared_bytes;
            self.functions.lock().unwrap_or_else(|e| e.into_inner()).insert(name, func);
        }
        // The kernel's one parameter is the params struct: the driver copies `params.len()`
        // bytes from this pointer when the launch is queued.
        let mut args = [params.as_ptr() as *mut c_void];
        // SAFETY: the caller guarantees the params are kernel `name`'s and point into live
        // buffers; their size was checked against the kernel's.
        unsafe {
            result::launch_kernel(
                func.f,
                (cfg.grid[0], cfg.grid[1], cfg.grid[2]),
                (cfg.block[0], cfg.block[1], cfg.block[2]),
                cfg.shared_bytes,
                self.stream.cu_stream(),
                &mut args,
            )
        }
        .map_err(|e| driver(&format!("launching {name} grid {:?} block {:?}", cfg.grid, cfg.block), e))
    }

    fn synchronize(&self) -> Result<()> {
        self.bind()?;
        self.stream
            .synchronize()
            .map_err(|e| driver("synchronising the stream (a kernel may have faulted)", e))
    }

    type Graph = CudaGraph;

    /// Thread-local capture mode: only this thread's calls can break the capture.
    fn begin_capture(&self) -> Result<()> {
        self.bind()?;
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| driver("beginning a graph capture", e))
    }

    fn end_capture(&self) -> Result<CudaGraph> {
        self.bind()?;
        match self.stream.end_capture(sys::CUgraphInstantiate_flags(0)) {
            Ok(Some(graph)) => Ok(CudaGraph { graph }),
            Ok(None) => Err(device_err("the graph capture recorded no work")),
            Err(e) => Err(driver("ending the graph capture", e)),
        }
    }

    fn replay(&self, graph: &CudaGraph) -> Result<()> {
        graph.graph.launch().map_err(|e| driver("replaying a graph", e))
    }
}
